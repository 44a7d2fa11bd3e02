"""Max logit difference and wall time of exports of a finished run, per format and dtype.

    python benchmarks/export_proof.py RUN_DIR                      # merged-16bit in float32 and bfloat16
    python benchmarks/export_proof.py RUN_DIR --dtypes float32 float16 bfloat16 --formats merged-16bit lora
    python benchmarks/export_proof.py RUN_DIR --formats merged-4bit --cpu-4bit   # bitsandbytes' CPU backend

Each export goes to a fresh temporary folder (deleted afterwards) with --tolerance set very loose, so
that the measured difference is printed even where the default tolerance would fail the export.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--formats", nargs="+", default=["merged-16bit"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--cpu-4bit", action="store_true", help="let merged-4bit run without CUDA")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from lowmem_grpo.export import proof as export_proof
    from lowmem_grpo.export.formats import export

    print(f"{'format':<14} {'dtype':<9} {'max|diff|':>10} {'default tol':>11} {'adapter effect':>14} "
          f"{'max|logit|':>10} {'wall s':>7}")
    for fmt in args.formats:
        for dtype in (args.dtypes if fmt != "lora" else [None]):
            scratch = Path(tempfile.mkdtemp(prefix="export-bench-"))
            started = time.monotonic()
            result = export(args.run_dir, fmt, scratch / "out", dtype=dtype, tolerance=1e9,
                            cpu_4bit=args.cpu_4bit)
            wall = time.monotonic() - started
            shutil.rmtree(scratch)
            diff = "-" if result.max_abs_diff is None else f"{result.max_abs_diff:.3g}"
            effect = "-" if result.adapter_effect is None else f"{result.adapter_effect:.3g}"
            default = "-" if result.max_abs_diff is None else \
                f"{export_proof.tolerance_for(fmt, dtype, result.logit_scale):.3g}"
            print(f"{fmt:<14} {str(dtype):<9} {diff:>10} {default:>11} {effect:>14} {result.logit_scale:>10.3g} "
                  f"{wall:>7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
