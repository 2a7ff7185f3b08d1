"""The P-EAGLE drafter as a plain ``torch.nn.Module`` (no vLLM imports).

Parameter names equal the on-disk names that vLLM's ``Eagle3LlamaForCausalLM``
loads (``fc``, ``midlayer.*``, ``layers.{i}.*``, ``norm``, ``lm_head``,
``embed_tokens``, ``mask_hidden``, ``d2t``), so ``state_dict()`` is the checkpoint.
The arithmetic mirrors vLLM 0.32 ``llama_eagle3.py`` so that training, offline
evaluation and serving agree token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PEagleDrafterConfig:
    """Shape and options of a P-EAGLE (or plain EAGLE-3) drafter."""

    hidden_size: int
    """Drafter width H; also the width of the token embeddings."""
    num_hidden_layers: int
    """Decoder layers; layer 0 is the fusion layer stored as ``midlayer``."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads (GQA); must divide ``num_attention_heads``."""
    intermediate_size: int
    """SwiGLU MLP width."""
    vocab_size: int
    """Target vocabulary size (rows of ``embed_tokens``; width of ``compute_logits``)."""
    draft_vocab_size: int | None = None
    """LM-head rows; smaller than ``vocab_size`` only together with a ``d2t`` map."""
    target_hidden_size: int | None = None
    """Width of one target aux hidden state; defaults to ``hidden_size``."""
    head_dim: int | None = None
    """Per-head width; defaults to ``hidden_size // num_attention_heads``."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base (plain, non-scaled RoPE; neox rotation like vLLM's Llama)."""
    max_position_embeddings: int = 2048
    """Longest position the drafter is meant to see (written to config.json)."""
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    """Target layers tapped (vLLM: output after that many layers); None = vLLM's default 3."""
    mask_token_id: int | None = None
    """P-EAGLE mask token (``ptd_token_id``); ``None`` means plain EAGLE-3, no ``mask_hidden``."""
    norm_before_residual: bool = False
    """Layer 0 takes its residual after ``hidden_norm`` instead of before it."""
    norm_before_fc: bool = False
    """One RMSNorm (``input_norm``) over the concatenated aux states before ``fc``."""
    fc_norm: bool = False
    """EAGLE-3.1: a separate RMSNorm (``fc_norm.{i}``) per aux state before ``fc``."""
    norm_output: bool = False
    """Return post-norm instead of pre-norm hidden states as the second output."""
    attention_bias: bool = False
    """Biases on q/k/v/o projections (vLLM reads ``attention_bias``)."""
    mlp_bias: bool = False
    """Biases on the MLP projections."""
    hidden_act: str = "silu"
    """MLP activation; vLLM's Llama only supports ``silu``."""

    def __post_init__(self) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"only silu is supported (vLLM Llama), got {self.hidden_act}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError("draft_vocab_size cannot exceed vocab_size")
        if self.eagle_aux_hidden_state_layer_ids is not None:
            self.eagle_aux_hidden_state_layer_ids = list(self.eagle_aux_hidden_state_layer_ids)

    @property
    def num_aux_hidden_states(self) -> int:
        ids = self.eagle_aux_hidden_state_layer_ids
        return len(ids) if ids else 3

    @property
    def fc_input_size(self) -> int:
        return self.num_aux_hidden_states * int(self.target_hidden_size or 0)

    @property
    def is_parallel(self) -> bool:
        return self.mask_token_id is not None


class RMSNorm(nn.Module):
    """RMSNorm in float32, cast back, like vLLM's native ``rms_norm`` IR op."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def _normalize(self, xf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf.to(self.weight.dtype) * self.weight).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._normalize(x.float(), x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's fused ``RMSNorm(x, residual)``: residual = x + residual; out = norm(residual)."""
        # Like vLLM, normalise the float32 sum and hand back the sum rounded to dtype.
        summed = x.float() + residual.float()
        return self._normalize(summed, x.dtype), summed.to(x.dtype)


class KVCache:
    """Per-layer key/value tensors, appended to by each forward (incremental decoding)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else k.shape[-2]

    def append(
        self, idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[idx], self.values[idx]
        if old_k is not None and old_v is not None:
            k, v = torch.cat([old_k, k], dim=-2), torch.cat([old_v, v], dim=-2)
        self.keys[idx], self.values[idx] = k, v
        return k, v


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    # Neox-style rotation over the whole head, as vLLM's get_rope(is_neox_style=True).
    dim = x.shape[-1]
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)
    )
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, dim/2]
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]  # broadcast over heads
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: PEagleDrafterConfig, in_size: int, layer_idx: int) -> None:
        super().__init__()
        d = int(cfg.head_dim or 0)
        self.cfg, self.layer_idx, self.head_dim = cfg, layer_idx, d
        self.q_proj = nn.Linear(in_size, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(in_size, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(in_size, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(
            cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.attention_bias
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = (
            _rope(q, positions, self.cfg.rope_theta),
            _rope(k, positions, self.cfg.rope_theta),
        )
        if cache is not None:
            k, v = cache.append(self.layer_idx, k, v)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: PEagleDrafterConfig) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Llama decoder layer; layer 0 fuses norm(embeds) ⊕ hidden_norm(hidden) into a 2H-wide QKV."""

    def __init__(self, cfg: PEagleDrafterConfig, layer_idx: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg, self.first = cfg, layer_idx == 0
        self.self_attn = Attention(cfg, 2 * h if self.first else h, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if self.first:
            # vLLM builds hidden_norm on every layer but only layer 0 uses it, so
            # later layers omit it here and in checkpoints.
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.first:
            embeds = self.input_layernorm(embeds)
            if self.cfg.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual = hidden
            else:
                residual = hidden
                hidden = self.hidden_norm(hidden)
            hidden = torch.cat([embeds, hidden], dim=-1)
        else:
            assert residual is not None
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, positions, mask, cache)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


def _build_mask(mask: torch.Tensor | None, t: int, past: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        # Causal over [cache | new]: new query i sees every cached key and new keys <= i.
        q = torch.arange(t, device=device)[:, None] + past
        return (torch.arange(past + t, device=device)[None, :] <= q)[None, None]
    if mask.dtype != torch.bool:
        raise TypeError("attention_mask must be boolean (True = may attend)")
    if mask.shape[-2:] != (t, past + t):
        raise ValueError(f"attention_mask must end in ({t}, {past + t}), got {tuple(mask.shape)}")
    return mask[None, None] if mask.dim() == 2 else mask[:, None]


class PEagleDrafter(nn.Module):
    """EAGLE-3 Llama drafter with P-EAGLE's ``mask_hidden``; names match vLLM checkpoints."""

    def __init__(self, cfg: PEagleDrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.fc_input_size, eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(int(cfg.target_hidden_size or 0), eps)
                for _ in range(cfg.num_aux_hidden_states)
            )
        self.fc = nn.Linear(cfg.fc_input_size, h, bias=False)
        self.midlayer = DecoderLayer(cfg, 0)
        # A ModuleDict keyed "1".."N-1" yields the on-disk names layers.{i}.*.
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, i) for i in range(1, cfg.num_hidden_layers)}
        )
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, int(cfg.draft_vocab_size or 0), bias=False)
        # Stored [1, 1, n_aux*H_t] (pre-fc) as in released checkpoints.
        self.mask_hidden: nn.Parameter | None
        mask = torch.zeros(1, 1, cfg.fc_input_size) if cfg.is_parallel else None
        self.register_parameter("mask_hidden", None if mask is None else nn.Parameter(mask))
        # d2t exists only for a reduced draft vocab: vLLM rejects it otherwise.
        self.d2t: torch.Tensor | None
        reduced = cfg.draft_vocab_size != cfg.vocab_size
        d2t = torch.zeros(int(cfg.draft_vocab_size or 0), dtype=torch.long) if reduced else None
        self.register_buffer("d2t", d2t)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Llama-style init; seed the global RNG first for a reproducible drafter."""
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
                if mod.bias is not None:
                    mod.bias.zero_()
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, std=std)
            elif isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)
        if self.mask_hidden is not None:
            nn.init.normal_(self.mask_hidden, std=std)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [self.midlayer, *self.layers.values()]  # type: ignore[list-item]

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """Fuse concatenated target aux states ``[..., n_aux * H_target]`` into ``[..., H]``."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            chunks = aux.chunk(self.config.num_aux_hidden_states, dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux)

    def mask_hidden_fused(self) -> torch.Tensor:
        """``fc(mask_hidden)`` as ``[H]``: the hidden input of every MTP slot (vLLM caches it)."""
        if self.mask_hidden is None:
            raise ValueError("this drafter has no mask_hidden (plain EAGLE-3)")
        return self.combine_hidden_states(self.mask_hidden.view(1, -1))[0]

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_hidden_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the decoder stack; returns ``(normed hidden, aux output)`` like vLLM.

        ``input_ids``/``positions`` are ``[T]`` or ``[B, T]``; ``hidden_states`` is the
        already fused (H-wide) input.  ``attention_mask`` is boolean ``[T, S]`` or
        ``[B, T, S]`` (True = may attend, S = cached + T); ``None`` means causal.
        Every query row must allow at least one key.
        """
        unbatched = input_ids.dim() == 1
        if unbatched:
            input_ids, positions, hidden_states = (
                input_ids[None],
                positions[None],
                hidden_states[None],
            )
            if input_embeds is not None:
                input_embeds = input_embeds[None]
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        if hidden_states.shape[-1] != embeds.shape[-1]:
            raise ValueError(
                "hidden_states must be fused to hidden_size; call combine_hidden_states"
            )
        past = 0 if cache is None else cache.length
        mask = _build_mask(attention_mask, input_ids.shape[1], past, input_ids.device)
        hidden, residual = hidden_states, None
        for layer in self.decoder_layers():
            hidden, residual = layer(embeds, hidden, residual, positions, mask, cache)
        assert residual is not None
        normed, prenorm = self.norm.add_and_norm(hidden, residual)
        aux = normed if self.config.norm_output else prenorm
        return (normed[0], aux[0]) if unbatched else (normed, aux)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over the draft vocab, scattered into the target vocab (-inf elsewhere)."""
        logits = self.lm_head(hidden)
        if self.d2t is None:
            return logits
        targets = torch.arange(logits.shape[-1], device=logits.device) + self.d2t
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., targets] = logits
        return full


class DraftInputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    hidden_states: torch.Tensor
    sample_index: torch.Tensor


def prepare_parallel_inputs(
    drafter: PEagleDrafter,
    tokens: torch.Tensor,
    aux_hidden: torch.Tensor,
    next_token: int,
    num_draft: int,
    start_position: int = 0,
) -> DraftInputs:
    """Lay out one request the way vLLM's ``copy_and_expand_eagle_inputs`` kernel does.

    ``tokens`` x_0..x_{n-1} are what the target processed (x_0 at ``start_position``),
    ``aux_hidden`` [n, n_aux*H_t] its aux states a_0..a_{n-1}, ``next_token`` x_n the
    token it sampled.  Slot j (position start+j) gets token x_{j+1} and hidden a_j, so
    x_n rides with a_{n-1}; the K-1 MTP slots follow at consecutive positions with the
    mask token and fc(mask_hidden).  The last K slots are sampled.
    """
    n = tokens.shape[0]
    if aux_hidden.shape[0] != n or n < 1:
        raise ValueError("need one aux hidden state per context token (n >= 1)")
    if num_draft > 1 and not drafter.config.is_parallel:
        raise ValueError("a plain EAGLE-3 drafter drafts one token per forward")
    n_mask = num_draft - 1
    mask_id = drafter.config.mask_token_id if n_mask else 0
    ids = torch.cat(
        [
            tokens[1:],
            tokens.new_tensor([next_token]),
            tokens.new_full((n_mask,), int(mask_id or 0)),
        ]
    )
    hidden = drafter.combine_hidden_states(aux_hidden)
    if n_mask:
        hidden = torch.cat([hidden, drafter.mask_hidden_fused().expand(n_mask, -1)])
    positions = torch.arange(start_position, start_position + n + n_mask, device=tokens.device)
    return DraftInputs(
        ids, positions, hidden, torch.arange(n - 1, n + n_mask, device=tokens.device)
    )


@torch.no_grad()
def draft_parallel(
    drafter: PEagleDrafter,
    tokens: torch.Tensor,
    aux_hidden: torch.Tensor,
    next_token: int,
    num_draft: int,
    start_position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy K-token draft in ONE drafter forward; returns ``(token_ids [K], logits [K, V])``."""
    inp = prepare_parallel_inputs(
        drafter, tokens, aux_hidden, next_token, num_draft, start_position
    )
    hidden, _ = drafter(inp.input_ids, inp.positions, inp.hidden_states)
    logits = drafter.compute_logits(hidden[inp.sample_index])
    return logits.argmax(-1), logits
