"""Publishing a trained drafter: both checkpoint layouts plus a run summary."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm_peagle.checkpoint import atomic_write_json, save_drafter
from vllm_peagle.modeling import PEagleDrafter


def export_run(
    drafter: PEagleDrafter,
    out: str | os.PathLike,
    *,
    target: str | os.PathLike,
    num_speculative_tokens: int,
    summary: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Write ``out/drafter`` (native) and, for P-EAGLE, ``out/drafter-speculators``.

    The speculators layout records the trained K (``speculative_tokens``) and the target
    as verifier; both copy the target's tokenizer files. ``summary`` (history, config...)
    goes to ``out/train_summary.json`` together with the exported paths. Every write is
    atomic, so an interrupted export never leaves a half-written drafter behind.
    """
    out = Path(out)
    paths = {
        "native": str(
            save_drafter(
                drafter,
                out / "drafter",
                num_speculative_tokens=num_speculative_tokens,
                tokenizer_dir=target,
            )
        )
    }
    if drafter.config.is_parallel:
        paths["speculators"] = str(
            save_drafter(
                drafter,
                out / "drafter-speculators",
                layout="speculators",
                num_speculative_tokens=num_speculative_tokens,
                verifier=str(Path(target).resolve()),
                tokenizer_dir=target,
            )
        )
    atomic_write_json(out / "train_summary.json", {**(summary or {}), "exported": paths})
    return paths


def summarize_history(history: list[dict[str, Any]], window: int = 3) -> dict[str, Any]:
    """First/last losses and per-depth accuracies (mean of ``window`` logged points)."""

    def mean(rows: list[dict[str, Any]], key: str) -> Any:
        if key == "loss":
            return round(sum(r["loss"] for r in rows) / len(rows), 4)
        cols = list(zip(*[r[key] for r in rows], strict=True))
        return [round(sum(c) / len(c), 3) if all(x == x for x in c) else None for c in cols]

    head, tail = history[:window], history[-window:]
    return {
        "first_loss": mean(head, "loss"),
        "last_loss": mean(tail, "loss"),
        "first_acc": mean(head, "acc"),
        "last_acc": mean(tail, "acc"),
    }
