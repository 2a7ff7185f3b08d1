"""Plugin registration: cheap, idempotent, version-guarded."""

import subprocess
import sys

import pytest

from vllm_peagle import patches


def test_register_is_cheap_and_idempotent():
    # A fresh interpreter: registering twice must not import the model runner or torch.
    code = (
        "import sys\n"
        "from vllm_peagle.plugin import register\n"
        "register(); register()\n"
        "heavy = [m for m in ('torch', 'vllm.v1.worker.gpu_model_runner') if m in sys.modules]\n"
        "hooks = [f for f in sys.meta_path if type(f).__name__ == '_PatchOnImport']\n"
        "print(heavy, len(hooks))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] 2"


@pytest.mark.parametrize(
    ("version", "supported"),
    [("0.32.0", True), ("0.33.1", True), ("0.31.9", False), ("0.34.0", False), ("1.0", False)],
)
def test_supported_version_range(version, supported):
    assert patches.is_supported_vllm(version) is supported


def test_unsupported_version_message_names_the_range():
    message = patches.unsupported_vllm_message("0.35.0")
    assert ">=0.32,<0.34" in message and "0.35.0" in message and "Fix:" in message
