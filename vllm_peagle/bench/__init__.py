"""Benchmark harness: no speculation vs EAGLE-3 vs upstream P-EAGLE vs ours, through the
OpenAI-compatible server, with acceptance read from the server's own counters."""
