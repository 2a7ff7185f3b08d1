"""Online estimates the K policy decides from: per-position acceptance and step cost.

Both forget the past exponentially (a half-life in engine steps), so they follow a workload
that changes under them: new prompts the drafter predicts worse, a batch that grows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike


def decay_for_half_life(half_life_steps: float) -> float:
    """Per-step weight multiplier that halves an observation's weight every ``half_life_steps``."""
    if half_life_steps <= 0:
        raise ValueError(f"half_life_steps must be positive, got {half_life_steps}.")
    return 0.5 ** (1.0 / half_life_steps)


class AcceptanceEstimate:
    """Smoothed conditional acceptance ``alpha_k = P(draft k accepted | drafts 1..k-1 accepted)``.

    A verification with ``d`` drafts of which the first ``a`` were accepted tested positions
    ``1..min(a + 1, d)`` and accepted positions ``1..a``. Each position keeps decayed counts of
    trials and acceptances plus a Beta prior of ``prior_weight`` pseudo-trials. Its mean is
    ``prior_acceptance`` for position 1 and the estimate of the position before for the others,
    so a position never tried reads as the one before it: a drafter whose first draft is
    rarely accepted is not credited with even odds at the positions its probes never reach
    (a 0.5 prior there made drafting on sampled requests look worth re-measuring, and each
    such measurement cost a few plain steps).

    The half-life counts engine steps, but the decay is applied when the next verification
    arrives: while nothing is verified (plain decoding steps) the estimate holds still rather
    than drifting back to the prior, which would send the policy into unplanned speculation;
    the first verification after a long gap (a probe) then weighs more against the stale
    past, though never more than one half-life's worth of forgetting: a single probe at batch
    size 1 is one draw, too few to discard most of what is known before it. (With two, one
    lucky probe of a drafter the target accepts 10 % of the time turned K up for a few
    steps often enough to cost ~6 % over plain decoding in simulation, against ~1 % now;
    a recovered drafter is seen within two probes instead of one.)
    """

    max_forget_half_lives = 1.0

    def __init__(
        self,
        max_k: int,
        half_life_steps: float = 64.0,
        prior_acceptance: float = 0.5,
        prior_weight: float = 1.0,
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

    def conditional(self, cautious: bool = False) -> np.ndarray:
        """``alpha_1 .. alpha_maxk`` (index 0 is position 1).

        ``cautious``: with a prior of the same weight that expects every draft rejected, so
        a position tried a few times reads well below its mean (what a decision that costs
        several steps when wrong should rest on), and one tried often reads as its mean.
        """
        if cautious:
            return self.accepted / (self.trials + self.prior_weight)
        alphas = np.empty(self.max_k)
        prior = self.prior_acceptance
        for position in range(self.max_k):
            prior = (self.accepted[position] + prior * self.prior_weight) / (
                self.trials[position] + self.prior_weight
            )
            alphas[position] = prior
        return alphas


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
    refit_every = 4
    """Observations between refits (a refit is a small solve; the policy reads the fit
    only every few steps, and this runs on the engine's critical path)."""

    def __init__(self, half_life_steps: float = 256.0, ridge: float = 1e-6) -> None:
        self.decay = decay_for_half_life(half_life_steps)
        self.ridge = ridge
        self.gram = np.zeros((self.num_features, self.num_features))
        self.moment = np.zeros(self.num_features)
        self.num_observations = 0
        self._coefficients: np.ndarray | None = None
        self._fitted_at = 0

    @staticmethod
    def features(num_tokens: ArrayLike, batch_size: ArrayLike, drafting: ArrayLike) -> np.ndarray:
        """One row of regressors per step (scalars give one row, arrays one row each)."""
        tokens = np.asarray(num_tokens, dtype=float)
        drafts = np.asarray(drafting, dtype=float)
        batch = np.asarray(batch_size, dtype=float)
        return np.stack(
            [np.ones_like(drafts), tokens, drafts, batch * drafts, tokens * drafts], axis=-1
        )

    @property
    def trusted(self) -> bool:
        return self.num_observations >= self.trusted_after

    def observe(self, num_tokens: int, batch_size: int, drafting: bool, seconds: float) -> None:
        self.observe_many(
            np.array([num_tokens]),
            np.array([batch_size]),
            np.array([drafting]),
            np.array([seconds]),
        )

    def observe_many(
        self,
        num_tokens: np.ndarray,
        batch_size: np.ndarray,
        drafting: np.ndarray,
        seconds: np.ndarray,
    ) -> np.ndarray | None:
        """Fold in steps in the order they ran; returns what the fit before them predicted
        for each (None while the model is not yet trusted)."""
        x = self.features(num_tokens, batch_size, drafting)
        predicted = None
        if self.trusted:
            # A stall (first use of a kernel shape, another process taking the CPU, a GC
            # pause) is not the cost of this step's shape; clip it so it cannot drag the fit.
            predicted = x @ self.coefficients()
            limit = np.where(predicted > 0, self.outlier_factor * predicted, np.inf)
            seconds = np.minimum(seconds, limit)
        count = len(seconds)
        weights = self.decay ** np.arange(count - 1, -1, -1, dtype=float)
        self.gram = self.gram * self.decay**count + (x * weights[:, None]).T @ x
        self.moment = self.moment * self.decay**count + (weights * seconds) @ x
        self.num_observations += count
        return predicted

    def coefficients(self) -> np.ndarray:
        stale = self.num_observations - self._fitted_at >= self.refit_every
        if self._coefficients is None or stale:
            self._fitted_at = self.num_observations
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


def batch_bucket(batch_size: np.ndarray | int) -> np.ndarray | int:
    """Batch sizes within ~9% of each other share a bucket (exact below 10 requests)."""
    return np.rint(4.0 * np.log2(np.maximum(batch_size, 1))).astype(int)


class CostCorrection:
    """Measured over predicted step time, per (batch bucket, tokens per request, drafting).

    The linear :class:`StepCostModel` is fitted where the policy has run, and extrapolates
    elsewhere: drafting measured only at batch size 1 says nothing about how its cost splits
    into per-step and per-request parts, and a CPU target's step time grows faster than
    linearly in tokens. Before a K is chosen at a batch size over one measured there, its
    prediction is scaled by what steps of that shape actually took (a step's shape is its
    batch bucket, tokens per request ``1 + K`` and whether the drafter ran). A shape never
    measured keeps the model's prediction; the policy's cost probes measure it.

    Each shape keeps decayed means of its step times and of its steps' regressors, and the
    factor is their ratio under the model as it is when asked: a factor taken against the
    prediction of the moment a step ran would correct twice once the model has learnt from
    that very step. A shape's memory also fades while other shapes run, so the steps that
    measure it again after a pause soon outweigh what it measured before: the host's speed
    drifts, and a shape compared against one measured just now must be measured near now
    too (the CPU bench host runs ~30 % slow for ~50 steps about a tenth of the time; a plain
    step measured in such a window kept sampled requests drafting for hundreds of steps).
    """

    half_life_observations = 8.0
    """Observations of one shape after which an older one weighs half."""
    half_life_steps = 16.0
    """Decoding steps without a shape after which its earlier steps weigh half (down to the
    weight of one step: a single step, noisy on a shared host, moves a shape at most
    halfway to what it measured)."""

    def __init__(self, max_batch_size: int, max_k: int) -> None:
        shape = (int(batch_bucket(max_batch_size)) + 1, max_k + 2, 2)
        self.seconds = np.zeros(shape)
        """Decayed mean step time of each shape."""
        self.features = np.zeros((*shape, StepCostModel.num_features))
        """Decayed mean regressors (:meth:`StepCostModel.features`) of each shape's steps."""
        self.weight = np.zeros(shape)
        self.count = np.zeros(shape, dtype=int)
        """Steps measured of each shape."""
        self.last_seen = np.full(shape, -(10**9))
        """Decoding step at which each shape was last measured."""
        self.decay = decay_for_half_life(self.half_life_observations)
        self.pause_decay = decay_for_half_life(self.half_life_steps)
        self.max_k = max_k

    def observe_many(
        self,
        num_tokens: np.ndarray,
        batch_size: np.ndarray,
        drafting: np.ndarray,
        seconds: np.ndarray,
        predicted: np.ndarray | None,
        steps: np.ndarray,
    ) -> None:
        """Fold in steps in the order they ran, with the cost model's prediction for each,
        which clips stalls like the model's own inputs: one must not condemn a shape.

        Steps that ran before the model was trusted (``predicted`` None: start-up calibration,
        whose first steps pay one-off costs) fitted the model but are not folded into the
        factors; they count only as measuring their shapes.
        """
        per_request = np.clip(np.rint(num_tokens / batch_size), 1, self.max_k + 1).astype(int)
        if predicted is None:
            index = batch_bucket(batch_size), per_request, drafting.astype(int)
            np.add.at(self.count, index, 1)
            np.maximum.at(self.last_seen, index, steps.astype(int))
            return
        seconds = np.minimum(
            seconds, np.where(predicted > 0, StepCostModel.outlier_factor * predicted, np.inf)
        )
        features = StepCostModel.features(num_tokens, batch_size, drafting)
        shapes = zip(
            batch_bucket(batch_size).tolist(),
            per_request.tolist(),
            drafting.astype(int).tolist(),
            strict=True,
        )
        # A batch of steps holds few shapes: fold each shape's steps in turn.
        folded: dict[tuple[int, int, int], list] = {}
        for index, step_seconds, step_features, step in zip(
            shapes, seconds.tolist(), features, steps.tolist(), strict=True
        ):
            state = folded.setdefault(
                index,
                [
                    self.seconds[index],
                    self.features[index],
                    self.weight[index],
                    self.last_seen[index],
                    0,
                ],
            )
            weight = state[2] * self.decay
            paused = step - state[3] - 1
            if paused > 0:  # never below one step's weight: one noisy step moves it halfway
                weight = max(weight * self.pause_decay**paused, min(weight, 1.0))
            state[0] = (state[0] * weight + step_seconds) / (weight + 1)
            state[1] = (state[1] * weight + step_features) / (weight + 1)
            state[2] = weight + 1
            state[3] = step
            state[4] += 1
        for index, (mean_seconds, mean_features, weight, step, count) in folded.items():
            self.seconds[index], self.features[index] = mean_seconds, mean_features
            self.weight[index], self.last_seen[index] = weight, step
            self.count[index] += count

    def table(
        self, max_batch_size: int, coefficients: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per batch size 0..max (rows) and K = 0..max_k (columns) of a decoding step: the
        correction factor of the model with ``coefficients``, the decoding step at which a
        step of that kind (drafting or plain) was last measured at that batch bucket
        (negative: never), and the steps measured of that very shape there.

        Only the shapes the policy runs steadily count: a plain step (one token per request)
        and a step that verifies K drafts and drafts again (``1 + K`` tokens per request, K >= 1).
        The transitions a probe passes through (drafting after a plain step, verifying without
        drafting) are shapes of their own, and their factors say nothing about the steady ones.
        A K not measured at a bucket takes the factor interpolated between the measured K of
        its kind there (the nearest one beyond them), so one measured drafting K corrects
        every drafting K at that batch size.
        """
        steady = np.zeros(self.seconds.shape[1:], dtype=bool)
        steady[1, 0] = True
        steady[2:, 1] = True
        measured = (self.weight > 0) & steady
        predicted = self.features @ coefficients
        ratio = np.where(measured & (predicted > 0), self.seconds / np.maximum(predicted, 1e-12), 1)
        positions = np.arange(ratio.shape[1])
        for bucket, kind in zip(*np.nonzero(measured.any(axis=1)), strict=True):
            seen = np.flatnonzero(measured[bucket, :, kind])
            ratio[bucket, :, kind] = np.interp(positions, seen, ratio[bucket, seen, kind])
        kind_seen = np.where(steady, self.last_seen, -(10**9)).max(axis=1)
        buckets = batch_bucket(np.arange(max_batch_size + 1))[:, None]
        k = np.arange(self.max_k + 1)[None, :]
        kinds = (k > 0).astype(int)
        shape = buckets, 1 + k, kinds
        return ratio[shape], kind_seen[buckets, kinds], self.count[shape]


class RequestShape:
    """Decayed means of prompt tokens computed and output tokens generated per request.

    What a drafting policy invests beyond its decoding steps: a step that drafts runs the
    drafter over the prompt chunks it admits, so every request's prompt is paid for once and
    returned over its ``output / E[tokens | K]`` decoding steps.
    """

    def __init__(self, half_life_steps: float = 256.0) -> None:
        self.decay = decay_for_half_life(half_life_steps)
        self.prompt_tokens = 0.0
        self.admitted = 0.0
        self.output_tokens = 0.0
        self.finished = 0.0

    def observe_step(
        self, prompt_tokens: int, admitted: int, output_tokens: int, finished: int
    ) -> None:
        self.prompt_tokens = self.prompt_tokens * self.decay + prompt_tokens
        self.admitted = self.admitted * self.decay + admitted
        self.output_tokens = self.output_tokens * self.decay + output_tokens
        self.finished = self.finished * self.decay + finished

    def prompt_per_output_token(self) -> float:
        """Mean prompt tokens computed per output token (0 until requests have finished)."""
        if self.admitted < 1 or self.finished < 1 or self.output_tokens <= 0:
            return 0.0
        mean_prompt = self.prompt_tokens / self.admitted
        mean_output = self.output_tokens / self.finished
        return mean_prompt / mean_output


def drafter_compute_ratio(target_config: object, drafter_config: object) -> float:
    """Multiply-adds per token of the drafter over the target's, from their HF configs.

    Counts the decoder layers' projections (attention and MLP) and, for the drafter, the fc
    that fuses three target hidden states and its first layer's doubled attention input
    (EAGLE-3: token embedding and hidden state). 0 when a config lacks the sizes.
    """

    def projections(config: object) -> tuple[float, float]:
        """(q, k, v input projection, the rest of one layer) multiply-adds per token."""
        hidden = getattr(config, "hidden_size", 0)
        heads = getattr(config, "num_attention_heads", 0) or 1
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        qkv = hidden * (hidden + 2 * hidden * kv_heads / heads)
        return qkv, hidden * hidden + 3 * hidden * getattr(config, "intermediate_size", 0)

    target_layers = getattr(target_config, "num_hidden_layers", 0)
    drafter_layers = getattr(drafter_config, "num_hidden_layers", 0)
    target = target_layers * sum(projections(target_config))
    qkv, rest = projections(drafter_config)
    hidden = getattr(drafter_config, "hidden_size", 0)
    drafter = drafter_layers * (qkv + rest) + qkv + 3 * hidden * hidden
    return drafter / target if target > 0 and drafter_layers > 0 else 0.0
