#!/usr/bin/env bash
# Serve a target with a P-EAGLE drafter through vllm-peagle's own proposer.
#   bash examples/serve.sh TARGET DRAFTER [K]
# With no arguments it serves the local tiny models (CPU). Then, e.g.:
#   curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
#     -d '{"model": "TARGET", "prompt": "def main(", "max_tokens": 32, "temperature": 0}'
set -euo pipefail
TARGET=${1:-}
DRAFTER=${2:-}
K=${3:-4}
if [[ -z "$TARGET" || -z "$DRAFTER" ]]; then
    ROOT=$(python3 -c "from vllm_peagle.tiny_models import ensure_local_models as e; print(e().root)")
    TARGET=$ROOT/target
    DRAFTER=$ROOT/peagle-native
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
    EXTRA=(--gpu-memory-utilization 0.3 --max-model-len 1024)
fi
exec vllm serve "$TARGET" \
    --speculative-config "{\"method\": \"peagle\", \"model\": \"$DRAFTER\", \"num_speculative_tokens\": $K}" \
    "${EXTRA[@]+"${EXTRA[@]}"}"
