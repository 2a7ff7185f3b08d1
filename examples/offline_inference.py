"""Offline inference with P-EAGLE through vllm-peagle.

    python examples/offline_inference.py --target TARGET --drafter DRAFTER -k 4

Without arguments it uses the local tiny models (built on first use).
"""

import argparse

from vllm_peagle.cpu_env import default_cpu_kv_cache
from vllm_peagle.metrics import SpecDecodeCounters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args()
    if args.target is None or args.drafter is None:
        from vllm_peagle.tiny_models import ensure_local_models

        models = ensure_local_models()
        args.target = args.target or str(models.target)
        args.drafter = args.drafter or str(models.peagle_native)

    default_cpu_kv_cache()
    from vllm import LLM, SamplingParams

    llm = LLM(
        args.target,
        speculative_config={
            "method": "peagle",
            "model": args.drafter,
            "num_speculative_tokens": args.num_speculative_tokens,
        },
        gpu_memory_utilization=0.3,
        disable_log_stats=False,
    )
    outputs = llm.generate(
        ["def fibonacci(n):\n", "class Stack:\n"], SamplingParams(temperature=0.0, max_tokens=64)
    )
    for out in outputs:
        print(repr(out.prompt), "->", repr(out.outputs[0].text))
    counters = SpecDecodeCounters.from_metrics(llm.get_metrics())
    print(f"acceptance length: {counters.acceptance_length:.2f}")
    print("per-position acceptance:", [round(r, 3) for r in counters.per_position_acceptance])


if __name__ == "__main__":  # vLLM spawns engine processes that re-import this file
    main()
