"""The declared pass pipeline: which passes run per config, in which order, and what the loop does."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch.fx.passes.infra.pass_manager import PassManager

from rope_dedup import RopeDedupBackend, RopeDedupConfig, RopePassResult, dedup_rope
from rope_dedup.passes.fold_rope_constants import fold_rope_constants
from rope_dedup.passes.merge_rope_subgraphs import merge_rope_subgraphs
from rope_dedup.passes.pipeline import CONSTRAINTS, PASSES, enabled_passes, run_pipeline
from rope_dedup.core.store import CanonicalStore
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous

TOKENS = torch.randint(0, 64, (1, 8))
ALL = ["dedup_rope", "merge_rope_subgraphs", "fold_rope_constants"]


def mixed() -> ToyDecoder:
    """Two layers that build their table from an ``inv_freq`` buffer (shared, then merged) and two that
    build it from nothing (folded): every declared pass has something to rewrite."""
    torch.manual_seed(0)
    return ToyDecoder(homogeneous(2, layout="from_inv_freq") + homogeneous(2, layout="computed")).eval()


@pytest.mark.parametrize("config, names", [
    (RopeDedupConfig("eager"), ALL),
    (RopeDedupConfig("aot_eager"), ALL),
    (RopeDedupConfig("inductor"), ["dedup_rope"]),
    (RopeDedupConfig("inductor", fold_constants=True), ["dedup_rope", "fold_rope_constants"]),
    (RopeDedupConfig("eager", merge_computed=False), ["dedup_rope", "fold_rope_constants"]),
    (RopeDedupConfig("eager", dry_run=True), ["dedup_rope"]),
])
def test_config_enables_passes_by_name_in_declared_order(config: RopeDedupConfig, names: list[str]) -> None:
    assert [p.name for p in enabled_passes(config)] == names


def test_merging_before_dedup_breaks_the_declared_constraint() -> None:
    """merge_rope_subgraphs finds identical computations only once every layer reads one table node."""
    PassManager(list(PASSES), CONSTRAINTS).validate_constraints()
    with pytest.raises(RuntimeError, match="pass schedule constraint violated.*merge_rope_subgraphs"):
        PassManager([PASSES[1], PASSES[0], PASSES[2]], CONSTRAINTS).validate_constraints()


def test_the_loop_recompiles_once_per_pass_that_changed_the_graph(monkeypatch) -> None:
    """The pipeline does what the three passes' own entry points do one after another, and the graph is
    linted and recompiled once per pass that changed it (before, fold recompiled a second time whenever
    its redirect of aliased constants fired; on this model it does not, so the count was 3 then too)."""
    recompiles, results = [], []

    def pipeline(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """The pipeline alone, on dynamo's graph and inputs, counting recompiles while it runs."""
        recompile = gm.recompile  # dynamo's lazy GraphModule has its own
        with monkeypatch.context() as patch:
            patch.setattr(gm, "recompile", lambda: recompiles.append(1) or recompile())
            results.append(run_pipeline(gm, example_inputs, RopeDedupConfig("eager"), CanonicalStore()))
        return gm.forward

    def one_by_one(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        store = CanonicalStore()
        results.append([dedup_rope(gm, example_inputs, store=store),
                        merge_rope_subgraphs(gm, example_inputs, store=store),
                        fold_rope_constants(gm, example_inputs, store=store)])
        return gm.forward

    model = mixed()
    expected = model(TOKENS)
    torch.testing.assert_close(torch.compile(model, backend=pipeline)(TOKENS), expected, rtol=0, atol=0)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(mixed(), backend=one_by_one)(TOKENS), expected, rtol=0, atol=0)
    result, (dedup, merge, fold) = results
    assert isinstance(result, RopePassResult) and result.modified
    assert len(recompiles) == 3
    assert list(result.seconds) == ALL
    assert [dedup.seconds.keys(), merge.seconds.keys(), fold.seconds.keys()] == [{name} for name in ALL]
    assert dedup.modified and merge.modified and fold.modified
    assert result.merged_nodes == merge.merged_nodes > 0
    assert result.watched_inputs == dedup.watched_inputs and result.merged_inputs == dedup.merged_inputs
    assert [(f.name, f.replaced) for f in result.folded] == [(f.name, f.replaced) for f in fold.folded]
    assert [f.name for f in result.folded] == ["layers.2.attention.rope:cos_20", "layers.2.attention.rope:sin_20"]
    assert result.graph_module.code == fold.graph_module.code
    assert result.graph_module.meta["rope_dedup_report"] is result.report


def test_report_shows_seconds_per_pass_across_graphs() -> None:
    backend = RopeDedupBackend("eager")
    torch.compile(mixed(), backend=backend)(TOKENS)
    assert list(backend.pass_seconds) == ALL
    assert all(seconds > 0 for seconds in backend.pass_seconds.values())
    assert backend.report.pass_seconds == backend.pass_seconds
    assert "pass time: dedup_rope " in str(backend.report)


def test_an_error_in_a_pass_keeps_its_type_and_names_the_pass(monkeypatch) -> None:
    """torch's PassManager would re-raise a bare Exception; the loop keeps the error and adds where it arose."""
    def broken(gm: torch.fx.GraphModule) -> dict:
        raise ValueError("no pure nodes today")

    monkeypatch.setattr("rope_dedup.passes.merge_rope_subgraphs.find_pure_nodes", broken)
    gm = torch.fx.symbolic_trace(mixed())
    with pytest.raises(ValueError, match="no pure nodes today") as raised:
        run_pipeline(gm, None, RopeDedupConfig("eager"), CanonicalStore())
    assert raised.value.__notes__ == ["rope_dedup: raised in pass merge_rope_subgraphs, after dedup_rope"]
