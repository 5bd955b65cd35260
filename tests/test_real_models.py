"""rope_dedup on real models from real libraries (tiny random-init configs, see tests/real_models.py).

For each model and inner backend, whole-model and per-block (regional) compile: outputs bitwise equal
to the same compile without the pass, RoPE storages at the ideal count stated by the registry, every
table in the report as shared or skipped with the expected reason, and no recompile on a repeated call.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from helpers import compile_model, unwrap
from real_models import PERSISTENT, REAL_MODELS, WITH_PERSISTENT_TABLES, RealCase, unique_storages
from torch._dynamo.utils import counters

from rope_dedup import RopeDedupBackend
from rope_dedup.core.report import DedupReport

# fair-esm's modules use torch.jit.script_method, deprecated in torch 2.13: one warning per import.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

CALLS = 3  # lazy caches (ESM, rotary-embedding-torch) are built on call 1 and read from call 2 on


@dataclass
class Run:
    outputs: list[torch.Tensor]
    graphs: list[int]  # unique_graphs after each call
    model: nn.Module  # unwrapped: no _orig_mod in its paths


def run(case: RealCase, backend, mode: str) -> Run:
    compiled = compile_model(case.model, backend, mode == "regional", case.blocks)
    outputs, graphs = [], []
    with torch.no_grad():
        for _ in range(CALLS):
            outputs.append(case.output(compiled(*case.example_inputs)))
            graphs.append(counters["stats"]["unique_graphs"])
    return Run(outputs, graphs, case.model if case.blocks is None else unwrap(case.model, case.blocks))


def plain_run(name: str, inner: str, mode: str) -> tuple[Run, int]:
    """The same compile without the pass, and its RoPE storages after the calls; leaves dynamo clean."""
    case = REAL_MODELS[name]()
    reference = run(case, inner, mode)
    before = unique_storages(t for _, t in case.rope_tensors(reference.model))
    torch._dynamo.reset()
    counters.clear()
    return reference, before


def skip_reason(report: DedupReport, table: str) -> str | None:
    """The reason ``report`` (from ``backend.report_for(model)``: full paths) gives for skipping ``table``."""
    reasons = [s.reason for s in report.skipped if s.path == table]
    return reasons[0] if reasons else None


def check_report(case: RealCase, report: DedupReport, share_persistent: bool) -> None:
    """Every table forward reads is shared (a group member) or skipped with the expected reason."""
    assert not report.errors
    members = {m for g in report.groups for m in g.members}
    expected_skips = case.skips(share_persistent)
    for table, _ in case.rope_tensors(case.model):
        if table in case.unread:
            assert table not in members, f"{table} is never read, yet the report has it"
        elif table in expected_skips:
            assert table not in members, f"{table} should keep its own storage"
            reason = skip_reason(report, table)
            assert reason is not None and expected_skips[table] in reason, (table, reason, str(report))
        else:
            assert table in members, f"{table} neither shared nor skipped:\n{report}"
    assert not report.conflicts


def check_storages(case: RealCase, share_persistent: bool) -> None:
    tables = case.rope_tensors(case.model)
    assert unique_storages(t for _, t in tables) == case.ideal(share_persistent), [
        (n, t.untyped_storage().data_ptr()) for n, t in tables]
    # Whatever shares a storage has equal content (never merge what is not equal).
    by_storage: dict[int, list[torch.Tensor]] = {}
    for _, tensor in tables:
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    for group in by_storage.values():
        assert all(torch.equal(t, group[0]) for t in group)


# Default set: every model under eager/whole and aot_eager/regional; the other two pairings are the slow
# set (same code paths again, ~60 s more on 2 CPU cores).
DEFAULT = {("eager", "whole"), ("aot_eager", "regional")}


def cases() -> list:
    params = []
    for name in REAL_MODELS:
        for inner in ("eager", "aot_eager"):
            for mode in ("whole", "regional"):
                marks = [] if (inner, mode) in DEFAULT else [pytest.mark.slow]
                params.append(pytest.param(name, inner, mode, id=f"{name}-{inner}-{mode}", marks=marks))
    return params


@pytest.mark.parametrize("name,inner,mode", cases())
def test_real_model(name: str, inner: str, mode: str) -> None:
    case = REAL_MODELS[name]()
    if mode == "regional" and case.blocks is None:
        pytest.skip(f"{name}: no per-block structure to compile")
    reference, before = plain_run(name, inner, mode)
    backend = RopeDedupBackend(inner)
    got = run(case, backend, mode)

    for mine, want in zip(got.outputs, reference.outputs):
        torch.testing.assert_close(mine, want, rtol=0, atol=0)  # bitwise vs the compile without the pass
    assert got.graphs == reference.graphs  # same graphs, compiled at the same calls
    assert got.graphs[-1] == got.graphs[-2]  # a repeated call compiles nothing
    check_storages(case, share_persistent=False)
    # Without the pass every table keeps its own storage (each library builds one per layer), and the
    # ideal is below that: each model has something to share.
    assert before == len(case.rope_tensors(got.model)) > case.ideal()
    check_report(case, backend.report_for(got.model), share_persistent=False)


# aot_eager per block repeats eager's decisions through a second tracer, and test_real_model runs that pairing
# on every model: the slow set.
@pytest.mark.parametrize("inner,mode", [("eager", "whole"), pytest.param("aot_eager", "regional", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(WITH_PERSISTENT_TABLES))
def test_share_persistent_opt_in(name: str, inner: str, mode: str) -> None:
    """Persistent buffers (ESM's ``inv_freq``) and frozen parameters (rotary-embedding-torch's ``freqs``)
    are shared too once ``share_persistent=True`` opts in."""
    reference, _ = plain_run(name, inner, mode)
    case = REAL_MODELS[name]()
    backend = RopeDedupBackend(inner, share_persistent=True)
    got = run(case, backend, mode)
    for mine, want in zip(got.outputs, reference.outputs):
        torch.testing.assert_close(mine, want, rtol=0, atol=0)
    assert got.graphs == reference.graphs
    assert got.graphs[-1] == got.graphs[-2]
    check_storages(case, share_persistent=True)
    check_report(case, backend.report_for(got.model), share_persistent=True)
    assert not any(s.reason.startswith(PERSISTENT) for s in backend.report.skipped)


@pytest.mark.slow  # ~20 s on 2 CPU cores
def test_inductor_gptj() -> None:
    """The one inductor case: GPT-J whole-model, bitwise (under inductor graph inputs are not redirected)."""
    reference, _ = plain_run("transformers-gptj", "inductor", "whole")
    case = REAL_MODELS["transformers-gptj"]()
    backend = RopeDedupBackend("inductor")
    got = run(case, backend, "whole")
    for mine, want in zip(got.outputs, reference.outputs):
        torch.testing.assert_close(mine, want, rtol=0, atol=0)
    assert got.graphs == reference.graphs
    assert got.graphs[-1] == got.graphs[-2]
    check_storages(case, share_persistent=False)
    check_report(case, backend.report_for(got.model), share_persistent=False)
