"""Offline acceptance of a drafter against its target, simulating vLLM's decoding step.

No vLLM here: the target is the Hugging Face model and the drafter our PyTorch module, so
acceptance can be measured (and compared across drafters) anywhere. One request runs as
vLLM runs it:

1. prefill: the target reads the prompt and samples token ``x_n``;
2. the drafter reads ``[context | x_n | mask x (K-1)]`` in ONE pass (P-EAGLE) or drafts
   K tokens sequentially feeding back its own hidden state (EAGLE-3);
3. the target scores ``[x_n, d_1..d_K]``; the longest accepted prefix is kept plus one
   bonus/recovered token; repeat until ``max_tokens`` tokens have been produced.

Greedy (temperature 0): draft i is accepted iff it equals the target's argmax after the
accepted prefix. Temperature > 0: standard speculative rejection sampling (accept with
``min(1, p/q)``, else resample from ``norm(max(0, p - q))``); drafts are sampled from the
drafter's tempered distribution (``draft_sampling="probabilistic"``) or taken greedily
with ``q`` one-hot (``"greedy"``, vLLM's default ``draft_sample_method``).

Counts follow vLLM's spec-decode counters exactly (one "draft" per verification step,
none for the prefill step), so the figures are :class:`~vllm_peagle.metrics.SpecDecodeCounters`:
``AL = 1 + accepted / drafts`` and per-position acceptance = accepted at i / drafts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from vllm_peagle.checkpoint import load_drafter
from vllm_peagle.evaluation.long_context import (
    ContextBuckets,
    StepRecord,
    bucket_counters,
    counters_summary,
)
from vllm_peagle.metrics import SpecDecodeCounters
from vllm_peagle.modeling import KVCache, PEagleDrafter, prepare_parallel_inputs
from vllm_peagle.training.hidden_states import TargetModel

DraftSampling = Literal["probabilistic", "greedy"]


@dataclass
class OfflineEvalResult:
    counters: SpecDecodeCounters
    num_speculative_tokens: int
    temperature: float
    outputs: list[list[int]] = field(default_factory=list)
    """Generated token ids per prompt (truncated to ``max_tokens``)."""
    by_context: dict[str, SpecDecodeCounters] = field(default_factory=dict)
    """Counters per context-length bucket (only when buckets were asked for)."""

    @property
    def acceptance_length(self) -> float:
        return self.counters.acceptance_length

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        acc = self.counters.per_position_acceptance
        return acc + (0.0,) * (self.num_speculative_tokens - len(acc))

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.num_speculative_tokens,
            "temperature": self.temperature,
            "acceptance_length": round(self.acceptance_length, 4),
            "per_position_acceptance": [round(a, 4) for a in self.per_position_acceptance],
            "num_drafts": self.counters.num_drafts,
            "num_draft_tokens": self.counters.num_draft_tokens,
            "num_accepted_tokens": self.counters.num_accepted_tokens,
            "num_prompts": len(self.outputs),
            **(
                {
                    "by_context_length": {
                        label: counters_summary(c, self.num_speculative_tokens)
                        for label, c in self.by_context.items()
                    }
                }
                if self.by_context
                else {}
            ),
        }


def _crop(cache: KVCache, length: int) -> None:
    """Forget every drafter KV entry from slot ``length`` on (mask / sequential slots)."""
    for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        if k is not None and v is not None:
            cache.keys[i], cache.values[i] = k[..., :length, :], v[..., :length, :]


class _Drafting:
    """Turns (context, aux states, sampled token) into K draft tokens + their probabilities.

    Keeps the drafter's KV cache of the context slots between steps, as vLLM does: the
    slots of already-verified tokens are computed once, the K draft slots every step.
    """

    def __init__(self, drafter: PEagleDrafter, k: int, temperature: float, sampling: str) -> None:
        self.drafter, self.k, self.temperature, self.sampling = drafter, k, temperature, sampling
        self.cache = drafter.new_cache()

    def reset(self) -> None:
        self.cache = self.drafter.new_cache()

    def _pick(self, logits: torch.Tensor, gen: torch.Generator) -> tuple[int, torch.Tensor | None]:
        if self.temperature <= 0 or self.sampling == "greedy":
            return int(logits.argmax()), None
        q = torch.softmax(logits.double() / self.temperature, -1)
        return int(torch.multinomial(q, 1, generator=gen)), q

    @torch.no_grad()
    def __call__(
        self, tokens: torch.Tensor, aux: torch.Tensor, sampled: int, gen: torch.Generator
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Draft after context ``tokens`` x_0..x_{n-1} (aux a_0..a_{n-1}) and sampled x_n."""
        d, n, cache = self.drafter, len(tokens), self.cache
        done = cache.length  # slots 0..done-1 are cached from earlier steps
        # New slots: positions done..n-1 carry x_{done+1}..x_n (the last one is the
        # sampled token) with a_done..a_{n-1}; P-EAGLE appends K-1 mask slots.
        width = self.k if d.config.is_parallel else 1
        inp = prepare_parallel_inputs(d, tokens[done:], aux[done:], sampled, width, done)
        hidden, carried = d(inp.input_ids, inp.positions, inp.hidden_states, cache=cache)
        if d.config.is_parallel:
            # All K drafts from this ONE pass: the sampled-token slot and the mask slots.
            logits = d.compute_logits(hidden[inp.sample_index])
            picks = [self._pick(row, gen) for row in logits]
            drafts, probs = [t for t, _ in picks], [q for _, q in picks]
        else:
            # Sequential EAGLE-3: one more pass per token, feeding the drafted token and
            # the drafter's own (pre-norm) output hidden state at the next position.
            drafts, probs = [], []
            pos = n - 1
            for i in range(self.k):
                tok, q = self._pick(d.compute_logits(hidden[-1]), gen)
                drafts.append(tok)
                probs.append(q)
                if i + 1 < self.k:
                    pos += 1
                    hidden, carried = d(
                        torch.tensor([tok]), torch.tensor([pos]), carried[-1:], cache=cache
                    )
        _crop(cache, n)  # keep the context slots only; drafts are re-run once verified
        return drafts, probs


def _verify(
    target_logits: torch.Tensor,
    drafts: list[int],
    probs: list[torch.Tensor | None],
    temperature: float,
    gen: torch.Generator,
) -> tuple[int, int]:
    """Accepted count and the bonus/recovered token; ``target_logits`` [K+1, V]."""
    if temperature <= 0:
        argmax = target_logits.argmax(-1).tolist()
        m = 0
        while m < len(drafts) and drafts[m] == argmax[m]:
            m += 1
        return m, argmax[m]
    p_all = torch.softmax(target_logits.double() / temperature, -1)
    for i, tok in enumerate(drafts):
        p, q = p_all[i], probs[i]
        q_tok = 1.0 if q is None else float(q[tok])
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if u < min(1.0, float(p[tok]) / q_tok):
            continue
        if q is None:  # one-hot q: the residual is p without the rejected token
            residual = p.clone()
            residual[tok] = 0.0
        else:
            residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0:
            residual = p
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p_all[len(drafts)], 1, generator=gen))


def _sample(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(
        torch.multinomial(torch.softmax(logits.double() / temperature, -1), 1, generator=gen)
    )


@torch.no_grad()
def simulate_request(
    target: TargetModel,
    drafting: _Drafting,
    prompt_ids: list[int],
    max_tokens: int,
    gen: torch.Generator,
    counts: list[int],
    steps: list[StepRecord] | None = None,
) -> list[int]:
    """Run one request; adds to ``counts`` = [drafts, draft tokens, accepted, per-pos...]
    and, when given, one :class:`StepRecord` per verification step to ``steps``."""
    k, temp = drafting.k, drafting.temperature
    drafting.reset()
    tokens = torch.tensor(prompt_ids)
    aux, last, cache = target.extend(tokens[None], None, use_cache=True)
    aux = aux[0]  # a_0..a_{n-1}: aux states of every token the target has accepted
    nxt = _sample(target.logits_from_hidden(last[0, -1]), temp, gen)
    out = [nxt]
    while len(out) < max_tokens:
        drafts, probs = drafting(tokens, aux, nxt, gen)
        # The target scores [x_n, d_1..d_K] on top of its KV cache (vLLM's verify step).
        step_aux, last, cache = target.extend(torch.tensor([[nxt, *drafts]]), cache)
        m, bonus = _verify(target.logits_from_hidden(last[0]), drafts, probs, temp, gen)
        if k > m:
            cache.crop(-(k - m))  # drop the rejected drafts' KV (negative = count to remove)
        counts[0] += 1
        counts[1] += k
        counts[2] += m
        if steps is not None:
            steps.append(StepRecord(len(tokens) + 1, m))  # context + the sampled x_n
        for i in range(m):
            counts[3 + i] += 1
        tokens = torch.cat([tokens, torch.tensor([nxt, *drafts[:m]])])
        aux = torch.cat([aux, step_aux[0, : m + 1]])
        nxt = bonus
        out += [*drafts[:m], bonus]
    return out[:max_tokens]


def evaluate_offline(
    target: TargetModel | str | os.PathLike,
    drafter: PEagleDrafter | str | os.PathLike,
    prompts: list[str] | list[list[int]],
    num_speculative_tokens: int,
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    draft_sampling: DraftSampling = "probabilistic",
    seed: int = 0,
    progress: bool = True,
    context_buckets: ContextBuckets | None = None,
) -> OfflineEvalResult:
    """Acceptance figures of ``drafter`` for ``prompts`` (text, tokenized like vLLM, or ids).

    ``context_buckets`` adds the figures per context-length bucket (``result.by_context``).
    """
    from tqdm.auto import tqdm

    if not isinstance(drafter, PEagleDrafter):
        drafter = load_drafter(drafter)
    drafter = drafter.eval()
    aux_ids = drafter.config.eagle_aux_hidden_state_layer_ids
    if not isinstance(target, TargetModel):
        target = TargetModel(target, aux_ids)
    elif aux_ids and list(aux_ids) != target.aux_layer_ids:
        raise ValueError(f"drafter fuses layers {aux_ids}, target taps {target.aux_layer_ids}")
    k = num_speculative_tokens
    id_lists: list[list[int]]
    if prompts and isinstance(prompts[0], str):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target.path)
        id_lists = [tok(p)["input_ids"] for p in prompts]  # type: ignore[arg-type]
    else:
        id_lists = [list(p) for p in prompts]  # type: ignore[arg-type]
    drafting = _Drafting(drafter, k, temperature, draft_sampling)
    counts = [0, 0, 0] + [0] * k
    outputs = []
    gen = torch.Generator().manual_seed(seed)
    steps: list[StepRecord] = []
    for ids in tqdm(id_lists, desc=f"offline eval K={k} T={temperature}", disable=not progress):
        outputs.append(simulate_request(target, drafting, ids, max_tokens, gen, counts, steps))
    counters = SpecDecodeCounters(counts[0], counts[1], counts[2], tuple(counts[3:]))
    by_context = bucket_counters(steps, k, context_buckets) if context_buckets else {}
    return OfflineEvalResult(counters, k, temperature, outputs, by_context)
