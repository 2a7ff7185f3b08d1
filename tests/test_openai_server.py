"""A P-EAGLE server end to end through the official `openai` client, against a plain server.

Both servers are vLLM's own `vllm serve` (via `vllm-peagle serve`, see test_serve_cli.py).
"""

import re
import subprocess

import pytest
from openai import OpenAI

from tests.engines import PROMPTS, peagle_spec
from tests.test_deploy_manifests import METRIC, SUFFIXES, promql_expressions
from tests.test_serve_cli import free_port, vllm_serve, wait_healthy
from vllm_peagle.monitor import parse_metrics

pytestmark = pytest.mark.engine

CHAT = [{"role": "user", "content": "def fibonacci(n):"}]


@pytest.fixture(scope="module")
def servers(local_models, trained_peagle, tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    started: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for name, spec in (("plain", None), ("peagle", peagle_spec(trained_peagle))):
            port = free_port()
            proc = vllm_serve(local_models.target, spec, port, logs / f"{name}.log")
            started[name] = (proc, port)
            wait_healthy(proc, port)
        yield {
            name: OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            for name, (_, port) in started.items()
        } | {"ports": {name: port for name, (_, port) in started.items()}}
    finally:
        for proc, _ in started.values():
            proc.terminate()
            proc.wait(timeout=60)


def complete(client, model, stream: bool) -> list[str]:
    args = {"model": model, "prompt": PROMPTS[:4], "max_tokens": 32, "temperature": 0.0}
    if not stream:
        out = client.completions.create(**args)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    texts = [""] * 4
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    return texts


def chat(client, model, stream: bool) -> str:
    args = {"model": model, "messages": CHAT, "max_tokens": 32, "temperature": 0.0}
    if not stream:
        return client.chat.completions.create(**args).choices[0].message.content
    parts = client.chat.completions.create(**args, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_equal_plain_server(servers, local_models, stream):
    model = str(local_models.target)
    ours = complete(servers["peagle"], model, stream)
    assert ours == complete(servers["plain"], model, stream)
    assert all(ours)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completions_equal_plain_server(servers, local_models, stream):
    model = str(local_models.target)
    ours = chat(servers["peagle"], model, stream)
    assert ours and ours == chat(servers["plain"], model, stream)


def test_metrics_scrape_has_spec_counters_and_every_metric_we_reference(servers):
    import urllib.request

    port = servers["ports"]["peagle"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    reading = parse_metrics(text, now=0.0)  # the monitor's own parser, on a live scrape
    assert reading.spec_decode_enabled and reading.counters.num_accepted_tokens > 0
    exposed = set(re.findall(r"^(vllm:[a-z_]+)", text, flags=re.MULTILINE))
    for where, expr in promql_expressions().items():
        for name in METRIC.findall(expr):
            base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
            assert name in exposed or base in exposed, f"{where}: {name} not in a live scrape"
