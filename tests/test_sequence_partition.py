"""Sequence-partitioned training leaves exactly the gradients of one unpartitioned backward."""

from __future__ import annotations

import pytest
import torch

from tests.small_drafters import small_drafter
from vllm_peagle.modeling import PEagleDrafter
from vllm_peagle.training.cod import CodConfig, cod_sample, pack_layouts
from vllm_peagle.training.partition import partitioned_backward, segment_bounds
from vllm_peagle.training.step import Batch, drafter_loss_sum

VOCAB, MASK = 96, 95


def make_drafter(kind: str) -> PEagleDrafter:
    torch.manual_seed(0)
    drafter = small_drafter(VOCAB, MASK if kind == "peagle" else None)
    with torch.no_grad():  # non-trivial norms and a larger init: gradients of every kind
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn_like(p)) if p.dim() == 1 else p.mul_(5.0)
    return drafter


def random_batch(seed: int, lengths: list[int], num_depths: int) -> Batch:
    """Random sequences, aux states, target logits and COD layouts (prompt/response split)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.randint(0, MASK, (len(lengths), width), generator=gen)
    aux = torch.randn(len(lengths), width, 3 * 24, generator=gen)
    logits = 3 * torch.randn(len(lengths), width, VOCAB, generator=gen)
    layouts = []
    for n in lengths:
        label = torch.arange(n) + 1 >= int(torch.randint(1, n // 2, (), generator=gen))
        layouts.append(cod_sample(label, CodConfig(num_depths, 0.8, 0.3), gen))
    return Batch(tokens, aux, logits, pack_layouts(layouts))


def grads(drafter: PEagleDrafter) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def test_segment_bounds_cover_every_anchor_once() -> None:
    assert segment_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert segment_bounds(3, 5) == [(0, 3)]
    assert segment_bounds(0, 5) == []
    with pytest.raises(ValueError, match="segment_len"):
        segment_bounds(5, 0)


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
@pytest.mark.parametrize("seed", [0, 1])
def test_partitioned_gradients_equal_unpartitioned(kind: str, seed: int) -> None:
    """float32 throughout; allclose(rtol=1e-4, atol=1e-6) on every parameter gradient.

    The two computations run the same operations on the same numbers except that the
    partitioned one sums attention over a segment's keys in a different order and adds
    gradients segment by segment; that reorders float32 sums (relative error ~1e-7 per
    addition). The measured worst relative deviation is printed (pytest -s): ~1e-6.
    """
    torch.set_num_threads(1)
    lengths = [41, 29, 36]
    batch = random_batch(seed, lengths, num_depths=4)
    drafter = make_drafter(kind)
    loss, sums = drafter_loss_sum(drafter, batch, kind)
    n = float(sums[0].sum())
    (loss / n).backward()
    reference = grads(drafter)
    assert set(reference) >= {
        "fc.weight",
        "embed_tokens.weight",
        "midlayer.self_attn.q_proj.weight",
    }
    if kind == "peagle":
        assert "mask_hidden" in reference

    def call(fn, *args):
        return fn(drafter, *args)

    worst = 0.0
    # 40 anchors in the longest row: 1 segment, 2, 3, 6, and one anchor per segment.
    for segment_len in (64, 20, 14, 7, 1):
        drafter.zero_grad(set_to_none=True)
        total, part_sums = partitioned_backward(call, drafter, batch, kind, segment_len, n)
        assert torch.equal(part_sums[0], sums[0])  # same elements, each counted once
        torch.testing.assert_close(total, float(loss.detach()), rtol=1e-5, atol=1e-4)
        got = grads(drafter)
        assert got.keys() == reference.keys()
        for name, ref in reference.items():
            torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=1e-6, msg=name)
            scale = float(ref.abs().max())
            worst = max(worst, float((got[name] - ref).abs().max()) / max(scale, 1e-12))
    print(f"{kind} seed {seed}: worst relative gradient deviation {worst:.2e}")


def test_dropping_the_carried_gradient_is_detected() -> None:
    """The check above can fail: without the K/V gradient sent back from later segments
    (a naive 'detach the prefix'), the gradients differ."""
    batch = random_batch(3, [40], num_depths=3)
    drafter = make_drafter("peagle")
    loss, sums = drafter_loss_sum(drafter, batch, "peagle")
    (loss / float(sums[0].sum())).backward()
    reference = grads(drafter)
    drafter.zero_grad(set_to_none=True)

    def call(fn, *args):
        return fn(drafter, *args)

    # Segment length 1 with detached prefixes = every element blind to earlier K/V grads.
    from vllm_peagle.training import partition

    original = partition._prefixed_cache
    partition._prefixed_cache = lambda d, k, v: original(
        d, [x.detach() for x in k], [x.detach() for x in v]
    )
    try:
        partitioned_backward(call, drafter, batch, "peagle", 8, float(sums[0].sum()))
    finally:
        partition._prefixed_cache = original
    got = grads(drafter)
    assert not torch.allclose(got["fc.weight"], reference["fc.weight"], rtol=1e-3, atol=1e-5)
