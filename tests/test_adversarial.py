"""Adversarial inputs: each ends shared, skipped with a reason, or in a clear error; never silently wrong."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from rope_dedup import RopeDedupBackend, dedup_rope
from rope_dedup.core.eligibility import SkipReason


def cos_table(length: int = 16, dim: int = 8, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    return torch.outer(torch.arange(length).float(), freqs).cos()


class Tables(nn.Module):
    """Reads every buffer it is given, multiplied into the input so symbolic_trace keeps get_attr nodes."""

    def __init__(self, **tables: torch.Tensor) -> None:
        super().__init__()
        for name, table in tables.items():
            self.register_buffer(name, table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for buffer in self.buffers():
            out = out + (x.sum() * buffer).sum()
        return out


def run_pass(**tables: torch.Tensor):
    model = Tables(**tables)
    result = dedup_rope(torch.fx.symbolic_trace(model), share_persistent=True)
    return model, result.report, {s.path: s.reason for s in result.report.skipped}


def test_nan_and_inf_tables_are_skipped() -> None:
    nan, inf = cos_table(), cos_table()
    nan[3, 2] = float("nan")
    inf[5, 1] = float("inf")
    _, _, skipped = run_pass(a=nan, b=nan.clone(), c=inf)
    assert "NaN or inf" in skipped["a"] and "NaN or inf" in skipped["c"]


def test_zero_size_buffer_is_skipped() -> None:
    _, _, skipped = run_pass(a=torch.empty(0, 4), b=torch.empty(0, 4))
    assert skipped == {"a": "not RoPE-like: empty tensor", "b": "not RoPE-like: empty tensor"}


def test_views_into_a_larger_storage_are_shared_by_content() -> None:
    big = cos_table(length=32)
    view = big[:16]  # contiguous view: same strides as a plain (16, 4) table
    model, report, _ = run_pass(a=cos_table(), b=view)
    assert model.a.data_ptr() == model.b.data_ptr()
    assert torch.equal(model.b, cos_table())
    assert len(report.groups) == 1


def test_non_contiguous_tables_share_only_with_the_same_strides() -> None:
    wide = torch.cat([cos_table(), cos_table()], dim=1)  # (16, 8)
    strided = wide[:, :4]  # (16, 4) with stride (8, 1)
    model, report, _ = run_pass(a=cos_table(), b=strided, c=wide.clone()[:, :4])
    assert model.b.stride() == (8, 1) and model.c.stride() == (8, 1)
    assert model.b.data_ptr() == model.c.data_ptr() != model.a.data_ptr()
    assert torch.equal(model.b, model.a)
    assert len(report.groups) == 2


def test_tables_already_sharing_storage_are_counted_once() -> None:
    table = cos_table()
    model, report, _ = run_pass(a=table, b=table.view(16, 4), c=cos_table())
    (group,) = report.groups
    assert sorted(group.members) == ["a", "b", "c"]
    assert group.bytes_before == 2 * table.nbytes
    assert group.bytes_after == table.nbytes
    assert len({model.a.data_ptr(), model.b.data_ptr(), model.c.data_ptr()}) == 1


def test_buffers_that_require_grad_are_skipped() -> None:
    _, _, skipped = run_pass(a=cos_table().requires_grad_(), b=cos_table().requires_grad_())
    assert skipped["a"].startswith("requires grad")


class Attributes(nn.Module):
    """Tables held as parameters or plain attributes, each read once in forward."""

    def __init__(self, **tables: torch.Tensor) -> None:
        super().__init__()
        for name, table in tables.items():
            setattr(self, name, table)
        self.names = list(tables)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum((x.sum() * getattr(self, name)).sum() for name in self.names)


def test_rope_tables_held_as_parameters() -> None:
    model = Attributes(trained=nn.Parameter(cos_table()), frozen_a=nn.Parameter(cos_table(), requires_grad=False),
                       frozen_b=nn.Parameter(cos_table(), requires_grad=False))
    result = dedup_rope(torch.fx.symbolic_trace(model), share_persistent=True)
    skipped = {s.path: s.reason for s in result.report.skipped}
    assert skipped["trained"].startswith("trainable parameter")
    assert model.frozen_a.data_ptr() == model.frozen_b.data_ptr() != model.trained.data_ptr()


def test_meta_tensors_are_skipped() -> None:
    _, _, skipped = run_pass(a=cos_table().to("meta"), b=cos_table().to("meta"))
    assert skipped["a"] == SkipReason.META.value


class Tagged(torch.Tensor):
    """A trivial tensor subclass: its semantics are unknown to the pass, so it is left alone."""


def test_tensor_subclasses_are_skipped() -> None:
    model = Attributes(a=cos_table().as_subclass(Tagged), b=cos_table().as_subclass(Tagged))
    result = dedup_rope(torch.fx.symbolic_trace(model), share_persistent=True)
    skipped = {s.path: s.reason for s in result.report.skipped}
    assert skipped["a"] == "tensor subclass Tagged is not supported"
    assert model.a.data_ptr() != model.b.data_ptr()


def test_one_element_off_is_never_merged() -> None:
    off = cos_table()
    off[7, 3] += 1e-3
    model, report, skipped = run_pass(a=cos_table(), b=off)
    assert model.a.data_ptr() != model.b.data_ptr()
    assert torch.equal(model.b, off)


def test_random_tensor_with_rope_shape_is_not_rope() -> None:
    torch.manual_seed(0)
    _, _, skipped = run_pass(a=torch.randn(16, 4), b=torch.randn(16, 4))
    assert skipped["a"].startswith("not RoPE-like")


def test_inference_tensors_are_skipped() -> None:
    with torch.inference_mode():
        a, b = cos_table(), cos_table()
    _, _, skipped = run_pass(a=a, b=b)
    assert skipped["a"].startswith("inference tensor")


def test_meta_table_of_a_million_positions_is_skipped_cheaply() -> None:
    table = torch.empty(1 << 20, 64, device="meta")
    _, _, skipped = run_pass(a=table, b=torch.empty(1 << 20, 64, device="meta"))
    assert skipped["a"] == SkipReason.META.value


@pytest.mark.slow
def test_a_million_positions() -> None:
    model, report, _ = run_pass(a=cos_table(length=1 << 20, dim=64), b=cos_table(length=1 << 20, dim=64))
    (group,) = report.groups
    assert group.key.length == 1 << 20 and group.key.theta == 10000
    assert model.a.data_ptr() == model.b.data_ptr()


def test_an_inner_backend_that_raises_surfaces_its_error() -> None:
    def broken(gm, example_inputs):
        raise RuntimeError("inner backend exploded")

    model = Tables(a=cos_table(), b=cos_table())
    with pytest.raises(Exception, match="inner backend exploded"):
        torch.compile(model, backend=RopeDedupBackend(broken))(torch.randn(16, 4))
