"""Adaptive K inside a real engine: lossless, wired to vLLM's scheduler, reacts to acceptance.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can
read the scheduler's K controller directly.
"""

import pytest
from vllm import SamplingParams

from tests.engines import (
    BATCH_SIZES,
    PROMPTS,
    environment,
    greedy_token_ids,
    install_forward_counters,
    install_metadata_check,
    read_forward_counters,
    read_metadata_checks,
    spec_decode_counters,
    start_engine,
    stop_engine,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def adaptive_engine(local_models, plain_reference, trained_peagle):
    # No "adaptive" key: adaptive K is what `method: peagle` serves by default.
    spec = {"method": "peagle", "model": str(trained_peagle), "num_speculative_tokens": 4}
    with environment(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        llm = start_engine(local_models.target, spec)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        install_forward_counters(llm)
        install_metadata_check(llm)
        yield llm, scheduler
        stop_engine(llm)


def test_adaptive_k_is_on_by_default(adaptive_engine):
    _, scheduler = adaptive_engine
    assert type(scheduler).__name__ in {"AdaptiveKScheduler", "AdaptiveKAsyncScheduler"}
    assert scheduler.k_controller is not None
    assert scheduler.dynamic_sd_lookup is scheduler.k_controller.lookup


def test_greedy_equals_plain_decoding_while_k_changes(adaptive_engine, plain_reference):
    llm, scheduler = adaptive_engine
    controller = scheduler.k_controller
    read_forward_counters(llm)
    steps_before = len(controller.history)
    for batch_size in BATCH_SIZES:
        assert greedy_token_ids(llm, PROMPTS[:batch_size]) == plain_reference[batch_size]
    steps = list(controller.history)[steps_before:]
    drafted = [k for _, k, _ in steps]
    # Start-up calibration alone drafts K = 4, 0, 1 and 2, so every kind of step was verified.
    assert {0, 1, 4} <= set(drafted), drafted
    [counts] = read_forward_counters(llm)
    assert counts["target"] == len(steps)
    # One drafter pass per drafting step; a K = 0 step runs no drafter at all.
    assert counts["drafter"] == sum(1 for k in drafted if k > 0) < counts["target"]
    # Nor does vLLM prepare the drafter's inputs for it (patch ledger, entry 2).
    assert counts["proposer_calls"] == counts["drafter"]
    # ... and the engine core fetches drafts only after the steps that drafted (entry 5).
    if not scheduler.scheduler_config.async_scheduling:
        assert counts["draft_fetches"] == counts["drafter"]
    # Only steps with drafts to verify go through the rejection sampler; the others sample
    # as plain decoding does (the rejection sampler's noise draws cost a plain step ~10 %).
    after_drafting = sum(1 for k in drafted[:-1] if k > 0)  # the steps that can verify
    assert 0 < counts["rejection_sampler"] <= after_drafting < counts["target"]
    # Steps that verify nothing get vLLM's spec-decode metadata built directly (entry 2).
    [checks] = read_metadata_checks(llm)
    assert checks["zero_draft_steps"] >= counts["target"] - after_drafting > 0
    assert checks["mismatches"] == 0, checks


def test_controller_sees_what_vllm_counts(adaptive_engine):
    llm, scheduler = adaptive_engine
    controller = scheduler.k_controller
    counters_before = spec_decode_counters(llm)
    drafts_before, accepted_before = controller.verified_drafts, controller.accepted_drafts
    greedy_token_ids(llm, PROMPTS[:8], max_tokens=32)
    window = spec_decode_counters(llm) - counters_before
    assert controller.verified_drafts - drafts_before == window.num_draft_tokens
    assert controller.accepted_drafts - accepted_before == window.num_accepted_tokens


def test_no_drafts_after_the_step_that_ends_every_request(adaptive_engine, plain_reference):
    """Four requests with one max_tokens end in one step (or a few): drafting after it
    would be for nothing, so its K is 0 whatever the policy's K (useful_drafts)."""
    llm, scheduler = adaptive_engine
    controller = scheduler.k_controller
    # The policy drafts K = 4 throughout: no K it might prefer replaces it.
    controller.policy_k[:] = [4] * len(controller.policy_k)
    hysteresis, controller.config.hysteresis = controller.config.hysteresis, float("inf")
    steps_before = len(controller.history)
    try:
        assert greedy_token_ids(llm, PROMPTS[:4]) == plain_reference[4]
    finally:
        controller.config.hysteresis = hysteresis
    steps = list(controller.history)[steps_before:]
    *_, (_, drafted_last, policy_last) = steps
    assert drafted_last == 0 and policy_last > 0, steps[-5:]
    assert sum(1 for _, drafted, _ in steps if drafted) >= len(steps) // 2, steps


def test_k_falls_when_drafts_stop_being_accepted(adaptive_engine):
    llm, scheduler = adaptive_engine
    controller = scheduler.k_controller
    controller.policy_k[:] = [4] * len(controller.policy_k)  # start the phase at the full K
    steps_before = len(controller.history)
    # At temperature 2 the target samples nearly uniformly: nothing a drafter can predict.
    params = SamplingParams(temperature=2.0, max_tokens=96, ignore_eos=True, seed=1)
    updates = {"while a step runs": 0, "while scheduling": 0}
    running_ahead = [False]
    update_policy, update_ahead = controller._update_policy, controller.update_ahead

    def counting_update(step=None):
        updates["while a step runs" if running_ahead[0] else "while scheduling"] += 1
        update_policy(step)

    def counting_ahead(verifying):
        running_ahead[0] = True
        try:
            update_ahead(verifying)
        finally:
            running_ahead[0] = False

    controller._update_policy, controller.update_ahead = counting_update, counting_ahead
    try:
        llm.generate(PROMPTS[:4], params, use_tqdm=False)
    finally:
        del controller._update_policy, controller.update_ahead
    policy = [k for batch, _, k in list(controller.history)[steps_before:] if batch == 4]
    steps_to_zero = policy.index(0)
    assert steps_to_zero <= 64, policy
    assert policy[-1] == 0, policy
    # The scheduler runs the policy's updates while the workers execute a step, off the
    # engine's critical path (AdaptiveKMixin.get_grammar_bitmask).
    assert updates["while a step runs"] >= 5 and updates["while scheduling"] == 0, updates
