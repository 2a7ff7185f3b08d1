"""Environment defaults for vLLM's CPU build."""

import pytest

from vllm_peagle.cpu_env import KV_CACHE_SPACE_ENV, default_cpu_kv_cache


@pytest.mark.parametrize("env", [{}, {KV_CACHE_SPACE_ENV: ""}, {KV_CACHE_SPACE_ENV: " "}])
def test_unset_or_empty_kv_cache_space_gets_the_default(env):
    default_cpu_kv_cache(env)
    assert env[KV_CACHE_SPACE_ENV] == "1"
    int(env[KV_CACHE_SPACE_ENV])  # what vLLM does with it at start-up


def test_a_users_kv_cache_space_is_kept():
    env = {KV_CACHE_SPACE_ENV: "6"}
    default_cpu_kv_cache(env, gib=2)
    assert env == {KV_CACHE_SPACE_ENV: "6"}
