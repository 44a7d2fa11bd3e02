"""Peak resident memory (RSS) per stage of a run and per phase of a step, and glibc allocator settings that keep it
near the memory in use. A span's peak is exact when it raised the kernel's high-water mark (VmHWM, never reset), else
the largest RSS a background thread sampled every SAMPLE_SECONDS. Standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import re
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lowmem_grpo.rundir import layout

log = logging.getLogger(__name__)

STATUS = Path("/proc/self/status")
STATM = Path("/proc/self/statm")
PAGE = resource.getpagesize()
GIB = 2**30
SAMPLE_SECONDS = 0.01  # the sampling interval of a span that does not raise the high-water mark
RSS_PREFIX = "rss/"  # metrics.jsonl keys: rss/<phase>, the peak RSS (GiB) of each phase of the logged step


def current_bytes() -> int:
    """This process's resident set now (0 where /proc is not there)."""
    try:
        return int(STATM.read_bytes().split()[1]) * PAGE  # resident pages: cheaper than parsing status
    except (OSError, IndexError, ValueError):
        return 0


def high_water_bytes() -> int:
    """The kernel's high-water mark of this process's resident set (its peak since it started)."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+) kB", STATUS.read_text(), re.M)
    except OSError:
        match = None
    if match:
        return int(match.group(1)) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class _Sampler:
    """The open watches, and the one thread that samples the RSS into all of them while any is open (nested spans
    share each reading)."""

    def __init__(self) -> None:
        self.open: list[Watch] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, watch: Watch) -> None:
        with self.lock:
            self.open.append(watch)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="lowmem-rss", daemon=True)
                self.thread.start()

    def remove(self, watch: Watch) -> None:
        with self.lock:
            self.open.remove(watch)

    def _run(self) -> None:
        while True:
            with self.lock:
                watches = list(self.open)
                if not watches:
                    self.thread = None
                    return
            now = current_bytes()
            for watch in watches:
                watch.peak_bytes = max(watch.peak_bytes, now)
            time.sleep(SAMPLE_SECONDS)


SAMPLER = _Sampler()


class Watch:
    """The peak RSS of a `with` block in bytes (`peak_bytes`); `exact` when it raised the high-water mark."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.exact = False
        self._mark = 0

    def __enter__(self) -> Watch:
        self._mark = high_water_bytes()
        self.peak_bytes = current_bytes()
        SAMPLER.add(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        SAMPLER.remove(self)
        self.peak_bytes = max(self.peak_bytes, current_bytes())
        mark = high_water_bytes()
        if mark > self._mark:  # the process's peak so far was reached inside this span: the exact value
            self.peak_bytes, self.exact = max(self.peak_bytes, mark), True


class StagePeaks:
    """Peak RSS of each stage of a run, in order; written to `path` (when set) after each stage."""

    def __init__(self, trim: bool = False) -> None:
        self.records: list[dict[str, Any]] = []
        self.path: Path | None = None
        self.trim = trim  # release_free_memory after each stage (after its peak is read)

    @contextmanager
    def stage(self, name: str) -> Iterator[Watch]:
        """Measure the `with` block as stage `name` (recorded even when it raises)."""
        started = time.monotonic()
        watch = Watch()
        try:
            with watch:
                yield watch
        finally:
            self.records.append({"stage": name, "peak_rss_bytes": watch.peak_bytes, "exact": watch.exact,
                                 "seconds": round(time.monotonic() - started, 1)})
            if self.path is not None:
                self.write()
            if self.trim:
                release_free_memory()

    def attach(self, path: Path) -> None:
        """From now on, write the records to `path` (the run directory exists): at once and after each stage."""
        self.path = Path(path)
        self.write()

    def write(self) -> None:
        assert self.path is not None
        data = {"sample_seconds": SAMPLE_SECONDS, "stages": self.records}
        layout.replace_text(self.path, json.dumps(data, indent=1))


M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD = 2 << 20
"""Blocks of 2 MiB and more are mmapped (freed ones leave the process); lower thresholds page-fault far more often
(docs/results.md, "Speed on CPU": the allocator threshold)."""


def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def limit_heap_retention(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at `threshold` bytes, so that large freed blocks leave the process instead of
    fragmenting the heap (glibc raises it to each large block freed); False where the C library is not glibc."""
    libc = _glibc()
    ok = bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1)
    if ok:
        log.info("allocator: blocks of %d KiB and more go back to the OS when freed (glibc M_MMAP_THRESHOLD)",
                 threshold >> 10)
    return ok


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS (glibc malloc_trim(0)); False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
