"""COD sampling and the flattened training mask equal what the drafter sees inside vLLM."""

from __future__ import annotations

import pytest
import torch

from tests.small_drafters import small_drafter
from vllm_peagle.modeling import PEagleDrafter, prepare_parallel_inputs
from vllm_peagle.training.cod import (
    CodConfig,
    attention_mask,
    cod_sample,
    full_layout,
    inference_rollout_order,
    pack_layouts,
)
from vllm_peagle.training.step import flat_forward

VOCAB, MASK = 80, 79


def make_drafter(parallel: bool = True, seed: int = 0) -> PEagleDrafter:
    torch.manual_seed(seed)
    drafter = small_drafter(VOCAB, MASK if parallel else None).eval()
    with torch.no_grad():  # non-trivial norms so a wrong input order shows up
        for p in drafter.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return drafter


def test_worked_example_structure() -> None:
    label = torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.bool)
    lay = cod_sample(label, CodConfig(num_depths=4), torch.Generator().manual_seed(0))
    assert lay.depth_counts == [5, 3, 2, 1]
    assert lay.anchor[:5].tolist() == [0, 1, 2, 3, 4]
    assert lay.supervised[:5].tolist() == [False, True, True, True, True]
    assert torch.equal(lay.positions, lay.anchor + lay.depth)
    assert int(lay.label_index.max()) <= 5


@pytest.mark.parametrize("seed", range(5))
def test_cod_counts_nesting_and_labels(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    length = 60
    label = torch.rand(length, generator=gen) > 0.3
    cfg = CodConfig(num_depths=8, ratio=0.7, min_ratio=0.2)
    lay = cod_sample(label, cfg, gen)
    n = int(label[1:].sum())
    counts = lay.depth_counts
    assert counts[0] == length - 1  # every anchor is context
    for d in range(1, len(counts)):
        assert counts[d] <= round(n * cfg.keep_ratio(d))
        here = set(lay.anchor[lay.depth == d].tolist())
        assert here <= set(lay.anchor[lay.depth == d - 1].tolist()), "rollouts have no holes"
    deep = lay.depth > 0
    assert label[lay.label_index[deep]].all(), "deep elements are always supervised labels"
    assert torch.equal(lay.supervised[~deep], label[1:])
    again = cod_sample(label, cfg, torch.Generator().manual_seed(seed))
    again2 = cod_sample(label, cfg, torch.Generator().manual_seed(seed))
    assert torch.equal(again.anchor, again2.anchor), "seeded sampling is reproducible"


def test_min_ratio_floor() -> None:
    gen = torch.Generator().manual_seed(0)
    counts = cod_sample(torch.ones(201, dtype=torch.bool), CodConfig(8, 0.5, 0.2), gen).depth_counts
    assert counts[:4] == [200, 100, 50, 40]  # 200 * max(0.5**d, 0.2)
    # Deeper groups want 40 too but may lose the few rollouts that run off the end.
    assert all(36 <= c <= 40 for c in counts[4:]) and len(counts) == 8


@pytest.mark.parametrize("anchors", [None, [0, 3, 7]])
def test_flattened_mask_equals_inference_causal_layout(anchors) -> None:
    length, depths = 12, 5
    lay = full_layout(length, depths, anchors)
    mask = attention_mask(lay.anchor, lay.depth)
    for j in sorted(set(lay.anchor[lay.depth > 0].tolist())):
        order = inference_rollout_order(lay, j)
        # vLLM's layout [context 0..j-1 | sampled slot j | masks]: consecutive positions.
        assert lay.positions[order].tolist() == list(range(len(order)))
        causal = torch.ones(len(order), len(order), dtype=torch.bool).tril()
        sub = mask[order][:, order]
        for q in range(len(order)):  # position by position
            assert sub[q].tolist() == causal[q].tolist(), f"anchor {j}, slot {q}"
        # ...and the rollout's rows see nothing outside that layout.
        outside = torch.ones(len(lay), dtype=torch.bool)
        outside[order] = False
        assert not mask[order][:, outside].any()


def _random_sequence(drafter: PEagleDrafter, length: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB - 1, (length,), generator=gen)
    aux = torch.randn(length, drafter.config.fc_input_size, generator=gen)
    return tokens, aux


def test_drafter_under_flat_mask_equals_vllm_single_pass() -> None:
    drafter = make_drafter()
    length, k = 14, 5
    tokens, aux = _random_sequence(drafter, length)
    gen = torch.Generator().manual_seed(3)
    lay = cod_sample(torch.ones(length, dtype=torch.bool), CodConfig(k, 0.8, 0.3), gen)
    packed = pack_layouts([lay])
    with torch.no_grad():
        flat = flat_forward(drafter, tokens[None], aux[None], packed, "peagle")[0]
        checked = 0
        for j in sorted(set(lay.anchor[lay.depth > 0].tolist())):
            depth_max = int(lay.depth[lay.anchor == j].max())
            # What vLLM runs after the target accepted x_0..x_j and sampled x_{j+1}.
            inp = prepare_parallel_inputs(
                drafter, tokens[: j + 1], aux[: j + 1], int(tokens[j + 1]), depth_max + 1
            )
            ref, _ = drafter(inp.input_ids, inp.positions, inp.hidden_states)
            for d in range(depth_max + 1):
                col = int(((packed.anchor[0] == j) & (packed.depth[0] == d)).nonzero())
                torch.testing.assert_close(
                    flat[col], ref[inp.sample_index[d]], atol=1e-5, rtol=1e-5
                )
                checked += 1
    assert checked > length


def test_ttt_flat_forward_equals_sequential_eagle3_drafting() -> None:
    drafter = make_drafter(parallel=False)
    length, k = 12, 4
    tokens, aux = _random_sequence(drafter, length, seed=5)
    lay = full_layout(length, k, anchors=[2, 5, 6])
    packed = pack_layouts([lay])
    with torch.no_grad():
        flat = flat_forward(drafter, tokens[None], aux[None], packed, "eagle3")[0]
        for j in (2, 5, 6):
            # vLLM's sequential drafting, fed the data tokens (what an accepted path sees).
            inp = prepare_parallel_inputs(
                drafter, tokens[: j + 1], aux[: j + 1], int(tokens[j + 1]), 1
            )
            cache = drafter.new_cache()
            out, carried = drafter(inp.input_ids, inp.positions, inp.hidden_states, cache=cache)
            for d in range(k):
                if j + d + 1 > length - 1:
                    break
                col = int(((packed.anchor[0] == j) & (packed.depth[0] == d)).nonzero())
                torch.testing.assert_close(flat[col], out[-1], atol=1e-5, rtol=1e-5)
                if j + d + 2 <= length - 1:
                    out, carried = drafter(
                        tokens[j + d + 2 : j + d + 3],
                        torch.tensor([j + d + 1]),
                        carried[-1:],
                        cache=cache,
                    )


def test_pack_layouts_aligns_depth_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    lays = [cod_sample(torch.ones(n, dtype=torch.bool), CodConfig(4), gen) for n in (9, 15, 4)]
    packed = pack_layouts(lays)
    starts = packed.block_starts
    for d in range(packed.num_depths):
        assert (packed.depth[:, starts[d] : starts[d + 1]] == d).all()
    for row, lay in enumerate(lays):
        assert int(packed.valid[row].sum()) == len(lay)
        got = sorted(
            zip(
                packed.anchor[row][packed.valid[row]].tolist(),
                packed.depth[row][packed.valid[row]].tolist(),
                strict=True,
            )
        )
        assert got == sorted(zip(lay.anchor.tolist(), lay.depth.tolist(), strict=True))
        for col in (packed.depth[row] > 0).nonzero().flatten().tolist():
            if packed.valid[row, col]:
                par = int(packed.parent[row, col])
                assert int(packed.anchor[row, par]) == int(packed.anchor[row, col])
                assert int(packed.depth[row, par]) == int(packed.depth[row, col]) - 1
    mask = packed.mask()
    pad = ~packed.valid
    # Padding is invisible to real rows and sees only itself (no empty softmax rows).
    assert not (mask & pad[:, None, :] & packed.valid[:, :, None]).any()
    assert mask.any(-1).all()
