"""One training step's arithmetic: batch assembly, the flat drafter forward, the loss.

Kept apart from the trainer's bookkeeping so the core reads top to bottom: target
features + COD layouts -> drafter inputs per element -> one (P-EAGLE) or K (EAGLE-3 TTT)
drafter passes under the parallel-group mask -> KL(target || draft) on supervised elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vllm_peagle.modeling import PEagleDrafter
from vllm_peagle.training.cod import (
    CodConfig,
    FlatLayout,
    PackedLayouts,
    cod_sample,
    pack_layouts,
)
from vllm_peagle.training.data import Sample
from vllm_peagle.training.hidden_states import FeatureCache, TargetModel, batch_features


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] right-padded token ids
    aux: torch.Tensor  # [B, T, n_aux*H] target aux states
    target_logits: torch.Tensor  # [B, T, V]
    layout: PackedLayouts

    def to(self, device: torch.device | str) -> Batch:
        lay = self.layout
        moved = PackedLayouts(
            *(t.to(device) for t in (lay.anchor, lay.depth, lay.valid, lay.supervised, lay.parent)),
            lay.block_starts,
        )
        return Batch(
            self.tokens.to(device), self.aux.to(device), self.target_logits.to(device), moved
        )


def make_layouts(
    samples: list[Sample], cod: CodConfig, generator: torch.Generator, loss_on_prompt: bool = False
) -> list[FlatLayout]:
    """COD layouts of ``samples``, drawn in order from ``generator``.

    Distributed runs draw the layouts of the whole global batch on every rank and keep their
    own share, so each sample gets the layout a single process would have given it.
    """
    layouts = []
    for s in samples:
        t = torch.arange(len(s.input_ids))
        # l_t is a label when the token it predicts, x_{t+1}, belongs to the response.
        label_mask = (
            torch.ones_like(t, dtype=torch.bool) if loss_on_prompt else t + 1 >= s.prompt_len
        )
        layouts.append(cod_sample(label_mask, cod, generator))
    return layouts


def make_batch(
    samples: list[Sample],
    target: TargetModel,
    cod: CodConfig,
    generator: torch.Generator,
    pad_id: int,
    loss_on_prompt: bool = False,
    cache: FeatureCache | None = None,
    layouts: list[FlatLayout] | None = None,
) -> Batch:
    if layouts is None:
        layouts = make_layouts(samples, cod, generator, loss_on_prompt)
    ids, feats = batch_features(target, [s.input_ids for s in samples], pad_id, cache)
    return Batch(ids, feats.aux, feats.logits, pack_layouts(layouts))


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, e]]`` for ``x`` [B, T, ...] and ``index`` [B, E]."""
    idx = index.clamp(0, x.shape[1] - 1)
    if x.dim() == 2:
        return x.gather(1, idx)
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def flat_forward(
    drafter: PEagleDrafter,
    tokens: torch.Tensor,
    aux: torch.Tensor,
    lay: PackedLayouts,
    kind: str,
) -> torch.Tensor:
    """Drafter output (normed hidden, ``[B, E, H]``) at every element of the flat layout.

    ``tokens`` [B, T] and ``aux`` [B, T, n_aux*H] are the sequence and its target aux
    states. Element (j, 0) gets token x_{j+1} with fc(a_j) at position j (vLLM's EAGLE
    shift). P-EAGLE: every (j, d >= 1) gets the mask token with fc(mask_hidden) at j+d and
    everything runs in one pass. EAGLE-3: (j, d) gets the data token x_{j+d+1} with the
    drafter's own output hidden state at (j, d-1), one depth per pass (TTT).
    """
    fused = drafter.combine_hidden_states(aux)  # [B, T, H]
    positions = lay.positions
    hidden0 = _gather(fused, lay.anchor)
    ids = _gather(tokens, lay.label_index)  # x_{j+d+1}; at depth 0 that is x_{j+1}
    is0 = lay.depth == 0
    mask = lay.mask()
    if kind == "peagle":
        mask_id = int(drafter.config.mask_token_id or 0)
        ids = torch.where(is0, ids, torch.full_like(ids, mask_id))
        hidden = torch.where(is0[..., None], hidden0, drafter.mask_hidden_fused().to(hidden0))
        out, _ = drafter(ids, positions, hidden, attention_mask=mask)
        return out
    cache, outs, carried = drafter.new_cache(), [], []
    for d in range(lay.num_depths):
        s, e = lay.block_starts[d], lay.block_starts[d + 1]
        # Depth d >= 1 takes the drafter's own output at (j, d-1), as vLLM feeds it back.
        prev = torch.cat(carried, dim=1) if carried else None
        h_in = hidden0[:, s:e] if prev is None else _gather(prev, lay.parent[:, s:e])
        # Block d attends to the KV of blocks 0..d-1 (cached) and to itself.
        normed, aux_out = drafter(
            ids[:, s:e], positions[:, s:e], h_in, attention_mask=mask[:, s:e, :e], cache=cache
        )
        outs.append(normed)
        carried.append(aux_out)
    return torch.cat(outs, dim=1)


def kl_terms(
    drafter: PEagleDrafter,
    out: torch.Tensor,
    sel: torch.Tensor,
    target_logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(KL(target || draft) [N], top-1 hit [N])`` at the drafter outputs ``out[sel]``.

    ``target_logits`` [N, V] are the soft labels of those N elements. Only supervised
    elements reach the (vocab-wide, hence costly) head and loss.
    """
    draft_logits = drafter.lm_head(out[sel]).float()  # [N, Vd]
    # build_drafter keeps the full vocabulary, so lm_head rows are target token ids.
    with torch.no_grad():
        p = target_logits.softmax(-1)
        entropy = -(p * target_logits.log_softmax(-1)).sum(-1)
        hit = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
    # KL(p || q) = CE(p, q) - H(p); the fused soft-label CE keeps the graph small.
    kl = F.cross_entropy(draft_logits, p, reduction="none") - entropy  # [N]
    return kl, hit


def depth_sums(
    kl: torch.Tensor, hit: torch.Tensor, depth: torch.Tensor, num_depths: int
) -> torch.Tensor:
    """``[3, num_depths]`` float64: per depth, the element count, sum of hits and sum of KL.

    Sums (not means) so that segments, sequences and ranks add up before dividing.
    """
    out = torch.zeros(3, num_depths, dtype=torch.float64)
    d = depth.to(torch.long).cpu()
    out[0].index_add_(0, d, torch.ones_like(d, dtype=torch.float64))
    out[1].index_add_(0, d, hit.detach().double().cpu())
    out[2].index_add_(0, d, kl.detach().double().cpu())
    return out


def stats_from_sums(sums: torch.Tensor) -> dict[str, Any]:
    """``{"acc", "kl", "count"}`` per depth from :func:`depth_sums` (NaN where none)."""
    counts = [int(c) for c in sums[0].tolist()]
    acc = [h / c if c else float("nan") for h, c in zip(sums[1].tolist(), counts, strict=True)]
    kls = [k / c if c else float("nan") for k, c in zip(sums[2].tolist(), counts, strict=True)]
    return {"acc": acc, "kl": kls, "count": counts}


def drafter_loss(
    drafter: PEagleDrafter, batch: Batch, kind: str
) -> tuple[torch.Tensor, dict[str, Any]]:
    """KL(target || draft) over supervised elements, plus per-depth accuracy/KL."""
    loss, sums = drafter_loss_sum(drafter, batch, kind)
    n = int(sums[0].sum())
    return (loss / n if n else loss), stats_from_sums(sums)


def drafter_loss_sum(
    drafter: PEagleDrafter, batch: Batch, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (not averaged) KL over supervised elements and the :func:`depth_sums`."""
    lay = batch.layout
    out = flat_forward(drafter, batch.tokens, batch.aux, lay, kind)
    sel = lay.supervised
    rows = sel.nonzero(as_tuple=True)[0]
    target_logits = batch.target_logits[rows, lay.label_index[sel]]  # [N, V]
    kl, hit = kl_terms(drafter, out, sel, target_logits)
    # Even an empty selection leaves a graph through every parameter (DDP needs that).
    loss = kl.sum()
    return loss, depth_sums(kl, hit, lay.depth[sel], lay.num_depths)
