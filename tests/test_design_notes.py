"""Dynamo facts the rope_dedup design rests on, one test each, the fact stated in the test's docstring.

Measured with torch 2.13.0 (CPU wheel): re-check them when torch changes. Toy decoders are from
``rope_dedup.testing.toy_decoder``: attention layers that each own a RoPE module with ``cos``/``sin`` buffers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs
from torch._dynamo.utils import counters
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, rope_tensors

from rope_dedup import RopeDedupBackend
from rope_dedup.core.sources import InputOrigin, placeholder_origin


class RecordOrigins(EagerAndRecordGraphs):
    """Also keeps, per graph, each placeholder's origin and example input, read while the backend runs:
    dynamo drops the ``grapharg`` meta after compiling, and keeps only fake tensors in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.origins: list[list[tuple[InputOrigin, torch.Tensor]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        placeholders = gm.graph.find_nodes(op="placeholder")
        self.origins.append([(placeholder_origin(n), t) for n, t in zip(placeholders, example_inputs)])
        return super().__call__(gm, example_inputs)


def test_buffers_arrive_as_placeholders_that_are_the_module_tensors() -> None:
    """With ``torch._dynamo.config.inline_inbuilt_nn_modules = True`` (the default), parameters and buffers
    arrive as placeholders of the FX graph, in the order of ``example_inputs``, and ``example_inputs[i]``
    is the very same tensor object as the module's buffer (``is`` holds), not a copy. The placeholder's
    ``grapharg`` source (private API, read in one place: ``placeholder_origin``) spells the module path
    (``layers.1.attention.rope.cos``) and whether it is a buffer, a parameter or a forward input."""
    recorded = RecordOrigins()
    model = ToyDecoder(homogeneous(2))
    torch.compile(model, backend=recorded)(torch.randint(0, 64, (1, 8)))
    assert len(recorded.graphs) == 1
    origins = {where.path: (where.origin, tensor) for where, tensor in recorded.origins[0]}
    origin, tensor = origins["layers.1.attention.rope.cos"]
    assert origin == "buffer"
    assert tensor is model.layers[1].attention.rope.cos
    assert origins["layers.0.attention.qkv.weight"][0] == "parameter"
    assert origins["tokens"][0] == "input"


def test_regional_compile_calls_the_backend_once() -> None:
    """Each block compiled on its own (torchtitan, PyTorch's regional compilation advice): the backend is
    called once, with layer 0's two rope placeholders, and every other block reuses that graph with its
    own buffers passed in at run time. So a pass that only rewrites at compile time shares nothing there:
    the compiled callable must also intern RoPE inputs at run time."""
    recorded = RecordOrigins()
    model = ToyDecoder(homogeneous(4))
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=recorded)
    model(torch.randint(0, 64, (1, 8)))
    model(torch.randint(0, 64, (1, 8)))
    assert len(recorded.graphs) == 1
    rope = [(origin.path, tensor) for origin, tensor in recorded.origins[0] if ".rope." in origin.path]
    assert [path for path, _ in rope] == ["attention.rope.cos", "attention.rope.sin"]  # relative to the block
    layer0 = model.layers[0]._orig_mod.attention.rope
    assert rope[0][1] is layer0.cos and rope[1][1] is layer0.sin


def test_set_sharing_does_not_recompile() -> None:
    """Inside the backend, after checking ``torch.equal(dup, canonical)``, ``dup.set_(canonical)`` makes the
    duplicate share the canonical storage: the module keeps its attribute and the tensor its identity, so
    later calls with new inputs of the same shape cause no recompile (one frame compiled, ``unique_graphs``
    stays 1)."""
    counted = CompileCounterWithBackend(RopeDedupBackend("eager"))
    model = ToyDecoder(homogeneous(4))
    compiled = torch.compile(model, backend=counted)
    for _ in range(3):
        compiled(torch.randint(0, 64, (1, 8)))
    assert counted.frame_count == 1
    assert counters["stats"]["unique_graphs"] == 1
    assert len({t.data_ptr() for _, t in rope_tensors(model)}) == 2


def test_dynamo_reset_keeps_counters() -> None:
    """``torch._dynamo.reset()`` does not clear ``torch._dynamo.utils.counters``: tests that count graphs,
    recompiles or rewrites clear them themselves (``tests/conftest.py`` does, around every test)."""
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
    """In-place writes to a buffer are visible in the dynamo graph (``operator.setitem``, or a call whose
    target ends in ``_``, such as ``mul_``, on the placeholder or a view of it), and a buffer written
    anywhere in a graph must not be shared. Shared by one graph, then found written by another compiled
    later: it gets its storage back."""
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
    """Writes outside the compiled graph (after a graph break, or in user code between steps) cannot be
    seen by the pass: a documented limit. ``rope_dedup.unshare`` is the way out: every table gets its own
    storage back, and a later write changes only the table written."""
    import rope_dedup

    model = ToyDecoder(homogeneous(3))
    backend = RopeDedupBackend("eager")
    compiled = torch.compile(model, backend=backend)
    tokens = torch.randint(0, 64, (1, 8))
    compiled(tokens)
    assert len({t.data_ptr() for _, t in rope_tensors(model)}) == 2
    released = rope_dedup.unshare(model)
    assert sorted(released) == sorted(name for name, _ in rope_tensors(model))
    assert len({t.data_ptr() for _, t in rope_tensors(model)}) == 6
    with torch.no_grad():
        model.layers[2].attention.rope.cos.mul_(0.5)  # a write outside the graph: now only layer 2 sees it
    torch.testing.assert_close(compiled(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    assert len({t.data_ptr() for _, t in rope_tensors(model)}) == 6
    assert "released by rope_dedup.unshare" in str(backend.report)
