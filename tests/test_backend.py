"""The backend end to end on toy decoders: ideal storage counts, equal outputs, no extra recompiles."""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass, replace

import pytest
import torch
from helpers import build, compile_model, rope_storages, unwrap
from torch._dynamo.testing import EagerAndRecordGraphs, normalize_gm
from torch._dynamo.utils import counters
from ideal import ideal_storages
from rope_dedup.testing.toy_decoder import LAYOUTS, TableRecipe, ToyDecoder, homogeneous, local_global, rope_tensors

import rope_dedup
from rope_dedup import RopeDedupBackend

SCENARIOS = {
    "homogeneous": homogeneous(4),
    "local_global": local_global(6, every=3),
    "partial_rotary": [TableRecipe(rotary_dim=8), TableRecipe(), TableRecipe(rotary_dim=8), TableRecipe()],
    "scaled_vs_plain": [TableRecipe(), TableRecipe(scaling="linear"), TableRecipe(scaling="llama3", theta=5e5),
                        TableRecipe(theta=5e5), TableRecipe(scaling="yarn"), TableRecipe(),
                        TableRecipe(scaling="linear")],
    "mixed_dtypes": [TableRecipe(), TableRecipe(dtype=torch.bfloat16), TableRecipe(dtype=torch.float16),
                     TableRecipe(dtype=torch.bfloat16), TableRecipe()],
    "mutated_cache": [TableRecipe(layout="lazy_cache")] * 3 + [TableRecipe()] * 2,
}


@dataclass
class Run:
    """One scenario compiled twice, without and with the pass, on identical models."""

    expected: list[torch.Tensor]  # outputs of the same compile without the pass
    eager: list[torch.Tensor]  # outputs of the model run eagerly before compiling
    outputs: list[torch.Tensor]  # outputs with the pass
    plain_graphs: int  # unique graphs dynamo compiled without the pass
    graphs: int  # unique graphs with the pass
    before: int  # RoPE storages before the pass
    ideal: int  # RoPE storages after ideal sharing, from construction (tests/ideal.py)
    model: ToyDecoder  # the model compiled with the pass (regional: its blocks still wrapped)
    backend: RopeDedupBackend


def run_case(specs, inner: str, mode: str) -> Run:
    """Compile the same model twice (with and without the pass); outputs, graph counts, storages."""
    graph_break = mode == "graph_break"
    regional = mode == "regional"
    tokens = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]

    plain = compile_model(build(specs, graph_break=graph_break), inner, regional)
    expected = [plain(t) for t in tokens]
    plain_graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()

    model = build(specs, graph_break=graph_break)
    eager = [model(t) for t in tokens]
    before = rope_storages(model)
    ideal = ideal_storages(model)
    backend = RopeDedupBackend(inner)
    compiled = compile_model(model, backend, regional)
    outputs = [compiled(t) for t in tokens]
    return Run(expected, eager, outputs, plain_graphs, counters["stats"]["unique_graphs"], before, ideal, model,
               backend)


# aot_eager under graph breaks repeats what eager and whole-model aot_eager already cover: slow set.
INNER_MODES = [("eager", m) for m in ("whole", "graph_break", "regional")] + [
    ("aot_eager", "whole"), ("aot_eager", "regional"), pytest.param("aot_eager", "graph_break", marks=pytest.mark.slow)]


@pytest.mark.parametrize("inner,mode", INNER_MODES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ideal_storages_equal_outputs_no_recompiles(scenario: str, inner: str, mode: str) -> None:
    run = run_case(SCENARIOS[scenario], inner, mode)
    for got, want, ref in zip(run.outputs, run.expected, run.eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # bitwise vs the same compile without the pass
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert run.graphs == run.plain_graphs
    assert rope_storages(unwrap(run.model)) == run.ideal < run.before
    assert not run.backend.report.errors


@pytest.mark.parametrize("mode", ["whole", "graph_break", "regional"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reaches_the_ideal(layout: str, mode: str) -> None:
    run = run_case(homogeneous(4, layout=layout), "eager", mode)
    for got, ref in zip(run.outputs, run.eager):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert run.graphs == run.plain_graphs
    assert rope_storages(unwrap(run.model)) == run.ideal < run.before


# local_global compiled whole repeats homogeneous whole with more tables (11 s of cold inductor): slow set.
@pytest.mark.parametrize("scenario,mode", [
    (scenario, mode) if (scenario, mode) != ("local_global", "whole")
    else pytest.param(scenario, mode, marks=pytest.mark.slow)
    for scenario in ("homogeneous", "local_global") for mode in ("whole", "graph_break", "regional")])
def test_inductor(scenario: str, mode: str) -> None:
    run = run_case(SCENARIOS[scenario], "inductor", mode)
    for got, want, ref in zip(run.outputs, run.expected, run.eager):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert run.graphs == run.plain_graphs
    assert rope_storages(unwrap(run.model)) == run.ideal < run.before


# aot_eager traces the same joint graph; inductor's code for it is a 50 s cold compile on 2 cores: slow set.
@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_training_gradients_equal_eager(inner: str) -> None:
    specs = local_global(4, every=2)
    reference, model = build(specs), build(specs)
    compiled = torch.compile(model, backend=RopeDedupBackend(inner))
    for step in range(2):
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        loss_ref = reference(tokens).logsumexp(-1).mean()
        loss = compiled(tokens).logsumexp(-1).mean()
        loss_ref.backward()
        loss.backward()
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    for (name, p_ref), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert rope_storages(model) == 4


def test_report_covers_every_graph_and_names_full_paths() -> None:
    model = build(local_global(6, every=3))
    backend = RopeDedupBackend("eager")
    compile_model(model, backend, regional=True)(torch.randint(0, 64, (1, 8)))
    report = backend.report_for(unwrap(model))
    by_theta = {g.key.theta: g for g in report.groups if g.key.layout == "cos"}
    assert by_theta[1e4].members == [f"layers.{i}.attention.rope.cos" for i in (0, 1, 3, 4)]
    assert by_theta[1e6].members == [f"layers.{i}.attention.rope.cos" for i in (2, 5)]
    assert report.bytes_after == 4 * 128 * 8 * 4
    assert report.bytes_before == 12 * 128 * 8 * 4
    # Relative names before resolving: each block's table under the block's own path, numbered.
    assert backend.report.groups[0].members[:2] == ["attention.rope.cos", "attention.rope.cos#1"]


def test_report_for_names_every_block_s_skipped_table() -> None:
    """One graph serves every block: one relative skip name stands for the table of each block."""
    model = build([TableRecipe(layout="lazy_cache")] * 3)
    backend = RopeDedupBackend("eager")
    compile_model(model, backend, regional=True)(torch.randint(0, 64, (1, 8)))
    relative = [s.path for s in backend.report.skipped if s.path.endswith("cached_freqs")]
    assert relative == ["attention.rope.cached_freqs"]
    full = [s.path for s in backend.report_for(unwrap(model)).skipped if s.path.endswith("cached_freqs")]
    assert full == [f"layers.{i}.attention.rope.cached_freqs" for i in range(3)]


def test_replaced_table_falls_back_to_unmerged_graph() -> None:
    """A buffer swapped for different content after compiling must not be read through the merge."""
    model = build(homogeneous(3))
    compiled = torch.compile(model, backend=RopeDedupBackend("aot_eager"))
    tokens = torch.randint(0, 64, (1, 16))
    compiled(tokens)
    other = ToyDecoder([TableRecipe(theta=1e6)]).layers[0].attention.rope
    model.layers[1].attention.rope.cos = other.cos.clone()
    model.layers[1].attention.rope.sin = other.sin.clone()
    torch.testing.assert_close(compiled(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    assert counters["rope_dedup"]["fallbacks"] == 1


def test_dropping_a_model_frees_its_tables() -> None:
    backend = RopeDedupBackend("eager")
    model = build(homogeneous(3))
    torch.compile(model, backend=backend)(torch.randint(0, 64, (1, 8)))
    assert len(backend.report.groups) == 2
    del model
    torch._dynamo.reset()  # dynamo's cache holds the frame's guards, which reference the module
    gc.collect()
    assert backend.report.groups == []


def test_two_backends_never_share() -> None:
    first, second = build(homogeneous(2)), build(homogeneous(2))
    tokens = torch.randint(0, 64, (1, 8))
    torch.compile(first, backend=RopeDedupBackend("eager"))(tokens)
    torch.compile(second, backend=RopeDedupBackend("eager"))(tokens)
    first_ptrs = {t.data_ptr() for _, t in rope_tensors(first)}
    assert first_ptrs.isdisjoint(t.data_ptr() for _, t in rope_tensors(second))
    assert rope_storages(first) == rope_storages(second) == 2


def test_pass_failure_falls_back_loudly_or_raises_when_strict(monkeypatch, caplog) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(rope_dedup.passes.dedup_rope, "find_candidates", broken)  # inside the first pass
    model = build(homogeneous(2))
    tokens = torch.randint(0, 64, (1, 8))
    backend = RopeDedupBackend("eager")
    torch.testing.assert_close(torch.compile(model, backend=backend)(tokens), model(tokens))
    assert "boom" in backend.report.errors[0]
    assert "ERROR: graph 0: pass failed" in str(backend.report)
    if sys.version_info >= (3, 11):  # exception notes: the error names the pass that raised it
        assert backend.report.errors[0].endswith("(rope_dedup: raised in pass dedup_rope, after no other pass)")
    assert any(r.levelname == "ERROR" for r in caplog.records)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="boom"):
        torch.compile(model, backend=RopeDedupBackend("eager", strict=True))(tokens)


def test_registered_backend_name_and_ready_instance() -> None:
    assert "rope_dedup" in torch._dynamo.list_backends(exclude_tags=())
    model = build(homogeneous(2))
    tokens = torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(torch.compile(model, backend="rope_dedup")(tokens), model(tokens),
                               rtol=1e-5, atol=1e-5)
    assert isinstance(rope_dedup.rope_dedup_backend, RopeDedupBackend)
    assert rope_dedup.rope_dedup_backend.inner == "inductor"
    assert rope_storages(model) == 2


def test_dry_run_shares_nothing_but_reports() -> None:
    """Decides and reports, but hands the inner backend the graph it would get without rope_dedup."""
    tokens = torch.randint(0, 64, (1, 8))
    plain = EagerAndRecordGraphs()
    torch.compile(build(homogeneous(3)), backend=plain)(tokens)
    torch._dynamo.reset()
    model = build(homogeneous(3))
    graphs = EagerAndRecordGraphs()
    # A recording inner backend runs the graph as "eager" does; the computed-table transforms are asked
    # for explicitly, as "eager" turns them on by default.
    backend = RopeDedupBackend(graphs, dry_run=True, fold_constants=True, merge_computed=True)
    torch.compile(model, backend=backend)(tokens)
    assert rope_storages(model) == 6
    report = backend.report
    assert [len(g.members) for g in report.groups] == [3, 3]
    assert report.bytes_after == report.bytes_before // 3
    # Unrewritten: the same code, and every table placeholder still read by its own layer.
    assert len(graphs.graphs) == len(plain.graphs) == 1
    gm = graphs.graphs[0]
    assert normalize_gm(gm.print_readable(print_output=False)) == normalize_gm(
        plain.graphs[0].print_readable(print_output=False))
    assert [n.name for n in gm.graph.find_nodes(op="placeholder") if not n.users] == []


def test_interning_skips_known_tensors_cheaply() -> None:
    """After the first call, later calls find every RoPE input already interned (pointer check only)."""
    model = build(homogeneous(4))
    compile_model(model, RopeDedupBackend("eager"), regional=True)
    tokens = torch.randint(0, 64, (1, 8))
    model(tokens)
    interned = counters["rope_dedup"]["interned_at_runtime"]
    assert interned == 3 * 2  # layer 0 was interned by the compile-time pass
    model(tokens)
    assert counters["rope_dedup"]["interned_at_runtime"] == interned


def _dynamo_switches_per_call(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """How many times one call enters dynamo's ``disable`` wrapper (``eval_frame._fn``)."""
    entered = 0

    def profile(frame, event, arg) -> None:
        nonlocal entered
        code = frame.f_code
        if event == "call" and code.co_name == "_fn" and code.co_filename.endswith("eval_frame.py"):
            entered += 1

    sys.setprofile(profile)
    try:
        model(tokens)
    finally:
        sys.setprofile(None)
    return entered


def test_the_interning_wrapper_adds_no_second_dynamo_switch() -> None:
    """Dynamo wraps what a backend returns in ``disable``, unwrapping a graph the inner backend wrapped
    already; the callable around it must not make that two wrappers per call (a cost on every block)."""
    tokens = torch.randint(0, 64, (1, 8))
    switches = []
    for backend in ("inductor", RopeDedupBackend("inductor")):
        torch._dynamo.reset()
        model = compile_model(build(homogeneous(2)), backend, regional=True)
        model(tokens)
        switches.append(_dynamo_switches_per_call(model, tokens))
    assert switches[0] > 0 and switches[1] == switches[0]


def test_mixed_dtype_tables_never_merge_across_dtypes() -> None:
    model = build([TableRecipe(), replace(TableRecipe(), dtype=torch.bfloat16)] * 2)
    backend = RopeDedupBackend("eager")
    torch.compile(model, backend=backend)(torch.randint(0, 64, (1, 8)))
    dtypes = sorted(str(g.key.dtype) for g in backend.report.groups)
    assert dtypes == ["torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32"]
    assert rope_storages(model) == 4


def test_table_placeholders_stay_apart_under_inductor(monkeypatch) -> None:
    """Under inductor the tables are shared in memory but each placeholder keeps its uses: one node per
    table changes inductor's fusion (a Persimmon model's gradients moved by 2e-7; see
    ``test_transformers4.py``). Other backends read the shared table through one node."""
    graphs = {"inductor": EagerAndRecordGraphs(), "callable": EagerAndRecordGraphs()}
    # compile_fx replaced by a recorder (its config_patches dropped): the graph inductor would get, run as is.
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx",
                        lambda gm, example_inputs, **kwargs: graphs["inductor"](gm, example_inputs))
    tokens = torch.randint(0, 64, (1, 8))
    for inner in ("inductor", graphs["callable"]):
        torch._dynamo.reset()
        model = build(homogeneous(3))
        out = torch.compile(model, backend=RopeDedupBackend(inner))(tokens)
        torch.testing.assert_close(out, model(tokens), rtol=0, atol=0)
        assert rope_storages(model) == 2
    unused = {name: [n.name for n in recorded.graphs[0].graph.find_nodes(op="placeholder") if not n.users]
              for name, recorded in graphs.items()}
    assert {name: len(recorded.graphs) for name, recorded in graphs.items()} == {"inductor": 1, "callable": 1}
    assert unused["inductor"] == []
    # Layers 1 and 2's cos and sin now read layer 0's.
    assert unused["callable"] == [f"l_self_modules_layers_modules_{i}_modules_attention_modules_rope_buffers_{t}_"
                                  for i in (1, 2) for t in ("cos", "sin")], unused
