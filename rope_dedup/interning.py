"""Run-time interning: the callable a backend returns shares RoPE inputs it has not seen before.

With regional compilation (each block compiled on its own) or a graph break inside the layer loop,
dynamo compiles one graph and feeds it every layer's tables as inputs at run time: the compile-time
pass sees only the first layer. So before a call the compiled callable looks at its watched inputs and
offers the store each one it has not seen (once per tensor), which shares it or records why not.

A graph that only reads its tables cannot change a value by sharing: it looks on a schedule. It sweeps
(looks at every call) until a block comes round again, which covers each block it serves; once a sweep
finds nothing new it skips the next 2, 4, ... up to 64 rounds of blocks, back to every call as soon as a
look finds something. Whatever can reassign a table moves the process-wide epoch, and the next call of
every graph sweeps: each join, leave and release in any store (moves, ``share()``, ``unshare()``,
reloads) and each buffer or parameter registered or assigned anywhere (torch's global registration
hooks). A plain tensor attribute swapped in, or a storage regrown in place, waits for the next sweep. A
skipped call costs a counter.

A graph that writes some of its inputs in place gives each of them its own storage back, before every
call, if any store shared it since (a check per written input), and a graph whose inputs were merged
compares their memory: both look at every call, since values depend on it. A tensor saved in a
state_dict joins only with its module's ``load_state_dict`` guarded: the module is found by replaying
the input's source on the calling frame.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Sequence

import torch
from torch._dynamo.eval_frame import innermost_fn
from torch._dynamo.utils import counters
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_parameter_registration_hook)

from rope_dedup.core.eligibility import Refusal, SkipReason
from rope_dedup.core.memory import TRIM_THRESHOLD_BYTES, release_if_freed
from rope_dedup.core.reload import guard_reload
from rope_dedup.core.sources import WatchedInput, find_owner
from rope_dedup.core.store import EPOCH, Action, CanonicalStore, release_shared, shared_anywhere
from rope_dedup.tensors import TensorMark, memory_ptr

log = logging.getLogger("rope_dedup")

# Refused tensors remembered per compiled graph: a model's worth of blocks many times over.
_KEPT = 4096


# Rounds of blocks a settled read-only graph skips between sweeps, at most: how long a change no hook sees
# may wait (a plain attribute swapped in, ``.data =``, ``swap_tensors``, a storage regrown in place); the
# epoch brings every other change to the next call.
_WIDEST = 64


def _registered(module: torch.nn.Module, name: str, value: object) -> None:
    """A buffer or parameter registered or assigned anywhere: what settled graphs saw may have changed."""
    EPOCH.bump()


register_module_buffer_registration_hook(_registered)
register_module_parameter_registration_hook(_registered)


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
        self._unshared = store.unshared
        self._reads_only = not self._written and not self._merged
        # The schedule of a graph that only reads: calls left to skip, the epoch they were granted at, the
        # rounds skipped after the last sweep, the blocks seen in the sweep under way (each by its first
        # watched input) and whether it found nothing new so far.
        self._skip = 0
        self._epoch = -1
        self._rounds = 1
        self._swept: set[int] = set()
        self._quiet = True

    def __call__(self, *args):
        # A settled graph that only reads, between sweeps: a counter, before the graph call.
        if self._skip and self._epoch == EPOCH.now:
            self._skip -= 1
            return self._compiled(*args)
        if not self.check(args):
            return self._run_unmerged(args)
        # Dynamo calls what a backend returns positionally, whatever ``_boxed_call`` says; so do we.
        return self._compiled(*args)

    def check(self, args: Sequence) -> bool:
        """A look before a call: offer the watched inputs not seen before (a graph that writes first gives
        each written input its own storage if any store shares it); return whether merged inputs still share
        memory. A graph that only reads looks only while it sweeps (:meth:`_swept_all`)."""
        if self._reads_only and self._swept_all(args):
            return True
        for position in self._written:
            if shared_anywhere(args[position]):  # shared since this graph last ran, by any store
                release_shared(args[position])
        quiet = all([self._intern(position, args[position]) for position in self._unshared(args, self._positions)])
        if self._reads_only:
            self._quiet = self._quiet and quiet
        return not self._merged or self._merged_hold(args)

    def _swept_all(self, args: Sequence) -> bool:
        """Whether this call may skip the look: the sweep under way looked at this block already (each block
        is known by its first watched input), found nothing new, and nothing changed anywhere since it began.
        Then the calls of the next 2, 4, ... up to ``_WIDEST`` rounds of blocks are skipped, this one first.
        A sweep that found something new, or a change anywhere, begins a new sweep, from this call."""
        block = id(args[self._positions[0]]) if self._positions else 0
        epoch = EPOCH.now  # read before looking: a change while looking (our own offers too) sweeps again
        if epoch != self._epoch:
            self._epoch, self._swept, self._quiet, self._skip = epoch, set(), True, 0
        elif block in self._swept:
            if self._quiet:
                self._rounds = min(2 * self._rounds, _WIDEST)
                self._skip = self._rounds * len(self._swept) - 1
                self._swept = set()
                return True
            self._rounds, self._swept, self._quiet = 1, set(), True  # something new: sweep again
        self._swept.add(block)
        return False

    def _merged_hold(self, args: Sequence) -> bool:
        """Whether each group of merged inputs still reads one memory."""
        for group in self._merged:
            ptr = memory_ptr(args[group[0]])
            for other in group[1:]:
                if memory_ptr(args[other]) != ptr:
                    return False
        return True

    def _intern(self, position: int, tensor: torch.Tensor) -> bool:
        """Offer ``tensor`` unless refused before; return whether that was quiet: a refusal already known,
        for a reason no later write undoes (one for content is looked at again on every call)."""
        rejected = self._rejected.get(id(tensor))
        if rejected is not None and rejected.matches(tensor):
            return rejected.version is None
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
            return False
        if offer.action is Action.SKIP:
            self._reject(tensor, offer.refusal)
            return False
        counters["rope_dedup"]["interned_at_runtime"] += 1
        if self._release_memory:
            release_if_freed(self._store, TRIM_THRESHOLD_BYTES)
        return False

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
