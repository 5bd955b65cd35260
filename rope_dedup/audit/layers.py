"""One rule for a layer's name, used by every part of the audit.

A layer is a module path up to and including its first numeric component (``model.layers.5``): how a
``ModuleList`` of blocks names its blocks. A path without one is a layer of its own
(``model.rotary_emb``), and the model itself is ``(model)``. A layer's index is that component.
"""

from __future__ import annotations

from typing import Iterable

MODEL = "(model)"


def layer_of(module: str) -> str:
    """The layer a module (or a tensor inside it) belongs to: ``model.layers.5.self_attn`` -> ``model.layers.5``."""
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return module or MODEL


def split_layer(path: str) -> tuple[str, str]:
    """``layers.5.attention.rope.cos`` -> (``layers.5``, ``attention.rope.cos``); no index: (owner, attribute)."""
    owner, _, attribute = path.rpartition(".")
    layer = layer_of(owner)
    return layer, path[len(layer) + 1:] if path.startswith(layer + ".") else attribute


def layer_index(path: str) -> int | None:
    """``model.layers.5`` (or any path inside it) -> 5; None for a layer without an index."""
    last = layer_of(path).rpartition(".")[2]
    return int(last) if last.isdigit() else None


def layers_of(paths: Iterable[str]) -> list[str]:
    """Distinct layers of tensor ``paths``, in model order."""
    return sorted({split_layer(p)[0] for p in paths}, key=natural_order)


def natural_order(path: str) -> tuple:
    """Sort key that puts ``layers.10`` after ``layers.9``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))
