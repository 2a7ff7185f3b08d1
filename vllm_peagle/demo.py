"""The README's demo: the same prompts with and without P-EAGLE on the local tiny models.

The drafter is the quick-trained one the engine tests use (same cache), so acceptance is real.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from vllm_peagle.cpu_env import default_cpu_kv_cache
from vllm_peagle.metrics import SpecDecodeCounters

DEMO_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(",
    "class Queue:\n    def __init__(self",
    "def _read_config(path):\n    with open(",
    "    for key, value in sorted(",
)


@dataclass
class Run:
    texts: list[str]
    token_ids: list[list[int]]
    seconds: float
    counters: SpecDecodeCounters

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.token_ids) / self.seconds


def _engine_env() -> None:
    # CPU vLLM needs an explicit KV-cache size; its INFO logs would drown the demo's output.
    default_cpu_kv_cache()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def generate(target: str, prompts: tuple[str, ...], max_tokens: int, spec: dict | None) -> Run:
    from vllm import LLM, SamplingParams

    llm = LLM(
        target,
        speculative_config=spec,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        gpu_memory_utilization=0.3,
        seed=0,
        disable_log_stats=False,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(list(prompts[:1]), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        before = SpecDecodeCounters.from_metrics(llm.get_metrics())
        start = time.perf_counter()
        outputs = llm.generate(list(prompts), params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counters = SpecDecodeCounters.from_metrics(llm.get_metrics()) - before
    finally:
        llm.llm_engine.engine_core.shutdown()
    return Run(
        texts=[o.outputs[0].text for o in outputs],
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        seconds=seconds,
        counters=counters,
    )


def run_demo(
    num_speculative_tokens: int = 4, max_tokens: int = 64, drafter: str | None = None
) -> int:
    """Print plain and P-EAGLE outputs with acceptance figures; 0 when they match exactly."""
    from vllm_peagle.tiny_models import ensure_local_models

    _engine_env()
    models = ensure_local_models()
    if drafter is None:
        from vllm_peagle.training.quick import quick_train_drafter

        print("drafter: a briefly trained P-EAGLE drafter (about 90 s on the first run) ...")
        drafter = str(quick_train_drafter(models.target, kind="peagle", num_depths=4))
    spec: dict[str, Any] = {
        "method": "peagle",
        "model": drafter,
        "num_speculative_tokens": num_speculative_tokens,
    }
    print(f"target : {models.target}\ndrafter: {drafter}\nK      : {num_speculative_tokens}\n")
    print("[1/2] plain decoding ...", flush=True)
    plain = generate(str(models.target), DEMO_PROMPTS, max_tokens, None)
    print("[2/2] P-EAGLE (method: peagle) ...", flush=True)
    ours = generate(str(models.target), DEMO_PROMPTS, max_tokens, spec)

    all_equal = True
    for i, prompt in enumerate(DEMO_PROMPTS):
        equal = plain.token_ids[i] == ours.token_ids[i]
        all_equal &= equal
        print(f"\n--- prompt {i + 1}: {prompt!r}")
        print(f"plain  : {plain.texts[i]!r}")
        print(f"peagle : {ours.texts[i]!r}")
        print(f"identical token ids: {'yes' if equal else 'NO'}")

    c = ours.counters
    print(f"\nacceptance length (1 + accepted / drafts): {c.acceptance_length:.3f}")
    print(f"draft acceptance rate: {c.acceptance_rate:.3f}")
    per_pos = ", ".join(f"{r:.3f}" for r in c.per_position_acceptance)
    print(f"per-position acceptance: [{per_pos}]")
    request_steps = sum(len(ids) for ids in ours.token_ids) - c.num_accepted_tokens
    print(
        f"drafts per request-step: {c.num_draft_tokens / max(request_steps, 1):.2f} of K="
        f"{num_speculative_tokens} (adaptive K drafts less, or not at all, where it does not pay)"
    )
    print(
        f"output tok/s (batch {len(DEMO_PROMPTS)}, CPU): plain {plain.tokens_per_second:.1f}, "
        f"peagle {ours.tokens_per_second:.1f}"
    )
    print("\nresult: " + ("outputs identical" if all_equal else "OUTPUTS DIFFER"))
    return 0 if all_equal else 1
