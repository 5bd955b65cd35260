"""``torch.compile`` backend that deduplicates RoPE tables, then hands the graph to an inner backend."""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch
import torch.fx
from torch._dynamo.backends.registry import lookup_backend, register_backend
from torch._dynamo.utils import counters

from rope_dedup.passes.dedup_rope import dedup_rope
from rope_dedup.passes.fold_rope_constants import fold_rope_constants
from rope_dedup.passes.merge_rope_subgraphs import merge_rope_subgraphs
from rope_dedup.interning import InterningCallable
from rope_dedup.report import DedupReport
from rope_dedup.store import CanonicalStore

log = logging.getLogger("rope_dedup")

# Tables computed in forward: (fold_constants, merge_computed) per inner backend when left at None, as
# measured in docs/benchmarks.md ("Tables computed in forward"; 16 layers, 2-core CPU). eager, aot_eager:
# both help (forward step 0.55-0.85x) and outputs stay bitwise equal. inductor: merging 0.96-1.02x,
# nothing measurable; folding 0.97-0.98x forward, 0.89-0.94x training, but the folded table holds eager's
# cos/sin, which differ from inductor's fused ones in the last bits: outputs would no longer equal the
# compile without the pass, so it is opt-in (fold_constants=True). A callable inner gets neither.
COMPUTED_TABLE_DEFAULTS: dict[str, tuple[bool, bool]] = {
    "eager": (True, True),
    "aot_eager": (True, True),
    "inductor": (False, False),
}


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A structural copy (state shared, graph copied) to compile if the rewritten one cannot be used."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return torch.fx.GraphModule(gm, graph)


class RopeDedupBackend:
    """A torch.compile backend: share identical RoPE tables, then compile with ``inner``.

    ``inner`` is a backend name (``"inductor"``, ``"aot_eager"``, ``"eager"``) or a backend callable.
    One instance keeps one canonical store across every graph it compiles, so per-block compiles and
    graph breaks share too; two instances never share with each other. With ``strict=True`` an
    unexpected error inside the pass is raised; otherwise the graph is compiled without sharing and the
    error is logged and kept in ``report.errors``. With ``dry_run=True`` nothing is aliased or
    rewritten: the report says what would be shared (see :func:`rope_dedup.explain`). Tensors saved in
    a ``state_dict`` (persistent buffers, frozen parameters) are skipped with the reason unless
    ``share_persistent=True``: safetensors' ``save_file`` refuses tensors that share memory
    (``save_model`` handles them).

    Tables computed in ``forward``: ``fold_constants`` evaluates a subgraph that reads no input and
    ends in a RoPE table once, at compile time, into one shared constant; ``merge_computed`` merges
    identical table computations that read buffers or positions (never folded: those may change). None
    (the default) takes :data:`COMPUTED_TABLE_DEFAULTS`, set by measurement: both on for ``eager`` and
    ``aot_eager``, neither for ``inductor`` or a callable ``inner``. Under ``inductor``,
    ``fold_constants=True`` is a few percent faster on CPU, but a folded table holds eager's cos/sin
    values, which differ from inductor's fused ones in the last bits (outputs then differ by ~1e-6).
    """

    def __init__(self, inner: str | Callable = "inductor", *, strict: bool = False, dry_run: bool = False,
                 share_persistent: bool = False, fold_constants: bool | None = None,
                 merge_computed: bool | None = None) -> None:
        self.inner = inner
        self.fold_constants = fold_constants  # None: COMPUTED_TABLE_DEFAULTS for the inner backend
        self.merge_computed = merge_computed
        self.strict = strict
        self.store = CanonicalStore(dry_run=dry_run, share_persistent=share_persistent)
        self.graphs_compiled = 0
        self.pass_seconds = 0.0  # the pass plus its safety copy of the graph, all graphs together
        self.errors: list[str] = []

    def _inner_backend(self) -> Callable:
        return lookup_backend(self.inner) if isinstance(self.inner, str) else self.inner

    def computed_table_transforms(self) -> tuple[bool, bool]:
        """(fold constant RoPE subgraphs, merge identical ones) as this backend will apply them."""
        fold, merge = COMPUTED_TABLE_DEFAULTS.get(self.inner, (False, False)) if isinstance(self.inner, str) \
            else (False, False)
        fold = fold if self.fold_constants is None else self.fold_constants
        merge = merge if self.merge_computed is None else self.merge_computed
        return fold, merge

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
        inner = self._inner_backend()
        started = time.perf_counter()
        pristine = _copy_graph_module(gm)
        try:
            result = dedup_rope(gm, example_inputs, store=self.store)
            fold, merge = self.computed_table_transforms()
            if merge and not self.store.dry_run:  # after dedup_rope: per-layer tables now read one node
                merge_rope_subgraphs(gm, example_inputs, store=self.store)
            if fold and not self.store.dry_run:
                fold_rope_constants(gm, example_inputs, store=self.store)
        except Exception as error:
            if self.strict:
                raise
            message = f"graph {self.graphs_compiled}: pass failed, compiled without sharing: {error!r}"
            log.error("rope_dedup: %s", message, exc_info=True)
            self.errors.append(message)
            counters["rope_dedup"]["pass_errors"] += 1
            self.graphs_compiled += 1
            return inner(pristine, example_inputs)
        self.pass_seconds += time.perf_counter() - started
        self.graphs_compiled += 1
        counters["rope_dedup"]["graphs"] += 1
        if log.isEnabledFor(logging.INFO):  # the summary builds a whole report: only when someone reads it
            log.info("rope_dedup: graph %d: %d state input(s) watched at run time, %d merged group(s); %s",
                     self.graphs_compiled - 1, len(result.watched_inputs), len(result.merged_inputs),
                     str(self.report).splitlines()[0])
        compiled = inner(gm, example_inputs)
        fallback = None
        if result.merged_inputs:
            def fallback(args: Sequence) -> Callable:
                return inner(pristine, list(args))
        return InterningCallable(compiled, self.store, result.watched_inputs, result.merged_inputs, fallback)

    @property
    def report(self) -> DedupReport:
        """Everything this backend has shared or skipped, across all graphs it compiled."""
        return DedupReport.from_store(self.store, errors=self.errors)

    def report_for(self, model: torch.nn.Module) -> DedupReport:
        """The report with members named by their full path in ``model`` (useful after regional compile)."""
        return DedupReport.from_store(self.store, model=model, errors=self.errors)


rope_dedup_backend = RopeDedupBackend()
"""Ready instance with the inductor inner backend: ``torch.compile(model, backend=rope_dedup_backend)``."""

try:
    register_backend(rope_dedup_backend, name="rope_dedup")
except Exception as error:  # already registered (module reloaded): keep the first
    log.debug("rope_dedup: backend name already registered: %r", error)
