"""`python tests/fault_cli.py SPEC[,SPEC...] ARGS...`: `lowmem-grpo ARGS` in a process of its own, with tests/faults.py's
faults injected into training through the CLI's seam for extra trainer callbacks (an empty SPEC injects none): for
the runs that replace their process (an out-of-memory error resumes in a fresh one)."""

from __future__ import annotations

import sys

from faults import FaultInjector, parse_faults

from lowmem_grpo.cli import main

if __name__ == "__main__":
    specs = [s for s in sys.argv[1].split(",") if s]
    raise SystemExit(main(sys.argv[2:], callbacks=[FaultInjector(parse_faults(specs))] if specs else ()))
