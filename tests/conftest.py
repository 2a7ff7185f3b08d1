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


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small ops: extra threads only add synchronisation (and crawl on a shared machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def local_models() -> LocalModels:
    return ensure_local_models()


@pytest.fixture(scope="session")
def plain_reference(local_models):
    from tests.engines import plain_greedy_reference

    return plain_greedy_reference(str(local_models.target))


@pytest.fixture(scope="session")
def trained_peagle(local_models):
    """A briefly trained P-EAGLE drafter (K=4, native layout): drafts that get accepted, so
    engine tests exercise acceptance, not only rejection. ~90 s once, then cached."""
    from vllm_peagle.training.quick import quick_train_drafter

    return quick_train_drafter(local_models.target, kind="peagle", num_depths=4)
