"""Acceptance bucketed by context length: where a drafter stops keeping up.

Acceptance is known to collapse once the context outgrows what the drafter was trained on
(RoPE positions it never saw, attention over longer histories). The offline evaluation
records, for every verification step, the context length at drafting time (prompt plus
everything generated so far, including the token the target just sampled) and how many
drafts were accepted; this module sorts those steps into buckets ``[0, e1)``,
``[e1, e2)``, ..., ``[e_last, inf)`` and gives vLLM-style counters per bucket, so that
``AL`` and per-position acceptance can be read per context range.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_peagle.metrics import SpecDecodeCounters

DEFAULT_EDGES = (2048, 8192)


@dataclass(frozen=True)
class StepRecord:
    """One verification step of one request."""

    context_len: int
    """Tokens before the drafts: prompt, accepted output and the just-sampled token."""
    accepted: int
    """Drafts accepted in this step (0..K)."""


@dataclass(frozen=True)
class ContextBuckets:
    """Bucket edges in tokens, strictly increasing; ``(2048, 8192)`` = <2k, 2k-8k, >=8k."""

    edges: tuple[int, ...] = DEFAULT_EDGES

    def __post_init__(self) -> None:
        edges = tuple(int(e) for e in self.edges)
        if not edges or edges[0] <= 0 or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(
                f"context bucket edges must be positive and strictly increasing, got {edges}"
            )
        object.__setattr__(self, "edges", edges)

    def index(self, context_len: int) -> int:
        """Bucket of a context length (an edge belongs to the bucket it starts)."""
        return bisect.bisect_right(self.edges, context_len)

    @property
    def labels(self) -> list[str]:
        bounds = [0, *self.edges, None]
        return [f"[{lo}, {'inf' if hi is None else hi})" for lo, hi in itertools.pairwise(bounds)]


def bucket_counters(
    steps: Sequence[StepRecord], k: int, buckets: ContextBuckets
) -> dict[str, SpecDecodeCounters]:
    """vLLM's spec-decode counters per bucket (every bucket present, empty ones zero)."""
    drafts = [0] * len(buckets.labels)
    accepted = [0] * len(buckets.labels)
    per_pos = [[0] * k for _ in buckets.labels]
    for step in steps:
        b = buckets.index(step.context_len)
        drafts[b] += 1
        accepted[b] += step.accepted
        for i in range(step.accepted):
            per_pos[b][i] += 1
    return {
        label: SpecDecodeCounters(drafts[b], drafts[b] * k, accepted[b], tuple(per_pos[b]))
        for b, label in enumerate(buckets.labels)
    }


def counters_summary(counters: SpecDecodeCounters, k: int) -> dict[str, object]:
    """JSON-ready figures of one bucket (AL is null where the bucket saw no step)."""
    n = counters.num_drafts
    return {
        "acceptance_length": round(counters.acceptance_length, 4) if n else None,
        "per_position_acceptance": [
            round(a / n, 4) if n else None for a in counters.accepted_per_position[:k]
        ],
        "num_drafts": n,
        "num_accepted_tokens": counters.num_accepted_tokens,
    }
