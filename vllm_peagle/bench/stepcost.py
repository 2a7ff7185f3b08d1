"""Where the time of one decoding step goes: plain vs EAGLE-3 vs upstream P-EAGLE vs ours.

    python -m vllm_peagle.bench.stepcost [--models bench|tiny] [-k 7] [--concurrency 1]

Runs each configuration in an offline engine and times, inside the worker, the target
forward, the drafter forward(s), the whole drafting call (``propose_draft_token_ids``:
input preparation + drafter forwards + draft sampling), sampling/verification (``_sample``,
vLLM's rejection sampler under speculation) and the model runner's two step calls. What is
left of the wall time per step is the engine loop (scheduler, output processing, IPC).
Prints a markdown table per configuration, ms per step (= per target forward).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from vllm_peagle.cpu_env import default_cpu_kv_cache

TIMED_METHODS = ("execute_model", "sample_tokens", "propose_draft_token_ids", "_sample")


def _install_timers(worker: Any) -> bool:
    import time as _time

    runner = worker.model_runner
    acc: dict[str, float] = {}
    worker._bench_step_timers = acc

    def add(key: str, seconds: float) -> None:
        acc[key] = acc.get(key, 0.0) + seconds
        acc[key + "#"] = acc.get(key + "#", 0) + 1

    def hooks(module: Any, key: str) -> None:
        started: list[float] = []
        module.register_forward_pre_hook(lambda m, a: started.append(_time.perf_counter()))
        module.register_forward_hook(lambda m, a, o: add(key, _time.perf_counter() - started.pop()))

    def wrap(owner: Any, name: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = _time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                add(name, _time.perf_counter() - t0)

        setattr(owner, name, timed)

    hooks(runner.model, "target_forward")
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and hasattr(drafter, "model"):
        hooks(drafter.model, "drafter_forward")
    for name in TIMED_METHODS:
        wrap(runner, name)
    return True


def _read_timers(worker: Any) -> dict[str, float]:
    acc = dict(worker._bench_step_timers)
    worker._bench_step_timers.clear()
    return acc


def _per_step(acc: dict[str, float], wall_s: float) -> dict[str, float]:
    steps = max(acc.get("target_forward#", 0), 1)
    out = {"steps": steps, "wall_ms": 1e3 * wall_s / steps}
    for key in ("target_forward", "drafter_forward", *TIMED_METHODS):
        out[key + "_ms"] = 1e3 * acc.get(key, 0.0) / steps
    out["drafter_forwards_per_step"] = acc.get("drafter_forward#", 0) / steps
    out["engine_loop_ms"] = out["wall_ms"] - out["execute_model_ms"] - out["sample_tokens_ms"]
    return out


def main() -> None:
    default_cpu_kv_cache()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # timers via collective_rpc
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", choices=["bench", "tiny"], default="bench")
    parser.add_argument("-k", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4, help="requests per measurement")
    parser.add_argument("--configs", default="none,eagle3,upstream,peagle")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_peagle.bench.configs import label, resolve
    from vllm_peagle.bench.sweep import bench_prompts
    from vllm_peagle.bench.target import ensure_bench_models, ensure_tiny_models
    from vllm_peagle.plugin import register

    register()
    models = ensure_tiny_models() if args.models == "tiny" else ensure_bench_models()
    prompts = bench_prompts(args.requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for config in resolve(args.configs.split(","), args.k, models):
        llm = LLM(
            str(models.target),
            speculative_config=config.speculative_config,
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            max_num_seqs=args.concurrency,
            gpu_memory_utilization=0.3,
            seed=0,
        )
        try:
            llm.collective_rpc(_install_timers)
            llm.generate(prompts[: args.concurrency], SamplingParams(max_tokens=8), use_tqdm=False)
            llm.collective_rpc(_read_timers)
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            [acc] = llm.collective_rpc(_read_timers)
            rows.append((label(config.name), _per_step(acc, wall)))
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm

    plain = next((r for name, r in rows if name == label("none")), None)
    print(
        f"\nK={args.k}, concurrency {args.concurrency}, {args.max_tokens} tokens x "
        f"{args.requests} requests, greedy; ms per step (one target forward)\n"
    )
    cols = [
        "wall_ms",
        "target_forward_ms",
        "drafter_forward_ms",
        "drafter_forwards_per_step",
        "propose_draft_token_ids_ms",
        "_sample_ms",
        "execute_model_ms",
        "sample_tokens_ms",
        "engine_loop_ms",
    ]
    print("| method | " + " | ".join(cols) + " | step / plain |")
    print("|---|" + "---|" * (len(cols) + 1))
    for name, r in rows:
        ratio = r["wall_ms"] / plain["wall_ms"] if plain else float("nan")
        print(f"| {name} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + f" | {ratio:.2f} |")


if __name__ == "__main__":
    main()
