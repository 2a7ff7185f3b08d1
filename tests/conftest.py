import os

# Engines are started from tests; these must be set before vLLM reads them.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# collective_rpc ships test callables to workers (forward counters, drafter inspection).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import pytest

from vllm_peagle.plugin import register
from vllm_peagle.tiny_models import LocalModels, ensure_local_models

# Reference engines start with VLLM_PLUGINS excluding us; vLLM loads plugins once per process,
# so the first such engine would leave this process without our patches. Register up front.
register()


@pytest.fixture(scope="session")
def local_models() -> LocalModels:
    return ensure_local_models()


@pytest.fixture(scope="session")
def plain_reference(local_models) -> dict[int, list[list[int]]]:
    from tests.engines import plain_greedy_reference

    return plain_greedy_reference(str(local_models.target))
