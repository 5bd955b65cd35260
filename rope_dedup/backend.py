"""``torch.compile`` backend that deduplicates RoPE tables, then hands the graph to an inner backend."""

from __future__ import annotations

import dataclasses
import logging
import time
from importlib.metadata import entry_points
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._dynamo.backends.registry import register_backend
from torch._dynamo.utils import counters

from rope_dedup.config import ComputedTables, RopeDedupConfig
from rope_dedup.interning import InterningCallable
from rope_dedup.core.dynamo_state import release_tensor_refs_at_compile_end
from rope_dedup.core.memory import release_if_freed
from rope_dedup.passes.find_mutations import find_mutations
from rope_dedup.passes.pipeline import run_pipeline
from rope_dedup.core.eligibility import SkipReason
from rope_dedup.core.report import DedupReport, Recomputed, Skip
from rope_dedup.core.store import CanonicalStore
from rope_dedup.recompute.at_compile import CompileTimeConverter

log = logging.getLogger("rope_dedup")

BACKEND_NAME = "rope_dedup"


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A structural copy (state shared, graph copied) to compile if the rewritten one cannot be used.

    Without dynamo's ``grapharg`` entries: each holds a weak reference to the model's tensor at its input,
    which dynamo drops from its own graph once compiled; kept here, it would stop ``torch.utils.swap_tensors``
    on every parameter and buffer the graph reads."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    for node in graph.nodes:
        node.meta.pop("grapharg", None)  # node_copy gave each node a copy of the meta dict: gm keeps its own
    return torch.fx.GraphModule(gm, graph)


class RopeDedupBackend:
    """A torch.compile backend: share identical RoPE tables, then compile with the inner backend.

    ``RopeDedupBackend(inner, **options)`` takes the fields of :class:`~rope_dedup.config.RopeDedupConfig`
    as keywords (or ``config=`` one object); what each means and defaults to is documented there. One
    instance keeps one canonical store across every graph it compiles, so per-block compiles and graph
    breaks share too; two instances never share with each other. ``torch.compile(model, backend=...,
    mode=..., options=...)`` reaches the backend too: ``mode`` and inductor's options go on to the inner
    backend, rope_dedup's own option names in ``options`` (``inner``, ``dry_run``, ...) set this compile's
    config, so ``torch.compile(model, backend="rope_dedup", options={"inner": "aot_eager"})`` needs no
    import.
    """

    def __init__(self, inner: str | Callable = "inductor", *, config: RopeDedupConfig | None = None,
                 **options: Any) -> None:
        if config is None:
            unknown = sorted(set(options) - set(RopeDedupConfig.option_names()))
            if unknown:
                raise TypeError(f"unknown option(s) {', '.join(unknown)}: RopeDedupBackend takes "
                                f"{', '.join(RopeDedupConfig.option_names())}")
            config = RopeDedupConfig(inner=inner, **options)
        elif options or inner != "inductor":
            raise TypeError("give either config= or the options themselves, not both")
        self.config = config
        # One store per storage policy: a compile whose options ask for another policy (say dry_run) must
        # not alias into, or be reported as, this one's shared tables.
        self._stores: dict[tuple[bool, bool], CanonicalStore] = {}
        self.store = self._store_for(config)
        self._compiles: dict[str, tuple[RopeDedupConfig, Callable]] = {}  # compile kwargs -> (config, inner)
        self.graphs_compiled = 0
        self.pass_seconds: dict[str, float] = {}  # pass name -> seconds, all graphs together
        self.copy_seconds = 0.0  # the safety copy of each graph (see __call__), all graphs together
        self.errors: list[str] = []
        self._recompute = CompileTimeConverter()  # tables="recompute": one frequency vector per key, all graphs
        self._recomputed: dict[str, Recomputed] = {}  # path -> the table recomputed there
        self._kept: dict[str, Skip] = {}  # path -> why a table was not recomputed

    # The name this backend is registered under: dynamo treats a backend with a ``compiler_name`` it knows as
    # registered, and then drops its own weak references to the model's tensors when each frame's compile ends
    # (torch 2.13's invalidate_compile_context_weakrefs); see rope_dedup/core/dynamo_state.py for the rest.
    compiler_name = BACKEND_NAME

    def __copy__(self) -> RopeDedupBackend:
        return self

    def __deepcopy__(self, memo: dict) -> RopeDedupBackend:
        return self

    def __reduce__(self) -> tuple:
        return _fresh_backend, (self.config,)

    @property
    def stores(self) -> list[CanonicalStore]:
        """One store per storage policy the compiles asked for (dry run, share_persistent)."""
        return list(self._stores.values())

    @property
    def inner(self) -> str | Callable:
        return self.config.inner

    def computed_table_transforms(self) -> ComputedTables:
        """Whether this backend folds constant RoPE subgraphs and merges identical ones."""
        return self.config.computed_table_transforms()

    def _store_for(self, config: RopeDedupConfig) -> CanonicalStore:
        policy = (config.dry_run, config.share_persistent)
        if policy not in self._stores:
            self._stores[policy] = CanonicalStore(dry_run=config.dry_run, share_persistent=config.share_persistent)
        return self._stores[policy]

    def _config_for(self, compile_kwargs: dict[str, Any]) -> tuple[RopeDedupConfig, Callable]:
        """This compile's config (the backend's, with the mode and options ``torch.compile`` forwarded) and
        its inner backend, made once per distinct set of keywords."""
        unknown = sorted(set(compile_kwargs) - {"mode", "options"})
        if unknown:
            raise TypeError(f"RopeDedupBackend got unexpected keyword(s) {', '.join(unknown)}: torch.compile "
                            f"forwards only mode and options")
        cache_key = repr(sorted(compile_kwargs.items(), key=lambda kv: kv[0]))
        if cache_key not in self._compiles:
            config = self.config if not compile_kwargs else RopeDedupConfig.from_options(
                compile_kwargs.get("options"), base=self.config, mode=compile_kwargs.get("mode"))
            self._compiles[cache_key] = config, config.inner_backend()
        return self._compiles[cache_key]

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: reset the inner backends (inductor's CUDA graph trees), as
        torch does for an inner backend it was given directly. The stores and report are kept."""
        for _, inner in self._compiles.values():
            if hasattr(inner, "reset"):
                inner.reset()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence, **compile_kwargs: Any) -> Callable:
        """Rewrite ``gm`` with the passes of :mod:`rope_dedup.passes.pipeline`, compile it with the inner
        backend, and wrap that in the run-time interning of :mod:`rope_dedup.interning`."""
        config, inner = self._config_for(compile_kwargs)
        store = self._store_for(config)
        release_tensor_refs_at_compile_end(gm)
        if config.tables == "recompute":
            example_inputs = self._convert(gm, example_inputs, config)
        started = time.perf_counter()
        pristine = _copy_graph_module(gm)  # compiled instead if the passes fail, or merged inputs part
        self.copy_seconds += time.perf_counter() - started
        try:
            result = run_pipeline(gm, example_inputs, config, store)
        except Exception as error:
            if config.strict:
                raise
            where = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))  # which pass, on 3.11+
            message = f"graph {self.graphs_compiled}: pass failed, compiled without sharing: {error!r}{where}"
            log.error("rope_dedup: %s", message, exc_info=True)
            self.errors.append(message)
            counters["rope_dedup"]["pass_errors"] += 1
            self.graphs_compiled += 1
            return inner(pristine, example_inputs)
        if config.release_memory:
            release_if_freed(store)
        for name, seconds in result.seconds.items():
            self.pass_seconds[name] = self.pass_seconds.get(name, 0.0) + seconds
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
        return InterningCallable(compiled, store, result.watched_inputs, result.merged_inputs, fallback,
                                 release_memory=config.release_memory)

    def _convert(self, gm: torch.fx.GraphModule, example_inputs: Sequence, config: RopeDedupConfig) -> Sequence:
        """tables="recompute": the model's tables recomputed before dynamo guards on them; the graph's inputs
        with the recomputed tables in place. A failure converts nothing (strict: raises)."""
        try:
            written = {node: how for node, how in find_mutations(gm).items() if node.op == "placeholder"}
            inputs, conversion = self._recompute.convert(gm, example_inputs, written, dry_run=config.dry_run)
        except Exception as error:
            if config.strict:
                raise
            message = f"graph {self.graphs_compiled}: tables not recomputed: {error!r}"
            log.error("rope_dedup: %s", message, exc_info=True)
            self.errors.append(message)
            return example_inputs
        self._recomputed.update((r.path, r) for r in conversion.recomputed)
        self._kept.update((path, Skip(path, refusal)) for path, refusal in conversion.kept
                          if refusal.reason is SkipReason.NOT_EXACT)
        return inputs

    @property
    def report(self) -> DedupReport:
        """Everything this backend has shared, recomputed or skipped, across all graphs it compiled."""
        return self._with_recomputed(DedupReport.from_stores(self._stores.values(), errors=self.errors,
                                                             pass_seconds=self.pass_seconds))

    def report_for(self, model: torch.nn.Module) -> DedupReport:
        """The report with members named by their full path in ``model`` (useful after regional compile)."""
        return self._with_recomputed(DedupReport.from_stores(self._stores.values(), model=model, errors=self.errors,
                                                             pass_seconds=self.pass_seconds))

    def _with_recomputed(self, report: DedupReport) -> DedupReport:
        if not self._recomputed and not self._kept:
            return report
        return dataclasses.replace(report, recomputed=list(self._recomputed.values()),
                                   recomputed_bytes=self._recompute.vector_bytes,
                                   skipped=report.skipped + list(self._kept.values()))


def _fresh_backend(config: RopeDedupConfig) -> RopeDedupBackend:
    return RopeDedupBackend(config=config)


rope_dedup_backend = RopeDedupBackend()
"""Ready instance with the inductor inner backend: ``torch.compile(model, backend=rope_dedup_backend)``."""


def _installed_as_entry_point() -> bool:
    """Whether this package's metadata names the backend in torch's ``torch_dynamo_backends`` group.

    Then torch finds the name on its own, even in a process that never imported rope_dedup, and loading
    that entry point imports this module: registering here too would make torch assert a duplicate name.
    """
    try:
        return any(ep.name == BACKEND_NAME for ep in entry_points(group="torch_dynamo_backends"))
    except Exception:  # unreadable metadata of some other distribution: fall back to registering here
        return False


if not _installed_as_entry_point():  # a source tree on sys.path without pip install
    register_backend(rope_dedup_backend, name=BACKEND_NAME)
