"""vLLM general-plugin entry point (``vllm.general_plugins`` → ``register``).

vLLM calls ``register()`` in every process it starts, so it must stay idempotent, cheap and
device-free: it only installs import-time patches (see :mod:`vllm_peagle.patches`).
"""

from __future__ import annotations

import logging

from vllm_peagle import patches

# A child of the "vllm" logger, so messages go through the handlers vLLM configures.
logger = logging.getLogger("vllm.vllm_peagle")
_registered = False


def register() -> None:
    """Make ``"method": "peagle"`` available to this process's vLLM."""
    global _registered
    if _registered:
        return
    _registered = True
    version = patches.vllm_version()
    if not patches.is_supported_vllm(version):
        logger.warning(patches.unsupported_vllm_message(version))
        patches.apply_version_guard_only()
        return
    patches.apply_all()
