"""The audit without a forward: ``explain(model, expect=...)`` with no inputs measures the tables the model
holds, the moment it is built.

Every model audited here first gets a forward pre-hook on each of its modules that fails the test if a
forward starts: the static audit must not run one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from rope_dedup import RopeMismatch, RopeSpec, explain
from rope_dedup.testing.toy_decoder import LAYOUTS, ToyDecoder, homogeneous, local_global

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "catch_misconfiguration.py"


def no_forward(model: nn.Module) -> nn.Module:
    def refuse(module: nn.Module, args) -> None:
        raise AssertionError(f"{type(module).__name__}.forward ran during a static audit")

    for module in model.modules():
        module.register_forward_pre_hook(refuse)
    return model


def thetas(explanation) -> dict[str, set[float]]:
    return {row.layer: {t.key.theta for t in row.applied} for row in explanation.layers}


def test_each_layers_tables_are_measured_without_a_forward() -> None:
    torch.manual_seed(0)
    model = ToyDecoder(local_global(6, every=3))
    static = explain(no_forward(model))
    assert static.static and not static.judged and static.mismatches == ()
    assert thetas(static) == {f"layers.{i}": {1e6 if i in (2, 5) else 1e4} for i in range(6)}
    assert static.pattern.startswith("layers follow a pattern that repeats every 3 layers")
    torch.manual_seed(0)
    dynamic = explain(ToyDecoder(local_global(6, every=3)), torch.zeros(1, 8, dtype=torch.long))
    assert static.groups == dynamic.groups  # the same tables would share, forward or not
    assert str(static).startswith("RoPE audit (static: no forward ran): 12 table(s) in 6 layer(s), 4 distinct")
    assert "what each held table encodes:" in str(static)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_is_judged_by_value(layout: str, dtype: torch.dtype) -> None:
    model = no_forward(ToyDecoder(homogeneous(2, layout=layout, theta=5e5, dtype=dtype, max_len=64)))
    right = explain(model, expect=RopeSpec(5e5))
    assert all(row.applied for row in right.layers)
    if layout == "inv_freq" and dtype == torch.bfloat16:  # frequencies rounded to bf16: the bug itself
        assert {(m.field, m.found) for m in right.mismatches} == {("frequency dtype", "bfloat16 (inv_freq rounded)")}
        return
    assert right.mismatches == ()
    right.check()
    wrong = explain(model, expect=RopeSpec(1e4))
    assert [(m.layer, m.field, m.expected) for m in wrong.mismatches] == [("layers.0", "theta", "10000"),
                                                                         ("layers.1", "theta", "10000")]
    assert all(float(m.found) == pytest.approx(5e5, rel=0.01) for m in wrong.mismatches)  # bf16 measures it roughly
    with pytest.raises(RopeMismatch):
        wrong.check()


def test_a_rotary_width_other_than_expected_is_a_rotary_dim_mismatch() -> None:
    model = no_forward(ToyDecoder(homogeneous(2, rotary_dim=8)))  # head_dim 16: a partial rotary of 8
    found = explain(model, expect=RopeSpec(1e4, rotary_dim=16)).mismatches
    assert [(m.layer, m.field, m.expected, m.found) for m in found] == [("layers.0", "rotary_dim", "16", "8"),
                                                                       ("layers.1", "rotary_dim", "16", "8")]
    assert explain(model, expect=RopeSpec(1e4, rotary_dim=8)).mismatches == ()


def _emptied(fill) -> nn.Module:
    """A toy decoder after ``to_empty``, its tables then given ``fill`` (what the allocator left)."""
    model = ToyDecoder(homogeneous(2))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            fill(buffer)
    return no_forward(model)


@pytest.mark.parametrize("fill, found", [
    (torch.Tensor.zero_, "all zeros: never filled"),
    (lambda t: t.fill_(float("nan")), "NaN or inf: uninitialized memory"),
    (lambda t: t.uniform_(-3e4, 3e4, generator=torch.Generator().manual_seed(0)), "not a RoPE table: "),
])
def test_a_rope_slot_left_unfilled_is_a_mismatch_even_without_an_expectation(fill, found: str) -> None:
    for expect in (None, RopeSpec(1e4)):
        explanation = explain(_emptied(fill), expect=expect)
        assert [(m.layer, m.field, m.expected) for m in explanation.mismatches] == [
            ("layers.0", "content", "a RoPE table")] * 2 + [("layers.1", "content", "a RoPE table")] * 2
        paths = [m.found.split(": ", 1) for m in explanation.mismatches]
        assert [p for p, _ in paths] == [f"layers.{i}.attention.rope.{t}" for i in (0, 1) for t in ("cos", "sin")]
        assert all(what.startswith(found) for _, what in paths)
        with pytest.raises(RopeMismatch):
            explanation.check()


def test_tables_still_on_meta_are_named_as_never_initialized() -> None:
    with torch.device("meta"):
        model = ToyDecoder(homogeneous(1, layout="inv_freq"))
    (first, second) = explain(no_forward(model)).mismatches
    assert first.found == ("layers.0.attention.rope.inv_freq: meta tensor: never initialized "
                           "(to_empty and init_weights not run?)")
    assert second.found.startswith("layers.0.attention.rope.original_inv_freq: meta tensor")


class SlotsAttention(nn.Module):
    """An attention module whose zero buffers are RoPE slots only by shape, under an expectation: ``table``
    has a cos/sin table's shape for rotary dim 16, ``k_cache`` a KV cache's (never a slot), ``mask``
    neither."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(64, 16))
        self.register_buffer("k_cache", torch.zeros(1, 2, 64, 16))
        self.register_buffer("mask", torch.zeros(64, 64))
        self.register_buffer("cached_freqs", torch.zeros(64, 8))  # rotary-embedding-torch: zeros until a forward


class Router(nn.Module):
    """glm4_moe's MoE gate: ``e_score_correction_bias`` is zeros by design, with a frequency vector's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("e_score_correction_bias", torch.zeros(8))


class SlotsLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.gate, self.norm = SlotsAttention(), Router(), nn.LayerNorm(8)
        self.register_buffer("cache", torch.zeros(64, 16))  # the layer's own, not the attention's


def test_an_unnamed_slot_counts_only_where_the_expectation_gives_its_shape_in_an_attention_module() -> None:
    model = no_forward(nn.ModuleList([SlotsLayer()]))
    assert explain(model).mismatches == ()
    found = explain(model, expect=RopeSpec(1e4, rotary_dim=16)).mismatches
    never = "all zeros: never filled (to_empty without re-filling the RoPE buffers?)"
    assert [(m.layer, m.field, m.found) for m in found] == [
        ("0", "content", f"0.attention.table: {never}"), ("0", "content", f"0.attention.cached_freqs: {never}")]
    no_slot = explain(model, expect=RopeSpec(1e4, rotary_dim=48)).mismatches  # no shape of dim 48 here
    assert [(m.field, m.found) for m in no_slot] == [("rope", "no RoPE table held by the model")]


class GenericRope(nn.Module):
    """torchtitan style: the rotary module holds its complex table under a generic name."""

    def __init__(self, dim: int = 16, length: int = 64, theta: float = 1e4) -> None:
        super().__init__()
        self.dim, self.length, self.theta = dim, length, theta
        self.register_buffer("freqs", self.table(), persistent=False)

    def table(self) -> torch.Tensor:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        angles = torch.outer(torch.arange(self.length, dtype=torch.float64), inv_freq)
        return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


class GenericAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rope = GenericRope()
        self.wq = nn.Linear(32, 32)


class GenericDecoder(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"attention": GenericAttention()}) for _ in range(layers))


@pytest.mark.parametrize("fill, found", [(torch.Tensor.zero_, "all zeros: never filled"),
                                         (lambda t: t.fill_(float("nan")), "NaN or inf: uninitialized memory")])
def test_an_unfilled_table_in_a_rotary_module_is_named_per_layer_whatever_its_name(fill, found: str) -> None:
    """Built on meta, ``to_empty`` without ``init_weights``: every layer's ``freqs`` is unfilled; the
    expectation names a theta but no dim, and each layer is named all the same."""
    with torch.device("meta"):
        model = GenericDecoder()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for buffer in model.buffers():
            fill(buffer)
    for expect in (None, RopeSpec(1e4)):
        mismatches = explain(no_forward(model), expect=expect).mismatches
        assert [(m.layer, m.field) for m in mismatches] == [(f"layers.{i}", "content") for i in range(3)]
        assert all(m.found == f"layers.{i}.attention.rope.freqs: {found}" + m.found.split(found)[1]
                   for i, m in enumerate(mismatches))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GenericRope):
                module.freqs.copy_(module.table())
    assert explain(no_forward(model), expect=RopeSpec(1e4, rotary_dim=16)).mismatches == ()


def test_a_cache_filled_by_forward_beside_the_modules_frequencies_is_no_slot() -> None:
    """rotary-embedding-torch: ``cached_freqs`` stays zeros until a forward fills it from ``freqs``."""
    from rotary_embedding_torch import RotaryEmbedding

    rope = RotaryEmbedding(dim=16, cache_max_seq_len=64)
    assert not rope.cached_freqs.any()
    model = no_forward(nn.ModuleList([rope]))
    assert explain(model).mismatches == ()
    # Its frequencies are a (frozen) parameter, which the static audit does not measure: nothing is held.
    assert [m.field for m in explain(model, expect=RopeSpec(1e4, rotary_dim=16)).mismatches] == ["rope"]


def test_no_table_at_all_under_an_expectation_is_a_mismatch() -> None:
    model = no_forward(ToyDecoder(homogeneous(2, layout="computed")))  # builds its tables in forward
    assert explain(model).mismatches == ()
    assert "no RoPE table found (none held by the model)" in str(explain(model))
    (only,) = explain(model, expect=RopeSpec(1e4)).mismatches
    assert (only.layer, only.field, only.found) == ("(model)", "rope", "no RoPE table held by the model")


# -- transformers configs ---------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
_spec = importlib.util.spec_from_file_location("catch_misconfiguration", EXAMPLE)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def test_a_config_theta_changed_after_the_tables_were_built_is_flagged() -> None:
    model, _ = cases._llama(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert explain(no_forward(model), expect="config").mismatches == ()
    model.config.rope_parameters["rope_theta"] = 5e5
    found = explain(model, expect="config").mismatches
    assert [(m.layer, m.field, m.expected, m.found) for m in found] == [
        ("model.rotary_emb", "theta", "500000", "10000")]


def test_a_legacy_field_that_disagrees_with_rope_parameters_is_its_own_finding() -> None:
    model, _ = cases._llama(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    inputs = cases._inputs()
    model.config.rope_theta = 1e4  # the same value: nothing to say
    assert explain(model, expect="config").mismatches == ()
    model.config.rope_theta = 5e5  # transformers 4 code setting theta the old way: 5.x never reads it
    expected = [("(config)", "config", "rope_parameters: rope_theta=10000",
                 "rope_theta=500000 (a legacy field: transformers 5 ignores it)")]
    dynamic = explain(model, *inputs, expect="config")
    static = explain(no_forward(model), expect="config")
    for audit in (static, dynamic):
        assert [(m.layer, m.field, m.expected, m.found) for m in audit.mismatches] == expected


def test_each_layer_type_of_a_model_level_rotary_embedding_is_judged_by_its_own_parameters() -> None:
    model, _ = cases.gemma3_local_global_swapped(fixed=True)
    right = explain(no_forward(model), expect="config")
    assert right.mismatches == ()
    assert {str(spec) for spec in right.layers[0].judged_as} == {"theta=10000 dim=16", "theta=1e+06 dim=16"}
    model, _ = cases.gemma3_local_global_swapped()
    found = explain(no_forward(model), expect="config").mismatches
    assert sorted((m.layer, m.field, m.expected, m.found) for m in found) == [
        ("model.rotary_emb", "theta", "10000", "1e+06"), ("model.rotary_emb", "theta", "1e+06", "10000")]


@pytest.mark.parametrize("name, field", [("partial_rotary_ignored", "rotary_dim"),
                                         ("inv_freq_in_bf16", "frequency dtype"),
                                         ("llama3_dropped", "scaling")])
def test_the_dynamic_audits_bugs_held_in_model_level_tables_are_caught_statically(name: str, field: str) -> None:
    factory = cases.CASES[name][0]
    model, _ = factory()
    assert [(m.layer, m.field) for m in explain(no_forward(model), expect="config").mismatches] == [
        ("model.rotary_emb", field)]
    model, _ = factory(fixed=True)
    assert explain(no_forward(model), expect="config").mismatches == ()
