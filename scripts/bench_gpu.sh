#!/usr/bin/env bash
# The benchmark sweep of benchmarks/RESULTS.md on one CUDA GPU (written for an H200).
#
#   bash scripts/bench_gpu.sh            # results in benchmarks/gpu/
#
# Needs: the CUDA build of vLLM (`pip install -e ".[cuda,dev]"` beforehand; this script
# installs and downloads nothing) and a visible GPU. It builds the benchmark target and its
# drafters with our own scripts on the CPU (cached; a few minutes the first time: the
# target trains on 2 threads for determinism),
# then runs none / EAGLE-3 / upstream P-EAGLE / ours, K in {4,7}, concurrency 1..64,
# greedy and T=0.7, 2 interleaved repeats, 96 tokens, then adaptive K beside fixed K 1,2,4,7,
# and writes $OUT/RESULTS.md: meant to fit in about 8 minutes (not yet run on a GPU: size it
# with the first run and its printed timings);
# override any of the variables below to size it differently.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-benchmarks/gpu}
KS=${KS:-4,7}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16,32,64}
TEMPERATURES=${TEMPERATURES:-0,0.7}
REPEATS=${REPEATS:-2}
MAX_TOKENS=${MAX_TOKENS:-96}
# All seven servers (none + 3 per K) stay up for the whole sweep, started one at a time:
# vLLM's start-up memory profiling reads device-wide free memory, which servers starting
# alongside would disturb. 0.1 of the GPU each (~14 GiB) is ample for this target.
# CUDA graphs stay on (no --enforce-eager): a target this small is launch-bound without them.
SERVE_ARGS=${SERVE_ARGS:---dtype bfloat16 --max-model-len 1024 --gpu-memory-utilization 0.1}

fail() { echo "bench_gpu.sh: $*" >&2; exit 1; }

"$PYTHON" - <<'PY' || fail "needs the CUDA build of vLLM and a visible GPU (pip install -e '.[cuda,dev]')"
import sys
import torch
import vllm
from vllm.platforms import current_platform

ok = torch.cuda.is_available() and current_platform.is_cuda()
print(f"vllm {vllm.__version__}, torch {torch.__version__}, "
      f"GPU {torch.cuda.get_device_name(0) if ok else 'none'}")
sys.exit(0 if ok else 1)
PY

# The server's worker processes find the plugin through its entry point, so the package
# must be installed; an editable install without dependencies downloads nothing.
if ! "$PYTHON" -c "import importlib.metadata as m; m.version('vllm-peagle')" 2>/dev/null; then
    "$PYTHON" -m pip install --no-deps --no-build-isolation -e . \
        || fail "could not install vllm-peagle itself (pip install --no-deps -e .)"
fi

start=$(date +%s)
"$PYTHON" scripts/build_bench_models.py --threads "$(( $(nproc) > 8 ? 8 : $(nproc) ))"
built=$(date +%s)
echo "bench models ready in $(( built - start )) s"

mkdir -p "$OUT"
sweep() {  # the settings both sweeps share; extra arguments pick K, configurations and name
    "$PYTHON" -m vllm_peagle.cli bench --models bench --concurrency "$CONCURRENCY" \
        --temperatures "$TEMPERATURES" --repeats "$REPEATS" --max-tokens "$MAX_TOKENS" \
        --serve-args "$SERVE_ARGS" --request-seeds --start-one-at-a-time --start-timeout 600 \
        --out-dir "$OUT" "$@"
}
sweep -k "$KS" --all-k-at-once --name gpu 2>&1 | tee "$OUT/bench.log"
methods_done=$(date +%s)
echo "methods sweep took $(( methods_done - built )) s"
# Adaptive K beside no speculation and every fixed K, one round-robin (issue #6's table).
sweep -k 7 --configs none,fixed:1,fixed:2,fixed:4,fixed:7,adaptive --name gpu_adaptive \
    2>&1 | tee "$OUT/bench_adaptive.log"
echo "adaptive sweep took $(( $(date +%s) - methods_done )) s"
"$PYTHON" -m vllm_peagle.bench.results --dir "$OUT" --prefix gpu
