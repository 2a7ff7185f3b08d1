"""Choosing K each step: the draft length that maximises expected tokens per second.

For a decoding step of ``B`` requests that verifies ``K`` drafts each::

    rate(B, K) = B · E[tokens | K] / T(B, K)
    E[tokens | K] = 1 + sum_{k=1..K} prod_{i<=k} alpha_i

with ``alpha_i`` the conditional acceptance of draft position ``i`` and ``T`` the measured step
cost (:mod:`vllm_peagle.adaptive.estimates`). ``B`` is fixed within a step, so the best K for
batch size ``B`` is ``argmax_K E[tokens | K] / T(B, K)`` over ``K in min_k..max_k``; ``K = 0``
is a plain decoding step (no drafter forward, nothing to verify).

A step that drafts also runs the drafter over the prompt chunks it admits, so drafting at
batch size ``B`` invests in every prompt once; spread over a request's decoding steps that is
``B · d · (prompt / output tokens) · E[tokens | K]`` seconds per step, with ``d`` the drafter's
cost per prompt token (the target's measured per-token cost times the drafter's share of its
compute, :func:`~vllm_peagle.adaptive.estimates.drafter_compute_ratio`), added to ``T(B, K)``
for K > 0.

Around the argmax sit four guards:

* **calibration** at start-up: the first decoding steps run a fixed sweep of K values, so the
  cost model has seen drafting and non-drafting steps before it is trusted;
* **hysteresis**: the K of a batch size changes only when the new K is predicted to be faster
  by more than ``hysteresis`` (relative), so noise does not make K flap;
* **probes**: now and then one step drafts more than the policy's K, so acceptance past the
  chosen K stays measured and a K that collapsed can come back when the drafter predicts
  well again (:func:`probe_plan`). A batch size is probed only where a longer draft could
  win at all, and only as often as a small time budget (``probe_budget``) of the steps run
  at that batch size allows; where
  drafting costs more than it could ever return (large batches on a compute-bound target)
  there are no probes;
* **cost probes**: the step cost model is linear and fitted where the policy has run, so it
  extrapolates to batch sizes and K it has not seen; where the best K of the other kind
  (drafting against plain decoding) is predicted within ``cost_probe_margin`` of the
  policy's K, two steps run at that K so its step time is measured at this batch size, and
  predictions are scaled by what steps of each shape measured
  (:class:`~vllm_peagle.adaptive.estimates.CostCorrection`). Drafting is measured again
  once ``cost_refresh_steps`` old, plain decoding (within the wider
  ``plain_cost_probe_margin``) once ``plain_refresh_steps`` old, as often as
  ``probe_budget`` allows. A cost probe waits until
  the policy's K has run ``cost_probe_after_steps`` steps at that batch size (the first
  steps after a burst of prompts run slow; a first probe of drafting waits until its
  predicted loss is a small share of the steps run there, at most
  ``first_drafting_probe_after_steps``, as a burst that drains soon never repays it, and is
  skipped where drafting pays at no smaller batch size: its cost over a plain step's only
  grows with the batch), and drafting replaces plain decoding at a batch size only once
  measured there, never on the model's extrapolation alone (plain decoding replaces drafting
  on the model's word: it is the baseline, and does less work per step).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_peagle.adaptive.estimates import (
    AcceptanceEstimate,
    CostCorrection,
    RequestShape,
    StepCostModel,
    expected_tokens,
)


@dataclass
class AdaptiveConfig:
    """Settings of adaptive K, from ``"adaptive"`` in the speculative config."""

    enabled: bool = True
    """Choose K per step; false drafts ``num_speculative_tokens`` every step."""
    min_k: int = 0
    """Smallest K the policy may choose; 0 allows plain decoding steps."""
    hysteresis: float = 0.05
    """Relative predicted gain a new K needs before it replaces the current one."""
    acceptance_half_life_steps: float = 16.0
    """Engine steps after which an acceptance observation weighs half."""
    cost_half_life_steps: float = 256.0
    """Engine steps after which a step-time observation weighs half."""
    calibration_steps_per_k: int = 4
    """Decoding steps spent at each K of the start-up sweep."""
    probe_interval_steps: int = 16
    """Fewest decoding steps between two probes of a longer draft than the chosen K."""
    probe_budget: float = 0.005
    """Share of decoding time probes may cost; sets how often a batch size is probed."""
    cost_probe_margin: float = 0.15
    """Relative predicted shortfall within which the other kind of step (drafting or plain),
    once measured at a batch size, is measured again when stale; 0 disables cost probes.
    Predictions there are already scaled by a measurement, so only a drift of this size could
    change the choice (sampled requests on the CPU bench models: drafting ~20-25 % short,
    each refresh ~1 % of a 260-step run)."""
    plain_cost_probe_margin: float = 0.4
    """As ``cost_probe_margin``, for plain decoding where the policy drafts, which is measured
    again once ``plain_refresh_steps`` old: two plain steps lose little where drafting barely
    pays, and a plain step measured while the host ran slow (the CPU bench host runs ~30 %
    slow for ~50 steps about a tenth of the time) kept sampled requests drafting for hundreds
    of steps on a plain-step cost ~35 % too high."""
    cost_refresh_steps: int = 512
    """Decoding steps after which a measured drafting step shape is measured again."""
    plain_refresh_steps: int = 64
    """Decoding steps after which plain decoding, where the policy drafts, is measured again."""
    cost_probe_after_steps: int = 16
    """Steps the policy's own K must have run at a batch size before a cost probe compares
    the other kind there: the first steps after a burst of prompts run slow (fresh cache
    memory), and a comparison against them alone would favour the other kind."""
    first_drafting_probe_after_steps: int = 64
    """Most plain decoding steps a batch size must have run before drafting is first measured
    there: a drafting probe on a compute-bound target costs several plain steps, which a
    batch size that comes and goes (a burst that drains in a few dozen steps) never repays."""
    first_drafting_probe_loss_share: float = 0.1
    """A first drafting probe at a batch size comes once its predicted loss is at most this
    share of the plain steps run there (at least ``cost_probe_after_steps``, at most
    ``first_drafting_probe_after_steps``): a cheap probe need not wait as long as a dear
    one, and a batch size reached only in short runs (a CPU bench run at concurrency 16 has
    ~60 decoding steps at 16) is otherwise never measured drafting."""
    update_interval_steps: int = 4
    """Decoding steps between re-evaluations of the K table (4x as many while no step
    verifies drafts: plain decoding steps bring only step times)."""
    log_interval_s: float = 10.0
    """Seconds between log lines with the policy's state (0 disables them)."""

    @classmethod
    def from_setting(cls, setting: Any) -> AdaptiveConfig:
        """``True``/``False``/``None`` or a dict of fields (unknown keys are an error)."""
        if setting is None or setting is True:
            return cls()
        if setting is False:
            return cls(enabled=False)
        if not isinstance(setting, dict):
            raise ValueError(
                f"'adaptive' must be true, false or an object of settings, got {setting!r}. "
                'Fix: e.g. "adaptive": false or "adaptive": {"min_k": 1}.'
            )
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(setting) - names)
        if unknown:
            raise ValueError(
                f"Unknown 'adaptive' setting(s) {unknown}. Fix: use only {sorted(names)}."
            )
        config = cls(**setting)
        if (
            config.min_k < 0
            or config.hysteresis < 0
            or config.probe_interval_steps < 1
            or not 0 < config.probe_budget <= 1
            or not 0 <= config.cost_probe_margin < 1
            or not 0 <= config.plain_cost_probe_margin < 1
            or config.cost_refresh_steps < 1
            or config.plain_refresh_steps < 1
            or config.cost_probe_after_steps < 0
            or config.first_drafting_probe_after_steps < 0
            or not 0 < config.first_drafting_probe_loss_share <= 1
        ):
            raise ValueError(
                "'adaptive' needs min_k >= 0, hysteresis >= 0, probe_interval_steps >= 1, "
                "0 < probe_budget <= 1, 0 <= cost_probe_margin < 1, "
                "0 <= plain_cost_probe_margin < 1, cost_refresh_steps >= 1, "
                "plain_refresh_steps >= 1, "
                "cost_probe_after_steps >= 0, first_drafting_probe_after_steps >= 0 and "
                "0 < first_drafting_probe_loss_share <= 1. "
                f"Fix: correct {setting!r}."
            )
        return config


def rate_table(
    conditional_acceptance: np.ndarray, cost: StepCostModel, max_batch_size: int, max_k: int
) -> np.ndarray:
    """``E[tokens | K] / T(B, K)`` for B = 0..max_batch_size (rows) and K = 0..max_k (columns).

    Row 0 is unused (no batch of zero requests); it is computed for B = 1 so indexing by batch
    size stays direct.
    """
    gains = expected_tokens_table(conditional_acceptance, max_k)
    return _rates(gains[None, :], seconds_table(cost, max_batch_size, max_k))


def expected_tokens_table(conditional_acceptance: np.ndarray, max_k: int) -> np.ndarray:
    """``E[tokens | K]`` for K = 0..max_k (see :func:`expected_tokens`)."""
    survive = np.cumprod(conditional_acceptance[:max_k])
    return 1.0 + np.concatenate([[0.0], np.cumsum(survive)])


def seconds_table(cost: StepCostModel, max_batch_size: int, max_k: int) -> np.ndarray:
    """Predicted step seconds for B = 0..max_batch_size (rows, B = 0 as 1), K = 0..max_k."""
    batch = np.maximum(np.arange(max_batch_size + 1), 1)[:, None]
    return step_seconds(cost, batch, np.arange(max_k + 1)[None, :])


def step_seconds(cost: StepCostModel, batch: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Predicted seconds of decoding steps of ``batch`` requests at ``k`` drafts (broadcast)."""
    c0, c1, c2, c3, c4 = cost.coefficients()
    tokens = batch * (1 + k)
    return c0 + c1 * tokens + (c2 + c3 * batch + c4 * tokens) * (k > 0)


def _rates(gains: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    # An ill-fitted model can predict non-positive times; such a K is never preferred.
    return np.where(seconds > 0, gains / np.maximum(seconds, 1e-12), -np.inf)


def probe_plan(
    conditional_acceptance: np.ndarray,
    seconds: np.ndarray,
    policy_k: np.ndarray,
    budget: float,
    min_interval: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per batch size, the K of a probe step and the steps between probes.

    ``seconds`` is :func:`seconds_table` (rows: batch size, columns: K = 0..max_k). A probe
    drafts the longer K that would win if every position past the policy's K were always
    accepted (the optimistic case), so one probe measures all the positions a better drafter
    could use. Where even the optimistic case loses, the probe K is the policy's K (no probe:
    it costs throughput and could teach nothing that changes the choice). Probes are spaced so
    that their extra time, ``T(B, K_probe) - T(B, K)`` per probe (the drafting of one step
    plus the verification of the next), stays within ``budget`` of the step time, in whole
    multiples of ``min_interval`` steps at that batch size (the controller counts them per
    batch size, ``KController.steps_at``).
    """
    max_k = seconds.shape[1] - 1
    rows = np.arange(len(policy_k))
    k = np.arange(max_k + 1)[None, :]
    survive = np.concatenate([[1.0], np.cumprod(conditional_acceptance[:max_k])])
    gains = expected_tokens_table(conditional_acceptance, max_k)
    policy = policy_k[:, None]
    optimistic = gains[policy] + survive[policy] * np.maximum(k - policy, 0)
    rates = _rates(np.where(k > policy, optimistic, -np.inf), seconds)
    current_seconds = seconds[rows, policy_k]
    current = _rates(gains[policy_k], current_seconds)
    longer = np.argmax(rates, axis=1)
    worth = (policy_k < max_k) & (rates[rows, longer] > current)
    probe_k = np.where(worth, longer, policy_k)
    extra = seconds[rows, probe_k] - current_seconds
    overhead = np.maximum(extra, 0) / np.maximum(current_seconds, 1e-12)
    # Whole multiples of min_interval, so only every min_interval-th step needs a look.
    periods = np.maximum(1, np.ceil(overhead / max(budget, 1e-6) / min_interval))
    return probe_k, (min_interval * periods).astype(int)


def cost_probe_plan(
    rates: np.ndarray,
    seconds: np.ndarray,
    last_measured: np.ndarray,
    measured_steps: np.ndarray,
    policy_k: np.ndarray,
    step: int,
    config: AdaptiveConfig,
    min_k: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per batch size, the K of a cost probe (the policy's K where none is due) and the steps
    between cost probes.

    The contender is the best K of the other kind: the best drafting K where the policy
    decodes plainly, K = 0 where it drafts. A kind never measured at a batch bucket is
    probed at the next chance, however poor its prediction (the model's extrapolation is
    what is in doubt; a one-off two steps), except drafting where the drafter's acceptance
    alone rules it out: where drafting is predicted to win by less than ``hysteresis`` (what
    would make the policy draft) at every batch size up to this one. A drafting step's cost
    over a plain one's only grows with the batch (verification turns compute-bound), so a
    drafter that does not pay at batch size 1, measured there, pays nowhere (sampled requests
    it rarely predicts; a first probe at a large batch size costs several plain steps).
    Once measured, drafting is probed again where its predicted rate is within
    ``cost_probe_margin`` of the policy's and the measurement is more than
    ``cost_refresh_steps`` old; plain decoding, the baseline, where its rate is within the
    wider ``plain_cost_probe_margin`` and its measurement ``plain_refresh_steps`` old (its
    probe is cheap where the choice is close, and the host's speed drifts). Either is spaced so
    the lost time, two steps at the contender's lower rate, stays within ``probe_budget``
    of decoding time. No batch size is probed before the
    policy's own K has run ``cost_probe_after_steps`` steps there (``measured_steps``: steps
    measured per batch size and K), so the two steps of the contender are compared with a
    settled measurement of the incumbent; drafting is first measured at a batch size once
    plain decoding has run there long enough that the probe's predicted loss (two steps at the
    lower rate) is at most ``first_drafting_probe_loss_share`` of that time, and at most
    ``first_drafting_probe_after_steps`` steps (a burst that drains within a few dozen steps is
    not worth a dear probe; a cheap one pays within a short run).
    """
    rows = np.arange(len(policy_k))
    k = np.arange(seconds.shape[1])[None, :]
    other_kind = ((k > 0) != (policy_k[:, None] > 0)) & (k >= min_k)
    contender_rates = np.where(other_kind, rates, -np.inf)
    contender = np.argmax(contender_rates, axis=1)
    current = rates[rows, policy_k]
    relative = contender_rates[rows, contender] / np.maximum(current, 1e-12)
    never_measured = last_measured[rows, contender] < 0
    plain = contender == 0
    refresh_steps = np.where(plain, config.plain_refresh_steps, config.cost_refresh_steps)
    stale = step - last_measured[rows, contender] > refresh_steps
    first_drafting = never_measured & (contender > 0)
    drafting_rate = np.where((k > 0) & (k >= min_k), rates, -np.inf).max(axis=1)
    drafting_pays = drafting_rate > rates[:, 0] * (1 + config.hysteresis)
    ruled_out = first_drafting & ~np.maximum.accumulate(drafting_pays)
    margin = np.where(plain, config.plain_cost_probe_margin, config.cost_probe_margin)
    contends = (never_measured & ~ruled_out) | (stale & (relative >= 1 - margin))
    lost = 2 * seconds[rows, contender] * np.maximum(1 - relative, 0)
    overhead = lost / np.maximum(seconds[rows, policy_k], 1e-12)
    first_wait = np.clip(
        np.ceil(overhead / config.first_drafting_probe_loss_share),
        config.cost_probe_after_steps,
        max(config.first_drafting_probe_after_steps, config.cost_probe_after_steps),
    )
    wait = np.where(first_drafting, first_wait, config.cost_probe_after_steps)
    settled = measured_steps[rows, policy_k] >= wait
    due = (config.cost_probe_margin > 0) & other_kind.any(axis=1) & contends & settled
    probe_k = np.where(due, contender, policy_k)
    interval = config.probe_interval_steps
    periods = np.maximum(1, np.ceil(overhead / max(config.probe_budget, 1e-6) / interval))
    periods = np.where(never_measured, 1, periods)
    return probe_k, (interval * periods).astype(int)


def best_k(rates: np.ndarray, min_k: int = 0) -> np.ndarray:
    """Per row, the K with the highest rate among ``min_k..`` (the smallest K on ties)."""
    return min_k + np.argmax(rates[..., min_k:], axis=-1)


class KController:
    """Holds the per-batch-size K table the scheduler reads, and keeps it optimal.

    ``lookup[B]`` is the K for a step of B scheduled requests; vLLM's scheduler reads it as
    its dynamic-K table. Call :meth:`before_step` before each scheduling and
    :meth:`observe_step` with each step's outcome.
    """

    plain_update_factor = 4
    """While no step verifies drafts, the table is re-evaluated this many times less often."""

    def __init__(
        self,
        max_k: int,
        max_batch_size: int,
        config: AdaptiveConfig,
        drafter_compute_ratio: float = 0.0,
    ) -> None:
        self.max_k = max_k
        self.drafter_compute_ratio = drafter_compute_ratio
        """Drafter multiply-adds per token over the target's: prices drafting over prompts."""
        self.requests = RequestShape(config.cost_half_life_steps)
        self.max_batch_size = max_batch_size
        self.config = config
        self.min_k = min(config.min_k, max_k)
        self.acceptance = AcceptanceEstimate(max_k, config.acceptance_half_life_steps)
        self.cost = StepCostModel(config.cost_half_life_steps)
        self.correction = CostCorrection(max_batch_size, max_k)
        self.policy_k = [max_k] * (max_batch_size + 1)
        """The policy's K per batch size (index 0 unused)."""
        self.lookup = list(self.policy_k)
        """What the next step uses: the policy's K, or a calibration / probe override."""
        self._lookup_is_policy = True
        self._lookup_fill: int | None = None
        """The K every entry of ``lookup`` holds, while it holds one K for all batch sizes."""
        self.probe_k = np.full(max_batch_size + 1, max_k)
        """The K of a probe step per batch size (the policy's K where probing cannot pay)."""
        self.probe_interval = np.full(max_batch_size + 1, config.probe_interval_steps)
        """Decoding steps between probes per batch size."""
        self.cost_probe_k = np.array(self.policy_k)
        """The K of a cost probe per batch size (the policy's K where none is due)."""
        self.cost_probe_interval = np.full(max_batch_size + 1, config.probe_interval_steps)
        self.steps_at = np.zeros(max_batch_size + 1, dtype=int)
        """Decoding steps run at each batch size: probes are spaced in these, so a probe's
        cost is spread over the steps at its own batch size (a batch size that only short
        runs reach would otherwise take a dear probe in whichever run reaches it)."""
        self._last_probe = np.zeros(max_batch_size + 1, dtype=int)
        self._last_cost_probe = np.zeros(max_batch_size + 1, dtype=int)
        """``steps_at`` of each batch size at its last probe (or skipped probe) of each kind."""
        self._probe_second_step: list[int] | None = None
        """A cost probe's table, held for its second step (its first only drafts)."""
        half = max(1, (max_k + 1) // 2)
        sweep = [k for k in dict.fromkeys([max_k, 0, 1, half]) if k >= self.min_k]
        self.calibration = [max_k] * 2 + [
            k for k in sweep for _ in range(config.calibration_steps_per_k)
        ]
        self.decode_steps = 0
        self.changes = 0
        """Re-evaluations that changed the K of at least one batch size."""
        self.warmup_steps = 2
        self.verified_drafts = 0
        """Drafts verified since start-up (what vLLM counts as draft tokens)."""
        self.accepted_drafts = 0
        """Of those, accepted."""
        self.history: deque[tuple[int, int, int]] = deque(maxlen=4096)
        """Recent steps as (batch size, K drafted after the step, the policy's K for it)."""
        self._step_times: list[tuple[int, int, bool, float, int]] = []
        """Decoding step times not yet folded into the cost model."""
        self._verified_since_update = False
        self._updated_for = -1
        """The step the table was last re-evaluated for."""

    @property
    def calibrating(self) -> bool:
        return self.decode_steps < len(self.calibration)

    def before_step(self, heading_batch: int | None = None) -> None:
        """Set ``lookup`` for the step about to be scheduled (runs before every engine step,
        so the table is rewritten only when it changes).

        ``heading_batch``: while requests wait, the batch size the engine heads for once they
        are admitted. Such a step drafts with that batch size's K whatever its own size: a
        step that drafts runs the drafter over its prompt chunks too, which pays only if the
        batch those prompts will decode in drafts (a burst of 64 arrivals would otherwise
        draft over their prompts at the K of the 33 admitted first, then decode at K=0).
        """
        step = self.decode_steps
        if self.calibrating:
            self._fill_lookup(self.calibration[step])
            return
        if self._policy_update_due(step):
            self._update_policy(step)
        # Probes only measure decoding steps, and a step admitting prompts would draft over
        # them too (the dearest drafting there is): while requests wait, nothing probes.
        second_step, self._probe_second_step = self._probe_second_step, None
        if second_step is not None and heading_batch is None:
            self.lookup[:] = second_step
            return
        # Probe intervals are multiples of probe_interval_steps: no other step can probe.
        # A probe comes due a whole interval after the last one (not when the step count is
        # a multiple of the interval: intervals drift with the cost model, and a step count
        # near one would be a multiple of each new value in turn, probing every few steps).
        # A batch size not running when its probe is due skips that probe.
        if heading_batch is None and step % self.config.probe_interval_steps == 0:
            probing = (self.steps_at - self._last_probe >= self.probe_interval) & (
                self.probe_k != self.policy_k
            )
            cost_probing = (self.steps_at - self._last_cost_probe >= self.cost_probe_interval) & (
                self.cost_probe_k != self.policy_k
            )
            self._last_probe[probing] = self.steps_at[probing]
            self._last_cost_probe[cost_probing] = self.steps_at[cost_probing]
            if probing.any() or cost_probing.any():
                policy_or_probe = np.where(probing, self.probe_k, self.policy_k)
                self.lookup[:] = np.where(cost_probing, self.cost_probe_k, policy_or_probe).tolist()
                if cost_probing.any():
                    self._probe_second_step = np.where(
                        cost_probing, self.cost_probe_k, self.policy_k
                    ).tolist()
                self._lookup_is_policy = False
                self._lookup_fill = None
                return
        if heading_batch is not None:
            self._fill_lookup(self.policy_k[max(1, min(heading_batch, self.max_batch_size))])
        elif not self._lookup_is_policy:
            self.lookup[:] = self.policy_k
            self._lookup_is_policy = True
            self._lookup_fill = None

    def update_ahead(self, verifying: bool) -> None:
        """Re-evaluate the table now if the next step is due to, while the step in flight runs.

        The scheduler calls this once the step is dispatched to the workers: the engine core
        would only wait for them, and the next scheduling finds the work done (it is on
        the critical path there, and on a busy CPU host costs a millisecond and more). It
        sees the observations up to the step before the one in flight; ``verifying`` says
        whether that step verifies drafts (its news makes the next step's update due).
        """
        step = self.decode_steps + 1  # as before_step will see it, once this step is observed
        if step >= len(self.calibration) and self._policy_update_due(step, verifying):
            self._update_policy(step)

    def _policy_update_due(self, step: int, verifying: bool = False) -> bool:
        interval = self.config.update_interval_steps
        if step % interval or self._updated_for == step:
            return False
        # Steps that verify drafts bring acceptance news every step; plain decoding steps
        # bring only step times, which the cost model averages over hundreds of steps, so
        # re-evaluating after each few of them would only add work to short steps.
        return (
            verifying
            or self._verified_since_update
            or step % (self.plain_update_factor * interval) == 0
        )

    def _fill_lookup(self, k: int) -> None:
        # Under sustained load requests always wait: rewrite the table only when K changes.
        if self._lookup_fill != k:
            self.lookup[:] = [k] * len(self.lookup)
            self._lookup_fill = k
        self._lookup_is_policy = False

    def observe_step(
        self,
        num_tokens: int,
        batch_size: int,
        drafted_k: int,
        seconds: float | None,
        verifications: list[tuple[int, int]],
    ) -> None:
        """One finished step: its size, the K drafted after it, its duration, its verifications."""
        if batch_size <= 0:
            return
        self.decode_steps += 1
        row = min(batch_size, self.max_batch_size)
        self.steps_at[row] += 1
        self.history.append((batch_size, drafted_k, self.policy_k[row]))
        # The first steps of an engine pay one-off costs (kernel selection, allocator warm-up).
        if seconds is not None and seconds > 0 and self.decode_steps > self.warmup_steps:
            # Folded into the cost model when the policy next reads it: this runs on the
            # engine's critical path, where a step at batch size 1 can take a few ms.
            self._step_times.append(
                (num_tokens, batch_size, drafted_k > 0, seconds, self.decode_steps)
            )
        self.acceptance.observe_step(verifications)
        if verifications:
            self._verified_since_update = True
            self.verified_drafts += sum(drafts for drafts, _ in verifications)
            self.accepted_drafts += sum(accepted for _, accepted in verifications)

    def _fold_step_times(self) -> None:
        pending = np.array(self._step_times, dtype=float).reshape(-1, 5)
        self._step_times = []
        while len(pending):
            # Steps before the model is trusted only fit it (and mark their shapes measured);
            # those after also feed the correction, as if folded in one at a time.
            untrusted = max(self.cost.trusted_after - self.cost.num_observations, 0)
            split = untrusted or len(pending)
            (tokens, batch, drafting, seconds, steps), pending = pending[:split].T, pending[split:]
            predicted = self.cost.observe_many(tokens, batch, drafting > 0, seconds)
            self.correction.observe_many(tokens, batch, drafting > 0, seconds, predicted, steps)

    def observe_requests(
        self, prompt_tokens: int, admitted: int, output_tokens: int, finished: int
    ) -> None:
        """One step's prompt tokens computed for newly admitted requests, tokens generated,
        and requests finished (every step, prompt steps included)."""
        self.requests.observe_step(prompt_tokens, admitted, output_tokens, finished)

    def _prompt_drafting_seconds(self, gains: np.ndarray) -> np.ndarray:
        """Per decoding step (rows: batch size, columns: K), the drafter's pass over the
        prompts of the requests it decodes, spread over their decoding steps."""
        per_token = self.drafter_compute_ratio * self.cost.coefficients()[1]
        share = self.requests.prompt_per_output_token()
        batch = np.maximum(np.arange(self.max_batch_size + 1), 1)[:, None]
        k = np.arange(self.max_k + 1)[None, :]
        return (k > 0) * batch * (per_token * share) * gains[None, :]

    def _update_policy(self, step: int | None = None) -> None:
        self._updated_for = self.decode_steps if step is None else step
        self._fold_step_times()
        self._verified_since_update = False
        alphas = self.acceptance.conditional()
        gains = expected_tokens_table(alphas, self.max_k)
        correction, last_measured, measured_steps = self.correction.table(
            self.max_batch_size, self.cost.coefficients()
        )
        seconds = seconds_table(self.cost, self.max_batch_size, self.max_k) * correction
        seconds += self._prompt_drafting_seconds(gains)
        rates = _rates(gains[None, :], seconds)
        current = np.array(self.policy_k)
        rows = np.arange(len(current))
        # Drafting replaces plain decoding at a batch size only once measured there: a
        # measured plain step against the cost model's extrapolation of drafting is no contest
        # (its cost probe measures drafting first). The way back needs no such proof: a plain
        # step does less work than any drafting step, and when acceptance collapses the
        # runs are too short to spend a settled cost probe's worth of steps drafting first.
        drafting_k = np.arange(self.max_k + 1)[None, :] > 0
        unproven = (
            drafting_k
            & (current[:, None] == 0)
            & (last_measured < 0)
            & (last_measured[rows, current] >= 0)[:, None]
        )
        candidate = best_k(np.where(unproven, -np.inf, rates), self.min_k)
        switch = (candidate != current) & (
            rates[rows, candidate] > rates[rows, current] * (1 + self.config.hysteresis)
        )
        if switch.any():
            self.changes += 1
            current = np.where(switch, candidate, current)
            self.policy_k = current.tolist()
            self._lookup_is_policy = False
        self.probe_k, self.probe_interval = probe_plan(
            alphas,
            seconds,
            current,
            self.config.probe_budget,
            self.config.probe_interval_steps,
        )
        # A cost probe drafts two steps where drafting is the contender: decide it on a
        # cautious acceptance, or the few draws of acceptance probes (a drafter rarely
        # accepted, at K=0) read as drafting within the margin every so often.
        cautious_gains = expected_tokens_table(
            self.acceptance.conditional(cautious=True), self.max_k
        )
        self.cost_probe_k, self.cost_probe_interval = cost_probe_plan(
            _rates(cautious_gains[None, :], seconds),
            seconds,
            last_measured,
            measured_steps,
            current,
            self.decode_steps,
            self.config,
            self.min_k,
        )

    def summary(self, batch_size: int) -> str:
        """One log line: K for this batch size, acceptance, predicted gain and step times."""
        self._fold_step_times()
        batch_size = max(1, min(batch_size, self.max_batch_size))
        k = self.policy_k[batch_size]
        alphas = self.acceptance.conditional()
        correction, _, _ = self.correction.table(batch_size, self.cost.coefficients())
        plain_ms = self.cost.predict(batch_size, 0) * correction[batch_size, 0] * 1e3
        spec_ms = self.cost.predict(batch_size, k) * correction[batch_size, k] * 1e3
        return (
            f"batch {batch_size}: K={k} (max {self.max_k}), alpha="
            f"[{' '.join(f'{a:.2f}' for a in alphas[: max(k, 1) + 1])}], "
            f"E[tokens]={expected_tokens(alphas, k):.2f}, step {spec_ms:.1f} ms vs plain "
            f"{plain_ms:.1f} ms, {self.decode_steps} steps, {self.changes} K changes"
        )
