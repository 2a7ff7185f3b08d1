"""Adaptive speculation: K chosen each step from live acceptance and measured step cost.

``estimates`` (acceptance, step cost) and ``policy`` (the K choice) are plain numpy; only
``scheduler`` imports vLLM, inside the engine core.
"""
