"""Sequence-partitioned training: the flattened N·K sequence in segments of bounded size.

The flattened P-EAGLE sequence of one conversation has every depth-0 element plus the
COD-sampled rollouts, and its attention mask is ``E x E`` with ``E`` up to ``N·K``. Split
the *anchors* ``0..N-2`` into ranges; a segment holds every element whose anchor lies in
its range (its depth-0 slots and its complete rollouts). Under the parallel-group mask
(:func:`vllm_peagle.training.cod.attention_mask`) an element sees only depth-0 elements of
anchors ``<=`` its own and its own rollout, so a segment depends on earlier segments only
through their **depth-0 keys and values**, and depth-0 elements depend on nothing else.

Exact gradients, one segment in memory at a time (like activation checkpointing across a
KV cache):

1. no-grad pass over the depth-0 elements, segment by segment, keeping each layer's
   depth-0 K/V (``N`` rows per layer, tiny next to activations);
2. segments in *reverse* order: recompute the segment with grad on top of the earlier
   segments' K/V as leaf tensors, and backpropagate its loss together with the gradient
   that later segments sent to its own depth-0 K/V; the leaves' gradients are then
   added to what the earlier segments will receive.

Every parameter gradient therefore equals the unpartitioned one (up to float summation
order), while the live graph is one segment's ``E_s x (N + E_s)`` attention and
activations instead of ``E x E``. Works for both kinds (P-EAGLE single pass, EAGLE-3 TTT).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from vllm_peagle.modeling import KVCache, PEagleDrafter
from vllm_peagle.training.cod import attention_mask
from vllm_peagle.training.step import Batch, depth_sums, kl_terms

# ``call(fn, *args)`` runs ``fn(drafter, *args)``: directly, or through a DDP/FSDP wrapper
# so that parameters are gathered and gradients synchronised.
DrafterCall = Callable[..., Any]


def segment_bounds(num_anchors: int, segment_len: int) -> list[tuple[int, int]]:
    """Anchor ranges ``[lo, hi)`` of at most ``segment_len`` anchors covering ``num_anchors``."""
    if segment_len < 1:
        raise ValueError(f"segment_len must be >= 1, got {segment_len}")
    return [(lo, min(lo + segment_len, num_anchors)) for lo in range(0, num_anchors, segment_len)]


@dataclass
class _Segment:
    """The elements of one row whose anchor lies in ``[lo, hi)``, in layout order."""

    lo: int
    hi: int
    anchor: torch.Tensor
    depth: torch.Tensor
    supervised: torch.Tensor
    parent: torch.Tensor
    """Index *within the segment* of element (j, d-1); -1 at depth 0."""


def _row_segments(batch: Batch, row: int, segment_len: int) -> list[_Segment]:
    lay = batch.layout
    cols = lay.valid[row].nonzero().flatten()  # grouped by depth, anchors sorted within
    anchor, depth = lay.anchor[row, cols], lay.depth[row, cols]
    supervised, parent_col = lay.supervised[row, cols], lay.parent[row, cols]
    num_anchors = int((depth == 0).sum())
    if num_anchors and not torch.equal(
        anchor[:num_anchors], torch.arange(num_anchors, device=anchor.device)
    ):
        raise ValueError("layout must keep every depth-0 anchor 0..N-2 (COD does)")
    segments = []
    for lo, hi in segment_bounds(num_anchors, segment_len):
        pick = ((anchor >= lo) & (anchor < hi)).nonzero().flatten()
        local = torch.full((lay.anchor.shape[1],), -1, dtype=torch.long, device=anchor.device)
        local[cols[pick]] = torch.arange(pick.numel(), device=anchor.device)
        par = torch.where(parent_col[pick] >= 0, local[parent_col[pick].clamp_min(0)], -1)
        segments.append(_Segment(lo, hi, anchor[pick], depth[pick], supervised[pick], par))
    return segments


def _prefixed_cache(drafter: PEagleDrafter, keys: list[torch.Tensor], values: list[torch.Tensor]):
    cache = drafter.new_cache()
    if keys and keys[0].shape[-2]:
        cache.keys, cache.values = list(keys), list(values)
    return cache


def _depth0_pass(
    drafter: PEagleDrafter,
    tokens: torch.Tensor,
    aux: torch.Tensor,
    lo: int,
    hi: int,
    cache: KVCache,
) -> None:
    """Depth-0 elements of anchors ``[lo, hi)`` on top of ``cache`` (causal = their mask)."""
    anchors = torch.arange(lo, hi, device=tokens.device)
    hidden = drafter.combine_hidden_states(aux[anchors])
    drafter(tokens[anchors + 1], anchors, hidden, cache=cache)


def _segment_forward(
    drafter: PEagleDrafter,
    tokens: torch.Tensor,
    aux: torch.Tensor,
    seg: _Segment,
    cache: KVCache,
    kind: str,
) -> torch.Tensor:
    """Drafter output ``[E_s, H]`` of one segment on top of earlier segments' depth-0 K/V.

    Mirrors :func:`vllm_peagle.training.step.flat_forward` restricted to the segment: the
    prefix keys are all depth-0 with smaller anchors, hence visible to every query.
    """
    prefix = cache.length
    e = int(seg.anchor.numel())
    dev = tokens.device
    own = attention_mask(seg.anchor, seg.depth)
    mask = torch.cat([torch.ones(e, prefix, dtype=torch.bool, device=dev), own], dim=1)
    positions = seg.anchor + seg.depth
    ids = tokens[seg.anchor + seg.depth + 1]
    hidden0 = drafter.combine_hidden_states(aux[seg.anchor])
    is0 = seg.depth == 0
    if kind == "peagle":
        mask_id = int(drafter.config.mask_token_id or 0)
        ids = torch.where(is0, ids, torch.full_like(ids, mask_id))
        hidden = torch.where(is0[:, None], hidden0, drafter.mask_hidden_fused().to(hidden0))
        out, _ = drafter(ids, positions, hidden, attention_mask=mask, cache=cache)
        return out
    outs: list[torch.Tensor] = []
    carried: list[torch.Tensor] = []
    depths = seg.depth.tolist()
    start = 0
    while start < e:
        end = start + depths[start:].count(depths[start])  # one depth block (contiguous)
        prev = torch.cat(carried) if carried else None
        h_in = hidden0[start:end] if prev is None else prev[seg.parent[start:end]]
        normed, aux_out = drafter(
            ids[start:end],
            positions[start:end],
            h_in,
            attention_mask=mask[start:end, : prefix + end],
            cache=cache,
        )
        outs.append(normed)
        carried.append(aux_out)
        start = end
    return torch.cat(outs)


def _segment_loss(
    drafter: PEagleDrafter,
    batch: Batch,
    row: int,
    seg: _Segment,
    cache: KVCache,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = _segment_forward(drafter, batch.tokens[row], batch.aux[row], seg, cache, kind)
    label = (seg.anchor + seg.depth + 1)[seg.supervised]
    kl, hit = kl_terms(drafter, out, seg.supervised, batch.target_logits[row, label])
    return kl.sum(), kl.detach(), hit


def partitioned_backward(
    call: DrafterCall,
    drafter: PEagleDrafter,
    batch: Batch,
    kind: str,
    segment_len: int,
    normalizer: float,
    *,
    no_sync: Callable[[], AbstractContextManager[Any]] = nullcontext,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[float, torch.Tensor]:
    """Backpropagate ``sum(KL) / normalizer`` over ``batch``, ``segment_len`` anchors at a time.

    Gradients accumulate into the drafter's ``.grad`` exactly as one backward of the whole
    batch would leave them. ``no_sync`` wraps every backward but the last (DDP's
    ``no_sync``); ``autocast`` wraps the forwards. Returns the summed KL (before dividing)
    and :func:`~vllm_peagle.training.step.depth_sums`.
    """
    rows = batch.tokens.shape[0]
    sums = torch.zeros(3, batch.layout.num_depths, dtype=torch.float64)
    total = 0.0
    work = [(r, _row_segments(batch, r, segment_len)) for r in range(rows)]
    # Segments run last to first, so the final backward of the batch is segment 0 of the last row.
    last = (rows - 1, 0)
    for row, segments in work:
        tokens, aux = batch.tokens[row], batch.aux[row]
        # 1. depth-0 K/V of the whole row, one segment at a time, without a graph.
        cache = drafter.new_cache()
        with torch.no_grad(), autocast():
            for seg in segments:
                call(_depth0_pass, tokens, aux, seg.lo, seg.hi, cache)
        keys = [k for k in cache.keys if k is not None]
        values = [v for v in cache.values if v is not None]
        grad_k = [torch.zeros_like(k) for k in keys]
        grad_v = [torch.zeros_like(v) for v in values]
        # 2. segments last to first, each on its prefix's K/V as leaves.
        for index in range(len(segments) - 1, -1, -1):
            seg = segments[index]
            leaf_k = [k[..., : seg.lo, :].detach().requires_grad_() for k in keys]
            leaf_v = [v[..., : seg.lo, :].detach().requires_grad_() for v in values]
            sync = (row, index) == last
            with nullcontext() if sync else no_sync():
                seg_cache = _prefixed_cache(drafter, leaf_k, leaf_v)
                with autocast():
                    loss, kl, hit = call(_segment_loss, batch, row, seg, seg_cache, kind)
                outputs, grads = [loss / normalizer], [torch.ones((), device=loss.device)]
                n0 = seg.hi - seg.lo  # the segment's own depth-0 K/V sit right after the prefix
                if index + 1 < len(segments):
                    for full, acc in zip(
                        [*seg_cache.keys, *seg_cache.values], [*grad_k, *grad_v], strict=True
                    ):
                        assert full is not None
                        g = torch.zeros_like(full)
                        g[..., seg.lo : seg.lo + n0, :] = acc[..., seg.lo : seg.hi, :]
                        outputs.append(full)
                        grads.append(g)
                torch.autograd.backward(outputs, grads)
            if seg.lo:
                for acc, leaf in zip([*grad_k, *grad_v], [*leaf_k, *leaf_v], strict=True):
                    if leaf.grad is not None:
                        acc[..., : seg.lo, :] += leaf.grad
            total += float(loss.detach())
            sums += depth_sums(kl, hit, seg.depth[seg.supervised], batch.layout.num_depths)
    return total, sums
