"""Trained drafters in real vLLM engines: lossless both ways, offline AL == served AL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engines import (
    BATCH_SIZES,
    PROMPTS,
    greedy_token_ids,
    spec_decode_counters,
    start_engine,
    stop_engine,
)
from vllm_peagle.evaluation.offline import evaluate_offline

pytestmark = pytest.mark.engine

K = 4
MAX_TOKENS = 48  # greedy_token_ids' default, which plain_reference uses too


def _offline_al(target: Path, drafter: Path, prompts: list[str]) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = evaluate_offline(target, drafter, prompts, K, max_tokens=MAX_TOKENS, progress=False)
    finally:
        torch.set_num_threads(threads)
    return res.acceptance_length


@pytest.mark.parametrize(
    "way",
    [
        "peagle-plugin-speculators-layout",
        "eagle3-parallel-drafting-upstream-native-layout",
    ],
)
def test_trained_drafter_lossless_and_offline_al_matches_served(
    way, local_models, trained_peagle, plain_reference
):
    if way.startswith("peagle"):
        spec = {
            "method": "peagle",
            "model": str(trained_peagle.parent / "drafter-speculators"),
            "num_speculative_tokens": K,
            "adaptive": False,  # served AL is compared at this exact K
        }
    else:
        spec = {
            "method": "eagle3",
            "parallel_drafting": True,
            "model": str(trained_peagle),
            "num_speculative_tokens": K,
        }
    llm = start_engine(local_models.target, spec)
    try:
        for batch_size in BATCH_SIZES:
            before = spec_decode_counters(llm)
            tokens = greedy_token_ids(llm, PROMPTS[:batch_size], max_tokens=MAX_TOKENS)
            window = spec_decode_counters(llm) - before
            assert tokens == plain_reference[batch_size], f"batch {batch_size}"
        served = window.acceptance_length  # the 16-prompt window
    finally:
        stop_engine(llm)
    offline = _offline_al(local_models.target, trained_peagle, PROMPTS[:16])
    print(f"{way}: served AL {served:.4f}, offline AL {offline:.4f}")
    assert served > 1.2, "the trained drafter should be accepted often"
    assert abs(offline - served) / served < 0.03, (offline, served)


def test_eagle3_baseline_offline_al_matches_served(local_models, plain_reference):
    from vllm_peagle.training.quick import quick_train_drafter

    drafter = quick_train_drafter(local_models.target, kind="eagle3", num_depths=K)
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": K}
    llm = start_engine(local_models.target, spec)
    try:
        before = spec_decode_counters(llm)
        tokens = greedy_token_ids(llm, PROMPTS, max_tokens=MAX_TOKENS)
        served = (spec_decode_counters(llm) - before).acceptance_length
    finally:
        stop_engine(llm)
    assert tokens == plain_reference[16]
    offline = _offline_al(local_models.target, drafter, PROMPTS)
    print(f"eagle3 sequential: served AL {served:.4f}, offline AL {offline:.4f}")
    assert served > 1.2
    assert abs(offline - served) / served < 0.03, (offline, served)
