#!/usr/bin/env bash
# Sets up the environment and runs the demo: plain vs P-EAGLE generation on the local models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m vllm_peagle.cli demo "$@"
