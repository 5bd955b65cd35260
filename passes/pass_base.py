"""What every rope_dedup pass takes and returns, and the one loop that runs passes over a graph.

Modeled on ``torch.fx.passes.infra``: a pass rewrites a GraphModule in place and returns a
``PassResult``; the loop, not the pass, lints and recompiles the graph once after each pass that
changed it, times each pass and logs the graph's size before and after (as torchtitan's
``apply_graph_passes`` does). Which passes run, and in which order, is declared in :mod:`pipeline`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch.fx

from rope_dedup.core.sources import WatchedInput
from rope_dedup.core.report import DedupReport
from rope_dedup.core.store import CanonicalStore

log = logging.getLogger("rope_dedup")


@dataclass(frozen=True)
class FoldedTable:
    """One constant the pass created: the GraphModule attribute, its report name, the nodes it replaced."""

    attribute: str
    name: str
    replaced: tuple[str, ...]
    status: str  # the store's answer: canonical, shared (aliased onto an equal table) or skipped


@dataclass(frozen=True)
class PassContext:
    """What a pass may use besides the graph and its example inputs.

    ``store``: the canonical store tables are offered to (a backend keeps one across all its graphs);
    None for a pass run on its own without one (merging then recognizes tables from their content).
    ``redirect_inputs``: whether duplicate table placeholders are rewritten to read one node.
    """

    store: CanonicalStore | None = None
    redirect_inputs: bool = True


@dataclass(frozen=True)
class RopePassResult:
    """The result of one rope_dedup pass, or of several run by :func:`run_passes` (then combined).

    ``graph_module`` and ``modified`` as in torch's ``PassResult``, and:

    - ``report``: the store's :class:`DedupReport` after the passes (None without a store);
    - ``watched_inputs``: example-input position -> :class:`~rope_dedup.core.sources.WatchedInput`, the
      state inputs run-time interning offers to the store on first sight (from ``dedup_rope``);
    - ``merged_inputs``: groups of input positions whose uses now read the first one, valid only while
      they share memory, which the compiled callable checks on every call (from ``dedup_rope``);
    - ``merged_nodes``: nodes ``merge_rope_subgraphs`` removed;
    - ``folded``: constants ``fold_rope_constants`` created;
    - ``seconds``: pass name -> seconds it took, lint and recompile included.
    """

    graph_module: torch.fx.GraphModule
    modified: bool
    report: DedupReport | None = None
    watched_inputs: dict[int, WatchedInput] = field(default_factory=dict)
    merged_inputs: list[tuple[int, ...]] = field(default_factory=list)
    merged_nodes: int = 0
    folded: list[FoldedTable] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GraphPass:
    """A pass: the ``rewrite`` function of a module in ``passes/``, named for that module (as the pipeline
    enables it, the report times it and torch's schedule check names it). ``rewrite`` changes the graph in
    place and neither lints nor recompiles: :func:`run_passes` does."""

    rewrite: Callable[[torch.fx.GraphModule, Sequence | None, PassContext], RopePassResult]

    @property
    def name(self) -> str:
        return self.rewrite.__module__.rpartition(".")[2]

    def __repr__(self) -> str:
        return self.name


def run_passes(gm: torch.fx.GraphModule, example_inputs: Sequence | None, passes: Sequence[GraphPass],
               context: PassContext) -> RopePassResult:
    """Run ``passes`` in order over ``gm``; one combined result, with seconds per pass."""
    results: list[RopePassResult] = []
    seconds: dict[str, float] = {}
    for graph_pass in passes:
        nodes_before = len(gm.graph.nodes)
        started = time.perf_counter()
        try:
            result = graph_pass.rewrite(gm, example_inputs, context)
        except Exception as error:  # the error keeps its type; the note says where in the pipeline it arose
            _add_note(error, f"rope_dedup: raised in pass {graph_pass.name}, after "
                             f"{', '.join(p.name for p in passes[:len(results)]) or 'no other pass'}")
            raise
        if result.modified:
            gm.graph.lint()
            gm.recompile()
        seconds[graph_pass.name] = time.perf_counter() - started
        log.debug("rope_dedup: %s: %d -> %d node(s), %.3f s%s", graph_pass.name, nodes_before,
                  len(gm.graph.nodes), seconds[graph_pass.name], "" if result.modified else ", unchanged")
        results.append(result)
    report = DedupReport.from_store(context.store) if context.store is not None else None
    if report is not None:
        gm.meta["rope_dedup_report"] = report
    return RopePassResult(
        gm, any(r.modified for r in results), report=report,
        watched_inputs={i: how for r in results for i, how in r.watched_inputs.items()},
        merged_inputs=[g for r in results for g in r.merged_inputs],
        merged_nodes=sum(r.merged_nodes for r in results),
        folded=[f for r in results for f in r.folded],
        seconds=seconds,
    )


def _add_note(error: BaseException, note: str) -> None:
    """``BaseException.add_note`` where Python has it (3.11+); on 3.10 the traceback alone says where."""
    if hasattr(error, "add_note"):
        error.add_note(note)
