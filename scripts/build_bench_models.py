#!/usr/bin/env python3
"""Build the benchmark target (8 layers, hidden 512) and train its P-EAGLE and EAGLE-3 drafters.

    python scripts/build_bench_models.py [--threads 2]

Cached under ``$VLLM_PEAGLE_CACHE/bench`` (default ``~/.cache/vllm-peagle/bench``); a second
run returns at once. Nothing is downloaded: the target is trained on the Python standard
library like the test fixture. Prints the wall-clock time of each stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for training")
    args = parser.parse_args()

    from vllm_peagle.bench.target import ensure_bench_models

    t0 = time.perf_counter()
    models = ensure_bench_models(threads=args.threads, progress=True)
    report = json.loads((models.root / "build_report.json").read_text())
    print(
        json.dumps(
            {
                "target": str(models.target),
                "peagle": str(models.peagle),
                "eagle3": str(models.eagle3),
                "target_build_seconds": report["build_seconds"],
                "target_heldout_loss": round(report["heldout_loss"], 3),
                "total_seconds_this_run": round(time.perf_counter() - t0, 1),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
