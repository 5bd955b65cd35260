"""The zoo in the fast suite: twenty-six RoPE architectures of transformers 5, each built tiny from its
defaults (tests/zoo.py), through the static audit, the dynamic audit and ``share()``.

Each pinned type stands for a config form or a way of applying RoPE (named beside it). For each: it
builds, rope_dedup raises nothing, the two audits agree (:func:`zoo.disagreements`), ``share()`` leaves
the output bitwise equal, and its findings are exactly the ones docs/zoo.md explains. The whole 5.x
registry is ``nox -s zoo``; the 4.x one, about a minute, runs whole in the ``transformers4`` session.
"""

from __future__ import annotations

import pytest
import torch
import zoo

import rope_dedup

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("5."):
    pytest.skip("transformers 4.x: the transformers4 session sweeps its whole registry", allow_module_level=True)
transformers.logging.set_verbosity_error()

PINNED = {
    "llama": "flat rope_parameters, model-level rotary",
    "gemma3_text": "per layer type (sliding / full)",
    "modernbert": "per layer type, an encoder",
    "deepseek_v4": "labels main / compress; compressed windows at strided positions",
    "lfm3": "labels that are layer types, proportional RoPE, conv layers without RoPE",
    "embedding_gemma2_text": "per_layer_config (head_dim per layer)",
    "gemma4_unified_text": "per_layer_config, proportional RoPE",
    "glm4_moe": "partial rotary whose product is odd (42 x 0.5); a router bias of zeros",
    "minimax": "lightning-attention decay buffers shaped like tables",
    "qwen2_vl": "mrope sections, a vision tower with its own RoPE",
    "smollm3": "no_rope_layers",
    "beam": "rope_parameters[type] = None",
    "muse_spark_text": "layer_rope_theta, 0 for no RoPE",
    "flint": "RoPE turned off by code on full-attention layers",
    "paligemma": "positions counted from 1",
    "ernie4_5_vl_moe": "pre-rotated inv_freq",
    "recurrent_gemma": "block types repeating every 3 layers",
    "gpt_oss": "yarn",
    "apertus": "llama3 scaling",
    "jetmoe": "graph breaks inside the layers",
    "glm4v": "M-RoPE with an image in the text: 3-D positions, sections judged; a 2-D axial vision tower",
    "pixtral": "2-D axial, frequencies alternating between the axes; 1-D ids of one axis beside the grid",
    "gemma4_vision": "2-D axial, each half of the head rotated by one axis",
    "exaone4_5_vision": "2-D axial rows reordered by window attention",
    "hunyuan_vl": "4 position axes, the first the token index",
    "pe_audio_encoder": "audio RoPE applied as 2x2 rotation matrices",
}
# Audited one after the other in one process, each must say what it says alone (issue 31: jetmoe after
# higgs_audio_v2 saw no table applied). More pairs run in the sweep, where every type follows others.
# The second pair repeats the first's check on other types: the slow set.
PAIRS = [("higgs_audio_v2", "jetmoe"), pytest.param("gemma3_text", "openai_privacy_filter", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model_type", sorted(PINNED))
def test_pinned_type(model_type: str) -> None:
    outcome = zoo.sweep_one(model_type)
    assert isinstance(outcome, zoo.Outcome), outcome.reason
    assert zoo.problems_of(outcome) == []
    assert zoo.status_of(outcome) == ("finding" if model_type in zoo.explained() else "clean")


def _audit(model_type: str) -> tuple[list[str], list[tuple[str, str]]]:
    tiny = zoo.build(model_type)
    assert isinstance(tiny, zoo.Tiny), tiny.reason
    audit = rope_dedup.explain(tiny.model, expect="config", **tiny.inputs)
    return zoo.lines(audit), sorted((t.layer, t.source) for t in audit.applied)


@pytest.mark.parametrize("first, second", PAIRS)
def test_an_audit_says_the_same_after_another(first: str, second: str) -> None:
    alone = _audit(second)
    assert alone[1], f"{second} applies no table alone"
    torch._dynamo.reset()
    _audit(first)
    assert _audit(second) == alone
