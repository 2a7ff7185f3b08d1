"""Start, probe and stop ``vllm-peagle serve`` subprocesses for the benchmark."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vllm_peagle.bench.configs import BenchConfig
from vllm_peagle.cpu_env import default_cpu_kv_cache
from vllm_peagle.monitor import Reading, parse_metrics

CPU_SERVE_ARGS = "--dtype float32 --enforce-eager --max-model-len 1024 --gpu-memory-utilization 0.3"
"""Default server arguments on the CPU build (float32: no bf16 matmuls on most CPUs)."""


@dataclass
class Server:
    """A running server of one configuration."""

    config: BenchConfig
    process: subprocess.Popen
    port: int
    log: Path
    model: str
    """The served model name (``vllm serve PATH`` names it after the path)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: str, config: BenchConfig, log_dir: Path, serve_args: list[str]) -> Server:
    """Start ``vllm-peagle serve`` for ``config``; returns at once (see :func:`wait_ready`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_peagle.cli", "serve", str(target)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    if config.speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(config.speculative_config)]
    cmd += [*serve_args, *config.server_args]
    env = {**os.environ}
    default_cpu_kv_cache(env)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{config.name}-{port}.log"
    with open(log, "w") as fh:  # the child keeps its own descriptor
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    return Server(config, proc, port, log, str(target))


def _healthy(server: Server) -> bool:
    try:
        with urllib.request.urlopen(f"{server.base_url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


START_TIMEOUT_S = 1800.0
"""Server start-up limit: a few minutes on an idle machine, far longer on a shared one."""


def wait_ready(servers: list[Server], timeout: float = START_TIMEOUT_S) -> None:
    """Wait until every server answers ``/health``; a server that exits fails with the tail
    of its log."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                tail = "\n".join(server.log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(
                    f"bench server '{server.config.name}' exited with "
                    f"{server.process.returncode} (log {server.log}):\n{tail}"
                )
            if _healthy(server):
                pending.remove(server)
        if pending and time.monotonic() > deadline:
            names = [s.config.name for s in pending]
            raise RuntimeError(
                f"bench servers {names} not healthy after {timeout:.0f} s; "
                "raise --start-timeout on a busy machine"
            )
        if pending:
            time.sleep(1.0)


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def scrape(server: Server) -> Reading:
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode(), time.monotonic())


def scrape_after(server: Server, before: Reading, tokens: int, timeout: float = 5.0) -> Reading:
    """Scrape until the server's generation-token counter has counted ``tokens`` more than
    ``before``: vLLM records a step's stats just after sending its outputs, so a scrape
    right after the last response could miss the last step's spec-decode counts."""
    deadline = time.monotonic() + timeout
    while True:
        after = scrape(server)
        if after.generation_tokens - before.generation_tokens >= tokens:
            return after
        if time.monotonic() > deadline:
            return after
        time.sleep(0.05)
