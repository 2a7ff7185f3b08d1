"""Property-based tests of the drafter config normaliser and the checks around it.

Whatever JSON a checkpoint or a user hands us, the result is a valid spec or a
:class:`DrafterConfigError` with one line naming the problem and the fix: never a KeyError,
TypeError, AttributeError or IndexError from deep inside.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_peagle.config import (
    MAX_SPECULATIVE_TOKENS,
    DrafterConfigError,
    DrafterSpec,
    TargetSpec,
    check_drafter_for_target,
    is_peagle_config,
    normalise_drafter_config,
    read_safetensors_shapes,
    to_vllm_speculative_config,
)

TARGET = TargetSpec(name="t", hidden_size=64, vocab_size=100, num_hidden_layers=6)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True),
    st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

# Values near the valid ones hit the deeper checks more often than arbitrary JSON.
small_ints = st.integers(min_value=-3, max_value=300)
field_values = st.one_of(json_values, small_ints, st.lists(small_ints, max_size=5))
DRAFTER_KEYS = (
    "architectures",
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "draft_vocab_size",
    "target_hidden_size",
    "ptd_token_id",
    "mask_token_id",
    "pard_token",
    "eagle_aux_hidden_state_layer_ids",
    "eagle_config",
    "speculators_model_type",
    "transformer_layer_config",
    "speculators_config",
)


def near_valid_config() -> st.SearchStrategy[dict]:
    base = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 64,
        "vocab_size": 100,
        "num_hidden_layers": 1,
        "target_hidden_size": 64,
        "ptd_token_id": 3,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
    }
    speculators = {
        "speculators_model_type": "peagle",
        "transformer_layer_config": {"hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 1},
        "mask_token_id": 3,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 4}]},
    }
    edits = st.dictionaries(st.sampled_from(DRAFTER_KEYS), field_values, max_size=4)
    layer_edits = st.dictionaries(st.sampled_from(DRAFTER_KEYS), field_values, max_size=2)

    def build(start: dict, top: dict, layer: dict, drop: list[str]) -> dict:
        config = json.loads(json.dumps(start))
        config.update(top)
        if isinstance(config.get("transformer_layer_config"), dict):
            config["transformer_layer_config"].update(layer)
        for key in drop:
            config.pop(key, None)
        return config

    return st.builds(
        build,
        st.sampled_from([base, speculators]),
        edits,
        layer_edits,
        st.lists(st.sampled_from(DRAFTER_KEYS), max_size=3),
    )


shapes = st.lists(st.integers(min_value=0, max_value=1000), max_size=3).map(tuple)
weight_shapes = st.dictionaries(
    st.sampled_from(["mask_hidden", "fc.weight", "model.fc.weight", "norm.weight", "x"]),
    shapes,
    max_size=4,
)


def assert_clear(err: DrafterConfigError) -> None:
    text = str(err)
    assert text and "\n" not in text and "Fix" in text, text


def assert_valid(spec: DrafterSpec) -> None:
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        value = getattr(spec, field)
        assert isinstance(value, int) and not isinstance(value, bool) and value > 0, field
    for field in ("target_hidden_size", "draft_vocab_size"):
        value = getattr(spec, field)
        assert isinstance(value, int) and value > 0, field
    assert spec.mask_token_id is None or isinstance(spec.mask_token_id, int)
    assert spec.aux_layer_ids is None or all(isinstance(i, int) for i in spec.aux_layer_ids)
    k = spec.trained_num_speculative_tokens
    assert k is None or (isinstance(k, int) and k > 0)


@pytest.mark.parametrize("source", ["arbitrary", "near-valid"])
def test_normaliser_returns_a_valid_spec_or_our_error(source):
    strategy = (
        st.dictionaries(st.text(max_size=8), json_values)
        if source == "arbitrary"
        else near_valid_config()
    )

    @FUZZ
    @given(config=strategy | json_values, weights=weight_shapes)
    def check(config, weights):
        try:
            spec = normalise_drafter_config(config, weights, path="fuzz")
        except DrafterConfigError as err:
            assert_clear(err)
            return
        assert_valid(spec)
        # Whatever was accepted can be checked against a target without crashing.
        for problem in check_drafter_for_target(spec, TARGET):
            assert "\n" not in problem and "Fix:" in problem
        is_peagle_config(config)

    check()


@FUZZ
@given(config=json_values | near_valid_config())
def test_peagle_detection_never_crashes(config):
    assert is_peagle_config(config) in (True, False)


@FUZZ
@given(
    config=json_values
    | st.dictionaries(
        st.sampled_from(["text_config", "hidden_size", "vocab_size", "num_hidden_layers"]),
        field_values,
    )
)
def test_target_config_is_read_or_refused_clearly(config):
    try:
        spec = TargetSpec.from_dict(config, "fuzz-target")
    except DrafterConfigError as err:
        assert_clear(err)
        return
    assert min(spec.hidden_size, spec.vocab_size, spec.num_hidden_layers) > 0


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("fuzz") / "drafter"
    path.mkdir()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 64,
        "vocab_size": 100,
        "num_hidden_layers": 1,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "ptd_token_id": 3,
    }
    (path / "config.json").write_text(json.dumps(config))
    save_file({"mask_hidden": torch.zeros(1, 1, 192)}, str(path / "model.safetensors"))
    return path


request_keys = st.sampled_from(
    [
        "method",
        "model",
        "num_speculative_tokens",
        "parallel_drafting",
        "disable_padded_drafter_batch",
        "draft_tensor_parallel_size",
        "bogus",
    ]
)


@FUZZ
@given(request=st.dictionaries(request_keys, field_values, max_size=5), keep_model=st.booleans())
def test_speculative_config_translation_never_crashes(drafter_dir, request, keep_model):
    request = {"method": "peagle", **request}
    if keep_model:
        request["model"] = str(drafter_dir)
    known = {
        "method",
        "model",
        "num_speculative_tokens",
        "parallel_drafting",
        "disable_padded_drafter_batch",
        "draft_tensor_parallel_size",
    }
    try:
        translated, settings_ = to_vllm_speculative_config(request, TARGET, known_keys=known)
    except DrafterConfigError as err:
        assert_clear(err)
        return
    assert translated["method"] == "eagle3" and translated["parallel_drafting"] is True
    # The fuzzed drafter records no trained K, so only an explicit, valid K gets through.
    assert settings_["num_speculative_tokens"] == request["num_speculative_tokens"]
    k = request["num_speculative_tokens"]
    assert type(k) is int, k  # bool is an int to isinstance, not to the validator
    assert k in range(1, MAX_SPECULATIVE_TOKENS + 1), k


def safetensors_bytes(header: object, data_len: int) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * data_len


header_entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(st.sampled_from(["F32", "BF16", "I64", "BOOL"]), json_values),
        "shape": st.one_of(st.lists(st.integers(-2, 8), max_size=3), json_values),
        "data_offsets": st.one_of(st.lists(st.integers(-4, 64), max_size=3), json_values),
    },
)


@FUZZ
@given(
    header=st.one_of(
        json_values, st.dictionaries(st.sampled_from(["a", "b", "__metadata__"]), header_entries)
    ),
    data_len=st.integers(0, 64),
    garbage=st.binary(max_size=24),
    use_garbage=st.booleans(),
)
def test_safetensors_header_is_read_or_refused_clearly(
    tmp_path_factory, header, data_len, garbage, use_garbage
):
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    path.write_bytes(garbage if use_garbage else safetensors_bytes(header, data_len))
    try:
        shapes = read_safetensors_shapes(path)
    except DrafterConfigError as err:
        assert_clear(err)
        return
    assert all(isinstance(s, tuple) and all(d >= 0 for d in s) for s in shapes.values())
