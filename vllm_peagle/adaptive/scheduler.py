"""vLLM scheduler with adaptive K for P-EAGLE engines.

Wired through vLLM's own extension points: ``SchedulerConfig.scheduler_cls`` names
:func:`adaptive_scheduler` (set by :mod:`vllm_peagle.patches` for ``method: "peagle"``), and
the K of each step travels as ``SchedulerOutput.num_spec_tokens_to_schedule``, which vLLM
derives from the scheduler's dynamic-K table ``dynamic_sd_lookup`` (the table behind
``num_speculative_tokens_per_batch_size``). We own that table and rewrite it before every
step from live acceptance and step times (:class:`~vllm_peagle.adaptive.policy.KController`).

A step's K decides how many drafts the drafter writes after it, verified in the next step.
Verification stays vLLM's rejection sampler, so any K is lossless.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_peagle.adaptive.estimates import drafter_compute_ratio
from vllm_peagle.adaptive.policy import AdaptiveConfig, KController
from vllm_peagle.adaptive.scheduler_name import SCHEDULER_QUALNAME
from vllm_peagle.config import ADDITIONAL_CONFIG_KEY

logger = logging.getLogger("vllm.vllm_peagle")

__all__ = ["SCHEDULER_QUALNAME", "AdaptiveKAsyncScheduler", "AdaptiveKScheduler"]


class AdaptiveKMixin:
    """Adds the K controller to a vLLM scheduler (sync or async)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
        config = AdaptiveConfig.from_setting(settings.get("adaptive"))
        self.k_controller: KController | None = None
        self.last_scheduled_k: int | None = None
        """K of the step scheduled last; 0 tells the engine core the step drafts nothing
        (patch ledger, entry 5)."""
        if not (config.enabled and self.num_spec_tokens and self.dynamic_sd_lookup is None):
            return
        drafter_model = getattr(self.vllm_config.speculative_config, "draft_model_config", None)
        self.k_controller = KController(
            self.num_spec_tokens,
            self.max_num_running_reqs,
            config,
            drafter_compute_ratio(
                self.vllm_config.model_config.hf_text_config,
                getattr(drafter_model, "hf_config", None),
            ),
        )
        # vLLM reads dynamic_sd_lookup[batch size] each step; the controller rewrites the same
        # list in place. A non-None table also stops vLLM padding new decodes to the full K.
        self.dynamic_sd_lookup = self.k_controller.lookup
        self._step_starts: dict[int, tuple[float, int, int, int]] = {}
        self._last_output_time = 0.0
        self._last_log_time = time.monotonic()
        trace = os.environ.get("VLLM_PEAGLE_ADAPTIVE_TRACE")
        # One line per step: tokens, batch size, K drafted, drafts verified, seconds, the
        # seconds the engine sat idle before the step was scheduled, the policy's K for the
        # batch size (a K drafted above it is a probe), the wall-clock time and the drafts
        # accepted (last, so traces written before it read the same).
        self._trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115
        logger.info(
            "vllm-peagle adaptive K on: K chosen per step in %d..%d from live acceptance and "
            "step cost (calibrating over K=%s first; drafter/target compute %.2f).",
            self.k_controller.min_k,
            self.num_spec_tokens,
            sorted(set(self.k_controller.calibration)),
            self.k_controller.drafter_compute_ratio,
        )

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        controller = self.k_controller
        if controller is None:
            return super().schedule(*args, **kwargs)
        waiting = len(self.waiting)
        running = len(self.running)
        controller.before_step(
            min(running + waiting, self.max_num_running_reqs) if waiting else None
        )
        output = super().schedule(*args, **kwargs)
        self.last_scheduled_k = output.num_spec_tokens_to_schedule
        if output.total_num_scheduled_tokens:
            if len(self._step_starts) > 64:  # outputs that never came back (e.g. aborted)
                self._step_starts.clear()
            self._step_starts[id(output)] = (
                time.perf_counter(),
                output.total_num_scheduled_tokens,
                len(output.num_scheduled_tokens),
                output.num_spec_tokens_to_schedule,
            )
        return output

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        # vLLM calls this inside schedule(), after it took the step's K from the table and
        # before the async scheduler reserves that many draft placeholders (patch ledger,
        # entry 8): the last point to shorten K for every reader.
        k = scheduler_output.num_spec_tokens_to_schedule
        if k and self.k_controller is not None:
            scheduler_output.num_spec_tokens_to_schedule = useful_drafts(
                self.requests, scheduler_output.num_scheduled_tokens, k
            )
        super()._update_after_schedule(scheduler_output)

    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        # vLLM's engine core calls this once a step is dispatched to the workers, in both its
        # synchronous and its batch-queue loop: the policy's periodic work runs while they
        # execute instead of delaying the next step.
        grammar_output = super().get_grammar_bitmask(scheduler_output)
        if self.k_controller is not None and scheduler_output.total_num_scheduled_tokens:
            self.k_controller.update_ahead(bool(scheduler_output.scheduled_spec_decode_tokens))
        return grammar_output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self.k_controller is not None:
            self._observe(scheduler_output, model_runner_output)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _observe(self, scheduler_output: Any, model_runner_output: Any) -> None:
        now = time.perf_counter()
        sampled = model_runner_output.sampled_token_ids or []
        new_requests = scheduler_output.scheduled_new_reqs
        self.k_controller.observe_requests(
            sum(len(r.prompt_token_ids or ()) - r.num_computed_tokens for r in new_requests),
            len(new_requests),
            sum(len(tokens) for tokens in sampled),
            len(scheduler_output.finished_req_ids),
        )
        started = self._step_starts.pop(id(scheduler_output), None)
        if started is None:
            return
        start_time, num_tokens, batch_size, drafted_k = started
        # Under async scheduling the next step is scheduled before this one finishes, so a
        # step's own time starts when the previous output arrived, not when it was scheduled.
        idle = max(0.0, start_time - self._last_output_time)
        seconds = now - max(start_time, self._last_output_time)
        self._last_output_time = now
        index = model_runner_output.req_id_to_index
        invalid = scheduler_output.num_invalid_spec_tokens or {}
        verifications = []
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        # A step with prompt chunks is not a decoding step: its time is left out of the cost
        # model (see StepCostModel); its verifications still count.
        decoding = num_tokens == batch_size + sum(len(d) for d in spec_tokens.values())
        for req_id, drafts in spec_tokens.items():
            row = index.get(req_id)
            if row is None or row >= len(sampled) or not len(sampled[row]):
                continue
            num_drafts = len(drafts) - invalid.get(req_id, 0)
            if num_drafts > 0:
                verifications.append((num_drafts, len(sampled[row]) - 1))
        self.k_controller.observe_step(
            num_tokens, batch_size, drafted_k, seconds if decoding else None, verifications
        )
        if self._trace is not None:
            verified = sum(d for d, _ in verifications)
            accepted = sum(a for _, a in verifications)
            policy_k = self.k_controller.policy_k[min(batch_size, self.max_num_running_reqs)]
            self._trace.write(
                f"{num_tokens} {batch_size} {drafted_k} {verified} {seconds:.6f} {idle:.6f} "
                f"{policy_k} {time.time():.3f} {accepted}\n"
            )
        log_every = self.k_controller.config.log_interval_s
        if log_every and time.monotonic() - self._last_log_time >= log_every:
            self._last_log_time = time.monotonic()
            logger.info("vllm-peagle adaptive K, %s", self.k_controller.summary(batch_size))


def useful_drafts(requests: dict[str, Any], num_scheduled_tokens: dict[str, int], k: int) -> int:
    """``k``, shortened to the most drafts any request of the step could still use.

    Drafts written after this step are verified in the next one, which yields one token of
    its own; a request with ``n`` tokens left to ``max_tokens`` after this step uses at most
    ``n - 1``. The step yields at least one token for every request it decodes (none for a
    prompt chunk that does not reach the end of its prompt). A batch that ends together, as
    requests with one ``max_tokens`` started at once do, otherwise drafts K after its last
    step for nothing: ~20 ms of a ~1.1 s run at batch 16 on the CPU bench models.
    """
    most = 0
    for req_id, scheduled in num_scheduled_tokens.items():
        request = requests[req_id]
        if request.max_tokens is None:
            return k
        in_flight = request.num_output_placeholders
        left = request.max_tokens - request.num_output_tokens - in_flight
        decodes = request.num_computed_tokens + scheduled >= request.num_tokens + in_flight
        most = max(most, left - decodes - 1)
        if most >= k:
            return k
    return max(most, 0)


class AdaptiveKScheduler(AdaptiveKMixin, Scheduler):
    """vLLM's synchronous scheduler with adaptive K."""


class AdaptiveKAsyncScheduler(AdaptiveKMixin, AsyncScheduler):
    """vLLM's asynchronous scheduler with adaptive K."""


def adaptive_scheduler(*args: Any, vllm_config: Any, **kwargs: Any) -> Scheduler:
    """Build the adaptive variant of the scheduler vLLM would have chosen itself.

    ``scheduler_cls`` is fixed before vLLM decides on async scheduling, so it names this
    factory, which picks the matching class once the config is final.
    """
    cls = (
        AdaptiveKAsyncScheduler
        if vllm_config.scheduler_config.async_scheduling
        else AdaptiveKScheduler
    )
    return cls(*args, vllm_config=vllm_config, **kwargs)
