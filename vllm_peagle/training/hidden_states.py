"""Target features for drafter training: aux hidden states and next-token logits.

vLLM's Llama collects aux state ``i`` as ``hidden + residual`` *before* decoder layer ``i``
runs (``_maybe_add_hidden_state(aux, idx + 1, ...)`` after layer ``idx``; id 0 is the
embedding output). In transformers that is ``hidden_states[i]`` of
``output_hidden_states=True`` (``hidden_states[0]`` = embeddings, ``hidden_states[i]`` =
output of layer ``i-1``; only the last entry is post-norm, and ids stop at
``num_layers - 1``). Features are computed on the fly (default) or read from a disk cache.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from vllm_peagle.checkpoint import atomic_write_bytes


def check_aux_layer_ids(ids: list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """Aux layer ids must be distinct and in ``[0, num_layers)`` (vLLM collects each once)."""
    ids = [int(i) for i in ids]
    if len(set(ids)) != len(ids):
        raise ValueError(f"aux layer ids {ids} repeat a layer; vLLM collects each layer once")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} outside [0, {num_layers}) for this target")
    return ids


def default_train_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default (2, n//2, n-3) when distinct and valid, else the last three inputs."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and all(0 <= i < num_layers for i in ids):
        return ids
    if num_layers < 3:
        raise ValueError("a target needs >= 3 layers for three distinct aux layers")
    return [num_layers - 3, num_layers - 2, num_layers - 1]


@dataclass
class TargetFeatures:
    aux: torch.Tensor
    """[B, T, n_aux * H] concatenated aux states (vLLM's order: as listed in the ids)."""
    logits: torch.Tensor
    """[B, T, V] float32 next-token logits (``logits[:, t]`` predicts token t+1)."""


class TargetModel:
    """A Hugging Face causal LM used as the (frozen) teacher."""

    def __init__(
        self,
        path: str | os.PathLike,
        aux_layer_ids: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.path = str(path)
        self.model: Any = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = self.model.config.get_text_config()
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.aux_layer_ids = check_aux_layer_ids(
            aux_layer_ids or default_train_aux_layer_ids(self.num_layers), self.num_layers
        )

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def to(self, device: torch.device | str) -> TargetModel:
        self.model.to(device)
        return self

    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux [B,T,n*H], final normed hidden [B,T,H])``; right padding is harmless (causal)."""
        aux, last, _ = self.extend(input_ids, None)
        return aux, last

    @torch.no_grad()
    def extend(
        self, input_ids: torch.Tensor, cache: Any, use_cache: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Like :meth:`hidden`, continuing a transformers KV cache (``None`` starts one when
        ``use_cache``); returns ``(aux, last hidden, cache)``."""
        out = self.model.model(
            input_ids=input_ids.to(self.device),
            output_hidden_states=True,
            past_key_values=cache,
            use_cache=use_cache or cache is not None,
        )
        aux = torch.cat([out.hidden_states[i] for i in self.aux_layer_ids], dim=-1)
        return aux.float(), out.last_hidden_state, out.past_key_values

    @torch.no_grad()
    def logits_from_hidden(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(last_hidden.to(self.device)).float()

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor) -> TargetFeatures:
        aux, last = self.hidden(input_ids)
        return TargetFeatures(aux, self.logits_from_hidden(last))


class FeatureCache:
    """Per-sequence target features on disk (aux + final hidden; logits re-derived).

    Storing the final normed hidden state instead of logits keeps an entry at
    ``(n_aux + 1) * H`` floats per token instead of ``V``; the lm_head is one matmul.
    Entries are keyed by the token ids, written atomically, and reused across runs.
    """

    def __init__(self, root: str | os.PathLike, target: TargetModel) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.target = target
        self._tag = f"{Path(target.path).name}-{'_'.join(map(str, target.aux_layer_ids))}"

    def _path(self, ids: list[int]) -> Path:
        digest = hashlib.sha256((self._tag + ":" + ",".join(map(str, ids))).encode()).hexdigest()[
            :24
        ]
        return self.root / digest[:2] / f"{digest}.safetensors"

    def get(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux [T, n*H], last hidden [T, H])`` for one sequence, computing it if missing."""
        path = self._path(ids)
        if path.is_file():
            data = load_file(str(path))
            return data["aux"], data["last"]
        aux, last = self.target.hidden(torch.tensor([ids]))
        data = {"aux": aux[0].cpu().contiguous(), "last": last[0].float().cpu().contiguous()}
        atomic_write_bytes(path, save(data))
        return data["aux"], data["last"]


def batch_features(
    target: TargetModel,
    sequences: list[list[int]],
    pad_id: int,
    cache: FeatureCache | None = None,
) -> tuple[torch.Tensor, TargetFeatures]:
    """Right-pad ``sequences`` to ``[B, T]`` and return ``(input_ids, features)``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    if cache is None:
        return ids, target.features(ids)
    aux = torch.zeros(len(sequences), width, len(target.aux_layer_ids) * target.hidden_size)
    last = torch.zeros(len(sequences), width, target.hidden_size)
    for i, s in enumerate(sequences):
        a, h = cache.get(s)
        aux[i, : len(s)], last[i, : len(s)] = a, h
    return ids, TargetFeatures(aux, target.logits_from_hidden(last))


__all__ = [
    "FeatureCache",
    "TargetFeatures",
    "TargetModel",
    "batch_features",
    "check_aux_layer_ids",
    "default_train_aux_layer_ids",
]
