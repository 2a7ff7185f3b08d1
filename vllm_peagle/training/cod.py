"""COD position sampling and the flattened parallel-group layout P-EAGLE trains on.

Notation for one sequence of ``L`` tokens ``x_0..x_{L-1}``: the target produced aux hidden
states ``a_0..a_{L-1}`` and next-token logits ``l_0..l_{L-1}`` (``l_t`` predicts ``x_{t+1}``).
The drafter works in *elements* ``(anchor j, depth d)``:

* depth 0 is an ordinary EAGLE-3 slot: token ``x_{j+1}`` with hidden ``a_j`` (vLLM's shift,
  see :func:`vllm_peagle.modeling.prepare_parallel_inputs`), for every ``j in [0, L-2]``;
* depth ``d >= 1`` is the d-th parallel (MTP) slot of the rollout that starts at anchor
  ``j``: the mask token with ``mask_hidden``;
* element ``(j, d)`` sits at RoPE position ``j + d`` and is trained against ``l_{j+d+1}``,
  the target's distribution of token ``x_{j+d+2}``.

At inference (context ``x_0..x_n`` where ``x_n`` is the token the target just sampled) vLLM
runs the slots of positions ``0..n-1`` at depth 0 and the K-1 mask slots at positions
``n..n+K-2``: that is exactly the rollout of anchor ``j = n-1`` on top of its depth-0
context, which is what :func:`attention_mask` lets every element see.

Everything here is a pure function over small integer tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CodConfig:
    """How many parallel groups to train and how densely to sample them."""

    num_depths: int = 7
    """Depths 0..num_depths-1, i.e. the K the drafter is trained for."""
    ratio: float = 0.7
    """Depth d keeps about ``n * ratio**d`` elements (n = supervised depth-0 elements)."""
    min_ratio: float = 0.2
    """Floor of the keep ratio, so deep groups never vanish on long sequences."""

    def __post_init__(self) -> None:
        if self.num_depths < 1:
            raise ValueError("num_depths must be >= 1")
        if not 0.0 < self.min_ratio <= 1.0 or not 0.0 < self.ratio <= 1.0:
            raise ValueError("ratio and min_ratio must lie in (0, 1]")

    def keep_ratio(self, depth: int) -> float:
        return 1.0 if depth == 0 else max(self.ratio**depth, self.min_ratio)


@dataclass(frozen=True)
class FlatLayout:
    """The elements of one sequence, grouped by depth (depth 0 first, in anchor order)."""

    anchor: torch.Tensor
    """[E] long: the anchor j of each element."""
    depth: torch.Tensor
    """[E] long: its depth d."""
    supervised: torch.Tensor
    """[E] bool: whether the element's label ``l_{j+d+1}`` counts in the loss."""

    @property
    def positions(self) -> torch.Tensor:
        """RoPE positions ``anchor + depth`` (consecutive within a rollout, as in vLLM)."""
        return self.anchor + self.depth

    @property
    def label_index(self) -> torch.Tensor:
        """Index ``t = j + d + 1`` into the target's logits (``l_t`` predicts ``x_{t+1}``)."""
        return self.anchor + self.depth + 1

    @property
    def depth_counts(self) -> list[int]:
        return torch.bincount(self.depth).tolist() if self.depth.numel() else []

    def __len__(self) -> int:
        return int(self.anchor.numel())


def cod_sample(
    label_mask: torch.Tensor, cfg: CodConfig, generator: torch.Generator | None = None
) -> FlatLayout:
    """COD ("conditional drop-token") sampling of the parallel groups of one sequence.

    ``label_mask`` [L] bool says which target distributions ``l_t`` are training labels
    (typically: the predicted token ``x_{t+1}`` belongs to the response). Depth 0 keeps
    every anchor ``0..L-2`` (they are the context all rollouts attend to) and supervises
    those whose label is in the mask; ``n`` is the number so supervised. Depth ``d``
    draws ``round(n * max(ratio**d, min_ratio))`` anchors, uniformly without replacement,
    from the anchors kept at depth ``d-1`` whose label ``l_{j+d+1}`` exists and is in
    the mask; a rollout therefore never has holes.

    Worked example, ``L = 6``, ``label_mask = [0, 0, 1, 1, 1, 1]`` (2 prompt tokens),
    ``ratio = 0.7``, ``num_depths = 4``::

        depth 0: anchors 0 1 2 3 4  supervised 0 1 1 1 1       -> n = 4
        depth 1: candidates {0,1,2,3} (labels l_2..l_5); keep round(4*0.7)  = 3, e.g. {1,2,3}
        depth 2: candidates {1,2}     (j+3 <= 5);        keep round(4*0.49) = 2 -> {1,2}
        depth 3: candidates {1}       (j+4 <= 5);        keep round(4*0.34) = 1 -> {1}

        element    0   1   2   3   4 | 5   6   7 | 8   9 | 10
        (j, d)    00  10  20  30  40 | 11  21  31| 12  22| 13
        position   0   1   2   3   4 | 2   3   4 | 3   4 | 4
        label l_t  1   2   3   4   5 | 3   4   5 | 4   5 | 5

    Element 9 = (2, 2) attends to depth-0 elements 0, 1, 2 and to its own rollout 6, 9:
    the same as vLLM's slots at positions 0, 1, 2 (context + sampled token) and 3, 4
    (first and second mask slot).
    """
    label_mask = label_mask.bool()
    length = int(label_mask.numel())
    anchors = [torch.arange(max(length - 1, 0))]
    depths = [torch.zeros_like(anchors[0])]
    supervised = [label_mask[1:].clone()]
    n = int(supervised[0].sum())
    prev = anchors[0]
    for d in range(1, cfg.num_depths):
        prev = prev[prev + d + 1 <= length - 1]
        cand = prev[label_mask[prev + d + 1]]
        count = min(int(cand.numel()), round(n * cfg.keep_ratio(d)))
        if count <= 0:
            break
        pick = torch.randperm(int(cand.numel()), generator=generator)[:count]
        prev = cand[pick].sort().values
        anchors.append(prev)
        depths.append(torch.full_like(prev, d))
        supervised.append(torch.ones_like(prev, dtype=torch.bool))
    return FlatLayout(torch.cat(anchors), torch.cat(depths), torch.cat(supervised))


def full_layout(length: int, num_depths: int, anchors: list[int] | None = None) -> FlatLayout:
    """Every depth-0 anchor plus complete rollouts (all depths) for ``anchors`` (default all).

    Useful for tests and for evaluating every rollout without sampling.
    """
    base = torch.arange(max(length - 1, 0))
    chosen = base if anchors is None else torch.tensor(sorted(anchors), dtype=torch.long)
    parts_a, parts_d = [base], [torch.zeros_like(base)]
    for d in range(1, num_depths):
        keep = chosen[chosen + d + 1 <= length - 1]
        if not keep.numel():
            break
        parts_a.append(keep)
        parts_d.append(torch.full_like(keep, d))
    anchor, depth = torch.cat(parts_a), torch.cat(parts_d)
    return FlatLayout(anchor, depth, torch.ones_like(anchor, dtype=torch.bool))


def attention_mask(
    anchor: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean ``[..., E, E]`` mask (True = query row may attend key column).

    ``q`` sees ``k`` iff ``(k.depth == 0 and k.anchor <= q.anchor)`` (the causal depth-0
    context, which includes q's own sampled-token slot) or ``(k.anchor == q.anchor and
    k.depth <= q.depth)`` (its own rollout's earlier mask slots and itself). Padding
    elements (``valid`` False) are never seen and see only themselves, so no row is empty.
    Works on ``[E]`` or batched ``[B, E]`` inputs.
    """
    qa, ka = anchor[..., :, None], anchor[..., None, :]
    qd, kd = depth[..., :, None], depth[..., None, :]
    mask = ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))
    if valid is not None:
        mask &= valid[..., :, None] & valid[..., None, :]
        eye = torch.eye(anchor.shape[-1], dtype=torch.bool, device=anchor.device)
        mask |= eye & ~valid[..., :, None]
    return mask


def inference_rollout_order(layout: FlatLayout, anchor: int) -> torch.Tensor:
    """Indices of the elements vLLM would run for a draft at ``anchor``, in slot order.

    That is the depth-0 elements of anchors ``0..anchor`` (context, then the sampled-token
    slot) followed by the rollout's mask slots ``(anchor, 1..)``: positions ``0, 1, 2, ...``.
    """
    ctx = ((layout.depth == 0) & (layout.anchor <= anchor)).nonzero().flatten()
    ctx = ctx[layout.anchor[ctx].argsort()]
    roll = ((layout.depth > 0) & (layout.anchor == anchor)).nonzero().flatten()
    roll = roll[layout.depth[roll].argsort()]
    return torch.cat([ctx, roll])


@dataclass(frozen=True)
class PackedLayouts:
    """Several sequences' layouts padded into ``[B, E]`` with aligned depth blocks.

    Block ``d`` occupies columns ``block_starts[d]:block_starts[d+1]`` in every row, so a
    sequential (EAGLE-3 training-time-test) pass can process one depth at a time for the
    whole batch while the P-EAGLE pass takes all columns at once.
    """

    anchor: torch.Tensor
    """[B, E] long (0 on padding)."""
    depth: torch.Tensor
    """[B, E] long (the block's depth on padding too)."""
    valid: torch.Tensor
    """[B, E] bool: real element, not padding."""
    supervised: torch.Tensor
    """[B, E] bool: counts in the loss (implies valid)."""
    parent: torch.Tensor
    """[B, E] long: column of element (j, d-1) for depth d >= 1; -1 at depth 0 / padding."""
    block_starts: tuple[int, ...]
    """Column where each depth block starts, plus the total width at the end."""

    @property
    def positions(self) -> torch.Tensor:
        return self.anchor + self.depth

    @property
    def label_index(self) -> torch.Tensor:
        return self.anchor + self.depth + 1

    @property
    def num_depths(self) -> int:
        return len(self.block_starts) - 1

    def mask(self) -> torch.Tensor:
        return attention_mask(self.anchor, self.depth, self.valid)


def pack_layouts(layouts: list[FlatLayout]) -> PackedLayouts:
    """Pad ``layouts`` (each grouped by depth) into aligned depth blocks."""
    num_depths = max(len(lay.depth_counts) for lay in layouts)
    widths = [
        max((lay.depth_counts + [0] * num_depths)[d] for lay in layouts) for d in range(num_depths)
    ]
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + w)
    b, e = len(layouts), starts[-1]
    anchor = torch.zeros(b, e, dtype=torch.long)
    depth = torch.zeros(b, e, dtype=torch.long)
    valid = torch.zeros(b, e, dtype=torch.bool)
    supervised = torch.zeros(b, e, dtype=torch.bool)
    parent = torch.full((b, e), -1, dtype=torch.long)
    for d in range(num_depths):
        depth[:, starts[d] : starts[d + 1]] = d
    for row, lay in enumerate(layouts):
        column_of: dict[tuple[int, int], int] = {}
        counts = lay.depth_counts + [0] * num_depths
        src = 0
        for d in range(num_depths):
            n = counts[d]
            cols = slice(starts[d], starts[d] + n)
            anchor[row, cols] = lay.anchor[src : src + n]
            valid[row, cols] = True
            supervised[row, cols] = lay.supervised[src : src + n]
            for i, j in enumerate(lay.anchor[src : src + n].tolist()):
                column_of[(j, d)] = starts[d] + i
                if d:
                    parent[row, starts[d] + i] = column_of[(j, d - 1)]
            src += n
    return PackedLayouts(anchor, depth, valid, supervised, parent, tuple(starts))
