"""dedup_exported on torch.export programs: rewritten graph, dropped inputs, equal outputs, smaller files."""

from __future__ import annotations

import os

import expecttest
import pytest
import torch
import torch.nn as nn
from torch.export.graph_signature import InputKind
from ideal import ideal_storages
from rope_dedup.testing.toy_decoder import (
    LAYOUTS, TableRecipe, ToyDecoder, homogeneous, local_global, rope_tensors, unique_storages,
)

from rope_dedup import dedup_exported
from rope_dedup.core.eligibility import SkipReason

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def rope_table(length: int = 16, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(length).float(), freqs)
    return angles.cos(), angles.sin()


class Tables(nn.Module):
    """Two equal non-persistent buffers, an equal plain attribute and a different (persistent) one."""

    def __init__(self) -> None:
        super().__init__()
        cos, sin = rope_table()
        self.register_buffer("cos_a", cos.clone(), persistent=False)
        self.register_buffer("cos_b", cos.clone(), persistent=False)
        self.cos_c = cos.clone()
        self.register_buffer("sin", sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cos_a + x * self.cos_b + x * self.cos_c + x * self.sin


def rope_inputs(ep: torch.export.ExportedProgram) -> list[str]:
    return [s.target for s in ep.graph_signature.input_specs if s.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR)]


class TestRewrite(expecttest.TestCase):
    def test_uses_read_one_input_and_duplicates_leave_the_signature(self) -> None:
        model = Tables()
        x = torch.randn(16, 4)
        ep = torch.export.export(model, (x,))
        deduped = dedup_exported(ep)
        self.assertExpectedInline(deduped.graph_module.code.strip(), """\
def forward(self, b_cos_a, b_sin, x):
    mul = torch.ops.aten.mul.Tensor(x, b_cos_a)
    mul_1 = torch.ops.aten.mul.Tensor(x, b_cos_a)
    add = torch.ops.aten.add.Tensor(mul, mul_1);  mul = mul_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(x, b_cos_a);  b_cos_a = None
    add_1 = torch.ops.aten.add.Tensor(add, mul_2);  add = mul_2 = None
    mul_3 = torch.ops.aten.mul.Tensor(x, b_sin);  x = b_sin = None
    add_2 = torch.ops.aten.add.Tensor(add_1, mul_3);  add_1 = mul_3 = None
    return (add_2,)""")
        self.assertEqual(rope_inputs(ep), ["cos_a", "cos_b", "sin", "cos_c"])
        self.assertEqual(rope_inputs(deduped), ["cos_a", "sin"])
        self.assertEqual(sorted(deduped.constants), ["cos_a"])
        torch.testing.assert_close(deduped.module()(x), model(x), rtol=0, atol=0)
        report = deduped.graph_module.meta["rope_dedup_report"]
        self.assertEqual([g.members for g in report.groups], [["cos_a", "cos_b", "cos_c"]])
        self.assertEqual({s.path: s.reason for s in report.skipped}, {"sin": SkipReason.PERSISTENT.value})

    def test_the_input_program_and_the_model_are_untouched(self) -> None:
        model = Tables()
        ep = torch.export.export(model, (torch.randn(16, 4),))
        code, specs, constants = ep.graph_module.code, list(ep.graph_signature.input_specs), dict(ep.constants)
        dedup_exported(ep)
        self.assertEqual(ep.graph_module.code, code)
        self.assertEqual(list(ep.graph_signature.input_specs), specs)
        self.assertEqual(dict(ep.constants), constants)
        tables = [model.cos_a, model.cos_b, model.cos_c, model.sin]
        self.assertEqual(unique_storages(tables)[0], 4)


class Persistent(nn.Module):
    """Two equal persistent buffers, as older HF models registered their caches."""

    def __init__(self) -> None:
        super().__init__()
        _, sin = rope_table()
        self.register_buffer("sin", sin.clone())
        self.register_buffer("sin_b", sin.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.sin + x * self.sin_b


def test_persistent_buffers_are_shared_only_when_asked_and_keep_their_keys() -> None:
    model = Persistent()
    x = torch.randn(16, 4)
    ep = torch.export.export(model, (x,))
    default = dedup_exported(ep)
    assert default.graph_module.code == ep.graph_module.code
    assert {s.reason for s in default.graph_module.meta["rope_dedup_report"].skipped} == {SkipReason.PERSISTENT.value}
    shared = dedup_exported(ep, share_persistent=True)
    assert set(shared.state_dict) == set(ep.state_dict)  # keys kept: checkpoints still load
    assert shared.state_dict["sin_b"] is shared.state_dict["sin"]
    used = {n.name for n in shared.graph_module.graph.nodes if n.op == "placeholder" and n.users}
    assert used == {"b_sin", "x"}
    torch.testing.assert_close(shared.module()(x), model(x), rtol=0, atol=0)


SCENARIOS = {
    "homogeneous": homogeneous(4, max_len=64),
    "local_global": local_global(6, every=3, max_len=64),
    "every_layout": [TableRecipe(layout=layout, max_len=64) for layout in LAYOUTS for _ in range(2)],
    "mixed": [TableRecipe(max_len=64), TableRecipe(max_len=64, dtype=torch.bfloat16),
              TableRecipe(max_len=64, rotary_dim=8), TableRecipe(max_len=64, scaling="yarn"), TableRecipe(max_len=64),
              TableRecipe(max_len=64, scaling="yarn")],
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_toy_decoders_keep_one_input_per_table_and_equal_outputs(scenario: str) -> None:
    torch.manual_seed(0)
    model = ToyDecoder(SCENARIOS[scenario]).eval()
    with torch.no_grad():
        expected = model(TOKENS)
    ep = torch.export.export(model, (TOKENS,))
    deduped = dedup_exported(ep)
    with torch.no_grad():
        torch.testing.assert_close(deduped.module()(TOKENS), expected, rtol=0, atol=0)
    kept = {s.target for s in deduped.graph_signature.input_specs}
    values = {**deduped.constants, **deduped.state_dict}
    remaining = [values[name] for name, _ in rope_tensors(model) if name in kept]
    unread = sum(name.endswith("original_inv_freq") for name, _ in rope_tensors(model))  # never lifted
    assert len(remaining) + unread == ideal_storages(model)
    report = deduped.graph_module.meta["rope_dedup_report"]
    reasons = {s.path: s.reason for s in report.skipped}
    for name, _ in rope_tensors(model):
        if name.endswith("cached_freqs"):
            assert reasons[name].startswith("written in the graph"), reasons[name]
        elif not name.endswith("original_inv_freq"):
            assert any(name in g.members for g in report.groups), name


def test_save_writes_a_smaller_file_that_loads_and_runs(tmp_path) -> None:
    model = ToyDecoder(homogeneous(4, max_len=1024)).eval()
    ep = torch.export.export(model, (TOKENS,))
    deduped = dedup_exported(ep)
    torch.export.save(ep, tmp_path / "before.pt2")
    torch.export.save(deduped, tmp_path / "after.pt2")
    before, after = os.path.getsize(tmp_path / "before.pt2"), os.path.getsize(tmp_path / "after.pt2")
    report = deduped.graph_module.meta["rope_dedup_report"]
    assert report.bytes_saved == 6 * 1024 * 8 * 4  # 3 of 4 layers' cos and sin dropped
    assert before - after >= report.bytes_saved
    loaded = torch.export.load(tmp_path / "after.pt2")
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(TOKENS), model(TOKENS), rtol=0, atol=0)


def test_decompositions_and_a_second_pass_keep_the_result() -> None:
    model = ToyDecoder(homogeneous(3, max_len=64)).eval()
    deduped = dedup_exported(torch.export.export(model, (TOKENS,)))
    again = dedup_exported(deduped)
    assert rope_inputs(again) == rope_inputs(deduped)
    reference = torch.export.export(model, (TOKENS,)).run_decompositions()  # decomposed sdpa rounds differently
    with torch.no_grad():
        torch.testing.assert_close(again.run_decompositions().module()(TOKENS), reference.module()(TOKENS),
                                   rtol=0, atol=0)


def test_something_other_than_a_program_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="expects a torch.export.ExportedProgram, got ToyDecoder"):
        dedup_exported(ToyDecoder(homogeneous(1)))


def test_a_functional_program_reports_its_buffer_mutations() -> None:
    """After run_decompositions a write is no longer an in-place op but a BUFFER_MUTATION output."""
    model = ToyDecoder([TableRecipe(layout="lazy_cache", max_len=64)] * 2 + [TableRecipe(max_len=64)] * 2).eval()
    functional = torch.export.export(model, (TOKENS,)).run_decompositions()
    deduped = dedup_exported(functional)
    reasons = {s.path: s.reason for s in deduped.graph_module.meta["rope_dedup_report"].skipped}
    for layer in (0, 1):
        assert "BUFFER_MUTATION" in reasons[f"layers.{layer}.attention.rope.cached_freqs"]
    with torch.no_grad():
        torch.testing.assert_close(deduped.module()(TOKENS), functional.module()(TOKENS), rtol=0, atol=0)


# -- tables="recompute" ----------------------------------------------------------------------------------------

class Rows(nn.Module):
    """A cos table read by rows (a slice along its positions), and a sin table read whole."""

    def __init__(self) -> None:
        super().__init__()
        cos, sin = rope_table(length=64)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cos[: x.shape[0]] + self.sin.sum()


class TestRecompute(expecttest.TestCase):
    def test_a_read_of_rows_computes_those_rows_and_a_whole_read_keeps_its_table(self) -> None:
        model = Rows()
        x = torch.randn(8, 4)
        recomputed = dedup_exported(torch.export.export(model, (x,)), tables="recompute")
        self.assertExpectedInline(recomputed.graph_module.code.strip(), """\
def forward(self, c_cos_inv_freq, b_sin, x):
    arange = torch.ops.aten.arange.start_step(0, 8, dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
    view = torch.ops.aten.view.default(arange, [-1]);  arange = None
    _to_copy = torch.ops.aten._to_copy.default(view, dtype = torch.float32, device = device(type='cpu'));  view = None
    view_1 = torch.ops.aten.view.default(_to_copy, [8, 1]);  _to_copy = None
    mul_1 = torch.ops.aten.mul.Tensor(view_1, c_cos_inv_freq);  view_1 = c_cos_inv_freq = None
    cos = torch.ops.aten.cos.default(mul_1);  mul_1 = None
    view_2 = torch.ops.aten.view.default(cos, [8, 4]);  cos = None
    view_3 = torch.ops.aten.view.default(view_2, [8, 4]);  view_2 = None
    mul = torch.ops.aten.mul.Tensor(x, view_3);  x = view_3 = None
    sum_1 = torch.ops.aten.sum.default(b_sin);  b_sin = None
    add = torch.ops.aten.add.Tensor(mul, sum_1);  mul = sum_1 = None
    return (add,)""")
        torch.testing.assert_close(recomputed.module()(x), model(x), rtol=0, atol=0)
        report = recomputed.graph_module.meta["rope_dedup_report"]
        assert [r.path for r in report.recomputed] == ["cos"] and report.recomputed_bytes == 4 * 4
        reasons = {s.path: s.reason for s in report.skipped}
        assert "reads the whole table" in reasons["sin"], reasons


@pytest.mark.parametrize("layout", ["complex", "cos_sin", "hf_halves", "titan_cos_sin", "stacked"])
def test_recompute_leaves_no_table_in_the_program_and_equal_outputs(layout: str) -> None:
    model = ToyDecoder(homogeneous(3, layout=layout, max_len=64) + [TableRecipe(layout=layout, max_len=64, theta=1e6)])
    model.eval()
    ep = torch.export.export(model, (TOKENS,))
    recomputed = dedup_exported(ep, tables="recompute")
    with torch.no_grad():
        torch.testing.assert_close(recomputed.module()(TOKENS), model(TOKENS), rtol=0, atol=0)
    assert [name for name in rope_inputs(recomputed) if not name.endswith("_inv_freq")] == []
    report = recomputed.graph_module.meta["rope_dedup_report"]
    vectors = [name for name in recomputed.constants if name.endswith("_inv_freq")]
    assert len(vectors) == 2  # one per theta
    assert report.recomputed and report.recomputed_bytes == 2 * 8 * 4


def test_recompute_shrinks_the_saved_file_by_the_tables_bytes(tmp_path) -> None:
    model = ToyDecoder(homogeneous(2, layout="complex", max_len=8192)).eval()
    ep = torch.export.export(model, (TOKENS,))
    shared, recomputed = dedup_exported(ep), dedup_exported(ep, tables="recompute")
    torch.export.save(shared, tmp_path / "shared.pt2")
    torch.export.save(recomputed, tmp_path / "recomputed.pt2")
    table = 8192 * 8 * 8  # the one complex64 (8192, 8) table the shared program keeps
    assert os.path.getsize(tmp_path / "shared.pt2") - os.path.getsize(tmp_path / "recomputed.pt2") >= 0.9 * table
    loaded = torch.export.load(tmp_path / "recomputed.pt2")
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(TOKENS), model(TOKENS), rtol=0, atol=0)


def test_tables_takes_share_or_recompute() -> None:
    ep = torch.export.export(Rows(), (torch.randn(8, 4),))
    with pytest.raises(ValueError, match="takes 'share' or 'recompute', got 'none'"):
        dedup_exported(ep, tables="none")
