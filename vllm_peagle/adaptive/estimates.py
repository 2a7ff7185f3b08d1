"""Online estimates the K policy decides from: per-position acceptance and step cost.

Both forget the past exponentially (a half-life in engine steps), so they follow a workload
that changes under them: new prompts the drafter predicts worse, a batch that grows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def decay_for_half_life(half_life_steps: float) -> float:
    """Per-step weight multiplier that halves an observation's weight every ``half_life_steps``."""
    if half_life_steps <= 0:
        raise ValueError(f"half_life_steps must be positive, got {half_life_steps}.")
    return 0.5 ** (1.0 / half_life_steps)


class AcceptanceEstimate:
    """Smoothed conditional acceptance ``alpha_k = P(draft k accepted | drafts 1..k-1 accepted)``.

    A verification with ``d`` drafts of which the first ``a`` were accepted tested positions
    ``1..min(a + 1, d)`` and accepted positions ``1..a``. Each position keeps decayed counts of
    trials and acceptances plus a Beta prior (what a position never tried reads as).

    The half-life counts engine steps, but the decay is applied when the next verification
    arrives: while nothing is verified (plain decoding steps) the estimate holds still rather
    than drifting back to the prior, which would send the policy into unplanned speculation;
    the first verification after a long gap (a probe) then weighs more against the stale
    past, though never more than two half-lives' worth of forgetting: a single probe at batch
    size 1 is one draw, too few to discard everything known before it.
    """

    max_forget_half_lives = 2.0

    def __init__(
        self,
        max_k: int,
        half_life_steps: float = 64.0,
        prior_acceptance: float = 0.5,
        prior_weight: float = 2.0,
    ) -> None:
        self.max_k = max_k
        self.decay = decay_for_half_life(half_life_steps)
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.trials = np.zeros(max_k)
        self.accepted = np.zeros(max_k)
        self._steps_since_verification = 0

    def observe_step(self, verifications: Iterable[tuple[int, int]]) -> None:
        """Fold in one engine step: ``(num_drafts, num_accepted)`` for each verified request."""
        verifications = list(verifications)
        self._steps_since_verification += 1
        if not verifications:
            return
        forget = max(self.decay**self._steps_since_verification, 0.5**self.max_forget_half_lives)
        self._steps_since_verification = 0
        self.trials *= forget
        self.accepted *= forget
        for num_drafts, num_accepted in verifications:
            num_drafts = min(num_drafts, self.max_k)
            num_accepted = min(num_accepted, num_drafts)
            self.trials[: min(num_accepted + 1, num_drafts)] += 1.0
            self.accepted[:num_accepted] += 1.0

    def conditional(self) -> np.ndarray:
        """``alpha_1 .. alpha_maxk`` (index 0 is position 1)."""
        prior_hits = self.prior_acceptance * self.prior_weight
        return (self.accepted + prior_hits) / (self.trials + self.prior_weight)


def expected_tokens(conditional_acceptance: np.ndarray, k: int) -> float:
    """Tokens one request gains from a step that verifies ``k`` drafts.

    ``E[tokens | K] = 1 + sum_{j=1..K} prod_{i<=j} alpha_i``: the sampled (bonus) token always
    counts, draft j counts when drafts 1..j are all accepted.
    """
    if k <= 0:
        return 1.0
    return 1.0 + float(np.cumprod(conditional_acceptance[:k]).sum())


def _nonnegative_solve(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """Least squares from normal equations with every coefficient but the intercept >= 0.

    More tokens, more requests or running the drafter never make a step cheaper; a negative
    coefficient is the fit trading one regime off against another, and would let the policy
    believe drafting saves time. Active set: drop the most negative term and refit, at most
    once per term.
    """
    free = np.ones(len(moment), dtype=bool)
    coefficients = np.zeros(len(moment))
    for _ in range(len(moment)):
        coefficients[:] = 0.0
        index = np.flatnonzero(free)
        coefficients[index] = np.linalg.solve(gram[np.ix_(index, index)], moment[index])
        negative = np.flatnonzero(coefficients[1:] < 0) + 1
        if not len(negative):
            break
        free[negative[np.argmin(coefficients[negative])]] = False
    return coefficients


class StepCostModel:
    """Seconds per engine step as a linear function of what the step runs.

    ``T = c0 + c1·tokens + [drafting]·(c2 + c3·batch + c4·tokens)``, where ``tokens`` is every
    token the target processes (prompt chunks, sampled tokens and drafts under
    verification), ``batch`` the number of scheduled requests and ``[drafting]`` is 1 when the
    drafter runs after the step. The drafting terms follow what the drafter processes: the
    step's accepted tokens (so prompt chunks too: the drafter prefills them) plus ``K_max``
    slots per request, whatever the step's K (the P-EAGLE drafter lays out every slot,
    :mod:`vllm_peagle.proposer`). A decoding step of batch B at K thus costs
    ``c0 + c1·B·(1+K) + [K>0]·(c2 + c3·B + c4·B·(1+K))``. Fitted by decayed ridge regression
    with non-negative slopes, on decoding steps only (the scheduler leaves out steps with
    prompt chunks: their thousands of tokens would dominate a fit that is only ever asked about
    decoding steps), so it is the cost on whatever machine the engine runs on, CPU or GPU, and
    follows load.
    """

    num_features = 5
    trusted_after = 16
    """Observations after which predictions are used to clip outliers."""
    outlier_factor = 3.0
    """Step times above this multiple of the prediction are clipped to it."""

    def __init__(self, half_life_steps: float = 256.0, ridge: float = 1e-6) -> None:
        self.decay = decay_for_half_life(half_life_steps)
        self.ridge = ridge
        self.gram = np.zeros((self.num_features, self.num_features))
        self.moment = np.zeros(self.num_features)
        self.num_observations = 0
        self._coefficients: np.ndarray | None = None

    @staticmethod
    def features(num_tokens: float, batch_size: float, drafting: bool) -> np.ndarray:
        drafts = 1.0 if drafting else 0.0
        return np.array([1.0, num_tokens, drafts, batch_size * drafts, num_tokens * drafts])

    def observe(self, num_tokens: int, batch_size: int, drafting: bool, seconds: float) -> None:
        x = self.features(num_tokens, batch_size, drafting)
        if self.num_observations >= self.trusted_after:
            # A stall (first use of a kernel shape, another process taking the CPU, a GC
            # pause) is not the cost of this step's shape; clip it so it cannot drag the fit.
            predicted = float(x @ self.coefficients())
            if predicted > 0:
                seconds = min(seconds, self.outlier_factor * predicted)
        self.gram = self.gram * self.decay + np.outer(x, x)
        self.moment = self.moment * self.decay + x * seconds
        self.num_observations += 1
        self._coefficients = None

    def coefficients(self) -> np.ndarray:
        if self._coefficients is None:
            # A ridge relative to each feature's own scale only settles directions the
            # observations leave undetermined (e.g. the drafting term before any K=0 step),
            # without biasing well-measured coefficients of very different magnitudes.
            diagonal = np.diag(self.gram)
            regularised = self.gram + np.diag(self.ridge * diagonal + 1e-12)
            self._coefficients = _nonnegative_solve(regularised, self.moment)
        return self._coefficients

    def predict(self, batch_size: int, k: int) -> float:
        """Predicted seconds of a decoding step of ``batch_size`` requests at ``k`` drafts."""
        x = self.features(batch_size * (1 + k), batch_size, k > 0)
        return float(x @ self.coefficients())
