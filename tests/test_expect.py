"""explain(expect=...): each bug class is flagged with its layer and field, correct models pass.

The buggy and fixed models come from examples/catch_misconfiguration.py, so the README's examples and
these tests are the same models. Expectations for transformers models come from their own configs.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

from rope_dedup import RopeMismatch, RopeSpec, explain
from rope_dedup.audit.expectation import expectation_for
from rope_dedup.audit.spec import Scaling, SpecError, parse_spec
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, local_global

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "catch_misconfiguration.py"
_spec = importlib.util.spec_from_file_location("catch_misconfiguration", EXAMPLE)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)
TOKENS = torch.randint(0, 64, (1, 8))


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_each_bug_is_flagged_with_its_layer_and_field_and_the_fix_passes(name: str) -> None:
    factory, expect, flagged = cases.CASES[name]
    built = factory()
    model, inputs = built if isinstance(built, tuple) else (built, ())  # a model alone: the static audit
    buggy = explain(model, *inputs, expect=expect)
    assert [(m.layer, m.field) for m in buggy.mismatches] == flagged
    assert all(m.worst_position is not None for m in buggy.mismatches if m.field not in ("rotary_dim", "content"))
    with pytest.raises(RopeMismatch) as raised:
        buggy.check()
    assert str(raised.value).splitlines()[0] == f"{len(flagged)} RoPE mismatch(es):"
    built = factory(fixed=True)
    model, inputs = built if isinstance(built, tuple) else (built, ())
    fixed = explain(model, *inputs, expect=expect)
    assert fixed.mismatches == ()
    fixed.check()


def test_what_the_bugs_are_said_to_be() -> None:
    model, inputs = cases.yarn_attention_factor_dropped()
    (first, _) = explain(model, *inputs, expect="config").mismatches
    assert (first.expected, first.found) == (f"{0.1 * math.log(4) + 1:g}", "1")
    model, inputs = cases.scaling_factor_wrong()
    (first, _) = explain(model, *inputs, expect="config").mismatches
    assert first.expected == "llama3:32:1:4:8192" and first.found.startswith("nonuniform low/8 ")


def _tiny_llama(**settings):
    model, _ = cases._llama(**settings)
    return model


def test_transformers_5_tables_computed_at_model_level_are_shown_per_layer() -> None:
    model = _tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    result = explain(model, *cases._inputs())
    applied = {(t.layer, t.part_names, t.key.theta, t.key.dim, t.span) for t in result.applied}
    assert applied == {(f"model.layers.{i}", "cos+sin", 5e5, 16, "0..15") for i in range(2)}
    assert {t.source for t in result.applied} == {
        "computed in model.rotary_emb from model.rotary_emb.inv_freq (float32)"}
    assert result.odd_layers == [] and result.pattern is None
    assert "model.layers.1  cos+sin  computed in model.rotary_emb from" in str(result)


def test_correct_llama_and_modernbert_pass_with_their_config() -> None:
    assert explain(_tiny_llama(), *cases._inputs(), expect="config").mismatches == ()
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    config = ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=3)
    model = ModernBertModel(config).eval()
    tokens = torch.randint(3, 64, (1, 16))
    result = explain(model, tokens, expect="config")
    assert result.mismatches == ()
    assert {t.layer: t.key.theta for t in result.applied} == {
        "layers.0": 160000, "layers.1": 10000, "layers.2": 10000, "layers.3": 160000}
    # Without an expectation, 2 global + 2 local layers are a mix, not two odd layers.
    plain = explain(model, tokens)
    assert plain.odd_layers == [] and plain.pattern.startswith("no majority among the layers")


def test_mapping_and_callable_expectations() -> None:
    model = ToyDecoder(local_global(3, max_len=64))
    by_pattern = {"layers.2": RopeSpec(1e6), "layers.*": RopeSpec(1e4)}
    assert explain(model, TOKENS, expect=by_pattern).mismatches == ()
    swapped = {"layers.2": RopeSpec(1e4), "layers.*": RopeSpec(1e6)}
    assert [(m.layer, m.field, m.expected, m.found) for m in explain(model, TOKENS, expect=swapped).mismatches] == [
        ("layers.0", "theta", "1e+06", "10000"), ("layers.1", "theta", "1e+06", "10000"),
        ("layers.2", "theta", "10000", "1e+06")]
    only_global = explain(model, TOKENS, expect=lambda layer: RopeSpec(1e6) if layer == "layers.2" else None)
    assert only_global.mismatches == ()
    assert [row.expected for row in only_global.layers] == [None, None, RopeSpec(1e6)]


def test_a_model_without_rope() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    inputs = torch.randn(2, 8)
    result = explain(model, inputs)
    assert str(result).splitlines()[0] == "RoPE audit: no RoPE table found (none held by the model, none applied in its forward)"
    assert result.mismatches == ()
    judged = explain(model, inputs, expect=RopeSpec(1e4))
    assert [(m.layer, m.field, m.found) for m in judged.mismatches] == [("(model)", "rope", "no RoPE table applied")]


def test_rotary_dim_and_linear_scaling_from_a_spec() -> None:
    model = ToyDecoder(homogeneous(2, rotary_dim=8, scaling="linear", factor=4.0, max_len=64))
    assert explain(model, TOKENS, expect=RopeSpec(1e4, rotary_dim=8, scaling={"rope_type": "linear", "factor": 4}
                                                  )).mismatches == ()
    found = explain(model, TOKENS, expect=RopeSpec(1e4, rotary_dim=8)).mismatches
    assert [(m.layer, m.field, m.expected) for m in found] == [("layers.0", "scaling", "none"),
                                                                ("layers.1", "scaling", "none")]


@pytest.mark.parametrize("parameters", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
     "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": 64},
])
@pytest.mark.parametrize("seq_len", [32, 300])
def test_own_formulas_equal_transformers(parameters: dict, seq_len: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, max_position_embeddings=256,
                         rope_parameters={**parameters, "rope_theta": 1e4})
    theirs, their_factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, "cpu", seq_len=seq_len)
    spec_parameters = dict(parameters)
    if parameters["rope_type"] == "dynamic":  # transformers reads it from max_position_embeddings
        spec_parameters["original_max_position_embeddings"] = 256
    if parameters["rope_type"] == "longrope":
        spec_parameters["factor"] = 256 / 64
    ours, our_factor = RopeSpec(1e4, scaling=spec_parameters).frequencies(16, seq_len)
    torch.testing.assert_close(ours, theirs.to(torch.float64), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(their_factor, rel=1e-12)


@pytest.mark.parametrize("text, message", [
    ("theta=5e5,scaling=rope2:4", "unknown scaling type 'rope2'"),
    ("scaling=linear:4", "theta is missing"),
    ("theta=5e5,scaling=llama3", "llama3 scaling needs factor, original_max_position_embeddings"),
    ("theta=5e5,size=4", "unknown field(s) size"),
    ("theta=5e5,scaling=longrope:1", "longrope's short/long factor lists do not fit"),
])
def test_bad_expectations_name_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=None) as raised:
        parse_spec(text)
    assert message in str(raised.value)


def test_parse_spec() -> None:
    assert parse_spec("theta=5e5,dim=64,scaling=llama3:8:1:4:8192,attention_factor=1.2") == RopeSpec(
        5e5, rotary_dim=64, scaling=Scaling("llama3", factor=8, low_freq_factor=1, high_freq_factor=4,
                                            original_max_position_embeddings=8192), attention_factor=1.2)


def test_config_fields_that_are_missing_or_unknown_are_one_finding_each_or_raise_when_strict() -> None:
    with pytest.raises(SpecError, match="has none"):
        expectation_for("config", torch.nn.Linear(2, 2))
    model = _tiny_llama()
    for parameters, message in [
        ({"rope_type": "default"}, "model.config.rope_parameters has no rope_theta"),
        ({"rope_type": "rope2", "rope_theta": 1e4}, "model.config.rope_parameters: rope_type 'rope2' is not one "
                                                    "the audit knows"),
    ]:
        model.config.rope_parameters = parameters
        for audit in (explain(model, expect="config"), explain(model, *cases._inputs(), expect="config")):
            (finding,) = audit.mismatches  # one line naming the field; no layer judged against a guess
            assert (finding.layer, finding.field) == ("(config)", "config")
            assert finding.found.startswith(message)
        with pytest.raises(SpecError, match=re.escape(message)):
            explain(model, expect="config", strict=True)
    with pytest.raises(SpecError, match="unknown scaling type 'ntk'"):
        RopeSpec(1e4, scaling={"rope_type": "ntk", "factor": 2})


def test_config_without_rope_parameters_reads_rope_theta_and_rope_scaling() -> None:
    """transformers 4 configs keep rope_theta and rope_scaling side by side: a hand-written model may too."""
    from types import SimpleNamespace

    model = ToyDecoder(homogeneous(2, theta=5e5, max_len=64))
    model.config = SimpleNamespace(rope_theta=5e5, rope_scaling=None, hidden_size=32, num_attention_heads=2)
    assert explain(model, TOKENS, expect="config").mismatches == ()
    model.config.rope_theta = 1e4
    assert [(m.layer, m.field) for m in explain(model, TOKENS, expect="config").mismatches] == [
        ("layers.0", "theta"), ("layers.1", "theta")]
