"""A catalogue of unservable `--speculative-config` inputs, checked cheaply at start-up.

Each case goes through vLLM's own ``EngineArgs.create_engine_config()`` (where serving
start-up validates the speculative config; no engine is started) and must fail with our
error, in one line that names the problem and the fix. Cases already covered by
tests/test_bad_checkpoints.py (no mask_hidden, no mask token, hidden-size or vocabulary
mismatch, aux layer out of range, K of 0/-1/33, missing path) are not repeated here.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.drafter_edits import broken_copy, drop_keys, set_keys
from vllm_peagle.config import DrafterConfigError

pytestmark = pytest.mark.slow


def spec_for(drafter: Path | str, **overrides) -> dict:
    return {"method": "peagle", "model": str(drafter), "num_speculative_tokens": 4, **overrides}


def engine_config(target: Path, speculative_config):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(target),
        speculative_config=speculative_config,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
    )
    return args.create_engine_config()


def edit_weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(drafter: Path) -> None:
        for path in drafter.glob("*.safetensors"):
            tensors = load_file(str(path))
            edit(tensors)
            save_file(tensors, str(path))

    return apply


def cast(name: str, dtype: torch.dtype):
    return edit_weights(lambda t: t.__setitem__(name, t[name].to(dtype)))


def drop(prefix: str):
    return edit_weights(lambda t: [t.pop(k) for k in list(t) if k.startswith(prefix)])


def write_bytes(data: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def apply(drafter: Path) -> None:
        weights = drafter / "model.safetensors"
        weights.write_bytes(data(weights.read_bytes()))

    return apply


def swap_two_tokens(drafter: Path) -> None:
    """Same vocabulary size, two tokens trading ids: a tokenizer of another target."""
    tokenizer = json.loads((drafter / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[1000:1002]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (drafter / "tokenizer.json").write_text(json.dumps(tokenizer))


def replace_with_file(drafter: Path) -> Path:
    file = drafter.with_suffix(".bin")
    file.write_bytes(b"not a directory")
    return file


def in_config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(drafter: Path) -> None:
        config = json.loads((drafter / "config.json").read_text())
        edit(config)
        (drafter / "config.json").write_text(json.dumps(config))

    return apply


def config_text(text: str) -> Callable[[Path], None]:
    def apply(drafter: Path) -> None:
        (drafter / "config.json").write_text(text)

    return apply


def remove(name: str) -> Callable[[Path], None]:
    def apply(drafter: Path) -> None:
        (drafter / name).unlink()

    return apply


# id: (layout, edit of the drafter dir (may return another path), spec overrides, message)
CASES: dict[str, tuple[str, Callable | None, dict | object, str]] = {
    "spec-json-list": ("native", None, [1, 2], "must be a JSON object"),
    "unknown-key-typo": (
        "native",
        None,
        {"num_speculative_token": 4},
        "did you mean 'num_speculative_tokens'",
    ),
    "unknown-key": ("native", None, {"draft_temperature": 0.5}, "Unknown key 'draft_temperature'"),
    "k-string": ("native", None, {"num_speculative_tokens": "4"}, "must be an integer"),
    "k-fraction": ("native", None, {"num_speculative_tokens": 2.5}, "must be an integer"),
    "k-missing-untrained": (
        "native",
        None,
        {"num_speculative_tokens": None},
        "num_speculative_tokens is missing",
    ),
    "empty-model": ("native", None, {"model": ""}, "needs 'model'"),
    "parallel-drafting-false": (
        "native",
        None,
        {"parallel_drafting": False},
        "always drafts in parallel",
    ),
    "other-target-tokenizer": ("native", swap_two_tokens, {}, "ships a tokenizer that differs"),
    "truncated-safetensors": ("native", write_bytes(lambda b: b[: len(b) // 2]), {}, "truncated"),
    "empty-safetensors": ("native", write_bytes(lambda b: b""), {}, "truncated"),
    "corrupt-safetensors-header": (
        "native",
        write_bytes(lambda b: b[:8] + b"\xff" * (len(b) - 8)),
        {},
        "unreadable safetensors header",
    ),
    "missing-fc-weight": ("native", drop("fc."), {}, "lacks weight 'fc.weight'"),
    "missing-first-layer": ("native", drop("midlayer."), {}, "lacks weight 'midlayer."),
    "missing-norm-speculators": ("speculators", drop("norm."), {}, "lacks weight 'norm.weight'"),
    "int-dtype-weight": ("native", cast("fc.weight", torch.int32), {}, "'fc.weight' as I32"),
    "bool-dtype-mask-hidden": ("native", cast("mask_hidden", torch.bool), {}, "as BOOL"),
    "mask-hidden-wrong-width": (
        "native",
        edit_weights(lambda t: t.__setitem__("mask_hidden", torch.zeros(1, 1, 512))),
        {},
        "mask_hidden of shape [1, 1, 512]",
    ),
    "aux-ids-negative": (
        "native",
        in_config(set_keys(eagle_aux_hidden_state_layer_ids=[-1, 1, 2])),
        {},
        "fuses target layers [-1, 1, 2]",
    ),
    "aux-ids-repeated": (
        "native",
        in_config(set_keys(eagle_aux_hidden_state_layer_ids=[1, 1, 2])),
        {},
        "with repeats",
    ),
    "aux-ids-not-a-list": (
        "native",
        in_config(set_keys(eagle_aux_hidden_state_layer_ids="1,2,3")),
        {},
        "not a list of integers",
    ),
    "mask-token-outside-vocab": (
        "native",
        in_config(set_keys(ptd_token_id=5000)),
        {},
        "outside the target vocabulary",
    ),
    "mask-token-not-int": (
        "native",
        in_config(set_keys(ptd_token_id="3")),
        {},
        "non-integer mask token",
    ),
    "hidden-size-zero": (
        "native",
        in_config(set_keys(hidden_size=0)),
        {},
        "no valid 'hidden_size'",
    ),
    "speculators-no-layer-config": (
        "speculators",
        in_config(drop_keys("transformer_layer_config")),
        {},
        "no transformer_layer_config",
    ),
    "speculators-bad-trained-k": (
        "speculators",
        in_config(set_keys(speculators_config={"proposal_methods": [{"speculative_tokens": 0}]})),
        {},
        "speculative_tokens=0",
    ),
    "path-is-a-file": ("native", replace_with_file, {}, "is a file, not a checkpoint directory"),
    "config-not-json": ("native", config_text("{broken"), {}, "is not valid JSON"),
    "config-json-list": ("native", config_text("[]"), {}, "must hold a JSON object"),
    "no-config": ("native", remove("config.json"), {}, "has no config.json"),
    "no-safetensors": ("native", remove("model.safetensors"), {}, "has no *.safetensors"),
}


def build_case(case: str, local_models, tmp_path: Path):
    layout, edit, overrides, message = CASES[case]
    source = local_models.peagle_native if layout == "native" else local_models.peagle_speculators
    drafter = broken_copy(source, tmp_path / case)
    if edit is not None:
        drafter = edit(drafter) or drafter
    if not isinstance(overrides, dict):
        return overrides, message
    spec = {k: v for k, v in spec_for(drafter, **overrides).items() if v is not None}
    return spec, message


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_at_startup_with_one_line(case, local_models, tmp_path):
    spec, message = build_case(case, local_models, tmp_path)
    with pytest.raises(DrafterConfigError) as info:
        engine_config(local_models.target, spec)
    text = str(info.value)
    print(f"{case}: {text}")
    assert message in text
    assert "\n" not in text and "Fix:" in text


def test_good_inputs_still_pass(local_models):
    """The checks above refuse broken drafters only: both good layouts are accepted."""
    for drafter in (local_models.peagle_native, local_models.peagle_speculators):
        config = engine_config(local_models.target, spec_for(drafter))
        assert config.speculative_config.num_speculative_tokens == 4


def test_k_above_trained_k_is_served_with_a_warning(local_models):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.vllm_peagle")
    logger.addHandler(handler)
    try:
        config = engine_config(
            local_models.target, spec_for(local_models.peagle_speculators, num_speculative_tokens=8)
        )
    finally:
        logger.removeHandler(handler)
    assert config.speculative_config.num_speculative_tokens == 8
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("num_speculative_tokens=8 exceeds the K=4" in w for w in warnings), warnings
    print(f"k-above-trained: {warnings[0]}")


@pytest.mark.parametrize(
    "value", ['{"method": "peagle",', "{'method': 'peagle'}"], ids=["truncated", "single-quotes"]
)
def test_malformed_json_is_refused_by_the_serve_cli(local_models, value):
    cmd = [sys.executable, "-m", "vllm_peagle.cli", "serve", str(local_models.target)]
    proc = subprocess.run(
        [*cmd, "--speculative-config", value], capture_output=True, text=True, timeout=120
    )
    last = proc.stderr.strip().splitlines()[-1]
    print(f"malformed-json-{value[:6]}: {last}")
    assert proc.returncode == 2
    assert "--speculative-config is not valid JSON" in last and "Fix:" in last
