"""Closed-loop load on an OpenAI-compatible completions endpoint, one streamed request each.

``concurrency`` client threads each send their next request as soon as the previous one
finishes, so the server sees exactly that many requests in flight (vLLM's ``bench serve``
with ``--max-concurrency`` does the same). Output lengths are fixed with ``ignore_eos`` and
``min_tokens`` so every configuration generates the same number of tokens; the count
comes from the server's ``usage`` block, not from the client's guess.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class RequestResult:
    """Timing of one streamed request."""

    ttft_s: float
    """Seconds from sending to the first streamed token."""
    latency_s: float
    """Seconds from sending to the end of the stream."""
    output_tokens: int
    """Completion tokens as the server counted them."""
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT definition)."""
        if self.error or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadResult:
    """All requests of one run and its wall-clock time."""

    requests: list[RequestResult]
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests if r.error is None)

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.requests if r.error is not None]


def stream_completion(
    base_url: str,
    body: dict,
    timeout: float = 600.0,
) -> RequestResult:
    """POST ``body`` to ``/v1/completions`` with streaming and time the stream."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    payload = json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}
    ).encode()
    start = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    try:
        conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            detail = response.read().decode(errors="replace")[:300]
            return RequestResult(0.0, 0.0, 0, f"HTTP {response.status}: {detail}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    except (OSError, ValueError, http.client.HTTPException) as err:
        return RequestResult(0.0, 0.0, 0, f"{type(err).__name__}: {err}")
    finally:
        conn.close()
    latency = time.perf_counter() - start
    if ttft is None:
        return RequestResult(0.0, latency, tokens, "stream ended without a token")
    return RequestResult(ttft, latency, tokens)


def completion_body(
    model: str, prompt: str, max_tokens: int, temperature: float, seed: int | None
) -> dict:
    """A request generating exactly ``max_tokens`` tokens (EOS ignored)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": temperature,
    }
    if seed is not None:
        body["seed"] = seed
    return body


def run_load(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    *,
    concurrency: int,
    max_tokens: int,
    temperature: float,
    seed: int | None = None,
) -> LoadResult:
    """Send every prompt once with ``concurrency`` requests in flight; with a ``seed``,
    request i uses seed ``seed + i`` so a sampled run is reproducible per request."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: list[RequestResult | None] = [None] * len(prompts)
    lock = threading.Lock()
    next_index = [0]

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(prompts):
                return
            request_seed = None if seed is None else seed + i
            body = completion_body(model, prompts[i], max_tokens, temperature, request_seed)
            results[i] = stream_completion(base_url, body)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return LoadResult([r for r in results if r is not None], wall)
