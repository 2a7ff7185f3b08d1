"""The offline tiny-model builder: cache behaviour, determinism, quality of the target."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

import pytest
import torch

from vllm_peagle.checkpoint import load_drafter, read_drafter_config
from vllm_peagle.tiny_models import (
    MARKER,
    BuildSettings,
    LocalModels,
    build_key,
    ensure_local_models,
    stdlib_split,
)

MICRO = BuildSettings(
    max_files=6,
    vocab_size=400,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=96,
    seq_len=32,
    batch_size=2,
    train_steps=2,
    eval_windows=2,
    drafter_layers=2,
    aux_layer_ids=(0, 1, 2),
    eagle3_draft_vocab=128,
)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> LocalModels:
    return ensure_local_models(tmp_path_factory.mktemp("cache"), MICRO, progress=False)


def test_micro_build_layout(micro: LocalModels) -> None:
    for path in (micro.target, micro.tokenizer, micro.peagle_native, micro.peagle_speculators):
        assert (path / "config.json").is_file() or (path / "tokenizer.json").is_file(), path
    assert (micro.root / MARKER).is_file() and (micro.eagle3 / "model.safetensors").is_file()
    report = micro.load_report()
    assert report["ln_vocab"] == pytest.approx(math.log(report["vocab_size"]))
    assert math.isfinite(report["heldout_loss"])


def test_second_call_is_cached(micro: LocalModels) -> None:
    start = time.perf_counter()
    again = ensure_local_models(micro.root.parent, MICRO, progress=False)
    assert time.perf_counter() - start < 0.5 and again == micro


def test_drafters_match_target(micro: LocalModels) -> None:
    transformers = pytest.importorskip("transformers")
    target = transformers.AutoModelForCausalLM.from_pretrained(micro.target)
    tok = transformers.AutoTokenizer.from_pretrained(micro.tokenizer)
    mask_id = tok.convert_tokens_to_ids("<mask>")
    native, native_layout = read_drafter_config(micro.peagle_native)
    spec, spec_layout = read_drafter_config(micro.peagle_speculators)
    assert (native_layout, spec_layout) == ("native", "speculators")
    assert native == spec and native.mask_token_id == mask_id
    assert native.vocab_size == target.config.vocab_size
    assert native.target_hidden_size == target.config.hidden_size
    assert max(native.eagle_aux_hidden_state_layer_ids) <= target.config.num_hidden_layers
    raw = json.loads((micro.peagle_speculators / "config.json").read_text())
    assert Path(raw["speculators_config"]["verifier"]["name_or_path"]) == micro.target.resolve()
    drafter = load_drafter(micro.peagle_native)
    assert torch.equal(drafter.embed_tokens.weight, target.model.embed_tokens.weight)
    eagle3 = load_drafter(micro.eagle3)
    assert not eagle3.config.is_parallel and eagle3.d2t is not None
    keep = torch.arange(MICRO.eagle3_draft_vocab) + eagle3.d2t
    assert torch.equal(eagle3.lm_head.weight, target.lm_head.weight[keep])
    assert (micro.peagle_native / "tokenizer.json").is_file()


def test_build_is_deterministic(micro: LocalModels, tmp_path: Path) -> None:
    other = ensure_local_models(tmp_path, MICRO, progress=False)
    for rel in (
        "tokenizer/tokenizer.json",
        "target/model.safetensors",
        "peagle-native/model.safetensors",
        "eagle3/model.safetensors",
    ):
        assert digest(other.root / rel) == digest(micro.root / rel), rel


def test_interrupted_build_is_redone(tmp_path: Path) -> None:
    root = tmp_path / build_key(MICRO)
    (root / "target").mkdir(parents=True)
    (root / "target" / "junk").write_text("half-written")
    models = ensure_local_models(tmp_path, MICRO, progress=False)
    assert not (models.target / "junk").exists() and (models.root / MARKER).is_file()


def test_key_and_split() -> None:
    assert build_key(MICRO) != build_key(dataclasses.replace(MICRO, seed=1))
    held_in, held_out = stdlib_split(BuildSettings())
    assert held_out and not set(held_in) & set(held_out)
    assert stdlib_split(BuildSettings()) == (held_in, held_out)


@pytest.fixture(scope="module")
def full() -> LocalModels:
    return ensure_local_models()


@pytest.mark.slow
def test_full_target_learned_stdlib(full: LocalModels) -> None:
    report = full.load_report()
    assert report["heldout_loss"] < 0.6 * report["ln_vocab"], report


@pytest.mark.slow
def test_full_tokenizer_and_target_load(full: LocalModels) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(full.target)
    assert tok.is_fast and tok.mask_token == "<mask>"
    assert tok.convert_tokens_to_ids("<mask>") == full.load_report()["mask_token_id"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<s>") and chat.endswith("<|assistant|>\n")
    target = transformers.AutoModelForCausalLM.from_pretrained(full.target)
    ids = tok("def main(", return_tensors="pt").input_ids
    out = target.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
