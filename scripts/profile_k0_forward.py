"""Is a target forward slower in a speculative engine on steps that draft nothing?

    python scripts/profile_k0_forward.py [--rounds 6] [--max-tokens 1] [--method upstream]

Builds two offline engines in one process on the benchmark target: plain decoding, and ours
with K fixed at 0 for every batch size (no drafter forward, nothing verified). It then runs the
same prompts one request at a time on each (``--method upstream``: stock vLLM's P-EAGLE path
on the same checkpoint instead of ours), alternating which goes first, and prints the
target forward's seconds and the tokens it processed per engine (forward hooks) and their
ratios. ``--max-tokens 1`` measures prompt processing alone.

The prompts repeat, so they hit the prefix cache. Stock vLLM recomputes the last cached block
of every hit for EAGLE-type drafters (128 tokens on CPU), which made its prompt processing
1.2x as long here; ours keeps that block (``vllm_peagle/config.py``), and the ratio is 1.0.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from vllm_peagle.cpu_env import default_cpu_kv_cache


def _install_timer(worker: Any) -> bool:
    started: list[float] = []
    worker._k0_forward = [0.0, 0]  # seconds, tokens
    model = worker.model_runner.model

    def start(m: Any, args: Any, kwargs: Any) -> None:
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        worker._k0_forward[1] += 0 if positions is None else positions.shape[-1]
        started.append(time.perf_counter())

    def stop(m: Any, a: Any, o: Any) -> None:
        worker._k0_forward[0] += time.perf_counter() - started.pop()

    model.register_forward_pre_hook(start, with_kwargs=True)
    model.register_forward_hook(stop)
    return True


def _take_totals(worker: Any) -> tuple[float, int]:
    seconds, tokens = worker._k0_forward
    worker._k0_forward = [0.0, 0]
    return seconds, tokens


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both engines in this process
    default_cpu_kv_cache()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--method", choices=["peagle", "upstream"], default="peagle")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_peagle.bench.sweep import bench_prompts
    from vllm_peagle.bench.target import ensure_bench_models
    from vllm_peagle.plugin import register

    register()
    models = ensure_bench_models()
    method = (
        {"method": "peagle", "adaptive": False}
        if args.method == "peagle"
        else {"method": "eagle3", "parallel_drafting": True}
    )
    k0 = {
        **method,
        "model": str(models.peagle),
        "num_speculative_tokens": 7,
        "num_speculative_tokens_per_batch_size": [[1, 256, 0]],
    }
    engines = {
        name: LLM(
            str(models.target),
            speculative_config=spec,
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            max_num_seqs=1,
            gpu_memory_utilization=0.2,
            seed=0,
        )
        for name, spec in (("plain", None), (f"{args.method} K=0", k0))
    }
    prompts = bench_prompts(args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.collective_rpc(_install_timer)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        llm.collective_rpc(_take_totals)
    seconds = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
        for name in order:
            for prompt in prompts:
                engines[name].generate([prompt], params, use_tqdm=False)
            [(round_seconds, round_tokens)] = engines[name].collective_rpc(_take_totals)
            seconds[name] += round_seconds
            tokens[name] += round_tokens
    for name in engines:
        print(f"{name}: target forward {seconds[name]:.3f} s over {tokens[name]} tokens")
    name = f"{args.method} K=0"
    print(
        f"{name} / plain: {seconds[name] / seconds['plain']:.2f} (time), "
        f"{tokens[name] / tokens['plain']:.2f} (tokens)"
    )


if __name__ == "__main__":
    main()
