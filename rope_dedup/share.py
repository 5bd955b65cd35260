"""Share RoPE tables without compiling: :func:`share` on a built model, :class:`sharing` while one is built.

Both go through a backend's canonical store, with the rules the compile-time pass uses (recognition, keys,
exact equality, eligibility, skip reasons), so a model shared in eager and compiled later keeps its
storages, and one report covers both.

In eager nothing says which module writes its table, as a graph does at compile time. The rule here: a
cache that is only partly filled (RoPE rows followed by rows never written, as rotary-embedding-torch fills
its ``cached_freqs`` on demand) is never shared, since layers with different theta agree on the rows
written so far and would then fill the rest into one storage. A full table is shared; a module that writes
its own equal values into it again changes nothing. Code that writes *other* values into a shared table
must call :func:`rope_dedup.unshare` first, as for writes outside a compiled graph.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import torch
from torch.nn.modules.module import register_module_buffer_registration_hook

from rope_dedup.backend import RopeDedupBackend, rope_dedup_backend
from rope_dedup.config import TABLES
from rope_dedup.core.eligibility import Refusal, SkipReason
from rope_dedup.core.memory import TRIM_THRESHOLD_BYTES, release_if_freed
from rope_dedup.core.reload import guard_reload
from rope_dedup.core.report import DedupReport, Recomputed, Skip
from rope_dedup.tensors import Origin, module_state
from rope_dedup.core.store import Action, CanonicalStore, Plan
from rope_dedup.recompute import RecomputedTable, recompute_tables
from rope_dedup.recompute.convert import BuilderWrites, Converter, keep_values_in_state_dict

_SETTINGS = ("share_persistent", "dry_run", "release_memory")


def _store(backend: RopeDedupBackend | None, settings: dict[str, Any]) -> tuple[RopeDedupBackend, CanonicalStore,
                                                                               bool]:
    """The backend (default: the one ``torch.compile(..., backend="rope_dedup")`` uses), the store of its
    policy for these settings, and whether to give freed memory back to the OS."""
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(unknown)}: sharing without compiling takes "
                        f"{', '.join(_SETTINGS)}")
    backend = rope_dedup_backend if backend is None else backend
    if not isinstance(backend, RopeDedupBackend):
        raise TypeError(f"backend must be a RopeDedupBackend, got {type(backend).__name__}")
    config = dataclasses.replace(backend.config, **settings)
    return backend, backend._store_for(config), config.release_memory


def _check_tables(tables: str) -> None:
    if tables not in TABLES:
        raise ValueError(f"tables must be one of {', '.join(map(repr, TABLES))}, got {tables!r}")


def _still_filling(plan: Plan) -> Refusal | None:
    """A partly filled cache, or one equal to a partly filled canonical: see the module docstring."""
    key = plan.key if plan.action is Action.NEW else plan.group.key if plan.action is Action.JOIN else None  # type: ignore[union-attr]
    if key is None or key.filled is None:
        return None
    return Refusal(SkipReason.FILLING, f"{key.filled} of {key.length} positions written")


def _offer(store: CanonicalStore, tensor: torch.Tensor, name: str, persistent: bool,
           owner: tuple[torch.nn.Module, str]) -> Plan:
    with store.lock:
        plan = store.decide(tensor, persistent=persistent)
        refusal = _still_filling(plan)
        if refusal is not None:
            plan = Plan(Action.SKIP, refusal=refusal)
        store.apply(plan, tensor, name, owner)
    return plan


def share(*models: torch.nn.Module, backend: RopeDedupBackend | None = None, tables: str = "share",
          **settings: Any) -> DedupReport:
    """Share identical RoPE tables of ``models`` in place, with no compile and no change to model code.

    Every parameter, buffer and plain tensor attribute (``inv_freq`` included) is offered to ``backend``'s
    store (default: the store of ``rope_dedup_backend``, which ``torch.compile(..., backend="rope_dedup")``
    uses), so tables of several models share too, and compiling later keeps these storages. Settings:
    ``share_persistent``, ``dry_run`` and ``release_memory``, as in :class:`~rope_dedup.RopeDedupConfig`.
    A second call changes nothing: the report's ``newly_shared`` is then empty. Tables still on the meta
    device are skipped (share after they are initialized), and so are partly filled caches. Returns the
    report of the store, with members named by their path in the first model.

    ``tables="recompute"`` keeps no table at all where it can: each table a recipe reproduces bit for bit
    becomes a :class:`~rope_dedup.recompute.RecomputedTable`, which computes the rows a read reads from
    one frequency vector per key (``report.recomputed``); the others are shared as above, each with its
    reason in ``report.skipped``.
    """
    _check_tables(tables)
    if not models:
        raise TypeError("share() needs at least one nn.Module")
    for model in models:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"share() takes nn.Module objects, got {type(model).__name__}: {model!r:.80}")
    backend, store, release = _store(backend, settings)
    conversion = recompute_tables(*models, dry_run=store.dry_run) if tables == "recompute" else None
    newly: list[str] = []
    for model in models:
        for path, tensor, _, persistent, module in module_state(model):
            if isinstance(tensor, RecomputedTable):  # holds no values: nothing to share
                continue
            if _offer(store, tensor, path, persistent, (module, path.rpartition(".")[2])).action is Action.JOIN:
                newly.append(path)
            if persistent:
                guard_reload(module, store, tensor)
    if release and not store.dry_run:
        release_if_freed(store)
    report = backend.report_for(models[0])
    if conversion is None:
        return dataclasses.replace(report, newly_shared=newly)
    not_exact = [Skip(path, refusal) for path, refusal in conversion.kept if refusal.reason is SkipReason.NOT_EXACT]
    return dataclasses.replace(report, newly_shared=newly, recomputed=conversion.recomputed,
                               recomputed_bytes=conversion.vector_bytes, skipped=report.skipped + not_exact)


class sharing:  # noqa: N801 (used as a context manager, like torch.no_grad)
    """``with rope_dedup.sharing():`` shares each RoPE table registered as a buffer inside the block with an
    equal one registered before, the moment it is registered, so a model built inside holds about one
    table per distinct key while it is built.

    It works through torch's public ``register_module_buffer_registration_hook``, which sees
    ``register_buffer`` and assignments to existing buffers, not plain tensor attributes (:meth:`report_for`
    lists those) nor ``Module._apply`` (``.to()``, ``to_empty()``: call :func:`share` after them). The hook
    is process-wide: buffers registered by other threads during the block are shared too. Blocks do not
    nest, and one block is entered once. Persistence is set after the hook runs, so a persistent buffer is
    shared at once and gets its own storage back at the end of the block (unless ``share_persistent``).

    ``tables="recompute"`` replaces each table a recipe reproduces bit for bit by a
    :class:`~rope_dedup.recompute.RecomputedTable` as it registers (as :func:`share` does); the first table of
    each key is kept for comparison until the block ends, so the build holds one table per key at most.
    """

    _active_lock = threading.Lock()
    _active: sharing | None = None

    def __init__(self, backend: RopeDedupBackend | None = None, tables: str = "share", **settings: Any) -> None:
        _check_tables(tables)
        self.backend, self.store, self._release = _store(backend, settings)
        # tables="recompute": each table a recipe reproduces is replaced as it registers. The converter holds
        # the first table of each key until the block ends, so the build holds one table per key at most.
        self._converter = Converter() if tables == "recompute" else None
        self._builder_writes = BuilderWrites() if tables == "recompute" else None
        self._recomputed: list[tuple[Recomputed, weakref.ref]] = []  # and the table, to see if written since
        self._not_exact: list[Skip] = []
        self._vector_bytes = 0
        self._handle = None
        self._used = False
        self._pending: list[tuple[torch.nn.Module, str, torch.Tensor]] = []  # persistence not known yet

    def __enter__(self) -> sharing:
        with sharing._active_lock:
            if self._used:
                raise RuntimeError("this sharing() block was already entered: make a new one")
            if sharing._active is not None:
                raise RuntimeError("sharing() blocks do not nest: one is already active")
            sharing._active, self._used = self, True
        # torch's hint says the hook returns None; register_buffer uses a returned tensor in the buffer's place.
        self._handle = register_module_buffer_registration_hook(self._registered)  # type: ignore[assignment, arg-type]
        if self._builder_writes is not None:
            self._builder_writes.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._handle is None:
            raise RuntimeError("sharing() block exited without being active")
        self._handle.remove()
        self._handle = None
        if self._builder_writes is not None:
            self._builder_writes.__exit__(*exc_info)
        with sharing._active_lock:
            sharing._active = None
        self._settle_persistence()
        if self._converter is not None:
            self._vector_bytes = self._converter.vector_bytes
            self._converter = None  # the tables it held for comparison are freed here
        if self._release and not self.store.dry_run:
            release_if_freed(self.store)

    def _registered(self, module: torch.nn.Module, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        self._settle_persistence()
        if tensor is None or not (tensor.is_floating_point() or tensor.is_complex()):
            return None
        label = f"{type(module).__name__}.{name}"
        known = name in module._buffers  # an assignment to an existing buffer: its persistence is set
        persistent = known and name not in module._non_persistent_buffers_set
        if self._converter is not None and not self.store.dry_run and not isinstance(tensor, RecomputedTable):
            replacement, recomputed, refusal = self._converter.convert(tensor, label, module=module)
            if replacement is not None:
                if recomputed is not None:  # else converted at an earlier registration: one table, two holders
                    replacement.state.owner = (weakref.ref(module), name)
                    self._recomputed.append((recomputed, weakref.ref(replacement)))
                    self._builder_writes.watch(tensor, replacement)  # type: ignore[union-attr]
                keep_values_in_state_dict(module)  # persistence is set after this hook: keep the values either way
                return replacement
            if refusal is not None and refusal.reason is SkipReason.NOT_EXACT:
                self._not_exact.append(Skip(label, refusal))
        action = _offer(self.store, tensor, label, persistent, (module, name)).action
        if action is Action.JOIN and self._release and not self.store.dry_run:
            # Freed tables of a few MB stay in glibc's heap, and the build's next layers do not always reuse
            # them: trim as interning does, once TRIM_THRESHOLD_BYTES more are freed, so the build's peak stays
            # about one table per key.
            release_if_freed(self.store, at_least=TRIM_THRESHOLD_BYTES)
        if action in (Action.JOIN, Action.NEW):
            if not known:
                self._pending.append((module, name, tensor))
            elif persistent:
                guard_reload(module, self.store, tensor)
        return None  # the tensor itself now reads the canonical storage

    def _settle_persistence(self) -> None:
        """Buffers shared while being registered: persistent ones get their own storage back."""
        pending, self._pending = self._pending, []
        for module, name, tensor in pending:
            if module._buffers.get(name) is not tensor:
                continue
            if name in module._non_persistent_buffers_set:
                continue
            if not self.store.share_persistent:
                self.store.refuse(tensor, f"{type(module).__name__}.{name}", Refusal(SkipReason.PERSISTENT))
            else:
                guard_reload(module, self.store, tensor)

    @property
    def report(self) -> DedupReport:
        return self._with_recomputed(self.backend.report)

    def _with_recomputed(self, report: DedupReport) -> DedupReport:
        if not self._recomputed and not self._not_exact:
            return report
        held = self._converter.vector_bytes if self._converter is not None else self._vector_bytes
        recomputed, written = [], []
        for done, table in self._recomputed:
            alive = table()
            if alive is None or alive.is_recomputed:
                recomputed.append(done)
            else:
                written.append(Skip(done.path, Refusal(SkipReason.NOT_EXACT, f"written by {alive.state.written_by} "
                                                                             f"after it was recomputed")))
        return dataclasses.replace(report, recomputed=recomputed, recomputed_bytes=held,
                                   skipped=report.skipped + self._not_exact + written)

    def report_for(self, model: torch.nn.Module) -> DedupReport:
        """The report with full paths in ``model``, and its plain tensor attributes, which the hook cannot see,
        listed as skipped unless something else shared them."""
        report = self.backend.report_for(model)
        shared = {m for g in report.groups for m in g.members}
        unseen = [Skip(path, Refusal(SkipReason.UNSEEN_ATTRIBUTE))
                  for path, tensor, kind, _, _ in module_state(model)
                  if kind is Origin.ATTRIBUTE and path not in shared and (tensor.is_floating_point() or tensor.is_complex())]
        return self._with_recomputed(dataclasses.replace(report, skipped=report.skipped + unseen))
