"""The precision audit: ``explain(..., precision=True)`` judges how exactly each table is computed, against the
reference implementation (transformers' float32 construction) and float64 math, and names what diverges.

Tables are built here the way the code under judgement builds them (transformers' own rotary module, the toy
decoder's float32 steps), then broken one way at a time: a cast to bf16, positions held in fp16, a bf16
``inv_freq``, another theta; and a compiled graph whose RoPE runs in bf16 while eager's runs in float32.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from torch._inductor import config as inductor_config

from rope_dedup import RopeMismatch, RopeSpec, explain
from rope_dedup.audit import precision
from rope_dedup.audit.held import held_tables
from rope_dedup.audit.precision import DEFAULT_MAX_ANGLE_ERROR, held_precision, reference_for
from rope_dedup.testing.toy_decoder import LAYOUTS, ToyDecoder, homogeneous
from rope_dedup.tools.cli import main
from rope_dedup.tools.profile import allocator_peak

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

MILLION = 1 << 20


class Cached(nn.Module):
    """cos/sin caches computed by transformers' own rotary module for positions 0..length-1, held as transformers
    4.x held them (``cos_cached``, ``sin_cached``), beside the module and its config: ``expect="config"`` reads
    transformers' own function for the reference."""

    def __init__(self, length: int, positions: torch.Tensor | None = None, head_dim: int = 8,
                 context: int | None = None) -> None:
        super().__init__()
        self.config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                                  num_hidden_layers=1, num_key_value_heads=2, intermediate_size=8, vocab_size=32,
                                  max_position_embeddings=context or length)
        self.rotary_emb = LlamaRotaryEmbedding(self.config)
        ids = torch.arange(length)[None] if positions is None else positions[None]
        cos, sin = self.rotary_emb(torch.zeros(1, 1, head_dim), ids)
        self.register_buffer("cos_cached", cos[0], persistent=False)
        self.register_buffer("sin_cached", sin[0], persistent=False)


def judged(explanation, name: str):
    (found,) = [t for t in explanation.precision if t.source.endswith(name)]
    return found


def float64_distance(cos: torch.Tensor, sin: torch.Tensor, theta: float) -> tuple[float, int]:
    """Independently of the audit: the largest angle of atan2(sin, cos) from p * theta ** (-2j / dim) in float64,
    over every position, and where."""
    n = cos.shape[-1] // 2
    inv_freq = 1 / theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float64) / (2 * n))
    worst, where = 0.0, 0
    for start in range(0, cos.shape[0], 1 << 16):
        c, s = cos[start:start + (1 << 16), :n].double(), sin[start:start + (1 << 16), :n].double()
        p = torch.arange(start, start + c.shape[0], dtype=torch.float64)
        wrapped = (torch.atan2(s, c) - torch.outer(p, inv_freq) + math.pi).remainder(2 * math.pi) - math.pi
        if float(wrapped.abs().max()) > worst:
            worst, where = float(wrapped.abs().max()), start + int(wrapped.abs().amax(dim=1).argmax())
    return worst, where


def float64_distance_of_angles(inv_freq: torch.Tensor, length: int, theta: float) -> float:
    """Independently of the audit: the largest |float32(p) * float32(f) - p * theta ** (-2j / dim)| over every
    position below ``length``: what a float32 build's angles are off by (its cos/sin add an ulp or two)."""
    n = inv_freq.numel()
    exact = 1 / theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float64) / (2 * n))
    worst = 0.0
    for start in range(0, length, 1 << 16):
        p = torch.arange(start, min(start + (1 << 16), length), dtype=torch.float32)
        built = torch.outer(p, inv_freq.float()).double()
        worst = max(worst, float((built - torch.outer(p.double(), exact)).abs().max()))
    return worst


def test_a_table_built_as_transformers_builds_it_matches_its_reference_and_states_its_float64_distance() -> None:
    """transformers' own rotary module builds the caches (4096 positions) and holds inv_freq for a context of 1M:
    the vector is judged up to it. Its float64 distance at 1M positions, computed independently over every
    position: 4.7 mrad (the float32 angle p * f at 1e5 rad has an ulp of 7.8e-3, and f is a rounded float32)."""
    model = Cached(4096, context=MILLION)
    explanation = explain(model, expect="config", precision=True)
    assert explanation.mismatches == ()
    cos = judged(explanation, "cos_cached")
    assert cos.verdict == "matches" and "(config)" in cos.reference  # transformers' own function built it
    assert cos.to_reference.angle == 0 and cos.to_reference.ulps == 0  # bit for bit
    inv_freq = judged(explanation, "rotary_emb.inv_freq")
    assert inv_freq.verdict == "matches" and inv_freq.length == MILLION and inv_freq.to_reference.angle == 0
    worst = float64_distance_of_angles(model.rotary_emb.inv_freq, MILLION, 1e4)
    assert worst == pytest.approx(4.6875e-3, rel=1e-3)
    # The audit reads the vector at 4096 spread positions and the last ones: within 1% of every position's worst.
    assert inv_freq.to_float64.angle == pytest.approx(worst, rel=0.01) and inv_freq.to_float64.angle <= worst
    assert inv_freq.reference_to_float64.angle == inv_freq.to_float64.angle  # the reference's own limit
    assert [mark for mark, _ in inv_freq.to_float64.growth] == [4096, 32768, 131072, MILLION]
    growth = [error for _, error in inv_freq.to_float64.growth]
    assert growth == sorted(growth) and growth[0] < growth[-1] / 64  # it grows with the position


@pytest.mark.slow
def test_a_million_position_table_built_as_transformers_builds_it_states_its_float64_distance() -> None:
    model = Cached(MILLION)
    explanation = explain(model, expect="config", precision=True)
    assert explanation.mismatches == ()
    cos = judged(explanation, "cos_cached")
    assert cos.verdict == "matches" and "(config)" in cos.reference  # transformers' own function built it
    assert cos.to_reference.angle == 0 and cos.to_reference.ulps == 0  # bit for bit
    # At 1M positions a float32 build is 4.7 mrad from float64 math: its angles p * f are rounded to float32
    # (ulp 7.8e-3 at 1e5 rad) and f itself is a rounded float32. The audit's figure, and the same independently:
    worst, where = float64_distance(model.cos_cached, model.sin_cached, 1e4)
    assert worst == pytest.approx(4.6875e-3, rel=1e-3)
    # A lone cos pins its angle where its slope is at least half (value error / slope, its own rounding
    # included): within 1% of the pair's.
    assert cos.to_float64.angle == pytest.approx(worst, rel=0.01)
    assert cos.reference_to_float64.angle == cos.to_float64.angle  # the reference itself: the same limit
    assert [mark for mark, _ in cos.to_float64.growth] == [4096, 32768, 131072, MILLION]  # it grows with position
    growth = [error for _, error in cos.to_float64.growth]
    assert growth == sorted(growth) and growth[0] < growth[-1] / 8
    assert where > MILLION // 2


@pytest.mark.parametrize("held_as", [torch.float32, torch.bfloat16])
def test_the_same_table_cast_to_bf16_diverges_and_the_finding_names_the_cast(held_as: torch.dtype) -> None:
    model = Cached(4096)
    with torch.no_grad():
        for name in ("cos_cached", "sin_cached"):
            setattr(model, name, getattr(model, name).to(torch.bfloat16).to(held_as))
    explanation = explain(model, expect="config", precision=True)
    found = [m for m in explanation.mismatches if m.field == "precision"]
    assert [m.expected.split(" ")[0] for m in found] == ["cos_cached", "sin_cached"]
    for mismatch in found:
        assert mismatch.found.startswith("a cast: values rounded to bfloat16")
        assert mismatch.fix.startswith("keep float32 not bf16")
        assert 1e-3 < mismatch.error < 4e-3  # bf16 keeps 8 bits: half an ulp of a value near 1 is 2e-3 rad
    cos = judged(explanation, "cos_cached")
    assert cos.diverges and cos.first_position == 1 and cos.to_reference.ulps <= (0.5 if held_as is torch.bfloat16 else 2 ** 15)
    with pytest.raises(RopeMismatch, match="values rounded to bfloat16"):
        explanation.check()
    if held_as is torch.float32:  # the expectation's own finding says what it is too, not "attention_factor"
        assert {m.field for m in explanation.mismatches} == {"table dtype", "precision"}


def test_a_table_computed_from_positions_held_in_fp16_diverges_past_2048() -> None:
    length = 8192
    model = Cached(length, positions=torch.arange(length).to(torch.float16).to(torch.int64))
    explanation = explain(model, expect="config", precision=True)
    cos = judged(explanation, "cos_cached")
    assert cos.diverges and cos.first_position == 2049  # fp16 holds every integer up to 2048
    assert cos.cause.startswith("positions held in float16")
    assert cos.fix.startswith("build as the reference builds: positions as int64 or float32")
    assert cos.to_reference.angle > 0.5  # a position off by 2 or 4 at full speed
    growth = dict(cos.to_reference.growth)
    assert growth[4096] > 0 and cos.to_reference.curve[0] == (0, 0.0)


def test_a_bf16_inv_freq_diverges_in_proportion_to_position() -> None:
    model = ToyDecoder(homogeneous(2, layout="inv_freq", dtype=torch.bfloat16, theta=1e4))
    explanation = explain(model, expect=RopeSpec(1e4), precision=True)
    vector = [t for t in explanation.precision if t.source.endswith("rope.inv_freq")]
    assert len(vector) == 2 and all(t.diverges for t in vector)
    assert vector[0].cause.startswith("frequencies (inv_freq) rounded to bfloat16: an error that grows in proportion")
    assert vector[0].fix.startswith("keep float32 not bf16: keep inv_freq in float32")
    assert vector[0].to_reference.ulps <= 0.5  # a clean cast: half a bf16 ulp of each frequency at most
    growth = [error for _, error in vector[0].to_reference.growth]
    assert growth[-1] > 50 * growth[0]  # 4096 positions, then up to 1M: the error grows with the position


class TorchtuneRope(nn.Module):
    """torchtune's RotaryPositionalEmbeddings: a ``theta`` vector and, beside it, a stacked cos/sin ``cache``."""

    def __init__(self, length: int) -> None:
        super().__init__()
        theta = 1.0 / (10000 ** (torch.arange(0, 16, 2)[:8].float() / 16))
        angles = torch.einsum("i, j -> ij", torch.arange(length, dtype=theta.dtype), theta).float()
        self.register_buffer("theta", theta, persistent=False)
        self.register_buffer("cache", torch.stack([angles.cos(), angles.sin()], dim=-1), persistent=False)


def test_a_vector_beside_a_table_is_judged_up_to_the_tables_length_else_to_1m() -> None:
    holder = nn.Module()
    holder.rope = TorchtuneRope(512)
    explanation = explain(holder, expect=RopeSpec(1e4), precision=True)
    assert {t.source: (t.verdict, t.length) for t in explanation.precision} == {
        "rope.theta": ("matches", 512), "rope.cache": ("matches", 512)}
    del holder.rope.cache
    (alone,) = explain(holder, expect=RopeSpec(1e4), precision=True).precision
    assert alone.length == MILLION


def test_a_theta_that_is_no_round_number_is_judged_only_against_an_expectation() -> None:
    """A key names theta to 4 significant digits: against a reference built for 1593 a table of theta 1593.49
    differs in its frequencies, which says nothing wrong of it. Without an expectation it is not judged."""
    theta = 1593.4884
    model = ToyDecoder(homogeneous(1, theta=theta, max_len=4096))
    measured = judged(explain(model, precision=True), "rope.cos")
    assert measured.verdict == "not judged" and "only to the 4 significant digits" in measured.reference
    assert explain(model, precision=True).mismatches == ()
    assert judged(explain(model, expect=RopeSpec(theta), precision=True), "rope.cos").verdict == "matches"


def test_another_theta_diverges_as_a_frequency_that_differs() -> None:
    model = ToyDecoder(homogeneous(1, theta=5e5, max_len=256))
    explanation = explain(model, expect=RopeSpec(1e4), precision=True)
    cos = judged(explanation, "rope.cos")
    assert cos.diverges and cos.cause.startswith("a frequency that differs: theta 500000 where the reference has 10000")
    assert cos.fix == "build as the reference builds: theta 10000"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_correct_model_gives_no_finding(layout: str) -> None:
    model = ToyDecoder(homogeneous(2, layout=layout, theta=5e5, max_len=512))
    for expect in (None, RopeSpec(5e5)):
        explanation = explain(model, expect=expect, precision=True)
        assert explanation.mismatches == ()
        judged_ = [t for t in explanation.precision if t.verdict != "not judged"]
        assert judged_ and all(t.verdict == "matches" for t in judged_)
        assert "0 diverge from their reference" in explanation.headline()


def test_a_table_computed_in_float64_is_within_the_references_precision() -> None:
    model = ToyDecoder(homogeneous(1, route="float64", max_len=32768))  # float32 inv_freq, angles in float64, cast
    cos = judged(explain(model, expect=RopeSpec(1e4), precision=True), "rope.cos")
    assert cos.verdict == "matches" and cos.cause.startswith("closer to float64 math than the reference")
    assert cos.to_reference.angle > DEFAULT_MAX_ANGLE_ERROR  # the reference's float32 angle rounding, which it lacks
    assert cos.to_float64.angle < cos.reference_to_float64.angle / 4  # left: its float32 frequencies' own error


def test_the_audit_reads_and_never_writes() -> None:
    model = Cached(4096)
    model.cos_cached.copy_(model.cos_cached.bfloat16().float())
    before = {name: (t.clone(), t.data_ptr()) for name, t in model.named_buffers()}
    explain(model, expect="config", precision=True)
    assert all(torch.equal(t, before[name][0]) and t.data_ptr() == before[name][1] for name, t in model.named_buffers())


def test_tables_of_identical_content_are_measured_once(monkeypatch) -> None:
    calls = []
    measure = precision.measure
    monkeypatch.setattr(precision, "measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    explanation = explain(ToyDecoder(homogeneous(6, max_len=256)), precision=True)
    assert len(explanation.precision) == 12 and len(calls) == 2  # 6 cos and 6 sin: one share group each


def test_a_chunk_at_a_time_the_peak_does_not_grow_with_the_table() -> None:
    """The transient is one chunk's work (CHUNK_ROWS rows in float64), whatever the table's length."""
    peaks = []
    for length in (4096, 16384):
        model = ToyDecoder(homogeneous(1, layout="complex", max_len=length), d_model=128, heads=1)  # 64 frequencies
        (table,) = held_tables(model).tables
        tensor = model.layers[0].attention.rope.freqs_cis
        tensor[1:].mul_(torch.tensor(1 + 1e-3j))  # diverging: every comparison runs, not only the bit-for-bit path
        reference = reference_for(RopeSpec(1e4), table.key, length)
        held_precision(table.layer, table.source, tensor, table, reference, 1e-4)
        peaks.append(allocator_peak(lambda: held_precision(table.layer, table.source, tensor, table, reference, 1e-4)))
    block = precision.CHUNK_ROWS * 16 * 8  # one float64 block of a chunk: 512 KiB, whatever the width
    assert peaks[1] <= peaks[0] * 1.1 + (1 << 20), peaks
    assert peaks[1] <= 24 * block, f"{peaks[1] / 2**20:.1f} MiB"


def test_a_negative_or_infinite_threshold_is_refused() -> None:
    for bad in (-1e-4, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_angle_error must be a finite number of radians"):
            explain(ToyDecoder(homogeneous(1)), precision=True, max_angle_error=bad)


def _bf16_trig(graph: torch.fx.Graph) -> None:
    """An inductor pass that rounds every cos and sin the graph computes to bf16: RoPE run in bf16 in the
    compiled graph only (inductor keeps the casts with emulate_precision_casts)."""
    convert = torch.ops.prims.convert_element_type.default
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (torch.ops.aten.cos.default, torch.ops.aten.sin.default):
            with graph.inserting_after(node):
                down = graph.call_function(convert, (node, torch.bfloat16))
            with graph.inserting_after(down):
                up = graph.call_function(convert, (down, torch.float32))
            node.replace_all_uses_with(up, delete_user_cb=lambda user: user is not down)


def test_a_compiled_graph_whose_rope_runs_in_bf16_while_eager_runs_float32_is_found() -> None:
    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(1, layout="from_inv_freq", max_len=64)).eval()  # RoPE computed in forward
    tokens = torch.randint(0, 64, (1, 24))
    with inductor_config.patch(post_grad_custom_post_pass=_bf16_trig, emulate_precision_casts=True, fx_graph_cache=False):
        explanation = explain(model, tokens, precision=True)
    (finding,) = explanation.mismatches
    assert (finding.layer, finding.field) == ("layers.0", "compiled precision")
    assert "the compiled graph applies the table rounded to bfloat16 where eager applies it unrounded" in finding.found
    assert finding.fix.startswith("keep the cast")
    assert 0 <= finding.worst_position < 24 and 1e-3 < finding.error < 1e-2
    assert [c.verdict for c in explanation.compiled] == ["differs", "differs"]  # queries and keys
    eager = [t for t in explanation.precision if t.applied]
    assert eager and all(t.verdict == "matches" for t in eager)  # what eager applies is right


def test_a_correct_model_with_inputs_gives_no_finding_eager_or_compiled() -> None:
    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(1, layout="from_inv_freq", max_len=64)).eval()
    explanation = explain(model, torch.randint(0, 64, (1, 24)), expect=RopeSpec(1e4), precision=True)
    assert explanation.mismatches == ()
    assert [c.verdict for c in explanation.compiled] == ["matches eager", "matches eager"]
    assert all(c.angle < 1e-6 for c in explanation.compiled)
    applied = [t for t in explanation.precision if t.applied]
    assert applied and all(t.verdict == "matches" and t.to_reference.angle == 0 for t in applied)


def test_a_graph_that_writes_its_inputs_is_not_run_again_and_says_so() -> None:
    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(1, layout="filled_cache", max_len=64)).eval()  # a cache the forward fills
    explanation = explain(model, torch.randint(0, 64, (1, 8)), precision=True)
    assert {c.verdict for c in explanation.compiled} == {"not checked"} and explanation.mismatches == ()
    notes = explanation.notes()
    at = notes.index("compiled rotation not checked (1):")
    assert notes[at + 1].endswith("the graph writes its inputs in place: not run a second time")
    assert int(model.layers[0].attention.rope.filled) == 8  # the eager run filled it once


FACTORY = """
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous

def build():
    model = ToyDecoder(homogeneous(2, max_len=4096))
    rope = model.layers[1].attention.rope
    rope.cos.copy_(rope.cos.bfloat16().float())  # layer 1's cos rounded through bf16, held as float32
    return model
"""


@pytest.fixture
def factory(tmp_path, monkeypatch) -> str:
    (tmp_path / "rounded.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    yield "rounded.py:build"
    __import__("sys").modules.pop("rounded", None)


def test_the_command_line_exits_1_on_a_divergence_and_prints_json(factory, capsys, tmp_path) -> None:
    assert main(["audit", factory, "--static", "--precision", "--format", "json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert found["max_angle_error"] == DEFAULT_MAX_ANGLE_ERROR
    diverging = [t for t in found["precision"] if t["verdict"] == "diverges"]
    assert [t["source"] for t in diverging] == ["layers.1.attention.rope.cos"]
    assert diverging[0]["dtype"] == "float32" and diverging[0]["to_reference"]["ulps"] > 1
    (mismatch,) = found["mismatches"]
    assert mismatch["field"] == "precision" and mismatch["fix"].startswith("keep float32 not bf16")
    # A threshold above the cast's error (4e-3 rad for a lone cos): no finding.
    assert main(["audit", factory, "--static", "--precision", "--max-angle-error", "0.01"]) == 0
    assert "0 diverge from their reference" in capsys.readouterr().out
    plot = tmp_path / "precision.png"
    assert main(["audit", factory, "--static", "--precision", "--format", "markdown", "--plot", str(plot)]) == 1
    out = capsys.readouterr()
    assert plot.stat().st_size > 10_000 and "wrote" in out.err
    assert "**precision (a finding past 0.0001 rad" in out.out and "DIVERGES from 1" in out.out


@pytest.mark.parametrize("argv, message", [
    (["--max-angle-error", "1e-3"], "--max-angle-error goes with --precision"),
    (["--plot", "x.png"], "--plot goes with --precision"),
    (["--precision", "--max-angle-error", "-1"], "expected a finite number of radians >= 0, got -1"),
    (["--precision", "--max-angle-error", "rad"], "expected a number of radians, got rad"),
])
def test_the_command_line_refuses_bad_precision_options(factory, argv, message, capsys) -> None:
    try:
        code = main(["audit", factory, "--static", *argv])
    except SystemExit as exit:  # argparse refuses a malformed value itself
        code = exit.code
    assert code == 2 and message in capsys.readouterr().err


def test_a_vector_held_in_another_order_is_judged_in_its_order_against_an_expectation() -> None:
    """Ernie 4.5 VL keeps its inv_freq pre-rotated for its multimodal layout: judged frequency by frequency,
    the expectation's vector put in the held order; without an expectation, not judged."""
    rope = nn.Module()
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    rope.register_buffer("inv_freq", inv_freq[torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])], persistent=False)
    holder = nn.Module()
    holder.rotary_emb = rope
    (vector,) = explain(holder, expect=RopeSpec(1e4), precision=True).precision
    assert vector.verdict == "matches" and vector.to_reference.angle == 0 and vector.source == "rotary_emb.inv_freq"
    assert vector.to_float64.angle == pytest.approx(float64_distance_of_angles(inv_freq, MILLION, 1e4), rel=0.01)
    (alone,) = explain(holder, precision=True).precision
    assert alone.verdict == "not judged" and "judged only against an expectation" in alone.reference
    rope.inv_freq = rope.inv_freq.to(torch.bfloat16)
    (cast,) = explain(holder, expect=RopeSpec(1e4), precision=True).precision
    assert cast.diverges and cast.cause.startswith("frequencies (inv_freq) rounded to bfloat16")
