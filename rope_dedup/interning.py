"""Run-time interning: the callable a backend returns shares RoPE inputs it has not seen before.

With regional compilation (each block compiled on its own) or a graph break inside the layer loop,
dynamo compiles one graph and feeds it every layer's tables as inputs at run time: the compile-time
pass sees only the first layer. So before each call the compiled callable checks its watched inputs
(the hot path: a dict lookup per tensor in the store, or for a graph of many tables one comparison with
the marks taken when they were last found shared) and, on first sight of a new tensor, offers it to the
store (the slow path, once per tensor), which shares it or records why not. A graph
that writes some of its inputs in place first gives each of them its own storage back if a graph that
only reads them shared it since, in any store (a pointer check per written input and store, in writing
graphs only). A tensor saved in a state_dict joins only with its module's ``load_state_dict`` guarded: the
module is found by replaying the input's source on the calling frame.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import replace
from typing import Callable, Sequence

import torch
from torch._dynamo.eval_frame import innermost_fn
from torch._dynamo.utils import counters

from rope_dedup.core.eligibility import Refusal, SkipReason
from rope_dedup.core.memory import TRIM_THRESHOLD_BYTES, release_if_freed
from rope_dedup.core.reload import guard_reload
from rope_dedup.core.sources import WatchedInput, find_owner
from rope_dedup.core.store import Action, CanonicalStore, SharedMarks, release_shared, shared_anywhere
from rope_dedup.tensors import TensorMark, memory_ptr

log = logging.getLogger("rope_dedup")

# Refused tensors, and input sets found shared, remembered per compiled graph: a model's worth of blocks
# many times over.
_KEPT = 4096
# Watched inputs from which comparing SharedMarks beats asking the store tensor by tensor: measured on CPU
# after a graph call (cold caches), 2.6 against 3.9 µs for a block's two tables, 41 against 31 µs for 80.
_MARKS_FROM = 32
_impl = operator.attrgetter("_cdata")
_data_ptr = torch.Tensor.data_ptr
_expired = torch.UntypedStorage._expired


class InterningCallable:
    """Wraps a compiled graph: offers watched inputs to the store on first sight, then runs it.

    ``watched_inputs`` say how each input was offered at compile time (path, kind, how the graph writes
    it, persistence); each new tensor there is offered the same way. ``merged_inputs`` are input groups
    whose uses the pass redirected to the first of the group; the graph is only valid while they share
    memory. If a caller later passes tables that differ (a buffer replaced with other content after
    compiling), the un-merged graph from ``fallback`` runs instead.
    """

    def __init__(
        self,
        compiled: Callable,
        store: CanonicalStore,
        watched_inputs: dict[int, WatchedInput],
        merged_inputs: list[tuple[int, ...]],
        fallback: Callable[[Sequence], Callable] | None = None,
        release_memory: bool = True,
    ) -> None:
        # Dynamo wraps what a backend returns in ``disable`` and unwraps a graph already wrapped so; ours is
        # not, so the inner backend's own wrapper would switch dynamo off a second time on every call (about
        # a microsecond per block under regional compile on CPU). Our wrapper covers the graph it calls.
        self._compiled = innermost_fn(compiled)
        self._store = store
        self._watched = watched_inputs
        self._positions = tuple(watched_inputs)
        # Inputs this graph writes in place: each must have its own storage when the graph runs.
        self._written = tuple(p for p, how in watched_inputs.items() if how.written is not None)
        self._merged = merged_inputs
        self._fallback_factory = fallback
        self._fallback: Callable | None = None
        # Tensors already refused, marked (a weak reference would stop torch.utils.swap_tensors): not examined
        # again on every call, unless a refusal for their content is followed by a write (a cache refused while
        # zeros, filled in place later). Bounded: nothing says when one is gone.
        self._rejected: dict[int, TensorMark] = {}
        self._release_memory = release_memory
        self._reads_only = not self._written and not self._merged
        self._unshared = store.unshared
        # For a graph that only reads many tables (a whole model: two per layer): the watched inputs found
        # shared, by their ids, compared on each call with C-level loops instead of asking the store per
        # tensor. A block's few tables are asked for directly: building the tuples costs more there.
        self._by_marks = len(self._positions) >= _MARKS_FROM
        self._pick = operator.itemgetter(*self._positions) if self._by_marks else None
        self._shared: dict[tuple[int, ...], SharedMarks] = {}

    def __call__(self, *args):
        if not self.check(args):
            return self._run_unmerged(args)
        # Dynamo calls what a backend returns positionally, whatever ``_boxed_call`` says; so do we.
        return self._compiled(*args)

    def check(self, args: Sequence) -> bool:
        """The work before each call: whether the compiled graph may run on ``args``. The common call, a
        graph that only reads and its watched inputs already shared, asks the store once (a block's few
        tables) or compares marks (many); anything else goes through :meth:`intern_inputs`."""
        if self._reads_only:
            if not self._by_marks:
                if not self._unshared(args, self._positions):
                    return True
            elif self._marks_hold(args):
                return True
        return self.intern_inputs(args)

    def _marks_hold(self, args: Sequence) -> bool:
        """Tensors found shared before, the same ones in the same memory, no member joined or left since."""
        tensors = self._pick(args)  # type: ignore[misc]
        marks = self._shared.get(tuple(map(id, tensors)))
        if (marks is not None and marks.generation == self._store.generation
                and tuple(map(_impl, tensors)) == marks.impls and tuple(map(_data_ptr, tensors)) == marks.ptrs
                and not any(map(_expired, marks.storages))):
            return True
        if self._unshared(args, self._positions):
            return False
        marks = self._store.shared_marks(tensors)
        if marks is not None:
            if len(self._shared) >= _KEPT:
                self._shared.clear()
            self._shared[tuple(map(id, tensors))] = marks
        return True

    def intern_inputs(self, args: Sequence) -> bool:
        """The per-call work: offer unseen watched inputs; return whether merged inputs still share memory."""
        for position in self._written:  # empty for graphs that only read: the check costs them nothing
            if shared_anywhere(args[position]):  # shared since this graph last ran, by any store
                release_shared(args[position])
        for position in self._unshared(args, self._positions):
            self._intern(position, args[position])
        for group in self._merged:
            ptr = memory_ptr(args[group[0]])
            for other in group[1:]:
                if memory_ptr(args[other]) != ptr:
                    return False
        return True

    def _intern(self, position: int, tensor: torch.Tensor) -> None:
        rejected = self._rejected.get(id(tensor))
        if rejected is not None and rejected.matches(tensor):
            return
        how = self._watched[position]
        try:
            owner = find_owner(how.reach, tensor) if how.reach is not None else None
            offer = self._store.offer(tensor, name=how.path, written=how.written, persistent=how.persistent,
                                      owner=owner)
            if offer.action is not Action.SKIP and how.persistent and \
                    not guard_reload(owner[0] if owner is not None else None, self._store, tensor):
                offer = replace(offer, action=Action.SKIP, refusal=Refusal(SkipReason.UNGUARDED))
        except Exception as error:  # never let bookkeeping break a forward pass
            log.warning("rope_dedup: run-time interning of %s failed, left unshared: %r", how.path, error)
            counters["rope_dedup"]["intern_errors"] += 1
            self._reject(tensor)
            return
        if offer.action is Action.SKIP:
            self._reject(tensor, offer.refusal)
            return
        counters["rope_dedup"]["interned_at_runtime"] += 1
        if self._release_memory:
            release_if_freed(self._store, TRIM_THRESHOLD_BYTES)

    def _reject(self, tensor: torch.Tensor, refusal: Refusal | None = None) -> None:
        if len(self._rejected) >= _KEPT:
            self._rejected.clear()
        content = refusal is not None and refusal.reason is SkipReason.NOT_ROPE
        self._rejected[id(tensor)] = TensorMark(tensor, content=content)

    def _run_unmerged(self, args: Sequence):
        if self._fallback is None:
            log.warning("rope_dedup: RoPE inputs that were identical at compile time now differ "
                        "(a table was replaced after compiling); running the graph without the merge")
            counters["rope_dedup"]["fallbacks"] += 1
            self._fallback = self._fallback_factory(args)  # type: ignore[misc]
        return self._fallback(*args)
