"""Pins the dynamo facts in ../shared/DESIGN-NOTES.md that the design rests on (re-check when torch changes)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from rope_dedup.toy_decoder import ToyDecoder, homogeneous, rope_tensors

from rope_dedup import RopeDedupBackend
from rope_dedup.sources import placeholder_origin


def recorder(calls: list):
    """Record each graph's placeholder origins (dynamo drops the ``grapharg`` meta after compiling)."""
    def backend(gm: torch.fx.GraphModule, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        calls.append([(placeholder_origin(n), t) for n, t in zip(placeholders, example_inputs)])
        return gm.forward
    return backend


def test_buffers_arrive_as_placeholders_that_are_the_module_tensors() -> None:
    calls: list = []
    model = ToyDecoder(homogeneous(2))
    torch.compile(model, backend=recorder(calls))(torch.randint(0, 64, (1, 8)))
    origins = {origin.path: (origin.kind, tensor) for origin, tensor in calls[0]}
    kind, tensor = origins["layers.1.attention.rope.cos"]
    assert kind == "buffer"
    assert tensor is model.layers[1].attention.rope.cos
    assert origins["layers.0.attention.qkv.weight"][0] == "parameter"
    assert origins["tokens"][0] == "input"


def test_regional_compile_calls_the_backend_once() -> None:
    calls: list = []
    model = ToyDecoder(homogeneous(4))
    backend = recorder(calls)
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=backend)
    model(torch.randint(0, 64, (1, 8)))
    model(torch.randint(0, 64, (1, 8)))
    assert len(calls) == 1


def test_set_sharing_does_not_recompile() -> None:
    model = ToyDecoder(homogeneous(4))
    compiled = torch.compile(model, backend=RopeDedupBackend("eager"))
    for _ in range(3):
        compiled(torch.randint(0, 64, (1, 8)))
    assert counters["stats"]["unique_graphs"] == 1
    assert len({t.data_ptr() for _, t in rope_tensors(model)}) == 2


def test_dynamo_reset_keeps_counters() -> None:
    counters["rope_dedup"]["probe"] += 1
    torch._dynamo.reset()
    assert counters["rope_dedup"]["probe"] == 1


class Reader(nn.Module):
    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("cos", table, persistent=False)

    def forward(self, x):
        return x * self.cos


class Writer(Reader):
    def forward(self, x):
        self.cos.mul_(1.0)
        return x * self.cos


def test_table_written_by_a_later_graph_is_unshared_first() -> None:
    """Shared by one graph, then found written by another compiled later: it gets its storage back."""
    table = torch.cos(torch.outer(torch.arange(16.0), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)))
    a, b = Reader(table.clone()), Reader(table.clone())
    backend = RopeDedupBackend("eager")
    x = torch.randn(16, 4)
    torch.compile(a, backend=backend)(x)
    torch.compile(b, backend=backend)(x)
    assert a.cos.data_ptr() == b.cos.data_ptr()
    writer = Writer(table.clone())
    writer.cos = b.cos  # the same tensor object, now also read by a graph that writes it
    torch.compile(writer, backend=backend)(x)
    assert a.cos.data_ptr() != b.cos.data_ptr()
    assert torch.equal(a.cos, table)
    skipped = {s.path: s.reason for s in backend.report.skipped}
    assert "written in the graph (mul_)" in skipped["cos"]


def test_unshare_gives_storage_back_and_stops_sharing() -> None:
    import rope_dedup

    model = ToyDecoder(homogeneous(3))
    backend = RopeDedupBackend("eager")
    compiled = torch.compile(model, backend=backend)
    tokens = torch.randint(0, 64, (1, 8))
    compiled(tokens)
    assert len({t.data_ptr() for _, t in rope_tensors(model)}) == 2
    released = rope_dedup.unshare(model, backend)
    assert sorted(released) == sorted(name for name, _ in rope_tensors(model))
    assert len({t.data_ptr() for _, t in rope_tensors(model)}) == 6
    with torch.no_grad():
        model.layers[2].attention.rope.cos.mul_(0.5)  # a write outside the graph: now only layer 2 sees it
    torch.testing.assert_close(compiled(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    assert len({t.data_ptr() for _, t in rope_tensors(model)}) == 6
    assert "released by rope_dedup.unshare" in str(backend.report)
