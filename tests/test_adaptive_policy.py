"""The adaptive-K estimates and policy on synthetic acceptance and step costs (no engine)."""

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_peagle.adaptive.estimates import (
    AcceptanceEstimate,
    CostCorrection,
    StepCostModel,
    expected_tokens,
)
from vllm_peagle.adaptive.policy import (
    AdaptiveConfig,
    KController,
    best_k,
    cost_probe_plan,
    expected_tokens_table,
    rate_table,
)
from vllm_peagle.adaptive.scheduler import useful_drafts


def simulate_verification(rng: np.random.Generator, alphas, num_drafts: int) -> int:
    """Accepted prefix length when draft j survives with conditional probability alphas[j]."""
    accepted = 0
    while accepted < num_drafts and rng.random() < alphas[accepted]:
        accepted += 1
    return accepted


def test_expected_tokens_matches_the_geometric_closed_form():
    for a in (0.1, 0.5, 0.9):
        for k in (0, 1, 3, 8):
            closed_form = 1 + a * (1 - a**k) / (1 - a)
            assert expected_tokens(np.full(8, a), k) == pytest.approx(closed_form)


def test_expected_tokens_matches_simulation():
    rng = np.random.default_rng(0)
    alphas = np.array([0.8, 0.6, 0.5, 0.3])
    simulated = np.mean([1 + simulate_verification(rng, alphas, 4) for _ in range(40000)])
    assert expected_tokens(alphas, 4) == pytest.approx(simulated, abs=0.02)


def test_acceptance_estimate_recovers_conditional_rates():
    rng = np.random.default_rng(1)
    truth = np.array([0.9, 0.7, 0.5, 0.2])
    estimate = AcceptanceEstimate(4, half_life_steps=1e9)
    for _ in range(3000):
        estimate.observe_step([(4, simulate_verification(rng, truth, 4)) for _ in range(4)])
    np.testing.assert_allclose(estimate.conditional(), truth, atol=0.03)


def test_acceptance_estimate_forgets_with_its_half_life():
    estimate = AcceptanceEstimate(2, half_life_steps=10)
    for _ in range(200):
        estimate.observe_step([(2, 2)])
    assert estimate.conditional()[0] > 0.9
    for _ in range(30):  # three half-lives of total rejection
        estimate.observe_step([(2, 0)])
    assert estimate.conditional()[0] < 0.2


def test_a_position_never_tried_reads_as_the_one_before_it():
    estimate = AcceptanceEstimate(4, half_life_steps=1e9)
    for _ in range(50):  # the first draft always rejected: positions 2..4 never tried
        estimate.observe_step([(4, 0)])
    alphas = estimate.conditional()
    assert alphas[0] < 0.05
    np.testing.assert_allclose(alphas[1:], alphas[0], rtol=1e-9)


def test_a_cautious_acceptance_doubts_few_draws_and_trusts_many():
    estimate = AcceptanceEstimate(1, half_life_steps=1e9)
    estimate.observe_step([(1, 1)])  # one draw, accepted
    assert estimate.conditional(cautious=True)[0] <= 0.5 < estimate.conditional()[0]
    for _ in range(400):
        estimate.observe_step([(1, 1), (1, 0)])
    assert estimate.conditional(cautious=True)[0] == pytest.approx(0.5, abs=0.01)
    assert estimate.conditional()[0] == pytest.approx(0.5, abs=0.01)


def true_seconds(c, batch, k, verified=None):
    """A step of ``batch`` requests verifying ``verified`` drafts each and drafting ``k``."""
    verified = k if verified is None else verified
    tokens = batch * (1 + verified)
    drafter_per_token = c[4] if len(c) > 4 else 0.0
    return c[0] + c[1] * tokens + (c[2] + c[3] * batch + drafter_per_token * tokens) * (k > 0)


def test_step_cost_model_recovers_a_linear_cost():
    rng = np.random.default_rng(2)
    costs = 5e-3, 2e-4, 3e-3, 5e-5
    model = StepCostModel(half_life_steps=1e9)
    for _ in range(400):
        batch, k = int(rng.integers(1, 33)), int(rng.integers(0, 8))
        seconds = true_seconds(costs, batch, k) * rng.uniform(0.97, 1.03)
        model.observe(batch * (1 + k), batch, k > 0, seconds)
    for batch, k in [(1, 0), (1, 7), (16, 3), (32, 7)]:
        assert model.predict(batch, k) == pytest.approx(true_seconds(costs, batch, k), rel=0.05)


def test_step_cost_model_separates_drafting_from_verification():
    """Drafting at batch 16 costs more than at batch 1 even at the same K (every K_max slot of
    every request runs, and the drafter re-reads the accepted tokens): seen at batch 1 and 16,
    the model predicts batch 8 for K = 0, 1 and 4."""
    costs = 8e-3, 1e-4, 4e-3, 3e-4, 5e-5
    model = StepCostModel(half_life_steps=1e9)
    for _ in range(10):
        for batch, k in itertools.product((1, 16), (0, 1, 4)):
            model.observe(batch * (1 + k), batch, k > 0, true_seconds(costs, batch, k))
    for batch, k in [(8, 0), (8, 1), (8, 4)]:
        assert model.predict(batch, k) == pytest.approx(true_seconds(costs, batch, k), rel=0.02)


def test_step_cost_model_folds_a_batch_as_it_would_one_step_at_a_time():
    rng = np.random.default_rng(5)
    steps = [
        (int(b * (1 + k)), int(b), k > 0, float(rng.uniform(0.005, 0.02)))
        for b, k in zip(rng.integers(1, 9, 40), rng.integers(0, 5, 40), strict=True)
    ]
    one_by_one, batched = StepCostModel(half_life_steps=32), StepCostModel(half_life_steps=32)
    for step in steps[:8]:  # below trusted_after: no clipping in either
        one_by_one.observe(*step)
    batched.observe_many(*(np.array(column) for column in zip(*steps[:8], strict=True)))
    np.testing.assert_allclose(batched.gram, one_by_one.gram, rtol=1e-12)
    np.testing.assert_allclose(batched.moment, one_by_one.moment, rtol=1e-12)
    assert batched.num_observations == one_by_one.num_observations == 8


def test_step_cost_model_batch_clips_stalls_against_the_fit_before_it():
    model = StepCostModel(half_life_steps=1e9)
    for i in range(40):
        model.observe(1 + i % 4, 1 + i % 2, i % 4 > 0, 0.010 + 0.001 * (i % 4))
    before = model.predict(1, 2)
    predicted = model.observe_many(
        np.array([3.0, 3.0]), np.array([1.0, 1.0]), np.array([True, True]), np.array([30.0, 0.012])
    )
    assert predicted == pytest.approx([before, before])
    assert model.predict(1, 2) < 2 * before


def update_steps(alphas: np.ndarray, steps: int = 400) -> list[int]:
    """The steps at which the K table was re-evaluated, over ``steps`` simulated steps."""
    controller = KController(4, 4, AdaptiveConfig())
    engine = SimulatedEngine(controller, batch=2)
    calls: list[int] = []
    update = controller._update_policy

    def counting_update(step: int | None = None) -> None:
        calls.append(controller.decode_steps)
        update(step)

    controller._update_policy = counting_update
    for _ in range(steps):
        engine.step(alphas, COSTS)
    return calls


def test_plain_decoding_reevaluates_the_table_less_often_than_drafting():
    interval = AdaptiveConfig().update_interval_steps
    # A drafter that predicts nothing: plain decoding but for probes.
    spacing = np.diff([s for s in update_steps(np.full(4, 0.01)) if s > 200])
    # Every 4x the interval (AdaptiveConfig.update_interval_steps says so); after a probe's
    # verification, once more at the next interval.
    assert spacing.max() == 4 * interval, spacing
    assert set(spacing) <= {interval, 2 * interval, 3 * interval, 4 * interval}
    # A drafter that predicts well: every step verifies drafts.
    assert set(np.diff([s for s in update_steps(np.full(4, 0.9)) if s > 200])) == {interval}


def test_step_cost_model_clips_stalls():
    model = StepCostModel(half_life_steps=1e9)
    for i in range(40):
        model.observe(1 + i % 4, 1 + i % 2, i % 4 > 0, 0.010 + 0.001 * (i % 4))
    before = model.predict(1, 2)
    model.observe(3, 1, True, 30.0)  # a 30 s stall
    assert model.predict(1, 2) < 2 * before


def fitted_cost(c0, c1, c2, c3, max_batch=64, max_k=8) -> StepCostModel:
    model = StepCostModel(half_life_steps=1e9)
    for batch in range(1, max_batch + 1, 3):
        for k in range(max_k + 1):
            model.observe(batch * (1 + k), batch, k > 0, true_seconds((c0, c1, c2, c3), batch, k))
    return model


def brute_force_best_k(alphas, c, batch, max_k):
    best, best_rate = 0, -1.0
    for k in range(max_k + 1):
        gain = 1 + sum(np.prod(alphas[: j + 1]) for j in range(k))
        seconds = true_seconds(c, batch, k)
        if gain / seconds > best_rate + 1e-12:
            best, best_rate = k, gain / seconds
    return best


@pytest.mark.parametrize(
    "alphas, coefficients",
    [
        ([0.9] * 8, (10e-3, 1e-5, 1e-3, 1e-6)),  # cheap verification, good drafter: K large
        ([0.3] * 8, (10e-3, 1e-5, 8e-3, 1e-6)),  # poor drafter, costly drafting: K = 0
        ([0.8, 0.6, 0.4, 0.2, 0.1, 0.1, 0.1, 0.1], (5e-3, 2e-4, 1e-3, 5e-5)),  # in between
        ([0.95] * 8, (2e-3, 1e-3, 5e-4, 1e-4)),  # compute-bound: K shrinks as batch grows
    ],
)
def test_policy_picks_the_analytically_optimal_k(alphas, coefficients):
    alphas = np.array(alphas)
    rates = rate_table(alphas, fitted_cost(*coefficients), 64, 8)
    chosen = best_k(rates)
    for batch in (1, 2, 8, 32, 64):
        assert chosen[batch] == brute_force_best_k(alphas, coefficients, batch, 8), batch


def test_policy_respects_min_k():
    alphas, costs = np.full(8, 0.1), (10e-3, 1e-5, 8e-3, 1e-6)
    rates = rate_table(alphas, fitted_cost(*costs), 8, 8)
    assert best_k(rates)[1] == 0
    restricted = best_k(rates, min_k=2)[1]
    assert restricted >= 2
    true_rates = {
        k: (1 + sum(0.1 ** (j + 1) for j in range(k))) / true_seconds(costs, 1, k)
        for k in range(2, 9)
    }
    assert restricted == max(true_rates, key=true_rates.get)


class SimulatedEngine:
    """Decoding steps of ``batch`` requests: drafts written after step t are verified at t+1."""

    def __init__(self, controller: KController, batch: int, seed: int = 0) -> None:
        self.controller = controller
        self.batch = batch
        self.rng = np.random.default_rng(seed)
        self.pending_drafts = 0
        self.k_history: list[int] = []
        self.drafted: list[int] = []

    def step(self, alphas, coefficients) -> None:
        self.controller.before_step()
        k = self.controller.lookup[self.batch]
        verified = self.pending_drafts
        verifications = [
            (verified, simulate_verification(self.rng, alphas, verified))
            for _ in range(self.batch)
            if verified
        ]
        seconds = self.seconds(coefficients, k, verified)
        self.controller.observe_step(
            self.batch * (1 + verified), self.batch, k, seconds, verifications
        )
        self.pending_drafts = k
        self.drafted.append(k)
        self.k_history.append(self.controller.policy_k[self.batch])

    def seconds(self, coefficients, k: int, verified: int) -> float:
        return true_seconds(coefficients, self.batch, k, verified)


COSTS = (5e-3, 1e-4, 1e-3, 2e-5)  # drafting pays when acceptance is good, not when it is poor
AGREEING = np.full(7, 0.85)
"""Conditional acceptance of a drafter the target mostly agrees with."""


def collapse_acceptance(engine: SimulatedEngine) -> tuple[list[int], int]:
    """200 steps of a drafter the target agrees with, then 200 of one it never does: the
    policy's K after the collapse and the steps it took to reach 0."""
    for _ in range(200):
        engine.step(AGREEING, COSTS)
    assert engine.k_history[-1] >= 5, engine.k_history[-20:]
    settled = len(engine.k_history)
    for _ in range(200):
        engine.step(np.full(7, 0.02), COSTS)
    after_collapse = engine.k_history[settled:]
    return after_collapse, next(i for i, k in enumerate(after_collapse) if k == 0)


def test_k_falls_when_acceptance_collapses_and_rises_when_it_recovers():
    config = AdaptiveConfig()
    engine = SimulatedEngine(KController(7, 16, config), batch=4)
    after_collapse, steps_to_fall = collapse_acceptance(engine)
    # ~2 acceptance half-lives (16 steps each) bring alpha_1 from 0.85 below the break-even.
    assert steps_to_fall <= 64, after_collapse[:80]
    # Probes keep trying one draft; the K stays at 0 between them (no flapping back up).
    assert max(after_collapse[steps_to_fall:]) == 0
    recovered_at = len(engine.k_history)
    for _ in range(300):
        engine.step(AGREEING, COSTS)
    after_recovery = engine.k_history[recovered_at:]
    steps_to_rise = next(i for i, k in enumerate(after_recovery) if k >= 5)
    # Recovery is seen through probes, one more position per probe, and a probe forgets at
    # most one half-life of the collapse: two probe intervals (~136 steps here) at most.
    assert steps_to_rise <= 320, after_recovery[:340]


class OverlappingEngine(SimulatedEngine):
    """As the adaptive scheduler drives the controller: the policy's update runs while the
    step executes (``update_ahead``), and ``before_step`` only reads the table."""

    def __init__(self, controller: KController, batch: int) -> None:
        super().__init__(controller, batch)
        self.updates_in_before_step = 0
        self.updates_ahead = 0
        update = controller._update_policy

        def counting_update(step: int | None = None) -> None:
            if self.in_flight:
                self.updates_ahead += 1
            elif not controller.calibrating:
                self.updates_in_before_step += 1
            update(step)

        controller._update_policy = counting_update
        self.in_flight = False

    def seconds(self, coefficients, k: int, verified: int) -> float:
        self.in_flight = True
        self.controller.update_ahead(verifying=verified > 0)
        self.in_flight = False
        return super().seconds(coefficients, k, verified)


def test_policy_updates_run_while_the_step_executes_and_still_follow_acceptance():
    engine = OverlappingEngine(KController(7, 16, AdaptiveConfig()), batch=4)
    after_collapse, steps_to_fall = collapse_acceptance(engine)
    assert steps_to_fall <= 64, after_collapse[:80]  # as without the overlap
    assert engine.updates_ahead > 20
    assert engine.updates_in_before_step == 0
    # Drafting resumes after a plain stretch, its first verification at each step phase: the
    # step in flight verifies drafts, so the update it makes due still runs ahead.
    controller = engine.controller
    for offset in range(4):
        # A plain stretch that a plain-decoding update ends (every 16 steps), then offset more.
        for _ in range(16):
            engine.step(np.full(7, 0.02), COSTS)
        while controller.decode_steps % 16 != 1 + offset:
            engine.step(np.full(7, 0.02), COSTS)
        controller.policy_k[:] = controller.lookup[:] = [7] * 17
        for _ in range(8):
            engine.step(AGREEING, COSTS)
        controller.policy_k[:] = controller.lookup[:] = [0] * 17
        assert engine.updates_in_before_step == 0, offset


def test_cost_correction_folds_a_batch_as_it_would_one_step_at_a_time():
    rng = np.random.default_rng(7)
    count = 12
    batch = rng.integers(1, 5, count).astype(float)
    tokens = batch * (1 + rng.integers(0, 3, count))
    drafting = tokens > batch
    seconds, predicted = rng.uniform(0.005, 0.02, count), rng.uniform(0.005, 0.02, count)
    steps = np.arange(count, dtype=float)
    batched, one_by_one = CostCorrection(8, 4), CostCorrection(8, 4)
    batched.observe_many(tokens, batch, drafting, seconds, predicted, steps)
    for i in range(count):
        one_by_one.observe_many(
            *(a[i : i + 1] for a in (tokens, batch, drafting, seconds, predicted, steps))
        )
    np.testing.assert_allclose(batched.seconds, one_by_one.seconds, rtol=1e-12)
    np.testing.assert_allclose(batched.features, one_by_one.features, rtol=1e-12)
    np.testing.assert_array_equal(batched.count, one_by_one.count)
    np.testing.assert_allclose(batched.weight, one_by_one.weight, rtol=1e-12)
    np.testing.assert_array_equal(batched.last_seen, one_by_one.last_seen)
    assert (batched.weight > 0).sum() > 2  # several shapes were folded


def test_a_shape_measured_again_after_a_pause_follows_the_new_measurement():
    """Twenty plain steps at 16 ms, then steps at 12 ms: straight after the twenty, one is a
    step among many; after 100 steps of other shapes the new steps are the news (the host's
    speed drifts), though one alone moves the shape only halfway (one step is noisy)."""

    def factor_after(gap: int, new_steps: int) -> float:
        correction = CostCorrection(8, 4)
        count = 20 + new_steps
        steps = np.concatenate([np.arange(20.0), 19.0 + gap + np.arange(new_steps)])
        seconds = np.concatenate([np.full(20, 0.016), np.full(new_steps, 0.012)])
        ones = np.ones(count)
        correction.observe_many(ones, ones, ones < 0, seconds, np.full(count, 0.012), steps)
        coefficients = np.array([0.0, 0.012, 0.0, 0.0, 0.0])  # predicts 12 ms per plain step
        return correction.table(1, coefficients)[0][1, 0]

    assert factor_after(1, 1) > 1.25
    assert factor_after(1, 3) > 1.2
    assert factor_after(100, 1) == pytest.approx(14 / 12)
    assert factor_after(100, 3) < 1.1


# CPU-like costs of a small target: per-request drafting is dear (every K_max slot runs).
CPU_COSTS = (8e-3, 1.5e-4, 4e-3, 3.5e-4)
# A compute-bound target: a step's fixed cost is small beside its per-token cost.
COMPUTE_BOUND_COSTS = (1e-3, 1e-3, 4e-3, 3.5e-4)


def test_no_probes_where_even_a_perfect_drafter_cannot_pay():
    batch, max_k = 16, 4
    plain = true_seconds(COMPUTE_BOUND_COSTS, batch, 0)
    assert all(  # K drafts, all accepted: K+1 tokens, still slower than K+1 plain steps
        true_seconds(COMPUTE_BOUND_COSTS, batch, k) > (1 + k) * plain for k in range(1, max_k + 1)
    )
    controller = KController(max_k, batch, AdaptiveConfig())
    engine = SimulatedEngine(controller, batch=batch)
    for _ in range(300):
        engine.step(np.full(max_k, 0.9), COMPUTE_BOUND_COSTS)
    assert engine.k_history[-1] == 0
    after_calibration = engine.drafted[len(controller.calibration) + 8 :]
    assert max(after_calibration) == 0, after_calibration


def test_probes_are_spaced_to_cost_the_budget():
    """Poor acceptance keeps K at 0; a perfect drafter would pay, so probes continue, each
    drafting the optimistic best K for one step, spaced so their extra time stays within the
    time budget (cost probes, which draft two steps in a row, are not counted)."""
    config = AdaptiveConfig()
    controller = KController(4, 16, config)
    engine = SimulatedEngine(controller, batch=1)
    for _ in range(1000):
        engine.step(np.full(4, 0.05), CPU_COSTS)
    assert engine.k_history[-1] == 0
    late = engine.drafted[200:]
    plain = true_seconds(CPU_COSTS, 1, 0)
    overhead = (true_seconds(CPU_COSTS, 1, 4) - plain) / plain
    periods = max(1, math.ceil(overhead / config.probe_budget / config.probe_interval_steps))
    interval = config.probe_interval_steps * periods
    lone = [i for i in range(1, len(late) - 1) if late[i] and not (late[i - 1] or late[i + 1])]
    assert {late[i] for i in lone} == {4}, late
    assert len(lone) == pytest.approx(len(late) / interval, abs=1.5), late


def test_hysteresis_stops_flapping_between_near_equal_choices():
    rng = np.random.default_rng(3)
    engine = SimulatedEngine(KController(4, 4, AdaptiveConfig()), batch=1)
    alphas = np.full(4, 0.5)
    for _ in range(400):
        # noisy costs where K=0 and K=1 are within ~1% of each other
        noise = rng.uniform(0.98, 1.02)
        engine.step(alphas, (10e-3 * noise, 1e-5, 4.9e-3, 1e-6))
    late = engine.k_history[100:]
    changes = sum(1 for a, b in itertools.pairwise(late) if a != b)
    assert changes <= 4, late


@pytest.mark.parametrize(
    "setting, message",
    [
        ("yes", "must be true, false or an object"),
        ({"min_k": -1}, "min_k >= 0"),
        ({"speed": 2}, "Unknown 'adaptive' setting"),
        ({"first_drafting_probe_loss_share": 0}, "0 < first_drafting_probe_loss_share <= 1"),
        ({"plain_cost_probe_margin": 1.0}, "0 <= plain_cost_probe_margin < 1"),
        ({"plain_refresh_steps": 0}, "plain_refresh_steps >= 1"),
    ],
)
def test_bad_adaptive_settings_are_clear_errors(setting, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveConfig.from_setting(setting)


def test_adaptive_settings():
    assert AdaptiveConfig.from_setting(None).enabled
    assert not AdaptiveConfig.from_setting(False).enabled
    assert AdaptiveConfig.from_setting({"min_k": 1, "hysteresis": 0.1}).min_k == 1


def test_step_cost_model_never_learns_that_drafting_saves_time():
    """Plain steps measured at large batches (a convex cost), drafting steps only at small
    ones: plain least squares trades the regimes off with a negative drafting slope, which
    would make speculation look cheaper than plain decoding. Slopes are held >= 0."""
    model = StepCostModel(half_life_steps=1e9)
    for batch in (1, 2, 4, 8, 16, 32, 64):
        model.observe(batch, batch, False, 0.010 + 2e-6 * batch**2)
    for batch, k in itertools.product((1, 2), (1, 3, 7)):
        tokens = batch * (1 + k)
        model.observe(tokens, batch, True, 0.010 + 2e-6 * tokens**2 + 0.004)
    unconstrained = np.linalg.solve(model.gram + np.eye(5) * 1e-12, model.moment)
    assert (unconstrained[1:] < 0).any()  # the trap is real
    assert (model.coefficients()[1:] >= 0).all()
    for batch in (1, 8, 64):
        plain = model.predict(batch, 0)
        assert all(model.predict(batch, k) > plain for k in range(1, 8))


def test_steps_admitting_prompts_draft_at_the_k_of_the_batch_they_head_for():
    controller = KController(7, 64, AdaptiveConfig())
    controller.decode_steps = len(controller.calibration) + 1  # past calibration, no update due
    controller.policy_k = [7] * 33 + [0] * 32  # K=7 up to 32 requests, plain decoding above
    controller.before_step(heading_batch=64)
    assert controller.lookup[32] == 0 and controller.lookup[1] == 0
    controller.before_step()
    assert controller.lookup[32] == 7 and controller.lookup[40] == 0
    controller.before_step(heading_batch=20)
    assert controller.lookup[32] == 7 and controller.lookup[64] == 7


def superlinear_seconds(tokens: int, batch: int, drafting: bool) -> float:
    """A CPU-like step: per-token cost grows with the step's tokens; the drafter is cheap per
    request, which drafting measured at batch size 1 alone cannot reveal."""
    return 0.015 + 7e-4 * tokens + 3e-7 * tokens**2 + drafting * (0.004 + 3e-4 * batch)


class SuperlinearEngine(SimulatedEngine):
    def seconds(self, coefficients, k: int, verified: int) -> float:
        return superlinear_seconds(self.batch * (1 + verified), self.batch, k > 0)


@pytest.mark.parametrize("margin", [0.0, 0.3])
def test_cost_probes_correct_a_cost_model_that_extrapolates_wrongly(margin):
    """Batch 1 (drafting pays), then 64 (plain decoding pays), then 32, where K=3 is ~9%
    faster than plain decoding but the linear model, fitted on the first two, predicts
    plain decoding. Without cost probes the policy never drafts at 32 and so never learns
    otherwise; with them, two measured steps at the contender correct the prediction."""
    alphas = np.full(7, 0.92)

    def true_rate(batch, k):
        return expected_tokens(alphas, k) / superlinear_seconds(batch * (1 + k), batch, k > 0)

    best_at = {b: max(range(8), key=lambda k, b=b: true_rate(b, k)) for b in (1, 32, 64)}
    assert best_at == {1: 7, 32: 3, 64: 0}
    controller = KController(7, 64, AdaptiveConfig(cost_probe_margin=margin))
    engine = SuperlinearEngine(controller, batch=1)
    for batch, steps in ((1, 200), (64, 200), (32, 300)):
        engine.batch = batch
        for _ in range(steps):
            engine.step(alphas, None)
        chosen = controller.policy_k[batch]
        if margin or batch != 32:
            assert chosen == best_at[batch], (batch, engine.drafted[-40:])
        else:  # the trap is real
            assert chosen == 0
            assert true_rate(32, 3) > 1.05 * true_rate(32, 0)
    if margin:
        # Few probes: the steady state at 32 drafts at its K, and the last 100 steps at 64
        # (K=0) tried drafting at most once (a two-step cost probe).
        assert engine.drafted[-100:].count(3) >= 95
        assert sum(1 for k in engine.drafted[300:400] if k) <= 2


class BurstEngine(SimulatedEngine):
    """Batch 1, then a burst of 64 requests whose first decoding steps run slow, as the CPU
    bench server's did (69.7, then 42.7, 37.9, 41.4 ms against ~30 ms steady)."""

    slowdowns = (2.3, 1.4, 1.3, 1.3)
    costs = (8e-3, 3.4e-4, 1e-3, 2e-4, 2e-4)  # plain at 64 ~30 ms; K=7 there ~300 ms

    def __init__(self, controller: KController) -> None:
        super().__init__(controller, batch=1)
        self.steps_at_64 = 0

    def seconds(self, coefficients, k: int, verified: int) -> float:
        seconds = true_seconds(self.costs, self.batch, k, verified)
        if self.batch == 64:
            if self.steps_at_64 < len(self.slowdowns):
                seconds *= self.slowdowns[self.steps_at_64]
            self.steps_at_64 += 1
        return seconds


@pytest.mark.parametrize("start_step", range(0, 16, 3))
def test_slow_first_steps_after_a_burst_do_not_tip_the_policy_into_drafting(start_step):
    """At 64 requests plain decoding is ~35 % faster than K=7 (~25 % on the CPU bench target
    at concurrency 64). A cost probe compares the two kinds; if it runs while the plain kind has
    been measured only over the burst's first slow steps, drafting looks faster and the run
    drafts to the end. Whatever the probe schedule's phase, the policy must stay plain."""
    alphas = np.array([0.93] + [0.99] * 6)
    costs = BurstEngine.costs

    def true_rate(batch, k):
        return expected_tokens(alphas, k) / true_seconds(costs, batch, k)

    assert true_rate(1, 7) > 2 * true_rate(1, 0)
    assert true_rate(64, 0) > 1.3 * true_rate(64, 7)
    engine = BurstEngine(KController(7, 64, AdaptiveConfig()))
    for _ in range(200 + start_step):
        engine.step(alphas, None)
    engine.batch = 64
    for _ in range(200):
        engine.step(alphas, None)
    assert engine.controller.policy_k[64] == 0, engine.drafted[-200:]
    assert sum(1 for k in engine.drafted[-200:] if k) <= 4, engine.drafted[-200:]


def test_a_dear_first_cost_probe_waits_until_its_batch_size_has_run_long_enough():
    """A burst of 64 that drains within ~60 steps (one CPU bench run) is not worth a K=7
    probe that costs ~10 plain steps; a batch size that stays is measured all the same."""
    alphas = np.array([0.93] + [0.99] * 6)
    engine = BurstEngine(KController(7, 64, AdaptiveConfig()))
    for _ in range(200):
        engine.step(alphas, None)
    engine.batch = 64
    for _ in range(60):
        engine.step(alphas, None)
    assert not any(engine.drafted[-50:]), engine.drafted[-60:]
    for _ in range(400):
        engine.step(alphas, None)
    last_measured = engine.controller.correction.table(64, engine.controller.cost.coefficients())[1]
    assert last_measured[64, 7] > 200, last_measured[64]
    assert engine.controller.policy_k[64] == 0


def test_a_first_drafting_probe_waits_in_proportion_to_what_it_may_lose():
    """Where the model predicts drafting short of plain decoding by ~10 % (batch 32 here), its
    two-step probe risks under two plain steps and comes after the usual 16; at batch 64
    (~27 % short, ~5 plain steps at risk) it waits ~55. A fixed 64-step wait never measured
    drafting at a batch size reached only in short runs: on the CPU bench at concurrency 16
    (~60 steps a run, fresh servers) K=7 was 1.2x plain and adaptive K never drafted."""
    config = AdaptiveConfig()
    costs = BurstEngine.costs
    batch = np.arange(65)[:, None]
    k = np.arange(8)[None, :]
    seconds = true_seconds(costs, np.maximum(batch, 1), k)
    gains = expected_tokens_table(np.array([0.93] + [0.99] * 6), 7)
    rates = gains[None, :] / seconds
    relative = rates[:, 1:].max(axis=1) / rates[:, 0]
    assert 0.85 < relative[32] < 0.95 and relative[64] < 0.8, relative[[32, 64]]
    policy_k = np.where(batch[:, 0] < 32, 7, 0)
    last_measured = np.full(seconds.shape, -(10**9))
    last_measured[:, 0] = 100
    last_measured[:8, 1:] = 100  # drafting measured at batch sizes below 8 only
    measured_steps = np.zeros(seconds.shape, dtype=int)
    measured_steps[:, 0] = 20  # plain steps run so far at each batch size

    def probe_k(steps_at_64: int) -> np.ndarray:
        measured_steps[64, 0] = steps_at_64
        return cost_probe_plan(
            rates, seconds, last_measured, measured_steps, policy_k, 200, config
        )[0]

    assert probe_k(20)[32] == 7
    assert probe_k(20)[64] == 0
    assert probe_k(60)[64] == 7


def test_no_first_drafting_probe_at_a_large_batch_where_drafting_loses_at_batch_one():
    """Sampled requests a drafter rarely predicts (alpha ~0.06, as at T=0.7 on the CPU bench
    models): drafting loses at batch size 1, where it was measured, and a drafting step's cost
    over a plain one's only grows with the batch, so at 64 no cost probe drafts (on the CPU
    sweep each such first probe cost ~5 % of a run at concurrency 32 and 64). Same costs as
    the test above, where a drafter that pays at batch size 1 is probed at 64."""
    poor = np.full(7, 0.06)
    costs = BurstEngine.costs
    assert all(expected_tokens(poor, k) < true_seconds(costs, 1, k) / true_seconds(costs, 1, 0)
               for k in range(1, 8))  # fmt: skip
    engine = BurstEngine(KController(7, 64, AdaptiveConfig()))
    for _ in range(200):
        engine.step(poor, None)
    assert engine.controller.policy_k[1] == 0
    engine.batch = 64
    for _ in range(400):
        engine.step(poor, None)
    controller = engine.controller
    last_measured = controller.correction.table(64, controller.cost.coefficients())[1]
    assert last_measured[64, 0] > 200 and last_measured[64, 1] < 0, last_measured[64]
    assert controller.policy_k[64] == 0
    assert sum(1 for k in engine.drafted[-400:] if k) <= 8, engine.drafted[-400:]


def test_drafting_measured_well_short_of_plain_decoding_is_not_measured_again():
    """Sampled requests as on the CPU bench models at T=0.7: drafting, measured while greedy
    requests ran, is ~20 % slower than plain decoding at its best K. Re-measuring it (a
    two-step cost probe every cost_refresh_steps) could not change the choice short of a
    20 % drift in a measured cost; only single-step acceptance probes draft."""
    costs = (0.015, 1.5e-3, 0.011, 0.0)  # batch 1: plain 16.5 ms, K=7 38 ms
    sampled = np.full(7, 0.35)
    plain_rate = 1 / true_seconds(costs, 1, 0)
    relative = [expected_tokens(sampled, k) / true_seconds(costs, 1, k) / plain_rate
                for k in range(1, 8)]  # fmt: skip
    assert 0.75 < max(relative) < 0.8, relative
    controller = KController(7, 8, AdaptiveConfig())
    engine = SimulatedEngine(controller, batch=1)
    for _ in range(300):
        engine.step(AGREEING, costs)
    assert controller.policy_k[1] > 0
    for _ in range(3000):
        engine.step(sampled, costs)
    assert controller.policy_k[1] == 0
    # Past the first ~1,000 steps (a K that never ran at batch 1 is measured once), 2,300
    # steps: four times cost_refresh_steps.
    after = engine.drafted[1000:]
    two_step_probes = sum(1 for a, b in itertools.pairwise(after) if a and b)
    assert two_step_probes == 0, after
    assert 5 <= sum(1 for k in after if k) <= 12  # acceptance probes, within their budget


def test_collapsed_acceptance_decodes_plainly_at_a_batch_size_where_only_drafting_ran():
    """As in the CPU sweep: greedy requests at batch 8 ended before a cost probe measured
    plain decoding there (K=7 ran ~9 steps per request), then sampled requests the drafter
    rarely predicts came. Plain decoding must take over at batch 8 at once, not after a
    settled cost probe's worth of drafting steps (a whole short run at 2x the step time)."""
    controller = KController(7, 16, AdaptiveConfig())
    engine = SimulatedEngine(controller, batch=1)
    for batch, alphas, steps in ((1, AGREEING, 200), (8, AGREEING, 10), (1, np.full(7, 0.1), 200)):
        engine.batch = batch
        for _ in range(steps):
            engine.step(alphas, COSTS)
    k_at_8 = controller.policy_k[8]
    assert controller.correction.table(16, controller.cost.coefficients())[1][8, 0] < 0
    poor = np.full(7, 0.1)
    assert expected_tokens(poor, 1) / true_seconds(COSTS, 8, 1) < 0.9 / true_seconds(COSTS, 8, 0)
    engine.batch = 8
    for _ in range(40):
        engine.step(poor, COSTS)
    assert k_at_8 == 0, engine.drafted[-40:]
    assert sum(1 for k in engine.drafted[-40:] if k) <= 3, engine.drafted[-40:]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_drafter_rarely_accepted_costs_little_more_than_plain_decoding(batch):
    """At K=0 only probes verify, a few draws each: a lucky one (the target accepts 10 % of
    first drafts) must not turn K up for steps at a time, nor make drafting look worth
    re-measuring. The budget is 0.5 % for probes; the rest of the 1.5 % allowed is what a
    run of good luck may still cost (with a 0.5 prior at untried positions and two half-lives
    forgotten per probe it was ~6 % at batch 1, ~1 % at batch 2)."""
    extra = []
    for seed in range(6):
        controller = KController(7, 16, AdaptiveConfig())
        engine = SimulatedEngine(controller, batch=1, seed=seed)
        for run_batch, alphas, steps in ((1, AGREEING, 200), (batch, np.full(7, 0.1), 600)):
            engine.batch = run_batch
            for _ in range(steps):
                engine.step(alphas, COSTS)
        late = engine.drafted[-400:]
        seconds = sum(true_seconds(COSTS, batch, k) for k in late)
        extra.append(seconds / (len(late) * true_seconds(COSTS, batch, 0)) - 1)
        assert controller.policy_k[batch] == 0
    assert np.mean(extra) < 0.015, extra


def test_no_probe_drafts_over_prompts_while_requests_wait():
    controller = KController(7, 64, AdaptiveConfig())
    controller.decode_steps = 4 * len(controller.calibration) * 16  # past calibration
    controller.steps_at[:] = controller.decode_steps  # as if every batch size had run them
    controller.policy_k = [0] * 65
    controller.probe_k = np.full(65, 7)  # every batch size due for a probe this step
    controller.probe_interval = np.full(65, 16)
    controller._update_policy = lambda step=None: None  # keep the forced plan
    controller.before_step(heading_batch=64)
    assert set(controller.lookup) == {0}
    controller.before_step()
    assert set(controller.lookup) == {7}


def test_probes_keep_their_interval_while_it_drifts():
    # The interval follows the cost model, so it drifts by a few multiples of 16 steps; probes
    # must still come about once per interval, not at every step that one of its recent
    # values happens to divide.
    controller = KController(7, 64, AdaptiveConfig())
    controller.policy_k = [0] * 65
    controller.lookup[:] = controller.policy_k
    controller.probe_k = np.full(65, 7)
    controller.cost_probe_k = np.zeros(65, dtype=int)  # no cost probes: probes alone
    controller._update_policy = lambda step=None: None
    start = len(controller.calibration)
    probes = []
    for step in range(start, start + 4000):
        controller.decode_steps = step
        controller.steps_at[32] = step  # every step at batch size 32
        controller.probe_interval = np.full(65, 368 + 16 * ((step // 16) % 4))
        controller.before_step()
        if controller.lookup[32] == 7:
            probes.append(step)
    gaps = np.diff(probes)
    assert len(probes) >= 4000 // 416 - 1
    assert gaps.min() >= 368, probes


def test_a_batch_size_only_short_runs_reach_is_probed_for_its_own_steps():
    """A probe at batch size 64 (a K=7 step there costs ~5 plain ones) is spaced to cost
    the budget of the steps run at 64. Spaced in steps at any batch size, it came due while
    the engine ran other batch sizes, and a short run at 64 took it (on the CPU bench, one
    K=7 step in 3 of 5 runs at concurrency 64, ~5 % of each)."""
    controller = KController(7, 64, AdaptiveConfig())
    controller._update_policy = lambda step=None: None  # keep the forced plan
    controller.policy_k = [0] * 65
    controller.probe_k = np.array([0] * 64 + [7])  # only batch size 64 has a probe to take
    controller.probe_interval = np.full(65, 800)
    controller.cost_probe_k = np.zeros(65, dtype=int)

    def run(batch: int, steps: int) -> list[int]:
        drafted = []
        for _ in range(steps):
            controller.before_step()
            drafted.append(controller.lookup[batch])
            controller.observe_step(batch, batch, drafted[-1], 0.01, [])
        return drafted

    run(1, 3000)
    assert not any(run(64, 70))  # 70 steps at 64: far from 800
    probes = run(64, 1600)
    at = [i for i, k in enumerate(probes) if k]
    # Due once 800 steps have run at 64 (70 of them before), at the next 16-step boundary.
    assert len(at) == 2, at
    assert 800 - 70 <= at[0] < 800 - 70 + 16, at
    assert 800 <= at[1] - at[0] < 800 + 16, at


def test_drafter_compute_ratio_counts_projections():
    from types import SimpleNamespace

    from vllm_peagle.adaptive.estimates import drafter_compute_ratio

    def config(layers):
        return SimpleNamespace(
            num_hidden_layers=layers, hidden_size=64, intermediate_size=176, num_attention_heads=4
        )

    h, i = 64, 176
    per_layer = 3 * h * h + h * h + 3 * h * i  # q, k, v; o; gate, up, down
    first_layer_extra_input, fc = 3 * h * h, 3 * h * h
    expected = (2 * per_layer + first_layer_extra_input + fc) / (8 * per_layer)
    assert drafter_compute_ratio(config(8), config(2)) == pytest.approx(expected)
    assert drafter_compute_ratio(config(8), None) == 0.0


@pytest.mark.parametrize("prompt_tokens, output_tokens", [(20, 512), (1500, 48)])
def test_drafting_over_prompts_is_charged_to_the_requests_it_decodes(prompt_tokens, output_tokens):
    """Whole-request time at batch B: the prompts (the target, plus the drafter at K > 0),
    then ``output / E[tokens | K]`` decoding steps. The policy's per-step amortisation must
    pick the K that minimises it: drafting with short prompts and long outputs, plain
    decoding when long prompts buy only a few tokens."""
    batch, max_k, ratio = 16, 4, 0.3
    alphas = np.full(max_k, 0.6)
    costs = (10e-3, 2e-4, 1e-3, 5e-5)
    controller = KController(max_k, batch, AdaptiveConfig(), drafter_compute_ratio=ratio)
    controller.cost = fitted_cost(*costs, max_batch=batch, max_k=max_k)
    rng = np.random.default_rng(7)
    for _ in range(200):
        controller.acceptance.observe_step(
            [(max_k, simulate_verification(rng, alphas, max_k)) for _ in range(8)]
        )
    for _ in range(50):
        controller.observe_requests(prompt_tokens * 4, 4, output_tokens * 4, 4)
    alphas_seen = controller.acceptance.conditional()
    per_prompt_token = costs[1]  # what the target's fitted per-token cost converges to

    def request_seconds(k):
        prompts = batch * prompt_tokens * per_prompt_token * (1 + ratio * (k > 0))
        steps = output_tokens / expected_tokens(alphas_seen, k)
        return prompts + steps * true_seconds(costs, batch, k)

    best = min(range(max_k + 1), key=request_seconds)
    controller._update_policy()
    assert controller.policy_k[batch] == best
    assert (best > 0) == (prompt_tokens < output_tokens)


def request_state(max_tokens, outputs, prompt=10, computed=None, in_flight=0):
    """What useful_drafts reads of a vLLM request (``computed`` defaults to a decode step:
    everything but the last sampled token, plus the steps in flight under async scheduling)."""
    tokens = prompt + outputs
    computed = tokens - 1 + in_flight if computed is None else computed
    return SimpleNamespace(
        max_tokens=max_tokens,
        num_output_tokens=outputs,
        num_output_placeholders=in_flight,
        num_tokens=tokens,
        num_computed_tokens=computed,
    )


@pytest.mark.parametrize(
    "states, scheduled, want",
    [
        ([request_state(64, 63)], [1], 0),  # this step yields the last token
        ([request_state(64, 62)], [1], 0),  # the next step's own token is the last one
        ([request_state(64, 60)], [1], 2),
        ([request_state(64, 60)], [4], 2),  # a step verifying 3 drafts yields >= 1 token
        ([request_state(64, 63), request_state(64, 10)], [1, 1], 5),  # the longest counts
        ([request_state(3, 0, prompt=50, computed=0)], [20], 2),  # a prompt chunk yields none
        ([request_state(3, 0, prompt=50, computed=30)], [20], 1),  # its last chunk yields one
        ([request_state(64, 58, in_flight=2)], [1], 2),  # async: tokens in flight are spent
        ([request_state(None, 63)], [1], 5),
    ],
)
def test_drafts_no_request_can_use_are_not_scheduled(states, scheduled, want):
    requests = {str(i): state for i, state in enumerate(states)}
    counts = {str(i): n for i, n in enumerate(scheduled)}
    assert useful_drafts(requests, counts, 5) == want


class SlowingEngine(SimulatedEngine):
    """Steps run ``slowdown`` times their cost: the host's speed drifting under the engine."""

    slowdown = 1.0

    def seconds(self, coefficients, k: int, verified: int) -> float:
        return self.slowdown * true_seconds(coefficients, self.batch, k, verified)


@pytest.mark.parametrize("seed", range(3))
def test_a_plain_step_measured_while_the_host_ran_slow_does_not_keep_the_policy_drafting(seed):
    """As in a CPU bench run at T=0.7: sampled requests the drafter rarely predicts, where
    plain decoding is ~8 % faster than the best drafting K. The host runs 35 % slow (as the
    CPU bench host does about a tenth of the time) until plain decoding, measured there,
    looks slower than drafting measured earlier and the policy drafts; then it is fast
    again, and drafting is measured at its true cost every step. Plain decoding must be
    measured again too, or the policy drafts at a loss for as long as it trusts the slow
    measurement (on the bench, hundreds of steps; here, to the end)."""
    costs = (0.011, 0.001, 0.0026, 0.0)  # batch 1: plain 12 ms, K=1 15.6 ms, K=4 18.6 ms
    sampled = np.full(7, 0.2)
    plain_rate = 1 / true_seconds(costs, 1, 0)
    drafting_rates = [expected_tokens(sampled, k) / true_seconds(costs, 1, k) for k in range(1, 8)]
    assert 0.85 < max(drafting_rates) / plain_rate < 0.95
    engine = SlowingEngine(KController(7, 8, AdaptiveConfig()), batch=1, seed=seed)
    for alphas, steps in ((AGREEING, 300), (sampled, 400)):
        for _ in range(steps):
            engine.step(alphas, costs)
    assert engine.controller.policy_k[1] == 0
    engine.slowdown = 1.35
    for _ in range(200):
        engine.step(sampled, costs)
        if engine.controller.policy_k[1]:
            break
    assert engine.controller.policy_k[1] > 0  # the slow measurement tipped it into drafting
    engine.slowdown = 1.0
    for _ in range(600):
        engine.step(sampled, costs)
    after = engine.k_history[-600:]
    assert after.index(0) <= 250, after
    assert sum(1 for k in after if k) <= 300, after
    assert engine.controller.policy_k[1] == 0, after
