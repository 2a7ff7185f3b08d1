"""The ``scheduler_cls`` value of adaptive engines, importable without importing vLLM."""

SCHEDULER_QUALNAME = "vllm_peagle.adaptive.scheduler.adaptive_scheduler"
