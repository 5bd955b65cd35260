"""Build, compile and unwrap toy decoders the same way in every test file.

Graphs are recorded with ``torch._dynamo.testing`` (``EagerAndRecordGraphs``, also as a
``RopeDedupBackend``'s inner backend) and printed for ``assertExpectedInline`` with ``normalize_gm``;
nothing here replaces those.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from rope_dedup.testing.toy_decoder import TableRecipe, ToyDecoder, rope_tensors, unique_storages

Blocks = Callable[[nn.Module], nn.ModuleList]


def toy_blocks(model: nn.Module) -> nn.ModuleList:
    """The per-block ``nn.ModuleList`` of a :class:`ToyDecoder`."""
    return model.layers


def build(specs: list[TableRecipe], seed: int = 0, graph_break: bool = False,
          device: torch.device | str = "cpu") -> ToyDecoder:
    """A toy decoder with seeded weights: two calls with the same arguments give identical models. Built on
    ``device`` (under it, as model code builds there): weights drawn there differ from CPU's draw."""
    torch.manual_seed(seed)
    with torch.device(device):
        return ToyDecoder(specs, graph_break=graph_break)


def compile_model(model: nn.Module, backend, regional: bool, blocks: Blocks | None = toy_blocks) -> nn.Module:
    """``torch.compile(model)``, or with ``regional`` each block compiled on its own (torchtitan style):
    then ``model`` itself is returned, its blocks replaced by their compiled wrappers. ``blocks`` (only
    read when ``regional``) returns the model's ``nn.ModuleList`` of blocks."""
    if not regional:
        return torch.compile(model, backend=backend)
    assert blocks is not None, "regional compile needs the model's blocks"
    layers = blocks(model)
    for i, block in enumerate(layers):
        layers[i] = torch.compile(block, backend=backend)
    return model


def unwrap(model: nn.Module, blocks: Blocks = toy_blocks) -> nn.Module:
    """Undo regional compile in place (no ``_orig_mod`` in module paths) and return ``model``."""
    layers = blocks(model)
    for i, block in enumerate(layers):
        layers[i] = getattr(block, "_orig_mod", block)
    return model


def rope_storages(model: nn.Module) -> int:
    """Unique storages behind the toy model's RoPE tables (by construction, not by recognition)."""
    return unique_storages([t for _, t in rope_tensors(model)])[0]


class WritesItsTable(nn.Module):
    """Scales its block's own cos in place before running it: a graph that writes a table."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.block.attention.rope.cos.mul_(1.0001)
        return self.block(x)
