"""The drafter module: names, single-pass drafting, masks, vLLM/HF-equivalent arithmetic."""

from __future__ import annotations

import pytest
import torch

from vllm_peagle.modeling import (
    KVCache,
    PEagleDrafter,
    PEagleDrafterConfig,
    RMSNorm,
    draft_parallel,
    prepare_parallel_inputs,
)

VOCAB, MASK = 96, 95


def make_drafter(seed: int = 0, **overrides: object) -> PEagleDrafter:
    torch.manual_seed(seed)
    kwargs: dict = dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=VOCAB,
        target_hidden_size=48,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        mask_token_id=MASK,
        rope_theta=500.0,
    )
    kwargs.update(overrides)
    drafter = PEagleDrafter(PEagleDrafterConfig(**kwargs)).eval()
    with torch.no_grad():  # non-trivial norm weights so norm mistakes show up
        for p in drafter.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return drafter


def layer_names(prefix: str, first: bool) -> set[str]:
    names = {f"{prefix}.self_attn.{p}_proj.weight" for p in "qkvo"}
    names |= {f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    norms = ["input_layernorm", "post_attention_layernorm"] + (["hidden_norm"] if first else [])
    return names | {f"{prefix}.{n}.weight" for n in norms}


def test_state_dict_uses_checkpoint_names() -> None:
    drafter = make_drafter(draft_vocab_size=40)
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight"}
    expected |= {"mask_hidden", "d2t"} | layer_names("midlayer", True)
    expected |= layer_names("layers.1", False) | layer_names("layers.2", False)
    assert set(drafter.state_dict()) == expected
    assert drafter.mask_hidden is not None and drafter.mask_hidden.shape == (1, 1, 3 * 48)
    assert drafter.midlayer.self_attn.q_proj.weight.shape == (64, 128)  # 2H-wide layer 0
    assert drafter.layers["1"].self_attn.q_proj.weight.shape == (64, 64)


def test_optional_modules_follow_config() -> None:
    plain = make_drafter(mask_token_id=None)
    assert "mask_hidden" not in plain.state_dict() and "d2t" not in plain.state_dict()
    normed = make_drafter(norm_before_fc=True, fc_norm=True, attention_bias=True)
    names = set(normed.state_dict())
    assert {"input_norm.weight", "fc_norm.0.weight", "fc_norm.2.weight"} <= names
    assert "midlayer.self_attn.q_proj.bias" in names and "layers.1.self_attn.o_proj.bias" in names


def test_rmsnorm_residual_semantics() -> None:
    norm = RMSNorm(8, 1e-6)
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    out, new_res = norm.add_and_norm(x, r)
    torch.testing.assert_close(new_res, x + r)
    torch.testing.assert_close(out, norm(x + r))


def _inputs(drafter: PEagleDrafter, n: int = 9, k: int = 5, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB - 1, (n,), generator=gen)
    aux = torch.randn(n, drafter.config.fc_input_size, generator=gen)
    return tokens, aux, prepare_parallel_inputs(drafter, tokens, aux, 7, k, start_position=3)


def test_parallel_layout_matches_vllm_kernel() -> None:
    drafter = make_drafter()
    tokens, aux, inp = _inputs(drafter, n=6, k=4)
    # Slot j: token x_{j+1} with hidden a_j at position start+j; then bonus, then masks.
    assert inp.input_ids.tolist() == [*tokens[1:].tolist(), 7, MASK, MASK, MASK]
    assert inp.positions.tolist() == list(range(3, 3 + 9))
    assert inp.sample_index.tolist() == [5, 6, 7, 8]
    with torch.no_grad():
        torch.testing.assert_close(inp.hidden_states[:6], drafter.combine_hidden_states(aux))
        mask_fc = drafter.fc(drafter.mask_hidden.view(1, -1))[0]
        torch.testing.assert_close(inp.hidden_states[6:], mask_fc.expand(3, -1))


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_single_pass_equals_incremental(norm_before_residual: bool) -> None:
    drafter = make_drafter(norm_before_residual=norm_before_residual, fc_norm=True)
    *_, inp = _inputs(drafter)
    with torch.no_grad():
        full, full_pre = drafter(inp.input_ids, inp.positions, inp.hidden_states)
        cache = drafter.new_cache()
        steps = [
            drafter(
                inp.input_ids[i : i + 1],
                inp.positions[i : i + 1],
                inp.hidden_states[i : i + 1],
                cache=cache,
            )
            for i in range(len(inp.input_ids))
        ]
    torch.testing.assert_close(torch.cat([s[0] for s in steps]), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([s[1] for s in steps]), full_pre, atol=1e-5, rtol=1e-5)
    assert cache.length == len(inp.input_ids)


def test_cached_context_then_k_slots_equals_single_pass() -> None:
    # vLLM's shape of work: the context is already in the drafter KV cache and the
    # K new slots (bonus + masks) run in one forward on top of it.
    drafter = make_drafter()
    _, _, inp = _inputs(drafter)
    n_ctx = int(inp.sample_index[0])
    with torch.no_grad():
        full, _ = drafter(inp.input_ids, inp.positions, inp.hidden_states)
        cache = drafter.new_cache()
        drafter(
            inp.input_ids[:n_ctx], inp.positions[:n_ctx], inp.hidden_states[:n_ctx], cache=cache
        )
        tail, _ = drafter(
            inp.input_ids[n_ctx:], inp.positions[n_ctx:], inp.hidden_states[n_ctx:], cache=cache
        )
    torch.testing.assert_close(tail, full[n_ctx:], atol=1e-5, rtol=1e-5)


def test_draft_parallel_is_one_forward() -> None:
    drafter = make_drafter()
    tokens, aux, inp = _inputs(drafter)
    calls = []
    handle = drafter.register_forward_hook(lambda *a: calls.append(1))
    ids, logits = draft_parallel(drafter, tokens, aux, 7, 5, start_position=3)
    handle.remove()
    assert len(calls) == 1 and ids.shape == (5,) and logits.shape == (5, VOCAB)
    with torch.no_grad():
        hidden, _ = drafter(inp.input_ids, inp.positions, inp.hidden_states)
        torch.testing.assert_close(logits, drafter.compute_logits(hidden[inp.sample_index]))
    with pytest.raises(ValueError, match="one token"):
        draft_parallel(make_drafter(mask_token_id=None), tokens, aux, 7, 2)


def test_explicit_masks() -> None:
    drafter = make_drafter()
    _, _, inp = _inputs(drafter)
    t = len(inp.input_ids)
    with torch.no_grad():
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        ref, _ = drafter(inp.input_ids, inp.positions, inp.hidden_states)
        out, _ = drafter(inp.input_ids, inp.positions, inp.hidden_states, attention_mask=causal)
        torch.testing.assert_close(out, ref)
        # A block-diagonal mask must equal running the two blocks separately.
        cut = 6
        block = causal.clone()
        block[cut:, :cut] = False
        out, _ = drafter(inp.input_ids, inp.positions, inp.hidden_states, attention_mask=block)
        tail, _ = drafter(inp.input_ids[cut:], inp.positions[cut:], inp.hidden_states[cut:])
        torch.testing.assert_close(out[cut:], tail, atol=1e-5, rtol=1e-5)
        # Batched [B, T, S] masks and inputs.
        both = torch.stack([causal, block])
        batched, _ = drafter(
            inp.input_ids.expand(2, -1),
            inp.positions.expand(2, -1),
            inp.hidden_states.expand(2, -1, -1),
            attention_mask=both,
        )
        torch.testing.assert_close(batched[0], ref)
        torch.testing.assert_close(batched[1, cut:], tail, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError):
        drafter(inp.input_ids, inp.positions, inp.hidden_states, attention_mask=causal.float())


def test_compute_logits_scatters_draft_vocab() -> None:
    drafter = make_drafter(draft_vocab_size=10)
    assert drafter.d2t is not None
    drafter.d2t.copy_(torch.tensor([0, 0, 3, 3, 3, 10, 20, 30, 40, 50]))
    targets = torch.arange(10) + drafter.d2t
    h = torch.randn(4, 64)
    with torch.no_grad():
        full = drafter.compute_logits(h)
        torch.testing.assert_close(full[:, targets], drafter.lm_head(h))
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[targets] = False
    assert torch.isneginf(full[:, others]).all()


def test_later_layers_match_hf_llama() -> None:
    # Layers >= 1 are plain Llama layers; HF Llama is the reference vLLM's Llama
    # matches, so this pins RoPE (neox), GQA, scaling and the residual stream.
    transformers = pytest.importorskip("transformers")
    drafter = make_drafter(num_hidden_layers=3)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        attn_implementation="sdpa",
    )
    hf = transformers.LlamaModel(cfg).eval()
    ours = {
        f"layers.{i - 1}.{k}": v
        for i in (1, 2)
        for k, v in drafter.layers[str(i)].state_dict().items()
    }
    ours["norm.weight"] = drafter.norm.weight
    missing, _ = hf.load_state_dict(ours, strict=False)
    assert missing == ["embed_tokens.weight"]
    x, pos = torch.randn(1, 7, 64), torch.arange(5, 12)[None]
    with torch.no_grad():
        ref = hf(inputs_embeds=x, position_ids=pos).last_hidden_state
        mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
        h, res = torch.zeros_like(x), x
        for i in (1, 2):
            h, res = drafter.layers[str(i)](x, h, res, pos, mask, None)
        out, _ = drafter.norm.add_and_norm(h, res)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_kv_cache_and_shape_errors() -> None:
    drafter = make_drafter()
    assert isinstance(drafter.new_cache(), KVCache) and drafter.new_cache().length == 0
    with pytest.raises(ValueError, match="fused"):
        drafter(torch.tensor([1]), torch.tensor([0]), torch.randn(1, 144))
    with pytest.raises(ValueError):
        PEagleDrafterConfig(64, 1, 4, 3, 96, VOCAB)  # kv heads must divide heads
