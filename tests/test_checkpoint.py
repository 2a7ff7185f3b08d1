"""Checkpoint layouts: round trips, on-disk names vLLM expects, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_peagle.checkpoint import (
    atomic_directory,
    config_from_dict,
    load_drafter,
    native_config_dict,
    read_drafter_config,
    save_drafter,
)
from vllm_peagle.modeling import PEagleDrafter, PEagleDrafterConfig, draft_parallel

# Parameter names of vLLM 0.32's Eagle3LlamaForCausalLM for a 2-layer drafter with a
# reduced draft vocab, read from a live engine (uniproc) that loaded such a drafter.
# layers.1.hidden_norm exists in vLLM but is never used, so checkpoints omit it.
VLLM_PARAMS_2_LAYERS = {
    "lm_head.weight",
    "draft_id_to_target_id",
    "model.embed_tokens.weight",
    "model.fc.weight",
    "model.norm.weight",
    *(
        f"model.layers.{i}.{name}.weight"
        for i in (0, 1)
        for name in (
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
            "hidden_norm",
        )
    ),
}
VLLM_UNUSED = {"model.layers.1.hidden_norm.weight"}
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj"}
STACKED |= {".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def vllm_param_name(disk_name: str) -> str | None:
    """What ``Eagle3LlamaForCausalLM.load_weights`` turns an on-disk name into."""
    if disk_name == "mask_hidden":
        return None  # copied into a non-persistent buffer
    if disk_name == "d2t":
        return "draft_id_to_target_id"
    name = disk_name if "lm_head" in disk_name else "model." + disk_name
    name = name.replace("midlayer.", "layers.0.")
    for old, new in STACKED.items():
        name = name.replace(old, new)
    return name


def tiny_drafter(seed: int = 0, **overrides: object) -> PEagleDrafter:
    torch.manual_seed(seed)
    kwargs: dict = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=80,
        draft_vocab_size=50,
        target_hidden_size=24,
        eagle_aux_hidden_state_layer_ids=[1, 3, 5],
        mask_token_id=79,
    )
    kwargs.update(overrides)
    drafter = PEagleDrafter(PEagleDrafterConfig(**kwargs)).eval()
    if drafter.d2t is not None:
        drafter.d2t.copy_(torch.arange(drafter.d2t.numel()) % 7)
    return drafter


def drafts(drafter: PEagleDrafter) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 70, (6,), generator=gen)
    aux = torch.randn(6, drafter.config.fc_input_size, generator=gen)
    return draft_parallel(drafter, tokens, aux, 5, 4)[1]


@pytest.mark.parametrize("layout", ["native", "speculators"])
def test_round_trip(tmp_path: Path, layout: str) -> None:
    drafter = tiny_drafter(norm_before_residual=True)
    out = save_drafter(drafter, tmp_path / "d", layout=layout, verifier="/models/target")  # type: ignore[arg-type]
    loaded = load_drafter(out)
    assert loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    torch.testing.assert_close(drafts(loaded), drafts(drafter), rtol=0, atol=0)
    cfg, found = read_drafter_config(out)
    assert found == layout and cfg == drafter.config


def test_disk_names_are_what_vllm_loads(tmp_path: Path) -> None:
    save_drafter(tiny_drafter(), tmp_path / "d")
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert "mask_hidden" in names and "midlayer.hidden_norm.weight" in names
    mapped = {vllm_param_name(n) for n in names} - {None}
    assert mapped == VLLM_PARAMS_2_LAYERS - VLLM_UNUSED


@pytest.mark.slow
def test_disk_names_through_vllm_mapper(tmp_path: Path) -> None:
    # Same check through vLLM's own mapper (slow: importing the module loads vLLM).
    llama_eagle3 = pytest.importorskip("vllm.model_executor.models.llama_eagle3")
    save_drafter(tiny_drafter(), tmp_path / "d")
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    inner = [n for n in names if n not in ("mask_hidden", "d2t", "lm_head.weight")]
    mapped = {"model." + n for n in llama_eagle3.LlamaModel.hf_to_vllm_mapper.apply_list(inner)}
    assert (
        mapped | {"lm_head.weight", "draft_id_to_target_id"} == VLLM_PARAMS_2_LAYERS - VLLM_UNUSED
    )


def test_native_config_keys(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    save_drafter(tiny_drafter(), tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["model_type"] == "llama"
    assert raw["ptd_token_id"] == 79 and raw["hidden_act"] == "silu"
    assert raw["draft_vocab_size"] == 50 and raw["target_hidden_size"] == 24
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "d")
    assert hf.ptd_token_id == 79 and hf.num_hidden_layers == 2


def test_speculators_config_through_vllm(tmp_path: Path) -> None:
    base = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    save_drafter(
        tiny_drafter(fc_norm=True),
        tmp_path / "d",
        layout="speculators",
        num_speculative_tokens=6,
        verifier="/models/target",
    )
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "model_type" not in raw  # a top-level model_type would bypass speculators detection
    spec = base.SpeculatorsConfig.extract_vllm_speculative_config(raw)
    assert spec == {"method": "eagle3", "num_speculative_tokens": 6, "parallel_drafting": True}
    hf = base.SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    assert hf["architectures"] == ["PeagleLlamaForCausalLM"] and hf["pard_token"] == 79
    assert hf["hidden_act"] == "silu" and hf["fc_norm"] is True
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and hf["draft_vocab_size"] == 50
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "/models/target"


def test_plain_eagle3_and_full_vocab(tmp_path: Path) -> None:
    drafter = tiny_drafter(mask_token_id=None, draft_vocab_size=None)
    save_drafter(drafter, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "ptd_token_id" not in raw
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert not names & {"mask_hidden", "d2t"}
    assert load_drafter(tmp_path / "d").config.is_parallel is False
    with pytest.raises(ValueError, match="mask token"):
        save_drafter(drafter, tmp_path / "s", layout="speculators", verifier="x")


def test_upstream_name_variants(tmp_path: Path) -> None:
    drafter = tiny_drafter()
    save_drafter(drafter, tmp_path / "d")
    f = tmp_path / "d" / "model.safetensors"
    state = load_file(str(f))
    state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    state["t2d"] = torch.ones(80, dtype=torch.bool)
    state["mask_hidden"] = state["mask_hidden"].view(1, -1)
    save_file(state, str(f))
    torch.testing.assert_close(drafts(load_drafter(tmp_path / "d")), drafts(drafter))
    del state["mask_hidden"]
    save_file(state, str(f))
    with pytest.raises(ValueError, match="mask_hidden"):
        load_drafter(tmp_path / "d")


def test_tokenizer_files_copied(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    save_drafter(tiny_drafter(), tmp_path / "d", tokenizer_dir=tok)
    assert (tmp_path / "d" / "tokenizer.json").is_file()
    assert (tmp_path / "d" / "tokenizer_config.json").is_file()


def test_atomic_directory_keeps_old_on_failure(tmp_path: Path) -> None:
    save_drafter(tiny_drafter(), tmp_path / "d")
    before = (tmp_path / "d" / "config.json").read_text()
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "d") as stage:
        (stage / "config.json").write_text("partial")
        raise RuntimeError("interrupted")
    assert (tmp_path / "d" / "config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no staging leftovers
    save_drafter(tiny_drafter(seed=1), tmp_path / "d")  # replacing an existing dir works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_config_parsing_defaults() -> None:
    raw = native_config_dict(tiny_drafter().config)
    del raw["eagle_aux_hidden_state_layer_ids"], raw["eagle_config"], raw["ptd_token_id"]
    raw["pard_token"] = 7
    cfg = config_from_dict(raw)
    assert cfg.mask_token_id == 7 and cfg.eagle_aux_hidden_state_layer_ids is None
    assert cfg.num_aux_hidden_states == 3
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1.0}
    with pytest.raises(NotImplementedError):
        config_from_dict(raw)
