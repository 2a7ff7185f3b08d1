"""Choosing K each step: the draft length that maximises expected tokens per second.

For a decoding step of ``B`` requests that verifies ``K`` drafts each::

    rate(B, K) = B · E[tokens | K] / T(B, K)
    E[tokens | K] = 1 + sum_{k=1..K} prod_{i<=k} alpha_i

with ``alpha_i`` the conditional acceptance of draft position ``i`` and ``T`` the measured step
cost (:mod:`vllm_peagle.adaptive.estimates`). ``B`` is fixed within a step, so the best K for
batch size ``B`` is ``argmax_K E[tokens | K] / T(B, K)`` over ``K in min_k..max_k``; ``K = 0``
is a plain decoding step (no drafter forward, nothing to verify).

Around the argmax sit three guards:

* **calibration** at start-up: the first decoding steps run a fixed sweep of K values, so the
  cost model has seen drafting and non-drafting steps before it is trusted;
* **hysteresis**: the K of a batch size changes only when the new K is predicted to be faster
  by more than ``hysteresis`` (relative), so noise does not make K flap;
* **probes**: every ``probe_interval_steps`` steps one step drafts one token more than the
  policy's K (a K = 0 policy drafts 1), so acceptance at the next position stays measured
  and a K that collapsed can come back when the drafter predicts well again.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_peagle.adaptive.estimates import AcceptanceEstimate, StepCostModel, expected_tokens


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
    """Decoding steps between probes of one draft more than the chosen K."""
    update_interval_steps: int = 4
    """Decoding steps between re-evaluations of the K table."""
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
        if config.min_k < 0 or config.hysteresis < 0 or config.probe_interval_steps < 1:
            raise ValueError(
                "'adaptive' needs min_k >= 0, hysteresis >= 0 and probe_interval_steps >= 1. "
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
    gains = np.array([expected_tokens(conditional_acceptance, k) for k in range(max_k + 1)])
    batch = np.maximum(np.arange(max_batch_size + 1), 1)[:, None]
    k = np.arange(max_k + 1)[None, :]
    c0, c1, c2, c3 = cost.coefficients()
    seconds = c0 + c1 * batch * (1 + k) + c2 * (k > 0) + c3 * batch * k
    # An ill-fitted model can predict non-positive times; such a K is never preferred.
    return np.where(seconds > 0, gains[None, :] / np.maximum(seconds, 1e-12), -np.inf)


def best_k(rates: np.ndarray, min_k: int = 0) -> np.ndarray:
    """Per row, the K with the highest rate among ``min_k..`` (the smallest K on ties)."""
    return min_k + np.argmax(rates[..., min_k:], axis=-1)


class KController:
    """Holds the per-batch-size K table the scheduler reads, and keeps it optimal.

    ``lookup[B]`` is the K for a step of B scheduled requests; vLLM's scheduler reads it as
    its dynamic-K table. Call :meth:`before_step` before each scheduling and
    :meth:`observe_step` with each step's outcome.
    """

    def __init__(self, max_k: int, max_batch_size: int, config: AdaptiveConfig) -> None:
        self.max_k = max_k
        self.max_batch_size = max_batch_size
        self.config = config
        self.min_k = min(config.min_k, max_k)
        self.acceptance = AcceptanceEstimate(max_k, config.acceptance_half_life_steps)
        self.cost = StepCostModel(config.cost_half_life_steps)
        self.policy_k = [max_k] * (max_batch_size + 1)
        """The policy's K per batch size (index 0 unused)."""
        self.lookup = list(self.policy_k)
        """What the next step uses: the policy's K, or a calibration / probe override."""
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

    @property
    def calibrating(self) -> bool:
        return self.decode_steps < len(self.calibration)

    def before_step(self) -> None:
        """Set ``lookup`` for the step about to be scheduled."""
        step = self.decode_steps
        if self.calibrating:
            forced = self.calibration[step]
            self.lookup[:] = [forced] * len(self.lookup)
            return
        if step % self.config.update_interval_steps == 0:
            self._update_policy()
        if step % self.config.probe_interval_steps == 0:
            self.lookup[:] = [min(k + 1, self.max_k) for k in self.policy_k]
        else:
            self.lookup[:] = self.policy_k

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
        self.history.append(
            (batch_size, drafted_k, self.policy_k[min(batch_size, self.max_batch_size)])
        )
        # The first steps of an engine pay one-off costs (kernel selection, allocator warm-up).
        if seconds is not None and seconds > 0 and self.decode_steps > self.warmup_steps:
            self.cost.observe(num_tokens, drafted_k > 0, batch_size * drafted_k, seconds)
        self.acceptance.observe_step(verifications)
        self.verified_drafts += sum(drafts for drafts, _ in verifications)
        self.accepted_drafts += sum(accepted for _, accepted in verifications)

    def _update_policy(self) -> None:
        rates = rate_table(
            self.acceptance.conditional(), self.cost, self.max_batch_size, self.max_k
        )
        current = np.array(self.policy_k)
        candidate = best_k(rates, self.min_k)
        rows = np.arange(len(current))
        switch = (candidate != current) & (
            rates[rows, candidate] > rates[rows, current] * (1 + self.config.hysteresis)
        )
        if switch.any():
            self.changes += 1
            self.policy_k = np.where(switch, candidate, current).tolist()

    def summary(self, batch_size: int) -> str:
        """One log line: K for this batch size, acceptance, predicted gain and step times."""
        batch_size = max(1, min(batch_size, self.max_batch_size))
        k = self.policy_k[batch_size]
        alphas = self.acceptance.conditional()
        plain_ms = self.cost.predict(batch_size, 0) * 1e3
        spec_ms = self.cost.predict(batch_size, k) * 1e3
        return (
            f"batch {batch_size}: K={k} (max {self.max_k}), alpha="
            f"[{' '.join(f'{a:.2f}' for a in alphas[: max(k, 1) + 1])}], "
            f"E[tokens]={expected_tokens(alphas, k):.2f}, step {spec_ms:.1f} ms vs plain "
            f"{plain_ms:.1f} ms, {self.decode_steps} steps, {self.changes} K changes"
        )
