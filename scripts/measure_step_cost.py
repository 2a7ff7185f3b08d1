"""Per-step cost of plain decoding, upstream P-EAGLE and ours, side by side in one run.

    python scripts/measure_step_cost.py [--k 4] [--concurrency 1 16] [--max-tokens 64]

Each configuration runs the same greedy requests on the local tiny target; a step is one
target forward (counted with forward hooks in the worker), so ms/step includes drafting.
Prints a markdown table. Ratios are what to compare: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from vllm_peagle.cpu_env import default_cpu_kv_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
default_cpu_kv_cache()
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    from tests.engines import (
        PROMPTS,
        greedy_token_ids,
        install_forward_counters,
        read_forward_counters,
        spec_decode_counters,
        start_engine,
        stop_engine,
    )
    from vllm_peagle.plugin import register
    from vllm_peagle.tiny_models import ensure_local_models

    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--drafter", default=None)
    args = parser.parse_args()

    register()
    models = ensure_local_models()
    drafter = args.drafter or str(models.peagle_native)
    configs = {
        "none": None,
        "upstream eagle3+parallel_drafting": {
            "method": "eagle3",
            "parallel_drafting": True,
            "model": drafter,
            "num_speculative_tokens": args.k,
        },
        "ours (method: peagle)": {
            "method": "peagle",
            "model": drafter,
            "num_speculative_tokens": args.k,
            "adaptive": False,  # the cost of a step at exactly this K
        },
    }
    rows = []
    for name, spec in configs.items():
        llm = start_engine(str(models.target), spec, max_num_seqs=max(args.concurrency))
        install_forward_counters(llm)
        try:
            for c in args.concurrency:
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
                greedy_token_ids(llm, prompts, max_tokens=8)  # warm-up
                read_forward_counters(llm)
                before = spec_decode_counters(llm) if spec else None
                best = float("inf")
                steps = tokens = 0
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    out = greedy_token_ids(llm, prompts, max_tokens=args.max_tokens)
                    elapsed = time.perf_counter() - start
                    [counts] = read_forward_counters(llm)
                    best = min(best, elapsed / counts["target"])
                    steps += counts["target"]
                    tokens += sum(len(o) for o in out)
                al = (spec_decode_counters(llm) - before).acceptance_length if spec else 1.0
                rows.append((name, c, best * 1e3, tokens / steps, al))
        finally:
            stop_engine(llm)

    plain = {c: ms for name, c, ms, _, _ in rows if name == "none"}
    print(f"\nK={args.k}, max_tokens={args.max_tokens}, best of {args.repeats}, float32, CPU\n")
    print("| method | concurrency | ms/step | x plain step | tokens/step | AL |")
    print("|---|---|---|---|---|---|")
    for name, c, ms, per_step, al in rows:
        print(f"| {name} | {c} | {ms:.2f} | {ms / plain[c]:.2f} | {per_step:.2f} | {al:.2f} |")


if __name__ == "__main__":
    main()
