"""Counts what a process constructs of the classes that must be built once per process: lowmem_grpo's Runtime and
every transformers Trainer. `install(path)` watches with sys.setprofile (nothing of the package is replaced) and
appends one JSON line per new object to `path`: {"process": an id of this process image, "class": its name}."""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from pathlib import Path
from types import CodeType
from typing import Any

WATCHED = {("lowmem_grpo.runtime", "Runtime"), ("transformers.trainer", "Trainer")}


def install(path: str | Path) -> None:
    process = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # an exec keeps the pid: the suffix tells the images apart
    relevant: dict[CodeType, bool] = {}  # an __init__'s code object -> whether it constructs a watched class
    seen: list[Any] = []  # kept alive, so that no id is reused

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_name != "__init__" or relevant.get(frame.f_code) is False:
            return
        obj = frame.f_locals.get("self")
        watched = obj is not None and any((c.__module__, c.__name__) in WATCHED for c in type(obj).__mro__)
        relevant[frame.f_code] = watched
        if watched and not any(o is obj for o in seen):
            seen.append(obj)
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"process": process, "class": type(obj).__name__}) + "\n")

    sys.setprofile(profile)
    threading.setprofile(profile)
