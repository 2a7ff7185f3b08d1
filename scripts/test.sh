#!/usr/bin/env bash
# Sets up the environment, builds the local tiny models (cached) and runs the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not engine"` for the quick subset.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

bash scripts/setup.sh
"$PYTHON" scripts/build_local_models.py
exec "$PYTHON" -m pytest "$@"
