"""Greedy P-EAGLE output equals plain decoding token for token, in one drafter pass per step."""

import pytest

from tests.engines import (
    BATCH_SIZES,
    PROMPTS,
    drafter_info,
    greedy_token_ids,
    install_forward_counters,
    peagle_spec,
    read_forward_counters,
    shared_prefix_run,
    spec_decode_counters,
    start_engine,
    stop_engine,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=[1, 4, 8, 32], ids=lambda k: f"K{k}")
def peagle_engine(request, local_models, plain_reference, trained_peagle):
    # The reference engine must exist before this one: starting an engine re-registers vLLM's
    # Prometheus metrics and would hide a live engine's spec-decode counters.
    k = request.param
    spec = peagle_spec(trained_peagle, k)
    llm = start_engine(local_models.target, spec)
    install_forward_counters(llm)
    yield k, llm
    stop_engine(llm)


def test_engine_uses_our_proposer(peagle_engine):
    _, llm = peagle_engine
    assert drafter_info(llm) == [
        {"class": "PEagleProposer", "peagle_enabled": True, "parallel_drafting": True}
    ]


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_greedy_equals_plain_decoding(peagle_engine, plain_reference, batch_size):
    k, llm = peagle_engine
    before = spec_decode_counters(llm)
    assert greedy_token_ids(llm, PROMPTS[:batch_size]) == plain_reference[batch_size]
    window = spec_decode_counters(llm) - before
    assert window.num_drafts > 0, "speculation never ran"
    assert window.num_accepted_tokens > 0, "no draft accepted: the acceptance path went untested"
    assert window.num_draft_tokens == k * window.num_drafts, "each step verifies K drafts"


def test_exactly_one_drafter_forward_per_step(peagle_engine):
    _, llm = peagle_engine
    read_forward_counters(llm)  # discard what start-up and earlier tests ran
    greedy_token_ids(llm, PROMPTS[:4], max_tokens=24)
    [counts] = read_forward_counters(llm)
    assert counts["target"] > 0
    # Each engine step runs the target once and then drafts for the next step.
    assert counts["drafter"] == counts["target"], counts


def test_prefix_cache_hits_as_plain_decoding_does(peagle_engine, plain_reference):
    # vLLM recomputes the last cached block for EAGLE-type drafters; ours keeps it (config.py,
    # KEEP_LAST_CACHED_BLOCK_KEY), so a shared prefix costs no more prefill than without
    # speculation, and the drafter's one stale position must not change a greedy token.
    plain_tokens, plain_cached = plain_reference.shared_prefix
    assert plain_cached[0] == 0 and min(plain_cached[1:]) > 0, plain_cached
    _, llm = peagle_engine
    tokens, cached = shared_prefix_run(llm)
    assert cached == plain_cached
    assert tokens == plain_tokens
