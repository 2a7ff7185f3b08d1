"""The benchmark target: a Llama larger than the test fixture, with briefly trained drafters.

The test fixture (4 layers, hidden 256) is so small that a drafter forward costs about as
much as a target forward, which hides what speculation buys in real serving. This target
(8 layers, hidden 512) keeps the cost structure closer to real serving: a drafter step is
a fraction of a target step. Built with the same cached, offline builder as the fixture
(:func:`vllm_peagle.tiny_models.ensure_local_models`), then a P-EAGLE and an EAGLE-3 drafter
are trained on it with our own trainer (:func:`quick_train_drafter`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_peagle.tiny_models import BuildSettings, LocalModels, default_cache_dir

BENCH_SETTINGS = BuildSettings(
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=1408,
    # Short windows and few steps keep the build within ~20 min on 2 cores; the target is
    # undertrained (see build_report.json), which the benchmark does not need it to be less.
    seq_len=128,
    batch_size=8,
    train_steps=60,
    eval_windows=16,
    drafter_layers=1,  # the builder's own untrained drafters are not used by the benchmark
    aux_layer_ids=(2, 4, 5),
    num_speculative_tokens=7,
)
"""Build settings of the benchmark target (hashed into its cache key like the fixture's)."""

DRAFTER_DEPTHS = 7
"""K the drafters are trained for; the benchmark serves any K up to this."""

DRAFTER_STEPS = 40
"""Training steps per drafter (quick_train_drafter's small-batch recipe)."""


@dataclass(frozen=True)
class BenchModels:
    """A target and the two trained drafters the benchmark compares."""

    target: Path
    peagle: Path
    """P-EAGLE drafter (native layout): served by upstream P-EAGLE and by ours."""
    eagle3: Path
    """EAGLE-3 drafter trained on the same data and budget."""
    root: Path


def bench_cache_dir() -> Path:
    return default_cache_dir() / "bench"


def ensure_bench_models(
    *, threads: int | None = 2, progress: bool = True, steps: int = DRAFTER_STEPS
) -> BenchModels:
    """Build (or find cached) the benchmark target and train its drafters."""
    from vllm_peagle.tiny_models import ensure_local_models
    from vllm_peagle.training.quick import quick_train_drafter

    local = ensure_local_models(bench_cache_dir(), BENCH_SETTINGS, progress=progress)
    return _with_drafters(local, DRAFTER_DEPTHS, steps, threads, progress, quick_train_drafter)


def ensure_tiny_models(*, threads: int | None = 1, progress: bool = False) -> BenchModels:
    """The test fixture's target with quick-trained K=4 drafters (what the CI smoke run uses)."""
    from vllm_peagle.tiny_models import ensure_local_models
    from vllm_peagle.training.quick import quick_train_drafter

    local = ensure_local_models(progress=progress)
    # The default quick-train directories: shared with the tests' trained_peagle fixture.
    return _with_drafters(local, 4, None, threads, progress, quick_train_drafter)


def _with_drafters(
    local: LocalModels,
    depths: int,
    steps: int | None,
    threads: int | None,
    progress: bool,
    train: Callable[..., Path],
) -> BenchModels:
    drafters = {}
    for kind in ("peagle", "eagle3"):
        t0 = time.perf_counter()
        where = None if steps is None else local.root / f"quick-{kind}-k{depths}-s{steps}"
        extra = {} if steps is None else {"steps": steps}
        drafters[kind] = train(
            local.target,
            where,
            kind=kind,
            num_depths=depths,
            threads=threads,
            progress=progress,
            **extra,
        )
        if progress:
            print(f"{kind} drafter ready in {time.perf_counter() - t0:.0f} s: {drafters[kind]}")
    return BenchModels(
        target=local.target, peagle=drafters["peagle"], eagle3=drafters["eagle3"], root=local.root
    )
