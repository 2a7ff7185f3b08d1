"""Save and load :class:`PEagleDrafter` checkpoints in the layouts vLLM reads.

* ``native``: a Llama-style ``config.json`` (``LlamaForCausalLMEagle3``) with EAGLE-3 /
  P-EAGLE keys (``ptd_token_id``, ``draft_vocab_size``, ...), served with
  ``{"method": "eagle3", "parallel_drafting": true}``.
* ``speculators``: the vllm-project/speculators format (``speculators_model_type:
  "peagle"``), which vLLM turns into the same runtime config by itself.

Both layouts store the same ``model.safetensors``; every write is atomic.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from vllm_peagle.modeling import PEagleDrafter, PEagleDrafterConfig

Layout = Literal["native", "speculators"]
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
NATIVE_ARCHITECTURE = "LlamaForCausalLMEagle3"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` so readers see either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # e.g. a filesystem without RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), str(b))


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield an empty staging directory next to ``path``; on success it replaces ``path``.

    The staging dir shares the parent so the final rename never crosses filesystems.
    A directory cannot be renamed over a non-empty one, so on Linux the two are exchanged
    atomically (a SIGKILL at any point leaves the old or the new directory at ``path``);
    elsewhere the old ``path`` is moved aside first and removed after the swap.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield stage
        for f in stage.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        _fsync_dir(stage)
        if path.exists() and _exchange(stage, path):
            _fsync_dir(path.parent)
            shutil.rmtree(stage, ignore_errors=True)  # now holds the previous contents
            return
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}-{id(stage)}"
            os.replace(path, old)
        os.replace(stage, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _llama_fields(cfg: PEagleDrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        # transformers >= 5 reads rope_parameters, 4.x reads rope_theta.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "vocab_size": cfg.vocab_size,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": False,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def _eagle_fields(cfg: PEagleDrafterConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    }
    if cfg.eagle_aux_hidden_state_layer_ids is not None:
        out["eagle_aux_hidden_state_layer_ids"] = list(cfg.eagle_aux_hidden_state_layer_ids)
    return out


def native_config_dict(cfg: PEagleDrafterConfig, dtype: torch.dtype = torch.float32) -> dict:
    """``config.json`` of the native (amazon-style) layout."""
    out = {"architectures": [NATIVE_ARCHITECTURE], **_llama_fields(cfg, dtype)}
    out.update(_eagle_fields(cfg))
    # vLLM's runner reads the top-level ids, its LlamaModel reads eagle_config.
    eagle_config: dict[str, Any] = {"use_aux_hidden_state": True}
    if cfg.eagle_aux_hidden_state_layer_ids is not None:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = list(
            cfg.eagle_aux_hidden_state_layer_ids
        )
    out["eagle_config"] = eagle_config
    if cfg.mask_token_id is not None:
        out["ptd_token_id"] = cfg.mask_token_id
    return out


def speculators_config_dict(
    cfg: PEagleDrafterConfig,
    *,
    num_speculative_tokens: int,
    verifier: str,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """``config.json`` of the speculators layout (what vLLM's ``SpeculatorsConfig`` reads)."""
    if cfg.mask_token_id is None:
        raise ValueError("the speculators 'peagle' layout needs a mask token")
    layer = {"architectures": ["LlamaForCausalLM"], **_llama_fields(cfg, dtype)}
    # vLLM's peagle updater copies only some EAGLE keys out of the top level; the
    # rest must already sit in transformer_layer_config to reach the model.
    layer.update({"fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output})
    return {
        "architectures": ["PEagleDraftModel"],
        "speculators_model_type": "peagle",
        "speculators_version": "0.3.0",
        "mask_token_id": cfg.mask_token_id,
        **_eagle_fields(cfg),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "peagle",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(verifier_architectures or ["LlamaForCausalLM"]),
            },
        },
    }


def detect_layout(config: dict) -> Layout:
    return "speculators" if "speculators_config" in config else "native"


def _rope_theta(d: dict) -> float:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) not in ("default", None):
        raise NotImplementedError(f"rope scaling {params} is not supported by PEagleDrafter")
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))


def config_from_dict(config: dict) -> PEagleDrafterConfig:
    """Parse either layout's ``config.json`` into a :class:`PEagleDrafterConfig`."""
    if detect_layout(config) == "speculators":
        layer, top, mask_id = config["transformer_layer_config"], config, config["mask_token_id"]
    else:
        layer = top = config
        # Same precedence as vLLM's proposer (dflash/dspark keys do not apply here).
        mask_id = next(
            (config[k] for k in ("mask_token_id", "pard_token", "ptd_token_id") if k in config),
            None,
        )
    eagle_cfg = top.get("eagle_config") or {}
    aux_ids = top.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return PEagleDrafterConfig(
        hidden_size=layer["hidden_size"],
        num_hidden_layers=layer["num_hidden_layers"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
        intermediate_size=layer["intermediate_size"],
        vocab_size=layer["vocab_size"],
        draft_vocab_size=top.get("draft_vocab_size"),
        target_hidden_size=top.get("target_hidden_size"),
        head_dim=layer.get("head_dim"),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(layer),
        max_position_embeddings=layer.get("max_position_embeddings", 2048),
        eagle_aux_hidden_state_layer_ids=list(aux_ids) if aux_ids else None,
        mask_token_id=mask_id,
        norm_before_residual=bool(top.get("norm_before_residual", False)),
        norm_before_fc=bool(top.get("norm_before_fc", eagle_cfg.get("norm_before_fc", False))),
        fc_norm=bool(top.get("fc_norm", layer.get("fc_norm", False))),
        norm_output=bool(top.get("norm_output", layer.get("norm_output", False))),
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)),
        hidden_act=layer.get("hidden_act", "silu"),
    )


def read_drafter_config(path: str | os.PathLike) -> tuple[PEagleDrafterConfig, Layout]:
    """Read ``config.json`` of a drafter directory; returns the config and its layout."""
    raw = json.loads((Path(path) / "config.json").read_text())
    return config_from_dict(raw), detect_layout(raw)


def save_drafter(
    model: PEagleDrafter,
    path: str | os.PathLike,
    *,
    layout: Layout = "native",
    num_speculative_tokens: int = 4,
    verifier: str | os.PathLike | None = None,
    verifier_architectures: list[str] | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Atomically write ``model`` to directory ``path`` in ``layout``; returns ``path``.

    ``verifier`` (target name or path) is required for the speculators layout, which
    records it. ``tokenizer_dir``'s tokenizer files are copied alongside so tools can
    check the drafter against the target's vocabulary. ``extra_files`` may add more
    files to the staging directory before it is published.
    """
    cfg = model.config
    dtype = dtype or next(model.parameters()).dtype
    if layout == "native":
        config = native_config_dict(cfg, dtype)
    elif layout == "speculators":
        if verifier is None:
            raise ValueError("the speculators layout needs verifier= (target name or path)")
        config = speculators_config_dict(
            cfg,
            num_speculative_tokens=num_speculative_tokens,
            verifier=str(verifier),
            verifier_architectures=verifier_architectures,
            dtype=dtype,
        )
    else:
        raise ValueError(f"unknown layout {layout!r}")
    tensors = {
        name: (t if t.dtype == torch.long else t.to(dtype)).detach().cpu().contiguous()
        for name, t in model.state_dict().items()
    }
    path = Path(path)
    with atomic_directory(path) as stage:
        save_file(tensors, str(stage / WEIGHTS_NAME), metadata={"format": "pt"})
        (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, stage / name)
        if extra_files is not None:
            extra_files(stage)
    return path


def load_drafter_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a drafter directory, with names normalised to ours."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            if name == "t2d" or name.endswith(".t2d"):
                continue  # vLLM ignores t2d as well
            # vLLM accepts layer 0 under either name (it maps midlayer. -> layers.0.).
            state[
                name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name
            ] = tensor
    if "mask_hidden" in state:
        state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
    return state


def load_drafter(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PEagleDrafter:
    """Load a drafter saved in either layout (or a compatible upstream EAGLE-3 dir)."""
    cfg, _ = read_drafter_config(path)
    state = load_drafter_state(path)
    if cfg.mask_token_id is not None and "mask_hidden" not in state:
        raise ValueError(f"{path}: config names a mask token but weights lack mask_hidden")
    model = PEagleDrafter(cfg)
    if model.d2t is not None and "d2t" not in state:
        state["d2t"] = torch.zeros_like(model.d2t)  # vLLM leaves an absent map at zeros
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: missing weights {missing}, unexpected weights {unexpected}")
    return model.to(device=device, dtype=dtype).eval()
