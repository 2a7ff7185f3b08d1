"""How far apart do two bench servers measure, run for run and session for session?

    python scripts/server_pair_noise.py [--configs none,none] [--sessions 3] [--rounds 6]
        [--concurrency 1] [--requests 8] [--temperature 0.7]

Starts the two configurations (``vllm-peagle bench`` names, on the bench models; the same
name twice measures two identical servers), sends the same requests to each in alternating
order for ``--rounds`` rounds, prints the second's tok/s over the first's per round and the
median per session, then stops both and starts them afresh for the next session. Identical
servers whose session medians differ far more than their rounds scatter are a placement
effect shared by every run of those processes: what ``vllm-peagle bench --fresh-servers``
turns into noise the median over repeats removes.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default="none,none")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    names = args.configs.split(",")
    if len(names) != 2:
        raise SystemExit("--configs takes exactly two bench configuration names, e.g. none,none")

    from vllm_peagle.bench.configs import resolve
    from vllm_peagle.bench.load import run_load
    from vllm_peagle.bench.server import CPU_SERVE_ARGS, start_server, stop_server, wait_ready
    from vllm_peagle.bench.sweep import bench_prompts
    from vllm_peagle.bench.target import ensure_bench_models

    models = ensure_bench_models()
    serve_args = [*shlex.split(CPU_SERVE_ARGS), "--max-num-seqs", str(args.concurrency)]
    prompts = bench_prompts(max(args.requests, 4))
    log_dir = Path(tempfile.mkdtemp(prefix="peagle-pair-"))
    medians = []
    for session in range(args.sessions):
        servers = [
            start_server(str(models.target), c, log_dir, serve_args)
            for c in resolve(names, 7, models)
        ]
        try:
            wait_ready(servers)
            for server in servers:  # first-call costs, then steady state at the temperature
                for temperature in (0.0, args.temperature):
                    run_load(
                        server.base_url,
                        server.model,
                        prompts[:4],
                        concurrency=1,
                        max_tokens=args.max_tokens,
                        temperature=temperature,
                    )
            ratios = []
            for round_ in range(args.rounds):
                tok_s = {}
                for index in (0, 1) if round_ % 2 == 0 else (1, 0):
                    load = run_load(
                        servers[index].base_url,
                        servers[index].model,
                        prompts[: args.requests],
                        concurrency=args.concurrency,
                        max_tokens=args.max_tokens,
                        temperature=args.temperature,
                    )
                    tok_s[index] = load.output_tokens / load.wall_s
                ratios.append(tok_s[1] / tok_s[0])
                print(
                    f"session {session} round {round_}: {tok_s[0]:.1f} and {tok_s[1]:.1f} tok/s, "
                    f"{names[1]}/{names[0]} {ratios[-1]:.3f}",
                    flush=True,
                )
            medians.append(statistics.median(ratios))
            print(f"session {session}: median {medians[-1]:.3f}", flush=True)
        finally:
            for server in servers:
                stop_server(server)
    print("session medians: " + " ".join(f"{m:.3f}" for m in medians))


if __name__ == "__main__":
    main()
