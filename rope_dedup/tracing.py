"""``torch.fx.symbolic_trace`` that keeps each buffer's persistence, so traced models share like compiled ones.

Up to torch 2.13, the GraphModule that ``symbolic_trace`` builds registers every buffer it copies from
the model as persistent (torch 2.14 keeps ``persistent=False``). A RoPE cache the model registered with
``persistent=False`` then looks like checkpoint state, and :func:`~rope_dedup.dedup_rope` leaves it
alone by default. Tracing through this function restores what the model said, on every torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx


def symbolic_trace(model: torch.nn.Module, concrete_args: dict[str, Any] | None = None) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace(model, concrete_args)``, with the model's non-persistent buffers kept so."""
    gm = torch.fx.symbolic_trace(model, concrete_args)
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, name = node.target.rpartition(".")
        try:
            original = model.get_submodule(owner_path)
        except AttributeError:  # an attribute the tracer made itself (a constant), not the model's
            continue
        if name in original._non_persistent_buffers_set:
            gm.get_submodule(owner_path)._non_persistent_buffers_set.add(name)
    return gm
