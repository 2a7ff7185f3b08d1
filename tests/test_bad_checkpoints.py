"""Each unservable drafter fails at engine start-up with one line naming problem and fix."""

import pytest

from tests.drafter_edits import broken_copy, drop_keys, set_keys
from tests.engines import peagle_spec, start_engine
from vllm_peagle.config import DrafterConfigError

pytestmark = pytest.mark.engine

MASK_KEYS = ("ptd_token_id", "mask_token_id", "pard_token")

CASES = {
    "no-mask-hidden": ({"drop_weights": ("mask_hidden",)}, "no 'mask_hidden' weight"),
    "no-mask-token": ({"edit_config": drop_keys(*MASK_KEYS)}, "no mask token id"),
    "hidden-size-mismatch": (
        {"edit_config": set_keys(target_hidden_size=384)},
        "expects target hidden size 384",
    ),
    "vocab-mismatch": ({"edit_config": set_keys(vocab_size=999)}, "has vocab_size 999"),
    "aux-layer-out-of-range": (
        {"edit_config": set_keys(eagle_aux_hidden_state_layer_ids=[1, 2, 40])},
        "fuses target layers",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_drafter_fails_at_startup(case, local_models, tmp_path):
    edits, message = CASES[case]
    drafter = broken_copy(local_models.peagle_native, tmp_path / case, **edits)
    spec = peagle_spec(drafter, 4)
    with pytest.raises(DrafterConfigError, match=message) as info:
        start_engine(local_models.target, spec)
    text = str(info.value)
    assert "\n" not in text and "Fix:" in text


@pytest.mark.parametrize("k", [0, 33, -1])
def test_k_outside_supported_range(k, local_models):
    spec = {
        "method": "peagle",
        "model": str(local_models.peagle_native),
        "num_speculative_tokens": k,
    }
    with pytest.raises(DrafterConfigError, match=r"outside 1\.\.32"):
        start_engine(local_models.target, spec)


def test_missing_path(local_models, tmp_path):
    spec = {"method": "peagle", "model": str(tmp_path / "nowhere"), "num_speculative_tokens": 4}
    with pytest.raises(DrafterConfigError, match="does not exist"):
        start_engine(local_models.target, spec)
