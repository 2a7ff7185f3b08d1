"""Starting, driving and inspecting real vLLM CPU engines in tests."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from typing import Any

from vllm import LLM, SamplingParams

from vllm_peagle.metrics import SpecDecodeCounters

ENGINE_DEFAULTS: dict[str, Any] = {
    # float32 keeps greedy ties rare: batched verification and single-token decoding
    # accumulate in different orders, and bf16 would flip near-tied argmaxes.
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 32,
    "gpu_memory_utilization": 0.3,
    "seed": 0,
    "disable_log_stats": False,
}

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(",
    "class Queue:\n    def __init__(self",
    "def _read_config(path):\n    with open(",
    "    for key, value in sorted(",
    "if __name__ == '__main__':\n",
    "    raise ValueError(",
    "from collections import ",
    "        return self._",
    "def __repr__(self):\n        return ",
    "# Copyright 2001 Python Software Foundation\n",
    "    try:\n        import ",
    "    @property\n    def name(self",
    "            elif isinstance(",
    "def test_",
    "    lines = text.splitlines()\n",
    "class Error(Exception):\n",
]


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for engines started inside (children inherit them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def start_engine(target: str, speculative_config: dict | None = None, **overrides: Any) -> LLM:
    kwargs = {**ENGINE_DEFAULTS, **overrides}
    return LLM(str(target), speculative_config=speculative_config, **kwargs)


def stop_engine(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy_token_ids(llm: LLM, prompts: Sequence[str], max_tokens: int = 48) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def spec_decode_counters(llm: LLM) -> SpecDecodeCounters:
    return SpecDecodeCounters.from_metrics(llm.get_metrics())


def _install_forward_counters(worker: Any) -> bool:
    runner = worker.model_runner
    counts = {
        "target": 0,
        "drafter": 0,
        "rejection_sampler": 0,
        "proposer_calls": 0,
        "draft_fetches": 0,
    }

    def counter(key: str):
        def hook(module: Any, args: Any, output: Any) -> None:
            counts[key] += 1

        return hook

    worker._peagle_test_counts = counts
    runner.model.register_forward_hook(counter("target"))
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and hasattr(drafter, "model"):
        drafter.model.register_forward_hook(counter("drafter"))
        propose = drafter.propose

        def counted_propose(*args: Any, **kwargs: Any) -> Any:
            counts["proposer_calls"] += 1
            return propose(*args, **kwargs)

        drafter.propose = counted_propose
        take_drafts = runner.take_draft_token_ids

        def counted_take_drafts() -> Any:
            counts["draft_fetches"] += 1
            return take_drafts()

        runner.take_draft_token_ids = counted_take_drafts
    rejection_sampler = getattr(runner, "rejection_sampler", None)
    if rejection_sampler is not None:
        rejection_sampler.register_forward_hook(counter("rejection_sampler"))
    return True


def metadata_differences(ours: Any, vllms: Any) -> list[str]:
    """Names of the ``SpecDecodeMetadata`` fields whose values or dtypes differ."""
    differing = [] if ours.num_draft_tokens == vllms.num_draft_tokens else ["num_draft_tokens"]
    for field in (
        "draft_token_ids",
        "cu_num_draft_tokens",
        "cu_num_sampled_tokens",
        "target_logits_indices",
        "bonus_logits_indices",
        "logits_indices",
    ):
        mine, theirs = getattr(ours, field), getattr(vllms, field)
        if mine.dtype != theirs.dtype or mine.tolist() != theirs.tolist():
            differing.append(field)
    return differing


def _install_metadata_check(worker: Any) -> bool:
    """Every zero-draft step's spec-decode metadata (built directly, patch ledger entry 2)
    is compared with what vLLM's own arithmetic makes of the same step."""
    runner = worker.model_runner
    patched = runner._calc_spec_decode_metadata
    vllm_metadata = type(runner)._calc_spec_decode_metadata.__wrapped__
    checks = {"zero_draft_steps": 0, "mismatches": 0}
    worker._peagle_metadata_checks = checks

    def checked(num_draft_tokens: Any, cu_num_scheduled_tokens: Any) -> Any:
        metadata = patched(num_draft_tokens, cu_num_scheduled_tokens)
        if not num_draft_tokens.any():
            expected = vllm_metadata(runner, num_draft_tokens, cu_num_scheduled_tokens)
            checks["zero_draft_steps"] += 1
            checks["mismatches"] += bool(metadata_differences(metadata, expected))
        return metadata

    runner._calc_spec_decode_metadata = checked
    return True


def _read_metadata_checks(worker: Any) -> dict[str, int]:
    return dict(worker._peagle_metadata_checks)


def install_metadata_check(llm: LLM) -> None:
    llm.collective_rpc(_install_metadata_check)


def read_metadata_checks(llm: LLM) -> list[dict[str, int]]:
    """Zero-draft steps seen and how many of their metadata differed from vLLM's, per worker."""
    return llm.collective_rpc(_read_metadata_checks)


def _read_forward_counters(worker: Any) -> dict[str, int]:
    counts = dict(worker._peagle_test_counts)
    for key in counts:
        worker._peagle_test_counts[key] = 0
    return counts


def install_forward_counters(llm: LLM) -> None:
    llm.collective_rpc(_install_forward_counters)


def read_forward_counters(llm: LLM) -> list[dict[str, int]]:
    """Target, drafter and rejection-sampler passes, calls into the proposer and fetches of
    drafts by the engine core, per worker since the last read (then reset)."""
    return llm.collective_rpc(_read_forward_counters)


def _drafter_info(worker: Any) -> dict[str, Any]:
    drafter = getattr(worker.model_runner, "drafter", None)
    return {
        "class": type(drafter).__name__,
        "peagle_enabled": getattr(drafter, "peagle_enabled", None),
        "parallel_drafting": getattr(drafter, "parallel_drafting", None),
    }


def drafter_info(llm: LLM) -> list[dict[str, Any]]:
    return llm.collective_rpc(_drafter_info)


BATCH_SIZES = (1, 4, 16)

# ~360 tokens: two full 128-token KV blocks (the CPU block size) that later requests share.
SHARED_PREFIX = "".join(
    f'def helper_{i}(value, scale={i}):\n    """Return value scaled by {i}."""\n'
    "    return value * scale\n\n\n"
    for i in range(12)
)
SHARED_PREFIX_SUFFIXES = ("def main(", "class Helper:\n    def ", "if __name__ == ")


def shared_prefix_run(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs and prefix-cache hits (prompt tokens not recomputed) of requests that
    share :data:`SHARED_PREFIX`, sent one after another so the first fills the cache."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens, cached = [], []
    for suffix in SHARED_PREFIX_SUFFIXES:
        [output] = llm.generate([SHARED_PREFIX + suffix], params, use_tqdm=False)
        tokens.append(list(output.outputs[0].token_ids))
        cached.append(output.num_cached_tokens or 0)
    return tokens, cached


class PlainReference(dict[int, list[list[int]]]):
    """Greedy outputs of plain decoding per batch size, and its :func:`shared_prefix_run`."""

    shared_prefix: tuple[list[list[int]], list[int]]


def plain_greedy_reference(target: str) -> PlainReference:
    """Greedy outputs of stock vLLM (our plugin not loaded) for each batch size."""
    with environment(VLLM_PLUGINS="no-plugins"):
        llm = start_engine(target)
        try:
            reference = PlainReference({b: greedy_token_ids(llm, PROMPTS[:b]) for b in BATCH_SIZES})
            reference.shared_prefix = shared_prefix_run(llm)
            return reference
        finally:
            stop_engine(llm)


def peagle_spec(drafter: object, k: int = 4, adaptive: bool = False) -> dict[str, Any]:
    """Our method at a fixed K unless ``adaptive`` (the serving default) is asked for."""
    return {
        "method": "peagle",
        "model": str(drafter),
        "num_speculative_tokens": k,
        "adaptive": adaptive,
    }
