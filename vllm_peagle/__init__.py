"""vllm-peagle: P-EAGLE parallel drafting for vLLM, from training to serving."""

__version__ = "0.1.0"
