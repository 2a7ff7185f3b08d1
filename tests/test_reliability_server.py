"""A P-EAGLE server under load, client aborts, KV-cache preemption and mixed sampling.

Two `vllm-peagle serve` servers (plain and P-EAGLE with the quick-trained drafter) are shared
by the module; every greedy output of the P-EAGLE server must equal the plain server's token
for token (compared as token ids via vLLM's ``return_token_ids``). The preemption test starts
its own P-EAGLE server with a KV cache too small for its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engines import peagle_spec
from tests.test_serve_cli import SERVE_ARGS, free_port, wait_healthy

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 512  # from SERVE_ARGS
NUM_LOAD_REQUESTS = 256
ABORT_EVERY = 10  # one client in ten disconnects mid-stream
REQUEST_TIMEOUT_S = 180.0
BATCH_TIMEOUT_S = 480.0
NUM_PREEMPT_REQUESTS = 16
PREEMPT_OUTPUT_TOKENS = 192
STARTUP_TIMEOUT_S = 600.0  # ~60 s on an idle 2-core machine; generous for shared ones


@dataclass(frozen=True)
class Server:
    url: str
    model: str


def serve(target: Path, spec: dict | None, log: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_peagle.cli", "serve", str(target)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *SERVE_ARGS, *extra]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as fh:
        # Its own process group: stopping a server that is still starting must not orphan
        # its engine core and workers (seen when SIGTERM reaches only the API server).
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left


@pytest.fixture(scope="module")
def tokenizer(local_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(local_models.target))


# A KV cache of 18 blocks of 32 tokens: one max_model_len request plus the drafter's
# lookahead fits; any two requests that grow to PREEMPT_OUTPUT_TOKENS past their prompt
# (100+ tokens) need 20+ blocks, so preemption does not depend on how requests overlap.
SMALL_KV = ("--block-size", "32", "--num-gpu-blocks-override", "18")


@pytest.fixture(scope="module")
def servers(local_models, trained_peagle, tmp_path_factory):
    """Plain and P-EAGLE servers, plus a small-KV P-EAGLE one (started now, waited for later)."""
    logs = tmp_path_factory.mktemp("reliability")
    # The load server runs the serving default (adaptive K, so K varies under load); the
    # preemption one a fixed K, so every step carries drafts through preemption.
    adaptive, fixed = peagle_spec(trained_peagle, adaptive=True), peagle_spec(trained_peagle)
    started: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        started["plain"] = serve(local_models.target, None, logs / "plain.log")
        started["peagle"] = serve(local_models.target, adaptive, logs / "peagle.log")
        started["small"] = serve(local_models.target, fixed, logs / "small.log", *SMALL_KV)
        for name in ("plain", "peagle"):
            wait_healthy(*started[name], timeout=STARTUP_TIMEOUT_S)
        yield {
            name: Server(f"http://127.0.0.1:{port}", str(local_models.target))
            for name, (_, port) in started.items()
        } | {"procs": {name: proc for name, (proc, _) in started.items()}}
    finally:
        for proc, _ in started.values():
            stop(proc)
    assert "vllm-peagle proposer active" in (logs / "peagle.log").read_text()


# --- clients ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool


def load_requests(tokenizer, num: int, seed: int, prompt_len: tuple[int, int]) -> list[Request]:
    """Real code snippets cut to mixed lengths, with mixed output lengths (8..48 tokens)."""
    from vllm_peagle.training.data import stdlib_prompts

    rng = random.Random(seed)
    texts = stdlib_prompts("held_out", num, seed=seed, min_chars=400, max_chars=1600)
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        cut = min(len(ids), rng.randint(*prompt_len))
        out.append(Request(ids[:cut], rng.randint(8, 48), ignore_eos=rng.random() < 0.5))
    return out


def completion_body(server: Server, req: Request, stream: bool) -> dict:
    return {
        "model": server.model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": req.ignore_eos,
        "return_token_ids": True,
        "stream": stream,
    }


async def stream_tokens(
    client: httpx.AsyncClient, server: Server, req: Request, abort_after: int | None = None
) -> list[int] | None:
    """Token ids of one streamed greedy completion; None when the client hung up on purpose."""
    tokens: list[int] = []
    finished = False
    body = completion_body(server, req, stream=True)
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                tokens += choice.get("token_ids") or []
                finished = finished or choice.get("finish_reason") is not None
            if abort_after is not None and len(tokens) >= abort_after:
                return None  # leaving the block closes the connection mid-stream
    assert finished, "stream ended without a finish_reason"
    return tokens


async def run_streams(
    server: Server, requests: list[Request], abort: set[int] = frozenset()
) -> list[list[int] | None]:
    limits = httpx.Limits(max_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        jobs = [
            stream_tokens(client, server, req, abort_after=2 if i in abort else None)
            for i, req in enumerate(requests)
        ]
        return await asyncio.wait_for(asyncio.gather(*jobs), BATCH_TIMEOUT_S)


def metric(server: Server, name: str) -> float:
    """Sum of a metric's samples in a live /metrics scrape."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert values, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def first_diff(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i} (lengths {len(a)}, {len(b)})"


def assert_same_outputs(ours, plain, requests: list[Request]) -> int:
    diffs = [
        f"request {i} (prompt {len(requests[i].prompt)} tokens): {first_diff(o, p)}"
        for i, (o, p) in enumerate(zip(ours, plain, strict=True))
        if o is not None and o != p
    ]
    assert not diffs, f"{len(diffs)} outputs differ from plain decoding: {diffs[:5]}"
    for o, req in zip(ours, requests, strict=True):
        assert o is None or (o and len(o) <= req.max_tokens)
        assert o is None or not req.ignore_eos or len(o) == req.max_tokens
    return sum(o is not None for o in ours)


# --- load and aborts -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def load(tokenizer):
    return load_requests(tokenizer, NUM_LOAD_REQUESTS, seed=8, prompt_len=(4, 400))


@pytest.fixture(scope="module")
def plain_outputs(servers, load):
    outputs = asyncio.run(run_streams(servers["plain"], load))
    assert all(outputs)
    return outputs


def test_load_256_concurrent_streams_equal_plain(servers, load, plain_outputs):
    ours = asyncio.run(run_streams(servers["peagle"], load))
    served = assert_same_outputs(ours, plain_outputs, load)
    assert served == NUM_LOAD_REQUESTS
    assert metric(servers["peagle"], "vllm:spec_decode_num_accepted_tokens_total") > 0
    print(f"load: {served} streamed requests served, 0 differ from plain decoding")


def test_aborted_streams_free_their_kv_blocks(servers, load, plain_outputs):
    peagle = servers["peagle"]
    assert metric(peagle, "vllm:num_requests_running") == 0
    baseline = metric(peagle, "vllm:kv_cache_usage_perc")
    abort = set(range(0, NUM_LOAD_REQUESTS, ABORT_EVERY))
    ours = asyncio.run(run_streams(peagle, load, abort))
    assert [i for i, o in enumerate(ours) if o is None] == sorted(abort)
    served = assert_same_outputs(ours, plain_outputs, load)
    assert served == NUM_LOAD_REQUESTS - len(abort)
    # The server notices each hang-up, aborts the request and returns its blocks.
    for _ in range(60):
        if metric(peagle, "vllm:num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(1))
    assert metric(peagle, "vllm:num_requests_running") == 0
    assert metric(peagle, "vllm:num_requests_waiting") == 0
    assert metric(peagle, "vllm:kv_cache_usage_perc") == baseline
    again = asyncio.run(run_streams(peagle, load[:4]))
    assert again == plain_outputs[:4]
    print(f"aborts: {len(abort)} clients hung up, {served} others served, KV back to {baseline}")


# --- preemption --------------------------------------------------------------------------------


def test_preemption_and_recompute_keep_outputs(servers, tokenizer):
    requests = load_requests(tokenizer, NUM_PREEMPT_REQUESTS, seed=3, prompt_len=(100, 150))
    requests = [Request(r.prompt, PREEMPT_OUTPUT_TOKENS, ignore_eos=True) for r in requests]
    small, proc = servers["small"], servers["procs"]["small"]
    wait_healthy(proc, int(small.url.rsplit(":", 1)[1]), timeout=STARTUP_TIMEOUT_S)
    ours = asyncio.run(run_streams(small, requests))
    preemptions = metric(small, "vllm:num_preemptions_total")
    plain = asyncio.run(run_streams(servers["plain"], requests))
    assert_same_outputs(ours, plain, requests)
    assert preemptions > 0, "the small KV cache never forced a preemption"
    assert proc.poll() is None and metric(small, "vllm:num_requests_running") == 0
    print(f"preemption: {int(preemptions)} preemptions, {len(requests)} requests equal plain")


# --- mixed sampling in one batch ------------------------------------------------------------


def mixed_batch(text_prompt: str, long_ids: list[int], stop_request: dict) -> dict[str, dict]:
    """Request bodies sent together; greedy ones must equal plain decoding exactly."""
    sampled = {"temperature": 0.8, "top_p": 0.9, "top_k": 20}
    return {
        "greedy": {"prompt": text_prompt, "max_tokens": 24, "temperature": 0.0},
        "greedy-stop": {**stop_request, "temperature": 0.0},
        "greedy-max-tokens-1": {"prompt": text_prompt, "max_tokens": 1, "temperature": 0.0},
        "greedy-at-context-limit": {
            "prompt": long_ids[: MAX_MODEL_LEN - 16],
            "max_tokens": 16,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        "greedy-last-slot": {
            "prompt": long_ids[: MAX_MODEL_LEN - 1],
            "max_tokens": 1,
            "temperature": 0.0,
        },
        "greedy-empty-prompt": {"prompt": "", "max_tokens": 8, "temperature": 0.0},
        "prompt-too-long": {"prompt": long_ids[: MAX_MODEL_LEN + 40], "max_tokens": 8},
        # vLLM shortens max_tokens to the room left: greedy to the very last slot.
        "greedy-output-past-limit": {
            "prompt": long_ids[:500],
            "max_tokens": 100,
            "temperature": 0.0,
        },
        "sampled": {"prompt": text_prompt, "max_tokens": 24, "ignore_eos": True, **sampled},
        "sampled-n3": {
            "prompt": text_prompt,
            "max_tokens": 12,
            "n": 3,
            "ignore_eos": True,
            **sampled,
        },
        "sampled-stop": {"prompt": text_prompt, "max_tokens": 40, "stop": ["\n", "def"], **sampled},
        "sampled-seeded": {
            "prompt": text_prompt,
            "max_tokens": 16,
            "seed": 1234,
            "ignore_eos": True,
            **sampled,
        },
        "sampled-max-tokens-1": {"prompt": text_prompt, "max_tokens": 1, "temperature": 1.0},
    }


async def post_all(server: Server, bodies: dict[str, dict]) -> dict[str, tuple[int, dict]]:
    async def post(client: httpx.AsyncClient, body: dict) -> tuple[int, dict]:
        body = {"model": server.model, "return_token_ids": True, **body}
        response = await client.post(f"{server.url}/v1/completions", json=body)
        return response.status_code, response.json()

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        results = await asyncio.wait_for(
            asyncio.gather(*(post(client, body) for body in bodies.values())), BATCH_TIMEOUT_S
        )
    return dict(zip(bodies, results, strict=True))


def choices(reply: dict) -> list[dict]:
    return sorted(reply["choices"], key=lambda c: c["index"])


def error_text(reply: dict) -> str:
    return str(reply.get("error", {}).get("message") or reply.get("message"))


def stop_word_request(tokenizer, load, plain_outputs) -> dict:
    """A request whose greedy output (known from the plain server) contains its stop word."""
    for req, tokens in zip(load, plain_outputs, strict=True):
        text = tokenizer.decode(tokens)
        words = re.findall(r"[A-Za-z_]{4,}", text[len(text) // 3 :])
        if words:
            return {"prompt": req.prompt, "max_tokens": req.max_tokens, "stop": [words[0]]}
    raise AssertionError("no greedy output with a word to stop at")


def test_mixed_sampling_batch_behaves_as_without_speculation(
    servers, load, plain_outputs, tokenizer
):
    long_ids = [t for req in load for t in req.prompt][: MAX_MODEL_LEN + 40]
    stop_request = stop_word_request(tokenizer, load, plain_outputs)
    bodies = mixed_batch("def parse_args(argv):\n    ", long_ids, stop_request)
    ours = asyncio.run(post_all(servers["peagle"], bodies))
    plain = asyncio.run(post_all(servers["plain"], bodies))
    for name, body in bodies.items():
        (status, reply), (plain_status, plain_reply) = ours[name], plain[name]
        assert status == plain_status, (name, reply, plain_reply)
        if status != 200:
            assert status == 400 and error_text(reply) == error_text(plain_reply), name
            continue
        got = choices(reply)
        assert len(got) == body.get("n", 1), name
        for choice in got:
            assert choice["token_ids"], name  # every 200 reply generated something
            assert len(choice["token_ids"]) <= body["max_tokens"], name
            if body.get("ignore_eos"):
                assert len(choice["token_ids"]) == body["max_tokens"], name
            assert not any(stop in choice["text"] for stop in body.get("stop", [])), name
        if body.get("temperature") == 0.0:
            want = choices(plain_reply)
            assert [(c["token_ids"], c["text"], c["finish_reason"]) for c in got] == [
                (c["token_ids"], c["text"], c["finish_reason"]) for c in want
            ], name
    assert ours["prompt-too-long"][0] == 400
    assert any(c["finish_reason"] == "stop" for c in choices(ours["greedy-stop"][1]))
    print("mixed:", {name: status for name, (status, _) in ours.items()})
