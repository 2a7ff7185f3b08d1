"""Copies of a good drafter checkpoint with one thing broken, for error-path tests."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file


def broken_copy(
    source: Path,
    dest: Path,
    edit_config: Callable[[dict], None] | None = None,
    drop_weights: tuple[str, ...] = (),
) -> Path:
    shutil.copytree(source, dest)
    if edit_config is not None:
        config = json.loads((dest / "config.json").read_text())
        edit_config(config)
        (dest / "config.json").write_text(json.dumps(config, indent=2))
    if drop_weights:
        for weights_file in dest.glob("*.safetensors"):
            tensors = load_file(weights_file)
            kept = {k: v for k, v in tensors.items() if not k.endswith(drop_weights)}
            save_file(kept, weights_file)
    return dest


def drop_keys(*keys: str) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for key in keys:
            config.pop(key, None)
            config.get("transformer_layer_config", {}).pop(key, None)

    return edit


def set_keys(**values) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        layer = config.get("transformer_layer_config")
        for key, value in values.items():
            if layer is not None and key in layer:
                layer[key] = value
            else:
                config[key] = value

    return edit
