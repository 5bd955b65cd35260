"""The dedup pass on plain GraphModules (symbolic_trace: get_attr) and on dynamo graphs (placeholders)."""

from __future__ import annotations

import dataclasses
import logging

import expecttest
import torch
import torch.nn as nn
from torch._dynamo.testing import EagerAndRecordGraphs, normalize_gm

from rope_dedup import DedupReport, RopeDedupBackend, RopePassResult, dedup_rope
from rope_dedup.passes.find_mutations import find_mutations
from rope_dedup.core.store import CanonicalStore


def rope_table(theta: float = 10000.0, dim: int = 8, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(length).float(), freqs)
    return angles.cos(), angles.sin()


class Rope(nn.Module):
    def __init__(self, theta: float = 10000.0) -> None:
        super().__init__()
        cos, sin = rope_table(theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :4], x[..., 4:]
        return torch.cat([x1 * self.cos - x2 * self.sin, x1 * self.sin + x2 * self.cos], -1)


class Layer(nn.Module):
    def __init__(self, theta: float = 10000.0) -> None:
        super().__init__()
        self.rope = Rope(theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rope(x) * 0.5 + x


class Stack(nn.Module):
    def __init__(self, thetas: list[float]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(t) for t in thetas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def storages(model: nn.Module) -> int:
    return len({b.untyped_storage().data_ptr() for b in model.buffers()})


class TestSymbolicTrace(expecttest.TestCase):
    def test_rewrite_reads_one_node_per_table(self) -> None:
        model = Stack([1e4, 1e4, 1e4])
        x = torch.randn(2, 16, 8)
        expected = model(x)
        gm = torch.fx.symbolic_trace(model)
        result = dedup_rope(gm, share_persistent=True)
        self.assertIsInstance(result, RopePassResult)  # a frozen dataclass with PassResult's two fields
        with self.assertRaises(dataclasses.FrozenInstanceError):
            result.modified = False
        self.assertTrue(result.modified)
        gm.graph.lint()
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, x : _torch_Tensor_) -> _torch_Tensor_:
    getitem = x[(Ellipsis, slice(None, 4, None))]
    getitem_1 = x[(Ellipsis, slice(4, None, None))]
    layers_0_rope_cos = getattr(self.layers, "0").rope.cos
    mul = getitem * layers_0_rope_cos
    layers_0_rope_sin = getattr(self.layers, "0").rope.sin
    mul_1 = getitem_1 * layers_0_rope_sin
    sub = mul - mul_1;  mul = mul_1 = None
    mul_2 = getitem * layers_0_rope_sin;  getitem = None
    mul_3 = getitem_1 * layers_0_rope_cos;  getitem_1 = None
    add = mul_2 + mul_3;  mul_2 = mul_3 = None
    cat = torch.cat([sub, add], -1);  sub = add = None
    mul_4 = cat * 0.5;  cat = None
    add_1 = mul_4 + x;  mul_4 = x = None
    getitem_2 = add_1[(Ellipsis, slice(None, 4, None))]
    getitem_3 = add_1[(Ellipsis, slice(4, None, None))]
    mul_5 = getitem_2 * layers_0_rope_cos
    mul_6 = getitem_3 * layers_0_rope_sin
    sub_1 = mul_5 - mul_6;  mul_5 = mul_6 = None
    mul_7 = getitem_2 * layers_0_rope_sin;  getitem_2 = None
    mul_8 = getitem_3 * layers_0_rope_cos;  getitem_3 = None
    add_2 = mul_7 + mul_8;  mul_7 = mul_8 = None
    cat_1 = torch.cat([sub_1, add_2], -1);  sub_1 = add_2 = None
    mul_9 = cat_1 * 0.5;  cat_1 = None
    add_3 = mul_9 + add_1;  mul_9 = add_1 = None
    getitem_4 = add_3[(Ellipsis, slice(None, 4, None))]
    getitem_5 = add_3[(Ellipsis, slice(4, None, None))]
    mul_10 = getitem_4 * layers_0_rope_cos
    mul_11 = getitem_5 * layers_0_rope_sin
    sub_2 = mul_10 - mul_11;  mul_10 = mul_11 = None
    mul_12 = getitem_4 * layers_0_rope_sin;  getitem_4 = layers_0_rope_sin = None
    mul_13 = getitem_5 * layers_0_rope_cos;  getitem_5 = layers_0_rope_cos = None
    add_4 = mul_12 + mul_13;  mul_12 = mul_13 = None
    cat_2 = torch.cat([sub_2, add_4], -1);  sub_2 = add_4 = None
    mul_14 = cat_2 * 0.5;  cat_2 = None
    add_5 = mul_14 + add_3;  mul_14 = add_3 = None
    return add_5""")
        torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)
        self.assertEqual(storages(model), 2)
        # Module attributes keep their identity and their names in the state dict.
        self.assertEqual(set(dict(model.named_buffers())), {f"layers.{i}.rope.{n}" for i in range(3) for n in ("cos", "sin")})

    def test_report_names_groups_and_bytes(self) -> None:
        model = Stack([1e4, 1e4, 1e6])
        result = dedup_rope(torch.fx.symbolic_trace(model), share_persistent=True)
        report = result.report
        self.assertIsInstance(report, DedupReport)
        self.assertIs(result.graph_module.meta["rope_dedup_report"], report)
        by_layout = {(g.key.layout, g.key.theta): g for g in report.groups}
        cos = by_layout[("cos", 1e4)]
        self.assertEqual(cos.members, ["layers.0.rope.cos", "layers.1.rope.cos"])
        self.assertEqual(cos.key.dim, 8)
        self.assertEqual(cos.key.length, 16)
        self.assertEqual(cos.bytes_saved, 16 * 4 * 4)
        self.assertEqual(by_layout[("cos", 1e6)].members, ["layers.2.rope.cos"])
        self.assertEqual(len(report.groups), 4)
        self.assertEqual(report.bytes_before, 6 * 256)
        self.assertEqual(report.bytes_after, 4 * 256)
        text = str(report)
        self.assertIn("theta=10000 dim=8 len=16 float32 cpu cos", text)
        self.assertIn("saved 512 B", text)

    def test_second_run_changes_nothing(self) -> None:
        model = Stack([1e4, 1e4])
        gm = torch.fx.symbolic_trace(model)
        store = CanonicalStore(share_persistent=True)
        self.assertTrue(dedup_rope(gm, store=store).modified)
        code = gm.code
        self.assertFalse(dedup_rope(gm, store=store).modified)
        self.assertEqual(gm.code, code)

    def test_same_key_different_content_is_reported_not_merged(self) -> None:
        model = Stack([1e4, 1e4])
        with torch.no_grad():
            model.layers[1].rope.cos[3, 1] += 1e-6
        x = torch.randn(1, 16, 8)
        expected = model(x)
        result = dedup_rope(torch.fx.symbolic_trace(model), share_persistent=True)
        self.assertEqual(model(x).tolist(), expected.tolist())
        conflicts = result.report.conflicts
        self.assertEqual([g.members for g in conflicts], [["layers.1.rope.cos"]])
        self.assertEqual(conflicts[0].conflict_with, "layers.0.rope.cos")
        self.assertIn("WARNING: layers.1.rope.cos has the same key as layers.0.rope.cos", str(result.report))

    def test_report_is_logged(self) -> None:
        model = Stack([1e4, 1e4])
        with self.assertLogs("rope_dedup", level=logging.INFO) as logs:
            torch.compile(model, backend=RopeDedupBackend("eager"))(torch.randn(1, 16, 8))
        self.assertTrue(any("2 distinct RoPE table(s)" in line for line in logs.output))


class WritesInPlace(nn.Module):
    """A lazily filled cache (rotary-embedding-torch) and a table written through a view."""

    def __init__(self) -> None:
        super().__init__()
        cos, sin = rope_table()
        self.register_buffer("cache", torch.zeros(16, 4), persistent=False)
        self.register_buffer("cos", cos.clone(), persistent=False)
        self.register_buffer("cos_copy", cos.clone(), persistent=False)
        self.register_buffer("sin", sin.clone(), persistent=False)
        self.register_buffer("sin_copy", sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[:4] = x[0, :4, :4]
        self.cos[:2].mul_(x[0, 0, 0])
        y = x[..., :4]
        return y * self.cache + y * self.cos + y * self.cos_copy + y * self.sin + y * self.sin_copy


class TestSafety(expecttest.TestCase):
    def test_find_mutations_sees_setitem_and_views(self) -> None:
        recording = EagerAndRecordGraphs()
        torch._dynamo.reset()
        torch.compile(WritesInPlace(), backend=recording)(torch.randn(1, 16, 8))
        written = {node.name: how for node, how in find_mutations(recording.graphs[0]).items()
                   if node.op == "placeholder"}
        self.assertEqual(written, {
            "l_self_buffers_cache_": "setitem",
            "l_self_buffers_cos_": "mul_ on a view of it (getitem_1)",
        })

    def test_written_buffers_are_never_shared(self) -> None:
        model = WritesInPlace()
        result = dedup_rope(torch.fx.symbolic_trace(model), share_persistent=True)
        skipped = {s.path: s.reason for s in result.report.skipped}
        self.assertIn("written in the graph (setitem)", skipped["cache"])
        # symbolic_trace turns the view cos[:2] into a constant that aliases cos: the write still counts.
        self.assertIn("shares memory with _tensor_constant0", skipped["cos"])
        self.assertNotEqual(model.cos.data_ptr(), model.cos_copy.data_ptr())
        self.assertEqual(model.sin.data_ptr(), model.sin_copy.data_ptr())

    def test_written_buffers_are_never_shared_under_compile(self) -> None:
        torch._dynamo.reset()
        model, reference = WritesInPlace(), WritesInPlace()
        backend = RopeDedupBackend("aot_eager")
        compiled = torch.compile(model, backend=backend)
        for _ in range(3):
            x = torch.randn(1, 16, 8)
            torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
        skipped = {s.path: s.reason for s in backend.report.skipped}
        self.assertIn("setitem", skipped["cache"])
        self.assertIn("mul_", skipped["cos"])
        self.assertNotEqual(model.cos.data_ptr(), model.cos_copy.data_ptr())
        self.assertEqual(model.sin.data_ptr(), model.sin_copy.data_ptr())

    def test_trainable_parameters_are_skipped_frozen_ones_shared(self) -> None:
        model = Stack([1e4, 1e4])
        cos = model.layers[0].rope.cos
        del model.layers[0].rope.cos
        model.layers[0].rope.cos = nn.Parameter(cos.clone())
        del model.layers[1].rope.sin
        model.layers[1].rope.sin = nn.Parameter(rope_table()[1], requires_grad=False)
        result = dedup_rope(torch.fx.symbolic_trace(model), share_persistent=True)
        skipped = {s.path: s.reason for s in result.report.skipped}
        self.assertIn("trainable parameter", skipped["layers.0.rope.cos"])
        members = {m for g in result.report.groups for m in g.members}
        self.assertIn("layers.1.rope.sin", members)
        self.assertEqual(model.layers[0].rope.sin.data_ptr(), model.layers[1].rope.sin.data_ptr())

    def test_non_rope_buffers_are_skipped_with_reason(self) -> None:
        class WithMask(Stack):
            def __init__(self) -> None:
                super().__init__([1e4, 1e4])
                self.register_buffer("mask", torch.ones(16, 16).tril())
                self.register_buffer("mask2", torch.ones(16, 16).tril())

            def forward(self, x):
                y = super().forward(x)
                return y + (y[..., :1, :1] * self.mask).sum() + (y[..., :1, :1] * self.mask2).sum()

        model = WithMask()
        result = dedup_rope(torch.fx.symbolic_trace(model), share_persistent=True)
        skipped = {s.path: s.reason for s in result.report.skipped}
        self.assertTrue(skipped["mask"].startswith("not RoPE-like"))
        self.assertNotEqual(model.mask.data_ptr(), model.mask2.data_ptr())


class TestDynamoGraph(expecttest.TestCase):
    def test_rewritten_dynamo_graph(self) -> None:
        recording = EagerAndRecordGraphs()
        torch._dynamo.reset()
        model = Stack([1e4, 1e4])
        x = torch.randn(1, 16, 8)
        out = torch.compile(model, backend=RopeDedupBackend(recording))(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
        self.assertEqual(len(recording.graphs), 1)
        self.assertExpectedInline(normalize_gm(recording.graphs[0].print_readable(print_output=False)), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[1, 16, 8]", L_self_modules_layers_modules_0_modules_rope_buffers_cos_: "f32[16, 4]", L_self_modules_layers_modules_0_modules_rope_buffers_sin_: "f32[16, 4]", L_self_modules_layers_modules_1_modules_rope_buffers_cos_: "f32[16, 4]", L_self_modules_layers_modules_1_modules_rope_buffers_sin_: "f32[16, 4]"):
        l_x_ = L_x_
        l_self_modules_layers_modules_0_modules_rope_buffers_cos_ = L_self_modules_layers_modules_0_modules_rope_buffers_cos_
        l_self_modules_layers_modules_0_modules_rope_buffers_sin_ = L_self_modules_layers_modules_0_modules_rope_buffers_sin_
        l_self_modules_layers_modules_1_modules_rope_buffers_cos_ = L_self_modules_layers_modules_1_modules_rope_buffers_cos_
        l_self_modules_layers_modules_1_modules_rope_buffers_sin_ = L_self_modules_layers_modules_1_modules_rope_buffers_sin_

        x1: "f32[1, 16, 4]" = l_x_[(Ellipsis, slice(None, 4, None))]
        x2: "f32[1, 16, 4]" = l_x_[(Ellipsis, slice(4, None, None))]

        mul: "f32[1, 16, 4]" = x1 * l_self_modules_layers_modules_0_modules_rope_buffers_cos_
        mul_1: "f32[1, 16, 4]" = x2 * l_self_modules_layers_modules_0_modules_rope_buffers_sin_
        sub: "f32[1, 16, 4]" = mul - mul_1;  mul = mul_1 = None
        mul_2: "f32[1, 16, 4]" = x1 * l_self_modules_layers_modules_0_modules_rope_buffers_sin_;  x1 = None
        mul_3: "f32[1, 16, 4]" = x2 * l_self_modules_layers_modules_0_modules_rope_buffers_cos_;  x2 = None
        add: "f32[1, 16, 4]" = mul_2 + mul_3;  mul_2 = mul_3 = None
        cat: "f32[1, 16, 8]" = torch.cat([sub, add], -1);  sub = add = None

        mul_4: "f32[1, 16, 8]" = cat * 0.5;  cat = None
        x: "f32[1, 16, 8]" = mul_4 + l_x_;  mul_4 = l_x_ = None

        x1_1: "f32[1, 16, 4]" = x[(Ellipsis, slice(None, 4, None))]
        x2_1: "f32[1, 16, 4]" = x[(Ellipsis, slice(4, None, None))]

        mul_5: "f32[1, 16, 4]" = x1_1 * l_self_modules_layers_modules_0_modules_rope_buffers_cos_
        mul_6: "f32[1, 16, 4]" = x2_1 * l_self_modules_layers_modules_0_modules_rope_buffers_sin_
        sub_1: "f32[1, 16, 4]" = mul_5 - mul_6;  mul_5 = mul_6 = None
        mul_7: "f32[1, 16, 4]" = x1_1 * l_self_modules_layers_modules_0_modules_rope_buffers_sin_;  x1_1 = l_self_modules_layers_modules_0_modules_rope_buffers_sin_ = None
        mul_8: "f32[1, 16, 4]" = x2_1 * l_self_modules_layers_modules_0_modules_rope_buffers_cos_;  x2_1 = l_self_modules_layers_modules_0_modules_rope_buffers_cos_ = None
        add_2: "f32[1, 16, 4]" = mul_7 + mul_8;  mul_7 = mul_8 = None
        cat_1: "f32[1, 16, 8]" = torch.cat([sub_1, add_2], -1);  sub_1 = add_2 = None

        mul_9: "f32[1, 16, 8]" = cat_1 * 0.5;  cat_1 = None
        x_1: "f32[1, 16, 8]" = mul_9 + x;  mul_9 = x = None
        return (x_1,)
""")
