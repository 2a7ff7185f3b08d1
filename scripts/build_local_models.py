"""Build (or find in the cache) the tiny offline models used by tests and examples.

usage: python scripts/build_local_models.py [--cache-dir DIR] [--quiet]
Prints the paths and the build report as JSON.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from vllm_peagle.tiny_models import ensure_local_models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="default: $VLLM_PEAGLE_CACHE or ~/.cache/vllm-peagle",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    models = ensure_local_models(args.cache_dir, progress=not args.quiet)
    paths = {k: str(v) for k, v in asdict(models).items()}
    print(json.dumps({"paths": paths, "report": models.load_report()}, indent=2))


if __name__ == "__main__":
    main()
