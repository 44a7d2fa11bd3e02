"""What glibc's mmap threshold costs a CPU loss pass: seconds, page faults and peak RSS at several thresholds.

    OMP_NUM_THREADS=2 python benchmarks/allocator_cpu.py                      # 0 (glibc's dynamic), 64 KiB, 8 MiB
    OMP_NUM_THREADS=2 python benchmarks/allocator_cpu.py --thresholds 0,65536,1048576,8388608 --rows 8

Each threshold runs in its own process (the threshold is process-wide and its history matters): the CPU default's
trainer (recipes/smollm2_135m_arith_cpu.py, as benchmarks/shared_prompt_cpu.py builds it) runs one warm-up pass,
then --repeats forward + backward passes of one micro-batch (--prompts x --rows / --prompts completions of 25-35
tokens after an 83-token prompt, the default's shape). Printed per threshold: the fastest forward and backward
(wall and CPU seconds), kernel CPU seconds and minor page faults per pass, and the process's peak RSS; then the
load average. 0 = glibc's own dynamic threshold (lowmem_grpo.rundir.rss.limit_heap_retention not called).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(threshold: int, prompts: int, rows: int, repeats: int) -> dict:
    """One threshold's figures, measured in this process."""
    sys.path.insert(0, str(HERE))
    import shared_prompt_cpu as bench
    import torch

    from lowmem_grpo.rundir import rss

    pinned = rss.limit_heap_retention(threshold) if threshold else False
    trainer, loaded = bench.build_trainer("auto", Path(tempfile.mkdtemp()))
    ids, mask, width = bench.make_batch(loaded.tokenizer, prompts, rows // prompts, 83, (25, 35), 0)[:3]
    advantages = torch.randn(ids.size(0), generator=torch.Generator().manual_seed(0))
    bench.one_pass(trainer, ids, mask, width, True, advantages)
    before = resource.getrusage(resource.RUSAGE_SELF)
    passes = [bench.one_pass(trainer, ids, mask, width, True, advantages) for _ in range(repeats)]
    after = resource.getrusage(resource.RUSAGE_SELF)
    best = {k: min(p[k] for p in passes) for k in ("forward", "backward", "cpu forward", "cpu backward")}
    return {"threshold": threshold, "pinned": pinned, **best,
            "sys_s_per_pass": (after.ru_stime - before.ru_stime) / repeats,
            "minor_faults_per_pass": (after.ru_minflt - before.ru_minflt) // repeats,
            "peak_rss_mib": after.ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--thresholds", default="0,65536,8388608", help="bytes, comma-separated; 0 = glibc's own")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.prompts, args.rows, args.repeats)))
        return 0
    print(f"load before: {os.getloadavg()[0]:.2f}")
    print(f"{'threshold':>10} {'fwd s':>6} {'bwd s':>6} {'cpu fwd':>7} {'cpu bwd':>7} {'sys s':>6} {'faults':>9} "
          f"{'peak MiB':>8}")
    for threshold in (int(t) for t in args.thresholds.split(",")):
        out = subprocess.run([sys.executable, __file__, "--worker", str(threshold), "--prompts", str(args.prompts),
                              "--rows", str(args.rows), "--repeats", str(args.repeats)],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{threshold:>10} {r['forward']:>6.2f} {r['backward']:>6.2f} {r['cpu forward']:>7.2f} "
              f"{r['cpu backward']:>7.2f} {r['sys_s_per_pass']:>6.2f} {r['minor_faults_per_pass']:>9} "
              f"{r['peak_rss_mib']:>8.0f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
