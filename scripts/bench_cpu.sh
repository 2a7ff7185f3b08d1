#!/usr/bin/env bash
# Every CPU figure of benchmarks/RESULTS.md, in one command (about two hours on 2 idle cores):
#
#   bash scripts/bench_cpu.sh
#
# 1. the benchmark target and drafters (cached after the first build);
# 2. the adaptive sweep: adaptive K (K_max 7) beside no speculation and fixed K 1,4,7 in one
#    round-robin, at least 24 requests a run (shorter runs are mostly noise) -> cpu_adaptive.*;
# 3. the methods sweep: none / EAGLE-3 / upstream P-EAGLE / ours at K=4 and 7 -> cpu.*;
# 4. the step-time breakdown at K=7, c=1 -> cpu_stepcost.md;
# 5. benchmarks/RESULTS.md from those files.
# Override the variables below to size it differently (e.g. REPEATS=1 for a quick look).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-benchmarks}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16,32,64}
TEMPERATURES=${TEMPERATURES:-0,0.7}
REPEATS=${REPEATS:-2}
ADAPTIVE_REPEATS=${ADAPTIVE_REPEATS:-5}  # adaptive is judged to 3 %: more repeats
MAX_TOKENS=${MAX_TOKENS:-64}
COMMON=(--models bench --concurrency "$CONCURRENCY" --temperatures "$TEMPERATURES"
        --max-tokens "$MAX_TOKENS" --requests-per-client 1 --out-dir "$OUT")

"$PYTHON" scripts/build_bench_models.py
"$PYTHON" -m vllm_peagle.cli bench "${COMMON[@]}" -k 7 --repeats "$ADAPTIVE_REPEATS" \
    --min-requests 24 --fresh-servers --configs none,fixed:1,fixed:4,fixed:7,adaptive --name cpu_adaptive
"$PYTHON" -m vllm_peagle.cli bench "${COMMON[@]}" -k 4,7 --repeats "$REPEATS" \
    --configs none,eagle3,upstream,peagle --name cpu
"$PYTHON" -m vllm_peagle.bench.stepcost --models bench -k 7 --concurrency 1 \
    --max-tokens "$MAX_TOKENS" --requests 2 | grep -E '^(\||K=[0-9])' | tee "$OUT/cpu_stepcost.md.tmp"
mv "$OUT/cpu_stepcost.md.tmp" "$OUT/cpu_stepcost.md"
"$PYTHON" -m vllm_peagle.bench.results --dir "$OUT"
