"""Read, normalise and validate P-EAGLE drafter checkpoints.

Two published layouts are understood:

* **native**: an EAGLE-3 Llama drafter config (``LlamaForCausalLMEagle3`` family) with a
  mask token id under ``ptd_token_id``, ``mask_token_id`` or ``pard_token`` and a
  ``mask_hidden`` weight of width ``num_aux * target_hidden_size``;
* **speculators**: ``speculators_model_type: "peagle"`` with the layer config nested under
  ``transformer_layer_config`` and the trained K under ``speculators_config``.

Everything here is plain Python over JSON (safetensors headers are JSON too), so checks run
at start-up in the API process without importing torch or touching a device. Every problem
is a :class:`DrafterConfigError` whose message is one line naming the problem and the fix.
"""

from __future__ import annotations

import difflib
import json
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vllm_peagle.adaptive.policy import AdaptiveConfig

MIN_SPECULATIVE_TOKENS = 1
MAX_SPECULATIVE_TOKENS = 32
MASK_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
MASK_HIDDEN_WEIGHT = "mask_hidden"


class DrafterConfigError(ValueError):
    """A drafter checkpoint or speculative config that cannot be served, with its fix."""


@dataclass(frozen=True)
class TargetSpec:
    """What a drafter has to agree with in its target model."""

    name: str
    """Path or hub id of the target, for messages."""
    hidden_size: int
    """Width of the target's hidden states (the aux states the drafter fuses)."""
    vocab_size: int
    """Size of the target's vocabulary (logit width)."""
    num_hidden_layers: int
    """Number of decoder layers: aux layer ids must lie in ``[0, num_hidden_layers)``."""

    @classmethod
    def from_hf_config(cls, hf_config: Any, name: str) -> TargetSpec:
        """Build from a transformers ``PretrainedConfig`` (multimodal: its text config)."""
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        return cls(
            name=name,
            hidden_size=int(text.hidden_size),
            vocab_size=int(text.vocab_size),
            num_hidden_layers=int(text.num_hidden_layers),
        )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], name: str) -> TargetSpec:
        """Build from a target ``config.json`` dict (nested ``text_config`` honoured)."""
        text = config.get("text_config") if isinstance(config, Mapping) else None
        text = text or config
        values = {}
        for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
            value = text.get(key) if isinstance(text, Mapping) else None
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise DrafterConfigError(
                    f"Target config of '{name}' has no valid {key} (got {value!r}). "
                    "Fix: point the target at a Hugging Face causal-LM checkpoint directory."
                )
            values[key] = value
        return cls(name=name, **values)


@dataclass(frozen=True)
class DrafterSpec:
    """A P-EAGLE drafter checkpoint, normalised across layouts."""

    path: str
    """Where the checkpoint was read from."""
    layout: Literal["native", "speculators"]
    """Which published layout the config follows."""
    hidden_size: int
    """Drafter hidden size."""
    target_hidden_size: int
    """Width of each target aux hidden state the drafter expects."""
    vocab_size: int
    """Target vocabulary size the drafter was built for."""
    draft_vocab_size: int
    """Size of the drafter's own LM head (``d2t`` maps it into the target vocabulary)."""
    num_hidden_layers: int
    """Number of drafter decoder layers."""
    mask_token_id: int | None
    """Token id whose embedding fills the parallel (mask) slots."""
    aux_layer_ids: tuple[int, ...] | None
    """Target layers whose hidden states are fused; None means vLLM's default choice."""
    trained_num_speculative_tokens: int | None
    """K the drafter was trained for, when the checkpoint records it."""
    weight_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    """Tensor name to shape over all safetensors files (empty for remote checkpoints)."""

    @property
    def has_mask_hidden(self) -> bool:
        return any(name.endswith(MASK_HIDDEN_WEIGHT) for name in self.weight_shapes)

    @property
    def num_aux_hidden_states(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids else 3


def _load_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise DrafterConfigError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}). "
            "Fix: repair or re-export the drafter config."
        ) from None
    if not isinstance(data, dict):
        raise DrafterConfigError(f"{path} must hold a JSON object. Fix: re-export the drafter.")
    return data


def read_safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from one safetensors file's header; detects truncated files."""
    return {name: shape for name, (_, shape) in read_safetensors_header(path).items()}


def _corrupt(path: Path, what: str) -> DrafterConfigError:
    return DrafterConfigError(
        f"{path} is corrupt ({what}). Fix: download or export the drafter again."
    )


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name to (dtype, shape) from one safetensors file's header; detects truncation."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise DrafterConfigError(
                f"{path} is truncated ({size} bytes). Fix: download or export it again."
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise DrafterConfigError(
                f"{path} is corrupt or truncated (header claims {header_len} bytes, file has "
                f"{size}). Fix: download or export it again."
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DrafterConfigError(
                f"{path} has an unreadable safetensors header. Fix: download or export it again."
            ) from None
    if not isinstance(header, dict):
        raise _corrupt(path, "its header is not a JSON object")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    data_len = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise _corrupt(path, f"header entry {name!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or not dtype.isidentifier() or not _is_index_list(shape):
            raise _corrupt(path, f"tensor {name!r} has no valid dtype and shape")
        if not _is_index_list(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise _corrupt(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
        tensors[name] = (dtype, tuple(shape))
        data_len = max(data_len, offsets[1])
    if 8 + header_len + data_len > size:
        raise DrafterConfigError(
            f"{path} is truncated ({size} bytes, tensors need {8 + header_len + data_len}). "
            "Fix: download or export it again."
        )
    return tensors


def _is_index_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    )


# Integer weights in a checkpoint without a quantization config load as garbage floats.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
INDEX_TENSORS = ("d2t", "t2d")
"""Vocabulary maps: the only tensors of a drafter stored as integers."""


def _check_weight_dtypes(model: str, config: Mapping[str, Any], dtypes: dict[str, str]) -> None:
    if config.get("quantization_config") is not None:
        return
    for name, dtype in sorted(dtypes.items()):
        if dtype not in FLOAT_DTYPES and name.rsplit(".", 1)[-1] not in INDEX_TENSORS:
            raise DrafterConfigError(
                f"Drafter '{model}' stores weight {name!r} as {dtype}, not a floating-point "
                "type (F32/F16/BF16), and has no quantization_config. Fix: re-export the "
                "drafter in float32 or bfloat16."
            )


def _resolve_local_dir(model: str) -> Path | None:
    """The checkpoint directory for ``model``: a local path, a cached hub repo, or None."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DrafterConfigError(
                f"Drafter path '{model}' is a file, not a checkpoint directory. "
                "Fix: pass the directory that holds config.json and the safetensors weights."
            )
        return path
    looks_like_repo_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_repo_id:
        raise DrafterConfigError(
            f"Drafter path '{model}' does not exist. "
            "Fix: pass an existing checkpoint directory or a Hugging Face repo id (org/name)."
        )
    return None


def _fetch_remote_config(repo_id: str) -> dict[str, Any]:
    try:
        from huggingface_hub import hf_hub_download

        return _load_json(Path(hf_hub_download(repo_id, "config.json")))
    except DrafterConfigError:
        raise
    except Exception as err:
        raise DrafterConfigError(
            f"Drafter '{repo_id}' is neither a local directory nor a reachable Hugging Face repo "
            f"({type(err).__name__}). Fix: download it and pass the local path."
        ) from None


def read_drafter_dict(model: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The raw ``config.json`` and weight shapes of a drafter (shapes empty when remote)."""
    local = _resolve_local_dir(model)
    if local is None:
        return _fetch_remote_config(model), {}
    config_path = local / "config.json"
    if not config_path.is_file():
        raise DrafterConfigError(
            f"Drafter directory '{model}' has no config.json. "
            "Fix: pass the directory of an exported drafter checkpoint."
        )
    weight_files = sorted(local.glob("*.safetensors"))
    if not weight_files:
        raise DrafterConfigError(
            f"Drafter directory '{model}' has no *.safetensors weights. "
            "Fix: export the drafter with its weights (vllm-peagle export) or download them."
        )
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for weight_file in weight_files:
        for name, (dtype, shape) in read_safetensors_header(weight_file).items():
            dtypes[name], shapes[name] = dtype, shape
    config = _load_json(config_path)
    _check_weight_dtypes(model, config, dtypes)
    return config, shapes


def is_peagle_config(config: Mapping[str, Any]) -> bool:
    """True for a P-EAGLE drafter config in either layout."""
    if not isinstance(config, Mapping):
        return False
    if config.get("speculators_model_type") == "peagle":
        return True
    names = config.get("architectures")
    names = names if isinstance(names, list) else []
    architectures = " ".join(n for n in names if isinstance(n, str))
    is_eagle3 = "Eagle3" in architectures or "Peagle" in architectures
    return is_eagle3 and any(config.get(key) is not None for key in MASK_TOKEN_KEYS)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def normalise_drafter_config(
    config: Mapping[str, Any],
    weight_shapes: Mapping[str, tuple[int, ...]] | None = None,
    path: str = "<config>",
) -> DrafterSpec:
    """Normalise either layout into a :class:`DrafterSpec`; raises DrafterConfigError."""
    if not isinstance(config, Mapping):
        raise DrafterConfigError(
            f"Drafter config of '{path}' must be a JSON object, got {type(config).__name__}. "
            "Fix: re-export the drafter (config.json holds one JSON object)."
        )
    layout: Literal["native", "speculators"] = "native"
    layer = config
    trained_k = None
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "peagle":
            raise DrafterConfigError(
                f"Drafter '{path}' is a speculators {config['speculators_model_type']!r} "
                "checkpoint, not P-EAGLE. Fix: use method "
                f"{config['speculators_model_type']!r} or a P-EAGLE drafter."
            )
        layout = "speculators"
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, Mapping):
            raise DrafterConfigError(
                f"Speculators drafter '{path}' has no transformer_layer_config object. "
                "Fix: re-export it with vllm-peagle export --layout speculators."
            )
        speculators = config.get("speculators_config") or {}
        if not isinstance(speculators, Mapping):
            raise DrafterConfigError(
                f"Speculators drafter '{path}' has speculators_config={speculators!r}, not an "
                "object. Fix: re-export it with vllm-peagle export --layout speculators."
            )
        methods = speculators.get("proposal_methods")
        if not isinstance(methods, list | None):
            raise DrafterConfigError(
                f"Speculators drafter '{path}' has speculators_config.proposal_methods="
                f"{methods!r}, not a list. Fix: re-export it with vllm-peagle export."
            )
        if methods and isinstance(methods[0], Mapping):
            trained_k = methods[0].get("speculative_tokens")
            if trained_k is not None and not _positive_int(trained_k):
                raise DrafterConfigError(
                    f"Speculators drafter '{path}' records speculative_tokens={trained_k!r}, "
                    "not a positive integer. Fix: set it to the K the drafter was trained for."
                )

    def required_int(source: Mapping[str, Any], key: str, default: Any = None) -> int:
        value = source.get(key)
        value = default if value is None else value
        if not _positive_int(value):
            raise DrafterConfigError(
                f"Drafter '{path}' has no valid '{key}' (got {value!r}). "
                f"Fix: set '{key}' to a positive integer in its config.json."
            )
        return value

    hidden_size = required_int(layer, "hidden_size")
    vocab_size = required_int(layer, "vocab_size")
    num_layers = required_int(layer, "num_hidden_layers")

    mask_token_id = None
    for key in MASK_TOKEN_KEYS:
        if config.get(key) is not None:
            mask_token_id = config[key]
            break
    if mask_token_id is not None and (
        isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int)
    ):
        raise DrafterConfigError(
            f"Drafter '{path}' has a non-integer mask token id {mask_token_id!r}. "
            "Fix: set ptd_token_id to the integer id of the mask token."
        )

    eagle_config = config.get("eagle_config") or {}
    if not isinstance(eagle_config, Mapping):
        raise DrafterConfigError(
            f"Drafter '{path}' has eagle_config={eagle_config!r}, not an object. "
            "Fix: make eagle_config a JSON object (or remove it)."
        )
    aux = config.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if aux is not None:
        if not isinstance(aux, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in aux
        ):
            raise DrafterConfigError(
                f"Drafter '{path}' has eagle_aux_hidden_state_layer_ids={aux!r}, not a list "
                "of integers. Fix: list the target layer ids, e.g. [2, 16, 29]."
            )
        aux = tuple(aux)

    return DrafterSpec(
        path=path,
        layout=layout,
        hidden_size=hidden_size,
        target_hidden_size=required_int(config, "target_hidden_size", hidden_size),
        vocab_size=vocab_size,
        draft_vocab_size=required_int(config, "draft_vocab_size", vocab_size),
        num_hidden_layers=num_layers,
        mask_token_id=mask_token_id,
        aux_layer_ids=aux,
        trained_num_speculative_tokens=trained_k,
        weight_shapes=dict(weight_shapes or {}),
    )


def read_drafter(model: str) -> DrafterSpec:
    """Read and normalise the drafter at ``model`` (local dir or hub id)."""
    config, shapes = read_drafter_dict(model)
    return normalise_drafter_config(config, shapes, path=model)


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 aux layers for Llama-style targets."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def validate_num_speculative_tokens(k: Any) -> int:
    """K must be an integer in 1..32."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise DrafterConfigError(
            f"num_speculative_tokens must be an integer, got {k!r}. "
            f"Fix: set it to an integer in {MIN_SPECULATIVE_TOKENS}..{MAX_SPECULATIVE_TOKENS}."
        )
    if not MIN_SPECULATIVE_TOKENS <= k <= MAX_SPECULATIVE_TOKENS:
        raise DrafterConfigError(
            f"num_speculative_tokens={k} is outside {MIN_SPECULATIVE_TOKENS}.."
            f"{MAX_SPECULATIVE_TOKENS}. Fix: choose K between {MIN_SPECULATIVE_TOKENS} and "
            f"{MAX_SPECULATIVE_TOKENS} (P-EAGLE drafters are usually trained for K<=10)."
        )
    return k


def check_drafter_for_target(spec: DrafterSpec, target: TargetSpec) -> list[str]:
    """Every incompatibility between a P-EAGLE drafter and a target, as one-line messages."""
    problems: list[str] = []
    where = f"Drafter '{spec.path}'"
    if spec.mask_token_id is None:
        problems.append(
            f"{where} has no mask token id (none of {', '.join(MASK_TOKEN_KEYS)} in config.json)."
            ' Fix: add "ptd_token_id": <id of the mask token> to its config.json.'
        )
    elif not 0 <= spec.mask_token_id < target.vocab_size:
        problems.append(
            f"{where} has mask token id {spec.mask_token_id}, outside the target vocabulary "
            f"(0..{target.vocab_size - 1}). Fix: set ptd_token_id to a token id of the target."
        )
    if spec.weight_shapes and not spec.has_mask_hidden:
        problems.append(
            f"{where} has no 'mask_hidden' weight, so it cannot draft in parallel (it looks like "
            "a sequential EAGLE-3 head). Fix: use a P-EAGLE-trained drafter, or serve this one "
            "with method 'eagle3'."
        )
    if spec.target_hidden_size != target.hidden_size:
        problems.append(
            f"{where} expects target hidden size {spec.target_hidden_size} but target "
            f"'{target.name}' has hidden_size {target.hidden_size}. Fix: use a drafter trained "
            "for this target."
        )
    if spec.vocab_size != target.vocab_size:
        problems.append(
            f"{where} has vocab_size {spec.vocab_size} but target '{target.name}' has "
            f"{target.vocab_size}. Fix: use a drafter trained for this target's tokenizer."
        )
    aux = spec.aux_layer_ids or default_aux_layer_ids(target.num_hidden_layers)
    source = "eagle_aux_hidden_state_layer_ids" if spec.aux_layer_ids else "vLLM's default"
    bad = [i for i in aux if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(
            f"{where} fuses target layers {list(aux)} ({source}) but target '{target.name}' has "
            f"layers 0..{target.num_hidden_layers - 1}. Fix: set eagle_aux_hidden_state_layer_ids "
            "to layer ids of this target."
        )
    elif len(set(aux)) != len(aux):
        problems.append(
            f"{where} fuses target layers {list(aux)} ({source}) with repeats; vLLM collects each "
            "layer once. Fix: list distinct layer ids in eagle_aux_hidden_state_layer_ids."
        )
    mask_hidden = next(
        (shape for name, shape in spec.weight_shapes.items() if name.endswith(MASK_HIDDEN_WEIGHT)),
        None,
    )
    expected_width = len(aux) * spec.target_hidden_size
    if mask_hidden is not None and mask_hidden[-1:] != (expected_width,):
        problems.append(
            f"{where} has mask_hidden of shape {list(mask_hidden)} but fuses {len(aux)} aux states "
            f"of size {spec.target_hidden_size} (= {expected_width}). Fix: re-export the drafter."
        )
    fc = spec.weight_shapes.get("fc.weight") or spec.weight_shapes.get("model.fc.weight")
    if fc is not None and fc[-1:] != (expected_width,):
        problems.append(
            f"{where} has fc of shape {list(fc)} but {len(aux)} aux states of size "
            f"{spec.target_hidden_size} give {expected_width}. Fix: make "
            "eagle_aux_hidden_state_layer_ids match the layers the drafter was trained on."
        )
    return problems


# Per decoder layer: tensors every Llama-style drafter layer has, even with fused q/k/v or
# gate/up projections. Layer 0 is "midlayer." in EAGLE-3 checkpoints, "layers.0." elsewhere.
_LAYER_WEIGHTS = ("input_layernorm.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight")


def missing_weights(spec: DrafterSpec, limit: int = 8) -> list[str]:
    """Up to ``limit`` required tensors absent from a local drafter's safetensors."""
    if not spec.weight_shapes:
        return []
    names = {name.removeprefix("model.") for name in spec.weight_shapes}
    missing = [name for name in ("fc.weight", "norm.weight") if name not in names]
    for layer in range(spec.num_hidden_layers):
        prefixes = ("midlayer.", "layers.0.") if layer == 0 else (f"layers.{layer}.",)
        for weight in _LAYER_WEIGHTS:
            if not any(prefix + weight in names for prefix in prefixes):
                missing.append(prefixes[0] + weight)
        if len(missing) >= limit:  # a config claiming 10**9 layers must not loop for ages
            break
    return missing[:limit]


def check_drafter_weights(spec: DrafterSpec) -> list[str]:
    """A one-line problem when required weights are missing (checked at serving start-up)."""
    missing = missing_weights(spec)
    if not missing:
        return []
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return [
        f"Drafter '{spec.path}' lacks weight '{missing[0]}'{more} in its safetensors. "
        "Fix: re-export the drafter, or download all of its weight files."
    ]


def validate_drafter_for_target(
    spec: DrafterSpec, target: TargetSpec, num_speculative_tokens: Any
) -> int:
    """Raise the first incompatibility; returns the validated K."""
    k = validate_num_speculative_tokens(num_speculative_tokens)
    problems = check_drafter_for_target(spec, target)
    if problems:
        raise DrafterConfigError(problems[0])
    return k


PEAGLE_METHOD = "peagle"
"""The ``method`` users write in ``--speculative-config``."""
ADDITIONAL_CONFIG_KEY = "vllm_peagle"
"""Key under ``VllmConfig.additional_config`` that marks an engine as served by vllm-peagle."""


def is_peagle_request(speculative_config: Mapping[str, Any]) -> bool:
    """Whether a ``--speculative-config`` dict asks for P-EAGLE.

    True for ``method: "peagle"``, and for no method at all when ``model`` is a local P-EAGLE
    checkpoint (stock vLLM would take it for a ``draft_model`` and die at its first step).
    """
    method = speculative_config.get("method")
    if method == PEAGLE_METHOD:
        return True
    model = speculative_config.get("model")
    if method is not None or not isinstance(model, str) or not Path(model).expanduser().is_dir():
        return False
    try:
        config, _ = read_drafter_dict(model)
    except DrafterConfigError:
        return False
    return is_peagle_config(config)


def _refuse_unknown_keys(spec: Mapping[str, Any], known_keys: Collection[str]) -> None:
    # vLLM would reject these too, but with a multi-line pydantic report and no hint.
    unknown = sorted(str(key) for key in spec if key not in known_keys)
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], [str(k) for k in known_keys], n=1)
    hint = f"did you mean '{close[0]}'?" if close else "remove it."
    raise DrafterConfigError(
        f"Unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in the "
        f"speculative config. Fix: {hint}"
    )


KEEP_LAST_CACHED_BLOCK_KEY = "disable_eagle_block_drop"
"""vLLM's speculative-config key that keeps the trailing prefix-cache block of EAGLE drafters;
on by default for ``method: "peagle"`` (see :func:`to_vllm_speculative_config`)."""


def to_vllm_speculative_config(
    speculative_config: Mapping[str, Any],
    target: TargetSpec,
    known_keys: Collection[str] | None = None,
    require_all_weights: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Translate a P-EAGLE request into vLLM's own terms, validating it against the target.

    Returns the dict vLLM's ``SpeculativeConfig`` accepts (its EAGLE-3 path with parallel
    drafting) and the settings our proposer reads from ``additional_config``. With
    ``known_keys`` (vLLM's field names) a key vLLM would reject is refused in one line, and
    ``require_all_weights`` refuses a checkpoint with required tensors missing.
    """
    if not isinstance(speculative_config, Mapping):
        raise DrafterConfigError(
            f"The speculative config must be a JSON object, got {speculative_config!r}. "
            'Fix: --speculative-config \'{"method": "peagle", "model": DRAFTER, '
            '"num_speculative_tokens": 4}\'.'
        )
    spec = dict(speculative_config)
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise DrafterConfigError(
            "method 'peagle' needs 'model', the drafter checkpoint. "
            'Fix: --speculative-config \'{"method": "peagle", "model": DRAFTER, '
            '"num_speculative_tokens": 4}\'.'
        )
    if spec.get("parallel_drafting") is False:
        raise DrafterConfigError(
            "method 'peagle' always drafts in parallel, but parallel_drafting is false. "
            "Fix: remove parallel_drafting, or use method 'eagle3' for sequential drafting."
        )
    if spec.get("disable_padded_drafter_batch"):
        raise DrafterConfigError(
            "method 'peagle' needs the padded drafter batch, but disable_padded_drafter_batch "
            "is true. Fix: remove disable_padded_drafter_batch from the speculative config."
        )
    drafter = read_drafter(model)
    k = spec.get("num_speculative_tokens", drafter.trained_num_speculative_tokens)
    if k is None:
        raise DrafterConfigError(
            f"num_speculative_tokens is missing and drafter '{model}' does not record the K it "
            'was trained for. Fix: add "num_speculative_tokens": K to the speculative config.'
        )
    k = validate_drafter_for_target(drafter, target, k)
    if require_all_weights and (problems := check_drafter_weights(drafter)):
        raise DrafterConfigError(problems[0])
    adaptive = spec.pop("adaptive", None)
    try:
        AdaptiveConfig.from_setting(adaptive)
    except ValueError as error:
        raise DrafterConfigError(str(error)) from None
    if known_keys is not None:
        _refuse_unknown_keys(spec, known_keys)
    spec.update(method="eagle3", parallel_drafting=True, num_speculative_tokens=k)
    if known_keys is None or KEEP_LAST_CACHED_BLOCK_KEY in known_keys:
        # vLLM recomputes the last block of every prefix-cache hit for EAGLE-type drafters
        # (the drafter's KV at the block's final position saw the next token of whichever
        # request wrote it). That is one scheduler block, 128 tokens on CPU, of target prefill
        # per hit; for P-EAGLE it costs at most one stale drafter position, which
        # verification makes harmless and which K=0 steps leave stale anyway. "false" restores
        # vLLM's behaviour.
        spec.setdefault(KEEP_LAST_CACHED_BLOCK_KEY, True)
    settings = {
        "drafter": model,
        "layout": drafter.layout,
        "num_speculative_tokens": k,
        "trained_num_speculative_tokens": drafter.trained_num_speculative_tokens,
        "adaptive": adaptive,
    }
    return spec, settings


def check_tokenizers(drafter_dir: str, target_dir: str) -> list[str]:
    """Compare the tokenizer a drafter ships (if any) with the target's, token id by token id.

    Loads tokenizer files only (no weights). A drafter without tokenizer files passes: vLLM
    always tokenizes with the target's tokenizer, so only a shipped, different one is a sign
    of a drafter trained for another target.
    """
    drafter, target = Path(drafter_dir), Path(target_dir)
    if not (drafter / "tokenizer.json").is_file() and not (drafter / "tokenizer.model").is_file():
        return []
    names = ("tokenizer.json", "tokenizer.model")
    if any(_same_file_bytes(drafter / name, target / name) for name in names):
        return []  # a copy of the target's own tokenizer: skip loading both (start-up cost)
    from transformers import AutoTokenizer

    drafter_vocab = AutoTokenizer.from_pretrained(str(drafter)).get_vocab()
    target_vocab = AutoTokenizer.from_pretrained(str(target)).get_vocab()
    differing = sum(1 for tok, i in target_vocab.items() if drafter_vocab.get(tok) != i)
    differing += sum(1 for tok in drafter_vocab if tok not in target_vocab)
    if not differing:
        return []
    return [
        f"Drafter '{drafter_dir}' ships a tokenizer that differs from target '{target_dir}' "
        f"({differing} tokens map to other ids). Fix: use a drafter trained with this target's "
        "tokenizer."
    ]


def _same_file_bytes(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()
