"""Run-time interning: the callable a backend returns shares RoPE inputs it has not seen before.

With regional compilation (each block compiled on its own) or a graph break inside the layer loop,
dynamo compiles one graph and feeds it every layer's tables as inputs at run time: the compile-time
pass sees only the first layer. So before each call the compiled callable checks each watched input's
data pointer against the store (a dict lookup: the hot path) and, on first sight of a new tensor,
offers it to the store (the slow path, once per tensor), which shares it or records why not. A graph
that writes some of its inputs in place first gives each of them its own storage back if a graph that
only reads them shared it since (a pointer check per written input, in writing graphs only).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from torch._dynamo.utils import counters

from rope_dedup.core.memory import TRIM_THRESHOLD_BYTES, release_if_freed
from rope_dedup.core.sources import WatchedInput
from rope_dedup.core.store import Action, CanonicalStore
from rope_dedup.tensors import TensorMark, memory_ptr

log = logging.getLogger("rope_dedup")

# Refused tensors remembered per compiled graph: a model's worth of blocks many times over.
_REJECTED_KEPT = 4096


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
        self._compiled = compiled
        self._store = store
        self._watched = watched_inputs
        self._positions = tuple(watched_inputs)
        # Inputs this graph writes in place: each must have its own storage when the graph runs.
        self._written = tuple(p for p, how in watched_inputs.items() if how.written is not None)
        self._merged = merged_inputs
        self._fallback_factory = fallback
        self._fallback: Callable | None = None
        # Tensors already refused, marked (a weak reference would stop torch.utils.swap_tensors): not examined
        # again on every call. Bounded: nothing says when one is gone.
        self._rejected: dict[int, TensorMark] = {}
        self._release_memory = release_memory
        self._reads_only = not self._written and not self._merged
        self._unshared = store.unshared

    def __call__(self, *args):
        # The common call: a graph that only reads, every watched input already shared. One store question.
        if self._reads_only and not self._unshared(args, self._positions):
            return self._compiled(*args)
        if not self.intern_inputs(args):
            return self._run_unmerged(args)
        # Dynamo calls what a backend returns positionally, whatever ``_boxed_call`` says; so do we.
        return self._compiled(*args)

    def intern_inputs(self, args: Sequence) -> bool:
        """The per-call work: offer unseen watched inputs; return whether merged inputs still share memory."""
        is_interned = self._store.is_interned
        for position in self._written:  # empty for graphs that only read: the check costs them nothing
            if is_interned(args[position]):  # shared by a read-only graph since this one last ran
                self._store.release(args[position])
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
            offer = self._store.offer(tensor, name=how.path, written=how.written, persistent=how.persistent)
        except Exception as error:  # never let bookkeeping break a forward pass
            log.warning("rope_dedup: run-time interning of %s failed, left unshared: %r", how.path, error)
            counters["rope_dedup"]["intern_errors"] += 1
            self._reject(tensor)
            return
        if offer.action is Action.SKIP:
            self._reject(tensor)
            return
        counters["rope_dedup"]["interned_at_runtime"] += 1
        if self._release_memory:
            release_if_freed(self._store, TRIM_THRESHOLD_BYTES)

    def _reject(self, tensor: torch.Tensor) -> None:
        if len(self._rejected) >= _REJECTED_KEPT:
            self._rejected.clear()
        self._rejected[id(tensor)] = TensorMark(tensor)

    def _run_unmerged(self, args: Sequence):
        if self._fallback is None:
            log.warning("rope_dedup: RoPE inputs that were identical at compile time now differ "
                        "(a table was replaced after compiling); running the graph without the merge")
            counters["rope_dedup"]["fallbacks"] += 1
            self._fallback = self._fallback_factory(args)  # type: ignore[misc]
        return self._fallback(*args)
