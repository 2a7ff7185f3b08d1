"""What the benchmark compares: a configuration is a name, a speculative config (or None)
and extra server arguments. Adding one (say, adaptive K) is one entry in :data:`CONFIGS`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_peagle.bench.target import BenchModels


@dataclass(frozen=True)
class BenchConfig:
    """One server configuration under test."""

    name: str
    """Short name used in tables, JSON and ratio labels."""
    speculative_config: dict[str, Any] | None
    """``--speculative-config`` of the server; None serves without speculation."""
    server_args: tuple[str, ...] = field(default=())
    """Extra ``vllm serve`` arguments for this configuration only."""

    @property
    def server_key(self) -> str:
        """Configurations with equal keys can share one running server."""
        return json.dumps([self.speculative_config, list(self.server_args)], sort_keys=True)


ConfigFactory = Callable[[int, BenchModels], BenchConfig]
"""Builds a configuration for a number of speculative tokens K and the models in use."""


def _spec(method: str, drafter: object, k: int, **extra: Any) -> dict[str, Any]:
    return {"method": method, "model": str(drafter), "num_speculative_tokens": k, **extra}


CONFIGS: dict[str, ConfigFactory] = {
    "none": lambda k, m: BenchConfig("none", None),
    "eagle3": lambda k, m: BenchConfig("eagle3", _spec("eagle3", m.eagle3, k)),
    # Stock vLLM's own P-EAGLE path, on the same checkpoint as ours.
    "upstream": lambda k, m: BenchConfig(
        "upstream", _spec("eagle3", m.peagle, k, parallel_drafting=True)
    ),
    # Fixed K, so it compares with upstream and EAGLE-3 at the same K.
    "peagle": lambda k, m: BenchConfig("peagle", _spec("peagle", m.peagle, k, adaptive=False)),
    # The serving default: K chosen per step in 0..K (issue #6).
    "adaptive": lambda k, m: BenchConfig("adaptive", _spec("peagle", m.peagle, k)),
    # Ours with K=0 at every batch size: what a speculative engine costs where adaptive K
    # stops drafting, with no policy, probes or drafts (its floor against "none").
    "k0": lambda k, m: BenchConfig(
        "k0",
        _spec(
            "peagle",
            m.peagle,
            k,
            adaptive=False,
            num_speculative_tokens_per_batch_size=[[1, 1024, 0]],
        ),
    ),
}
"""Every known configuration, in table order."""

LABELS = {
    "none": "no speculation",
    "eagle3": "EAGLE-3",
    "upstream": "upstream P-EAGLE",
    "peagle": "P-EAGLE (ours)",
    "adaptive": "P-EAGLE (ours, adaptive K)",
    "k0": "P-EAGLE (ours, K=0 every step)",
}
"""Display names; unknown configurations show their own name."""

OURS = "peagle"
BASELINE = "none"
ADAPTIVE = "adaptive"
FIXED_PREFIX = "fixed:"
"""``fixed:N`` is ours at a fixed K = N whatever the sweep's K: with ``adaptive`` (K_max = the
sweep's K) and ``none`` in one round-robin, adaptive K is compared with every fixed K under
the same machine load."""


def fixed_k(name: str) -> int | None:
    """N of a ``fixed:N`` name, else None."""
    if not name.startswith(FIXED_PREFIX):
        return None
    text = name[len(FIXED_PREFIX) :]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"bench configuration {name!r}: N must be a whole number >= 1 (fixed:4)")
    return int(text)


def label(name: str) -> str:
    k = fixed_k(name)
    return f"P-EAGLE (ours, K={k})" if k is not None else LABELS.get(name, name)


def resolve(names: list[str], k: int, models: BenchModels) -> list[BenchConfig]:
    """The configurations ``names`` at ``K``, with a one-line error for an unknown name."""
    unknown = [n for n in names if n not in CONFIGS and fixed_k(n) is None]
    if unknown:
        raise ValueError(
            f"unknown bench configuration(s) {unknown}; choose from {sorted(CONFIGS)} "
            f"or {FIXED_PREFIX}N (ours at fixed K=N)"
        )
    return [
        CONFIGS[n](k, models)
        if n in CONFIGS
        else BenchConfig(n, _spec("peagle", models.peagle, fixed_k(n) or k, adaptive=False))
        for n in names
    ]


def fixed_choices(names: Sequence[str]) -> list[str]:
    """The configurations adaptive K must match: no speculation and every fixed-K one."""
    return [n for n in names if n in (BASELINE, OURS) or fixed_k(n) is not None]


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """Ratio columns: every configuration against no speculation, then ours against every
    other speculative configuration."""
    pairs = [(n, BASELINE) for n in names if n != BASELINE and BASELINE in names]
    if OURS in names:
        pairs += [(OURS, n) for n in names if n not in (OURS, BASELINE)]
    return pairs
