"""Environment defaults for vLLM's CPU build, shared by everything here that starts an engine."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def default_cpu_kv_cache(env: MutableMapping[str, str] | None = None, gib: int = 1) -> None:
    """Size the CPU build's KV cache (GiB) unless the user has; GPU builds ignore it.

    An empty value counts as unset: vLLM parses it with ``int()``, so ``VLLM_CPU_KVCACHE_SPACE=``
    left over in a shell would otherwise stop every engine at start-up.
    """
    env = os.environ if env is None else env
    if not env.get(KV_CACHE_SPACE_ENV, "").strip():
        env[KV_CACHE_SPACE_ENV] = str(gib)
