"""Tables computed in forward: constant ones folded into one shared table, buffer-dependent ones merged."""

from __future__ import annotations

from dataclasses import replace

import expecttest
import pytest
import torch
import torch.nn as nn
from helpers import build
from torch._dynamo.testing import EagerAndRecordGraphs, normalize_gm
from torch._dynamo.utils import counters
from rope_dedup.testing.toy_decoder import COMPUTED_LAYOUTS, TableRecipe, homogeneous

from rope_dedup import RopeDedupBackend
from rope_dedup.config import COMPUTED_TABLE_DEFAULTS
from rope_dedup.passes.find_pure_nodes import find_pure_nodes
from rope_dedup.passes import fold_rope_constants as fold_rope_constants_module
from rope_dedup.passes.fold_rope_constants import fold_rope_constants
from rope_dedup.passes.merge_rope_subgraphs import merge_rope_subgraphs


class ComputedRope(nn.Module):
    """Builds its table from scratch on every call: arange -> pow -> outer -> cos/sin, no state."""

    def __init__(self, theta: float = 10000.0, dim: int = 8, max_len: int = 16) -> None:
        super().__init__()
        self.theta, self.dim, self.max_len = theta, dim, max_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2).float() / self.dim))
        angles = torch.outer(torch.arange(self.max_len, dtype=torch.float32), freqs)
        seq = x.shape[1]
        cos, sin = angles.cos()[:seq], angles.sin()[:seq]
        x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Stack(nn.Module):
    def __init__(self, thetas: list[float]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ComputedRope(t) for t in thetas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 0.5 + x
        return x


TOKENS = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]


def outputs_with(model: nn.Module, backend) -> list[torch.Tensor]:
    compiled = torch.compile(model, backend=backend)
    return [compiled(t) for t in TOKENS]


class TestRewrite(expecttest.TestCase):
    def test_two_layers_read_one_folded_table(self) -> None:
        recording = EagerAndRecordGraphs()
        model, x = Stack([1e4, 1e4]), torch.randn(1, 12, 8)
        backend = RopeDedupBackend(recording, fold_constants=True, merge_computed=True)
        out = torch.compile(model, backend=backend)(x)
        gm = recording.graphs[0]
        gm.graph.lint()
        self.assertExpectedInline(normalize_gm(gm.code), """\

def forward(self, L_x_ : torch.Tensor):
    l_x_ = L_x_
    _rope_folded0 = self._rope_folded0
    _rope_folded1 = self._rope_folded1
    x1 = l_x_[(Ellipsis, slice(None, 4, None))]
    x2 = l_x_[(Ellipsis, slice(4, None, None))]
    mul = x1 * _rope_folded0
    mul_1 = x2 * _rope_folded1
    sub = mul - mul_1;  mul = mul_1 = None
    mul_2 = x1 * _rope_folded1;  x1 = None
    mul_3 = x2 * _rope_folded0;  x2 = None
    add = mul_2 + mul_3;  mul_2 = mul_3 = None
    cat = torch.cat([sub, add], -1);  sub = add = None
    mul_4 = cat * 0.5;  cat = None
    x = mul_4 + l_x_;  mul_4 = l_x_ = None
    x1_1 = x[(Ellipsis, slice(None, 4, None))]
    x2_1 = x[(Ellipsis, slice(4, None, None))]
    mul_5 = x1_1 * _rope_folded0
    mul_6 = x2_1 * _rope_folded1
    sub_1 = mul_5 - mul_6;  mul_5 = mul_6 = None
    mul_7 = x1_1 * _rope_folded1;  x1_1 = _rope_folded1 = None
    mul_8 = x2_1 * _rope_folded0;  x2_1 = _rope_folded0 = None
    add_2 = mul_7 + mul_8;  mul_7 = mul_8 = None
    cat_1 = torch.cat([sub_1, add_2], -1);  sub_1 = add_2 = None
    mul_9 = cat_1 * 0.5;  cat_1 = None
    x_1 = mul_9 + x;  mul_9 = x = None
    return (x_1,)
""")
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
        # A (12, 4) slice of the (16, 4) table: the constant keeps only its 12 rows, with the slice's strides.
        self.assertEqual(gm._rope_folded0.shape, (12, 4))
        self.assertEqual(gm._rope_folded0.untyped_storage().nbytes(), 12 * 4 * 4)
        self.assertEqual(counters["rope_dedup"]["folded_tables"], 2)

    def test_without_merge_identical_subgraphs_still_fold_into_one_table(self) -> None:
        recording = EagerAndRecordGraphs()
        model, x = Stack([1e4, 1e4, 1e6]), torch.randn(1, 16, 8)
        backend = RopeDedupBackend(recording, fold_constants=True, merge_computed=False)
        out = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
        self.assertEqual(counters["rope_dedup"]["folded_tables"], 4)  # cos, sin per theta
        self.assertEqual(counters["rope_dedup"]["folded_nodes"], 6)
        self.assertNotIn("merged_nodes", counters["rope_dedup"])
        gm = recording.graphs[0]
        self.assertEqual(sorted(n.target for n in gm.graph.nodes if n.op == "get_attr"),
                         [f"_rope_folded{i}" for i in range(4)])
        # Nothing of the computation is left: no arange, pow, outer, cos or sin.
        self.assertFalse(any(n.op == "call_function" and n.target in (torch.arange, torch.outer)
                             for n in gm.graph.nodes))

    def test_pass_alone_on_a_dynamo_graph_and_a_second_run_changes_nothing(self) -> None:
        recording = EagerAndRecordGraphs()
        model, x = Stack([1e4, 1e4]), torch.randn(1, 16, 8)
        torch.compile(model, backend=recording)(x)
        gm = recording.graphs[0]
        result = fold_rope_constants(gm)
        self.assertTrue(result.modified)
        self.assertEqual([(f.attribute, f.name, len(f.replaced), f.status) for f in result.folded], [
            ("_rope_folded0", "layers.0:cos_1", 2, "canonical"),
            ("_rope_folded1", "layers.0:sin_1", 2, "canonical"),
        ])
        torch.testing.assert_close(gm(x)[0], model(x), rtol=0, atol=0)
        code = gm.code
        self.assertFalse(fold_rope_constants(gm).modified)
        self.assertEqual(gm.code, code)


@pytest.mark.parametrize("layout,inner", [
    ("computed", "eager"), ("from_inv_freq", "eager"), ("computed", "aot_eager"), ("from_inv_freq", "aot_eager")])
def test_bitwise_equal_to_the_compile_without_transforms(layout: str, inner: str) -> None:
    specs = [TableRecipe(layout=layout), TableRecipe(layout=layout, theta=1e6, scaling="yarn", dtype=torch.bfloat16),
             TableRecipe(layout=layout)]
    plain = outputs_with(build(specs), RopeDedupBackend(inner, fold_constants=False, merge_computed=False))
    plain_graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    model = build(specs)
    eager = [model(t) for t in TOKENS]
    backend = RopeDedupBackend(inner, fold_constants=True, merge_computed=True)
    got = outputs_with(model, backend)
    for g, p, e in zip(got, plain, eager):
        torch.testing.assert_close(g, p, rtol=0, atol=0)
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == plain_graphs  # three calls, no extra recompile
    assert not backend.report.errors
    if layout == "computed":  # theta 1e4, and 1e6 yarn bf16: two (cos, sin) pairs, each held once
        assert counters["rope_dedup"]["folded_tables"] == 4
        # Each q or k call builds its table anew: 19 nodes for theta 1e4 (arange(0, 16, 2) on the input's
        # device, float, / 16, pow, 1 / ., arange(128), outer, then cos and sin each * mscale, [:seq], two .to,
        # cat) and 29 for the yarn table (its ramp adds 10). Four calls read the 1e4 table (layers 0 and 2, q
        # and k): 3 x 19 merged; two the yarn one: 29 more; and the yarn table's first call repeats the
        # 1e4 table's arange(0, 16, 2), float, / 16 and arange(128): 4 more.
        assert counters["rope_dedup"]["merged_nodes"] == 3 * 19 + 29 + 4
    else:
        assert "folded_tables" not in counters["rope_dedup"]  # reads the inv_freq buffer: merged only
        # 17 nodes per q or k call (arange(seq), [None, None, :], inv_freq[None, :, None], float, @,
        # transpose, [0], then cos and sin each * mscale, .to(dtype), .to(x.dtype), cat); once dedup points
        # layer 2's inv_freq at layer 0's: 3 x 17 for the theta 1e4 calls, 17 for the yarn table's second
        # call, and the yarn table's first call repeats arange(seq) and its [None, None, :]: 2 more.
        assert counters["rope_dedup"]["merged_nodes"] == 3 * 17 + 17 + 2


def test_inductor_default_leaves_computed_tables_alone() -> None:
    """Folding would make inductor's outputs differ in the last bits: off by default there, opt-in works."""
    model, x = Stack([1e4, 1e4]), torch.randn(2, 12, 8)
    plain = torch.compile(model, backend="inductor")(x)
    torch._dynamo.reset()
    out = torch.compile(model, backend=RopeDedupBackend("inductor"))(x)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    assert "folded_tables" not in counters["rope_dedup"] and "merged_nodes" not in counters["rope_dedup"]
    torch._dynamo.reset()
    opted = torch.compile(model, backend=RopeDedupBackend("inductor", fold_constants=True))(x)
    torch.testing.assert_close(opted, model(x), rtol=1e-6, atol=1e-6)
    assert counters["rope_dedup"]["folded_tables"] == 2


@pytest.mark.slow
def test_inductor_matches_eager() -> None:
    """Under inductor the table is eager's (aten cos/sin), not inductor's fused one: equal within rounding."""
    model = build(homogeneous(3, layout="computed"))
    eager = [model(t) for t in TOKENS]
    backend = RopeDedupBackend("inductor", fold_constants=True, merge_computed=True)
    for got, want in zip(outputs_with(model, backend), eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counters["rope_dedup"]["folded_tables"] == 2


def test_report_lists_each_folded_table_once_across_graphs() -> None:
    backend = RopeDedupBackend("eager", fold_constants=True, merge_computed=True)
    first, second = build(homogeneous(4, layout="computed")), build(homogeneous(2, layout="computed"), seed=1)
    outputs_with(first, backend)
    outputs_with(second, backend)
    groups = {g.key.layout: g for g in backend.report.groups}
    assert set(groups) == {"cos-halves", "sin-halves"}
    for layout, group in groups.items():
        assert [m.split(":")[0] for m in group.members] == ["layers.0.attention.rope"] * 2
        assert (group.key.theta, group.key.dim, group.key.length) == (10000.0, 16, 16)
        assert group.bytes_after == group.table_bytes == 16 * 16 * 4  # the second graph's table shares it
    assert "layers.0.attention.rope:" in str(backend.report)


def test_buffer_dependent_tables_are_merged_not_folded_and_follow_the_buffer() -> None:
    recording = EagerAndRecordGraphs()
    model = build(homogeneous(3, layout="from_inv_freq"))
    compiled = torch.compile(model, backend=RopeDedupBackend(recording, fold_constants=True, merge_computed=True))
    before = compiled(TOKENS[0])
    gm = recording.graphs[0]
    assert not any(n.op == "get_attr" for n in gm.graph.nodes)
    assert [n.target for n in gm.graph.nodes].count("cos") == 1  # one table for 3 layers x (q, k)
    # A new theta written into the (shared) buffers after compiling: the compiled graph reads them.
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.rope.inv_freq.mul_(0.5)
    after = compiled(TOKENS[0])
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, model(TOKENS[0]), rtol=0, atol=0)
    # One layer's buffer replaced by other content: the merged graph no longer applies, the unmerged one runs.
    model.layers[1].attention.rope.inv_freq = model.layers[1].attention.rope.inv_freq * 3
    torch.testing.assert_close(compiled(TOKENS[0]), model(TOKENS[0]), rtol=0, atol=0)
    assert counters["rope_dedup"]["fallbacks"] == 1
    assert len(recording.graphs) == 2  # the unmerged fallback; no recompile by dynamo


class PositionsRope(nn.Module):
    """HF style with positions as a forward argument: depends on run-time values, so only merged."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        angles = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x[..., :4], x[..., 4:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class PositionsStack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PositionsRope() for _ in range(layers))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, position_ids) + x
        return x


class TestMergeRewrite(expecttest.TestCase):
    def test_second_layer_reads_the_first_layer_s_table_nodes(self) -> None:
        """dedup points layer 1's inv_freq placeholder at layer 0's; its table computation is then layer
        0's, node for node, and merging leaves one: layer 1's rotation reads layer 0's cos and sin."""
        recording = EagerAndRecordGraphs()
        model = PositionsStack(2)
        backend = RopeDedupBackend(recording, fold_constants=False, merge_computed=True)
        x, positions = torch.randn(1, 4, 8), torch.arange(4).expand(1, 4)
        out = torch.compile(model, backend=backend)(x, positions)
        torch.testing.assert_close(out, model(x, positions), rtol=0, atol=0)
        gm = recording.graphs[0]
        gm.graph.lint()
        self.assertExpectedInline(normalize_gm(gm.print_readable(print_output=False)), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_modules_layers_modules_0_buffers_inv_freq_: "f32[4]", L_position_ids_: "i64[1, 4]", L_x_: "f32[1, 4, 8]", L_self_modules_layers_modules_1_buffers_inv_freq_: "f32[4]"):
        l_self_modules_layers_modules_0_buffers_inv_freq_ = L_self_modules_layers_modules_0_buffers_inv_freq_
        l_position_ids_ = L_position_ids_
        l_x_ = L_x_
        l_self_modules_layers_modules_1_buffers_inv_freq_ = L_self_modules_layers_modules_1_buffers_inv_freq_

        getitem: "f32[1, 4, 1]" = l_self_modules_layers_modules_0_buffers_inv_freq_[(None, slice(None, None, None), None)];  l_self_modules_layers_modules_0_buffers_inv_freq_ = None
        getitem_1: "i64[1, 1, 4]" = l_position_ids_[(slice(None, None, None), None, slice(None, None, None))];  l_position_ids_ = None
        float_1: "f32[1, 1, 4]" = getitem_1.float();  getitem_1 = None
        matmul: "f32[1, 4, 4]" = getitem @ float_1;  getitem = float_1 = None
        angles: "f32[1, 4, 4]" = matmul.transpose(1, 2);  matmul = None

        cos: "f32[1, 4, 4]" = angles.cos()
        sin: "f32[1, 4, 4]" = angles.sin();  angles = None

        x1: "f32[1, 4, 4]" = l_x_[(Ellipsis, slice(None, 4, None))]
        x2: "f32[1, 4, 4]" = l_x_[(Ellipsis, slice(4, None, None))]

        mul: "f32[1, 4, 4]" = x1 * cos
        mul_1: "f32[1, 4, 4]" = x2 * sin
        sub: "f32[1, 4, 4]" = mul - mul_1;  mul = mul_1 = None
        mul_2: "f32[1, 4, 4]" = x1 * sin;  x1 = None
        mul_3: "f32[1, 4, 4]" = x2 * cos;  x2 = None
        add: "f32[1, 4, 4]" = mul_2 + mul_3;  mul_2 = mul_3 = None
        cat: "f32[1, 4, 8]" = torch.cat([sub, add], -1);  sub = add = None

        x: "f32[1, 4, 8]" = cat + l_x_;  cat = l_x_ = None

        x1_1: "f32[1, 4, 4]" = x[(Ellipsis, slice(None, 4, None))]
        x2_1: "f32[1, 4, 4]" = x[(Ellipsis, slice(4, None, None))]

        mul_4: "f32[1, 4, 4]" = x1_1 * cos
        mul_5: "f32[1, 4, 4]" = x2_1 * sin
        sub_1: "f32[1, 4, 4]" = mul_4 - mul_5;  mul_4 = mul_5 = None
        mul_6: "f32[1, 4, 4]" = x1_1 * sin;  x1_1 = sin = None
        mul_7: "f32[1, 4, 4]" = x2_1 * cos;  x2_1 = cos = None
        add_2: "f32[1, 4, 4]" = mul_6 + mul_7;  mul_6 = mul_7 = None
        cat_1: "f32[1, 4, 8]" = torch.cat([sub_1, add_2], -1);  sub_1 = add_2 = None

        x_1: "f32[1, 4, 8]" = cat_1 + x;  cat_1 = x = None
        return (x_1,)
""")
        # Layer 1's inv_freq[None, :, None], position_ids[:, None, :], float, @, transpose, cos and sin.
        self.assertEqual(counters["rope_dedup"]["merged_nodes"], 7)


def test_tables_from_run_time_positions_are_merged() -> None:
    recording = EagerAndRecordGraphs()
    model = PositionsStack(4)
    compiled = torch.compile(model, backend=RopeDedupBackend(recording, fold_constants=True, merge_computed=True))
    x = torch.randn(2, 16, 8)
    for offset in (0, 5, 100):  # new positions each call (decoding further along): same graph, new tables
        positions = torch.arange(offset, offset + 16).expand(2, 16)
        torch.testing.assert_close(compiled(x, positions), model(x, positions), rtol=0, atol=0)
    gm = recording.graphs[0]
    assert [n.target for n in gm.graph.nodes].count("cos") == 1
    assert "folded_tables" not in counters["rope_dedup"]
    assert counters["stats"]["unique_graphs"] == 1


class NotFoldable(nn.Module):
    """Constant subgraphs the pass must leave alone: not RoPE, random, written in place, returned."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mask = torch.ones(8, 8).tril()  # constant, not RoPE-like
        noise = torch.rand(8, 4)  # random: neither folded nor merged
        noise_2 = torch.rand(8, 4)
        written = torch.outer(torch.arange(8.0), 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8))).cos()
        written[0] = 2.0  # a RoPE table until this write
        returned = torch.outer(torch.arange(8.0), 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8))).sin()
        return x @ mask, x[:, :4] * noise + noise_2, x[:, :4] * written, returned


def test_constant_subgraphs_that_must_not_fold() -> None:
    recording = EagerAndRecordGraphs()
    backend = RopeDedupBackend(recording, fold_constants=True, merge_computed=True)
    compiled = torch.compile(NotFoldable(), backend=backend)
    x = torch.randn(8, 8)
    first, second = compiled(x), compiled(x)
    assert not torch.equal(first[1], second[1])  # still drawn on every call
    assert first[3].data_ptr() != second[3].data_ptr()  # a fresh output each call
    torch.testing.assert_close(first[2], NotFoldable()(x)[2], rtol=0, atol=0)
    targets = [n.target for n in recording.graphs[0].graph.nodes]
    assert targets.count(torch.rand) == 2 and targets.count("tril") == 1
    # The written and the returned table are still computed on every call, from one folded angle table
    # (outer(positions, inv_freq): constant, never written, never returned).
    assert (targets.count("cos"), targets.count("sin"), targets.count(torch.outer)) == (1, 1, 0)
    assert [g.key.layout for g in backend.report.groups] == ["angle"]


def test_autocast_regions_are_not_merged_across_or_folded() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        positions, freqs = torch.arange(16.0), 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8))
        outside = torch.outer(positions, freqs).cos()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = torch.outer(positions, freqs).cos()
        return x * outside + x * inside

    graphs = EagerAndRecordGraphs()
    torch.compile(f, backend=graphs)(torch.randn(16, 4))
    gm = graphs.graphs[0]
    pure = find_pure_nodes(gm)
    outers = [n for n in gm.graph.nodes if n.target is torch.outer]
    assert [bool(pure[n].autocast) for n in outers] == [False, True]
    merge_rope_subgraphs(gm, [])
    assert len([n for n in gm.graph.nodes if n.target is torch.outer]) == 2
    result = fold_rope_constants(gm, [])
    # The table outside autocast, and inv_freq (computed outside, read by the outer inside); not the inside one.
    assert [f.replaced for f in result.folded] == [("freqs",), ("outside",)]
    assert len([n for n in gm.graph.nodes if n.target is torch.outer]) == 1


def test_defaults_per_inner_backend() -> None:
    for inner, expected in COMPUTED_TABLE_DEFAULTS.items():
        assert RopeDedupBackend(inner).computed_table_transforms() == expected
    assert RopeDedupBackend(EagerAndRecordGraphs()).computed_table_transforms() == (False, False)
    assert RopeDedupBackend("eager", fold_constants=False, merge_computed=True).computed_table_transforms() == (
        False, True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph_break", "regional"])
def test_per_block_graphs_share_one_folded_table(mode: str) -> None:
    model = build(homogeneous(4, layout="computed"), graph_break=mode == "graph_break")
    eager = [model(t) for t in TOKENS]
    backend = RopeDedupBackend("aot_eager", fold_constants=True, merge_computed=True)
    if mode == "regional":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend)
        got = [model(t) for t in TOKENS]
    else:
        got = outputs_with(model, backend)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    groups = backend.report.groups
    assert sorted(g.key.layout for g in groups) == ["cos-halves", "sin-halves"]
    assert all(g.bytes_after == g.table_bytes for g in groups)


@pytest.mark.parametrize("layout", COMPUTED_LAYOUTS)
def test_toy_computed_layouts_match_the_stored_table(layout: str) -> None:
    """The toy's in-forward tables are the ones its cos_sin layout stores: same model, same outputs."""
    for spec in (TableRecipe(), TableRecipe(theta=5e5, scaling="llama3", max_len=64), TableRecipe(rotary_dim=8)):
        stored, computed = build([spec] * 2), build([replace(spec, layout=layout)] * 2)
        assert not list(computed.buffers()) or layout == "from_inv_freq"
        torch.testing.assert_close(computed(TOKENS[0]), stored(TOKENS[0]), rtol=1e-6, atol=1e-6)


def test_values_over_the_size_limit_are_never_computed(monkeypatch) -> None:
    monkeypatch.setattr(fold_rope_constants_module, "MAX_VALUE_BYTES", 100)  # the (16, 4) tables take 256
    recording = EagerAndRecordGraphs()
    model, x = Stack([1e4, 1e4]), torch.randn(1, 16, 8)
    out = torch.compile(model, backend=RopeDedupBackend(recording, fold_constants=True))(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    gm = recording.graphs[0]
    folded = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    assert [tuple(t.shape) for t in folded] == [(4,)]  # only inv_freq (16 bytes) was small enough


def test_reads_on_either_side_of_a_write_are_not_merged() -> None:
    def f(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        before = torch.outer(x, inv_freq).cos()
        x.mul_(2)
        after = torch.outer(x, inv_freq).cos()
        return before + after

    recording = EagerAndRecordGraphs()
    x, inv_freq = torch.arange(16.0), 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8))
    compiled = torch.compile(f, backend=RopeDedupBackend(recording, fold_constants=True, merge_computed=True))
    torch.testing.assert_close(compiled(x.clone(), inv_freq), f(x.clone(), inv_freq), rtol=0, atol=0)
    assert [n.target for n in recording.graphs[0].graph.nodes].count(torch.outer) == 2
