"""The drafter config normaliser and compatibility checks (pure, no engine)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from vllm_peagle.config import (
    DrafterConfigError,
    TargetSpec,
    check_drafter_for_target,
    is_peagle_config,
    is_peagle_request,
    normalise_drafter_config,
    read_drafter,
    read_safetensors_shapes,
    to_vllm_speculative_config,
    validate_num_speculative_tokens,
)

TARGET = TargetSpec(name="tiny", hidden_size=64, vocab_size=100, num_hidden_layers=6)


def native_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 100,
        "draft_vocab_size": 100,
        "target_hidden_size": 64,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "ptd_token_id": 99,
    }
    config.update(overrides)
    return config


def speculators_config(k: int = 6) -> dict:
    return {
        "speculators_model_type": "peagle",
        "architectures": ["PEagleSpeculator"],
        "transformer_layer_config": {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100},
        "target_hidden_size": 64,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "mask_token_id": 99,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": k}]},
    }


def write_drafter(path, config, weights=None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if weights is None:
        weights = {"mask_hidden": torch.zeros(1, 1, 192), "fc.weight": torch.zeros(64, 192)}
    save_file(weights, path / "model.safetensors")
    return path


def test_both_layouts_normalise_to_the_same_spec():
    native = normalise_drafter_config(native_config())
    spec = normalise_drafter_config(speculators_config(k=6))
    assert (native.layout, spec.layout) == ("native", "speculators")
    for field in (
        "hidden_size",
        "vocab_size",
        "num_hidden_layers",
        "mask_token_id",
        "aux_layer_ids",
    ):
        assert getattr(native, field) == getattr(spec, field), field
    assert spec.trained_num_speculative_tokens == 6
    assert native.trained_num_speculative_tokens is None


@pytest.mark.parametrize("key", ["ptd_token_id", "mask_token_id", "pard_token"])
def test_every_mask_token_key_is_read(key):
    config = native_config(ptd_token_id=None)
    config[key] = 42
    assert normalise_drafter_config(config).mask_token_id == 42


def test_detects_peagle_configs():
    assert is_peagle_config(native_config())
    assert is_peagle_config(speculators_config())
    assert not is_peagle_config(native_config(ptd_token_id=None))
    assert not is_peagle_config({"architectures": ["LlamaForCausalLM"], "ptd_token_id": 3})


def test_compatible_drafter_has_no_problems(tmp_path):
    spec = read_drafter(str(write_drafter(tmp_path / "d", native_config())))
    assert check_drafter_for_target(spec, TARGET) == []


@pytest.mark.parametrize(
    ("overrides", "target", "message"),
    [
        ({"ptd_token_id": None}, TARGET, "no mask token id"),
        ({"ptd_token_id": 100}, TARGET, "outside the target vocabulary"),
        ({"target_hidden_size": 32}, TARGET, "expects target hidden size 32"),
        ({}, TargetSpec("t", 64, 120, 6), "has vocab_size 100 but target 't' has 120"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 6]}, TARGET, "layers 0..5"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 1, 3]}, TARGET, "with repeats"),
        ({"eagle_aux_hidden_state_layer_ids": None}, TargetSpec("t", 64, 100, 2), "default"),
    ],
)
def test_incompatibilities_are_named_with_a_fix(tmp_path, overrides, target, message):
    spec = read_drafter(str(write_drafter(tmp_path / "d", native_config(**overrides))))
    problems = check_drafter_for_target(spec, target)
    assert any(message in p for p in problems), problems
    assert all("Fix:" in p and "\n" not in p for p in problems)


def test_missing_mask_hidden_is_named(tmp_path):
    path = write_drafter(tmp_path / "d", native_config(), {"fc.weight": torch.zeros(64, 192)})
    problems = check_drafter_for_target(read_drafter(str(path)), TARGET)
    assert any("no 'mask_hidden' weight" in p for p in problems)


def test_paths_that_are_not_checkpoints(tmp_path):
    with pytest.raises(DrafterConfigError, match="does not exist"):
        read_drafter(str(tmp_path / "missing"))
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(DrafterConfigError, match="is a file, not a checkpoint directory"):
        read_drafter(str(tmp_path / "file.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafterConfigError, match=r"has no config\.json"):
        read_drafter(str(tmp_path / "empty"))


def test_truncated_safetensors_is_detected(tmp_path):
    path = write_drafter(tmp_path / "d", native_config())
    weights = path / "model.safetensors"
    assert read_safetensors_shapes(weights)["fc.weight"] == (64, 192)
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(DrafterConfigError, match="truncated"):
        read_drafter(str(path))


def test_invalid_json_is_reported(tmp_path):
    path = write_drafter(tmp_path / "d", native_config())
    (path / "config.json").write_text("{not json")
    with pytest.raises(DrafterConfigError, match="is not valid JSON"):
        read_drafter(str(path))


@pytest.mark.parametrize("k", [0, -1, 33, 1.5, "4", True])
def test_k_must_be_an_integer_in_range(k):
    with pytest.raises(DrafterConfigError):
        validate_num_speculative_tokens(k)


@pytest.mark.parametrize("k", [1, 7, 32])
def test_k_in_range_is_accepted(k):
    assert validate_num_speculative_tokens(k) == k


def test_translation_to_vllm_terms(tmp_path):
    path = str(write_drafter(tmp_path / "d", native_config()))
    request = {"method": "peagle", "model": path, "num_speculative_tokens": 5}
    translated, settings = to_vllm_speculative_config(request, TARGET)
    assert translated == {
        "method": "eagle3",
        "model": path,
        "num_speculative_tokens": 5,
        "parallel_drafting": True,
        "disable_eagle_block_drop": True,
    }
    assert settings["num_speculative_tokens"] == 5 and settings["layout"] == "native"


def test_trained_k_is_the_default(tmp_path):
    path = str(write_drafter(tmp_path / "d", speculators_config(k=6)))
    translated, _ = to_vllm_speculative_config({"method": "peagle", "model": path}, TARGET)
    assert translated["num_speculative_tokens"] == 6


def test_requests_recognised_as_peagle(tmp_path):
    peagle = str(write_drafter(tmp_path / "p", speculators_config()))
    eagle3 = str(write_drafter(tmp_path / "e", native_config(ptd_token_id=None)))
    assert is_peagle_request({"method": "peagle", "model": "anything"})
    assert is_peagle_request({"model": peagle, "num_speculative_tokens": 4})
    assert not is_peagle_request({"model": eagle3, "num_speculative_tokens": 4})
    assert not is_peagle_request({"method": "eagle3", "model": peagle})
    assert not is_peagle_request({"method": "ngram", "num_speculative_tokens": 3})


@pytest.mark.parametrize(
    ("request_overrides", "message"),
    [
        ({"parallel_drafting": False}, "always drafts in parallel"),
        ({"disable_padded_drafter_batch": True}, "padded drafter batch"),
        ({"model": None}, "needs 'model'"),
    ],
)
def test_contradictory_requests(tmp_path, request_overrides, message):
    path = str(write_drafter(tmp_path / "d", native_config()))
    request = {"method": "peagle", "model": path, "num_speculative_tokens": 4}
    request.update(request_overrides)
    with pytest.raises(DrafterConfigError, match=message):
        to_vllm_speculative_config(request, TARGET)


def test_last_cached_block_kept_unless_asked_or_unknown_to_vllm(tmp_path):
    path = str(write_drafter(tmp_path / "d", native_config()))
    request = {"method": "peagle", "model": path, "num_speculative_tokens": 4}
    keep = "disable_eagle_block_drop"
    translated, _ = to_vllm_speculative_config({**request, keep: False}, TARGET)
    assert translated[keep] is False
    vllm_keys = {"method", "model", "num_speculative_tokens", "parallel_drafting"}
    translated, _ = to_vllm_speculative_config(request, TARGET, known_keys=vllm_keys)
    assert keep not in translated
    translated, _ = to_vllm_speculative_config(request, TARGET, known_keys=vllm_keys | {keep})
    assert translated[keep] is True
