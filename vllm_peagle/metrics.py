"""Acceptance figures from vLLM's spec-decode counters, with vLLM's own definitions.

* acceptance length AL = 1 + accepted / drafts (the bonus token counts, by convention);
* draft acceptance rate = accepted / draft tokens;
* per-position acceptance = accepted at position i / drafts (unconditional, non-increasing).

Counters are cumulative over a server's life, so a measurement is the difference of two
readings taken before and after the work being measured.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

COUNTER_PREFIX = "vllm:spec_decode_"


@dataclass(frozen=True)
class SpecDecodeCounters:
    """One reading of vLLM's cumulative spec-decode counters."""

    num_drafts: int = 0
    """Drafting steps (one per request per step that carried drafts)."""
    num_draft_tokens: int = 0
    """Draft tokens proposed."""
    num_accepted_tokens: int = 0
    """Draft tokens the target accepted."""
    accepted_per_position: tuple[int, ...] = ()
    """Accepted tokens at draft position 0, 1, ..."""

    @classmethod
    def from_metrics(cls, metrics: Iterable[Any]) -> SpecDecodeCounters:
        """From ``vllm.LLM.get_metrics()`` (Counter ``.value``, Vector ``.values``)."""
        found: dict[str, Any] = {}
        for metric in metrics:
            if metric.name.startswith(COUNTER_PREFIX):
                name = metric.name.removeprefix(COUNTER_PREFIX)
                found[name] = getattr(metric, "values", None) or getattr(metric, "value", 0)
        return cls.from_dict(found)

    @classmethod
    def from_dict(cls, found: Mapping[str, Any]) -> SpecDecodeCounters:
        return cls(
            num_drafts=int(found.get("num_drafts", 0)),
            num_draft_tokens=int(found.get("num_draft_tokens", 0)),
            num_accepted_tokens=int(found.get("num_accepted_tokens", 0)),
            accepted_per_position=tuple(
                int(v) for v in found.get("num_accepted_tokens_per_pos", ())
            ),
        )

    def __sub__(self, earlier: SpecDecodeCounters) -> SpecDecodeCounters:
        width = max(len(self.accepted_per_position), len(earlier.accepted_per_position))
        now = self.accepted_per_position + (0,) * (width - len(self.accepted_per_position))
        before = earlier.accepted_per_position + (0,) * (width - len(earlier.accepted_per_position))
        return SpecDecodeCounters(
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            accepted_per_position=tuple(a - b for a, b in zip(now, before, strict=True)),
        )

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def acceptance_rate(self) -> float:
        if not self.num_draft_tokens:
            return float("nan")
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        if not self.num_drafts:
            return ()
        return tuple(a / self.num_drafts for a in self.accepted_per_position)
