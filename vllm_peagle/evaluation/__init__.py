"""Drafter evaluation: offline acceptance simulation of vLLM's speculative decoding step."""
