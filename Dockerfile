# vLLM's OpenAI server image with the vllm-peagle plugin installed. The plugin registers
# through the `vllm.general_plugins` entry point, so the image's own entrypoint
# (`vllm serve`) picks it up: no wrapper script, no init container.
#   docker build -t vllm-peagle:0.1.0 .
#   docker run --gpus all --ipc=host -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#     vllm-peagle:0.1.0 Qwen/Qwen3-8B \
#     --speculative-config '{"method": "peagle", "model": "RedHatAI/Qwen3-8B-speculator.peagle", "num_speculative_tokens": 7}'
# The plugin is checked against vLLM 0.32 and 0.33 (pyproject's `cuda` extra); pick the tag here.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

# No WORKDIR change: the base image's working directory and ENTRYPOINT stay as they are.
COPY pyproject.toml README.md /opt/vllm-peagle/
COPY vllm_peagle /opt/vllm-peagle/vllm_peagle
# --no-deps: torch, transformers and vLLM itself come with the base image; letting pip
# re-resolve them could replace the image's CUDA build of torch.
RUN python3 -m pip install --no-cache-dir --no-deps /opt/vllm-peagle \
 && python3 -c "from importlib.metadata import entry_points as e; \
assert any(p.value == 'vllm_peagle.plugin:register' for p in e(group='vllm.general_plugins'))"
