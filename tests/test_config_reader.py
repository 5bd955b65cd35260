"""expect="config": every RoPE config form transformers 5 ships is read, per layer, and what cannot be
read is one finding naming the field (or SpecError under ``strict``).

The models are tiny random-init ones from tests/zoo.py (the defaults of each type, shrunk; rotary dims
kept). Expectations are stated from each type's default config as transformers 5.23.0 writes it.
"""

from __future__ import annotations

import pytest
import torch
import zoo

from rope_dedup import explain
from rope_dedup.audit.expectation import ConfigSpec, NoRope, candidates, read_config
from rope_dedup.audit.spec import SpecError

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("5."):
    pytest.skip("transformers 5 config forms", allow_module_level=True)
transformers.logging.set_verbosity_error()


def tiny(model_type: str) -> zoo.Tiny:
    built = zoo.build(model_type)
    assert isinstance(built, zoo.Tiny), built
    return built


def thetas(expected) -> set[float]:
    return {spec.theta for spec in candidates(expected)}


def test_rope_parameters_keyed_by_labels_that_are_no_layer_types() -> None:
    """DeepSeek-V4: ``{"main": ..., "compress": ...}``; every layer may apply either."""
    judging = read_config(tiny("deepseek_v4").model)
    assert judging.unreadable == ()
    assert all(thetas(expected) == {1e4, 160000.0} for expected in judging.stack.values())
    assert thetas(judging.judge("rotary_emb", "rotary_emb.compress_inv_freq")) == {160000.0}  # a held table: its label


def test_labels_that_are_layer_types_and_a_layer_type_without_rope() -> None:
    """LFM3: labels full/sliding attention with proportional RoPE for full attention; its conv layers
    have no rope entry and are not judged."""
    judging = read_config(tiny("lfm3").model)
    by_kind = {judging.kinds[layer]: expected for layer, expected in judging.stack.items()}
    assert by_kind["conv"] is None
    assert (by_kind["full_attention"].rope_type, by_kind["full_attention"].theta) == ("proportional", 1e6)
    assert (by_kind["sliding_attention"].rope_type, by_kind["sliding_attention"].theta) == ("default", 1e4)


@pytest.mark.parametrize("model_type", ["embedding_gemma2_text", "gemma4_unified_text"])
def test_per_layer_config(model_type: str) -> None:
    """head_dim set per layer: reading ``config.head_dim`` raises AmbiguousGlobalPerLayerAttributeError,
    so each layer is read from ``per_layer_config``."""
    model = tiny(model_type).model
    with pytest.raises(Exception, match="per-layer attribute"):
        _ = model.config.get_text_config().head_dim
    judging = read_config(model, strict=True)
    assert all(isinstance(expected, ConfigSpec) for expected in judging.stack.values())


def test_a_per_layer_field_the_reader_cannot_read_is_a_finding_that_names_it_and_the_layer(monkeypatch) -> None:
    """One layer's config refuses ``head_dim``: one finding names the field and the layer, and the other layers
    are judged as before (never a crash, never one config-wide finding that hides them)."""
    model = tiny("embedding_gemma2_text").model
    config = model.config.get_text_config()
    layers = config.per_layer_config

    class Refusing:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            if name == "head_dim":
                raise RuntimeError("'head_dim' cannot be read for this layer")
            return getattr(self.inner, name)

    class View:
        def __getitem__(self, where: int | str) -> object:
            return Refusing(layers[where]) if where == 1 else layers[where]

        def __len__(self) -> int:
            return len(layers)

    view = View()
    monkeypatch.setattr(type(config), "per_layer_config", property(lambda self: view))
    for audit in (explain(model, expect="config"), explain(model, torch.randint(4, 200, (1, 16)), expect="config")):
        (finding,) = audit.mismatches
        assert finding.layer == "(config)" and "read with per_layer_config[1]: RuntimeError: 'head_dim'" in finding.found
    judging = read_config(model)
    assert isinstance(judging.stack["layers.0"], ConfigSpec) and judging.stack["layers.1"] is None


def test_a_partial_rotary_dim_whose_product_is_odd_rounds_up_as_transformers_does() -> None:
    """glm4_moe's defaults: head_dim 4096 // 96 = 42, partial_rotary_factor 0.5: dim 21, 11 frequencies."""
    judging = read_config(tiny("glm4_moe").model, strict=True)
    assert {spec.rotary_dim for spec in judging.stack.values()} == {22}


def test_no_rope_layers_and_a_layer_type_set_to_none() -> None:
    smollm3 = read_config(tiny("smollm3").model)
    assert [type(e).__name__ for e in smollm3.stack.values()] == ["ConfigSpec", "NoRope"]
    assert str(smollm3.stack["layers.1"]) == "no RoPE (no_rope_layers[1] is 0)"
    beam = read_config(tiny("beam").model)
    none = [e for layer, e in beam.stack.items() if beam.kinds[layer] == "full_attention"]
    assert none and all(isinstance(e, NoRope) for e in none)


def test_mrope_sections_expect_the_one_dimensional_table_for_text() -> None:
    judging = read_config(tiny("qwen2_vl").model, strict=True)
    assert {(s.theta, s.rotary_dim) for s in judging.stack.values()} == {(1e6, 128)}
    assert all(layer.startswith("language_model.layers.") for layer in judging.stack)


def test_frequencies_come_from_transformers_own_functions() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    lfm3 = tiny("lfm3").model
    judging = read_config(lfm3)
    specs = [e for e in judging.stack.values() if isinstance(e, ConfigSpec)]
    assert {s.init for s in specs if s.rope_type == "proportional"} == {ROPE_INIT_FUNCTIONS["proportional"]}
    assert {s.init for s in specs if s.rope_type == "default"} == {type(lfm3.rotary_emb).compute_default_rope_parameters}
    for spec in specs:  # the model's own tables are what the expectation computes
        inv_freq, _ = spec.frequencies(spec.rotary_dim, 16)
        held = getattr(lfm3.rotary_emb, f"{spec.layer_type}_inv_freq")
        torch.testing.assert_close(inv_freq, held.to(torch.float64), rtol=0, atol=0)


def test_a_field_the_reader_cannot_read_is_one_finding_or_raises_when_strict() -> None:
    model = tiny("llama").model
    model.config.rope_parameters = {"rope_type": "spiral", "rope_theta": 1e4}
    for audit in (explain(model, expect="config"), explain(model, torch.randint(4, 200, (1, 16)), expect="config")):
        (finding,) = audit.mismatches
        assert (finding.layer, finding.field) == ("(config)", "config")
        assert finding.found.startswith("model.config.rope_parameters: rope_type 'spiral' is not one the audit knows")
    with pytest.raises(SpecError, match="rope_type 'spiral'"):
        explain(model, expect="config", strict=True)
    # "axial" is read with the model's own rotary class, which a text model has not.
    model.config.rope_parameters = {"rope_type": "axial", "rope_theta": 1e4}
    (finding,) = explain(model, expect="config").mismatches
    assert finding.found == ("model.config.rope_parameters: rope_type 'axial' and no rotary module with "
                             "compute_axial_rope_parameters")
