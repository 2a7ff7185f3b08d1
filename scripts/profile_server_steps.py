"""Where a server's decoding step goes: plain against P-EAGLE servers, phase by phase.

    python scripts/profile_server_steps.py [--configs none,adaptive] [--idle fixed:1,fixed:7]
        [--temperature 0.7] [--concurrency 1] [--rounds 6] [--requests 8]

Starts one ``vllm-peagle serve`` per bench configuration (``vllm-peagle bench`` names, on the
bench models) with step phase timings on (patch ledger, entry 7), plus ``--idle`` servers
that stay up unmeasured as in a bench sweep. It then sends the same requests
(``--concurrency`` at a time) to each measured server in interleaved rounds, and prints
each server's tokens per second and, per phase, the median and mean milliseconds:

* engine core: ``step`` (a whole engine step), ``schedule``, ``update`` (vLLM's scheduler);
* worker: ``execute`` (the model runner's step up to logits), ``forward`` (the target's
  forward inside it), ``sample`` (sampling and, when drafting, the drafter).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from vllm_peagle.patches import STEP_TIMINGS_ENV

PHASES = ("step", "schedule", "update", "execute", "forward", "sample")


def read_phases(prefix: Path, pids: list[int], since: float) -> dict[str, np.ndarray]:
    """Seconds per phase of the calls that started after ``since`` (``time.perf_counter`` is
    the system-wide monotonic clock on Linux, so the processes' clocks agree)."""
    seconds: dict[str, list[float]] = defaultdict(list)
    for pid in pids:
        path = Path(f"{prefix}.{pid}")
        if path.exists():
            for line in path.read_text().splitlines():
                phase, start, duration = line.split()
                if float(start) >= since:
                    seconds[phase].append(float(duration))
    return {phase: np.array(values) for phase, values in seconds.items()}


def server_pids(log: Path) -> list[int]:
    return sorted(
        {int(pid) for pid in re.findall(r"(?:EngineCore|Worker)\S* pid=(\d+)", log.read_text())}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default="none,adaptive")
    parser.add_argument("--idle", default="", help="configurations kept up but not measured")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="peagle-steps-"))
    os.environ[STEP_TIMINGS_ENV] = str(workdir / "timings")  # inherited by the servers

    from vllm_peagle.bench.configs import resolve
    from vllm_peagle.bench.load import run_load
    from vllm_peagle.bench.server import CPU_SERVE_ARGS, start_server, stop_server, wait_ready
    from vllm_peagle.bench.sweep import bench_prompts
    from vllm_peagle.bench.target import ensure_bench_models

    models = ensure_bench_models()
    names = args.configs.split(",")
    serve_args = [*shlex.split(CPU_SERVE_ARGS), "--max-num-seqs", "8"]
    configs = resolve(names + [n for n in args.idle.split(",") if n], 7, models)
    servers = [start_server(str(models.target), c, workdir / "logs", serve_args) for c in configs]
    measured = servers[: len(names)]
    tok_s: dict[str, list[float]] = defaultdict(list)
    try:
        wait_ready(servers)
        prompts = bench_prompts(args.requests, seed=3)
        load = dict(
            concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=args.temperature
        )
        for server in measured:
            run_load(server.base_url, server.model, prompts[:4], **load)
        since = time.perf_counter()  # the warm-up's steps are left out
        for round_index in range(args.rounds):
            for server in measured if round_index % 2 == 0 else measured[::-1]:
                result = run_load(server.base_url, server.model, prompts, **load)
                tok_s[server.config.name].append(result.output_tokens / result.wall_s)
    finally:
        for server in servers:
            stop_server(server)
    print(
        f"T={args.temperature}, concurrency {args.concurrency}, "
        f"{args.rounds} rounds of {args.requests} requests"
    )
    head = f"{'server':>10} {'tok/s':>7} " + " ".join(f"{p + ' p50/mean ms':>22}" for p in PHASES)
    print(head)
    for server in measured:
        phases = read_phases(workdir / "timings", server_pids(server.log), since)
        cells = []
        for phase in PHASES:
            values = phases.get(phase, np.array([]))
            cells.append(
                f"{np.median(values) * 1e3:9.3f}/{values.mean() * 1e3:<9.3f}"
                if len(values)
                else "-"
            )
        name = server.config.name
        print(
            f"{name:>10} {statistics.median(tok_s[name]):7.1f} "
            + " ".join(f"{c:>22}" for c in cells)
        )
    print(f"logs and timings: {workdir}")


if __name__ == "__main__":
    main()
