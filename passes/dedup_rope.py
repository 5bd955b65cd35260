"""The RoPE dedup pass over one GraphModule: candidates -> keys -> shared storage -> rewritten graph."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx

from rope_dedup.core.sources import WatchedInput
from rope_dedup.passes.find_candidates import Candidate, duplicates_by_memory, find_candidates
from rope_dedup.passes.find_mutations import find_mutations
from rope_dedup.passes.pass_base import GraphPass, PassContext, RopePassResult, run_passes
from rope_dedup.passes.redirect_to_canonical import redirect_to_canonical
from rope_dedup.tables.recognize import is_rope_table
from rope_dedup.core.reload import guard_reload
from rope_dedup.core.store import Action, CanonicalStore
from rope_dedup.tensors import Origin, has_storage, storage_ptr


def dedup_rope(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence | None = None,
    *,
    store: CanonicalStore | None = None,
    share_persistent: bool = False,
    redirect_inputs: bool = True,
) -> RopePassResult:
    """Share identical RoPE tables read by ``gm`` and rewrite the graph to read one node per table.

    Why: every attention layer that builds its own RoPE cache holds an identical copy; at long context
    that is gigabytes. Buffers and tensor attributes are recognized from their content, keyed, verified
    equal with ``torch.equal`` and aliased with ``Tensor.set_`` (module attributes keep their identity,
    so dynamo guards hold). Written tables, trainable parameters and non-RoPE tensors are left alone
    and listed in the report with the reason. ``example_inputs`` are needed for dynamo graphs, whose
    state arrives as placeholders; ``store`` lets a backend share across the graphs it compiles.
    Buffers saved in a ``state_dict`` are shared only with ``share_persistent=True`` (or a store made
    with it); note that ``symbolic_trace`` registers every buffer it copies as persistent.
    ``redirect_inputs=False`` leaves placeholders reading shared tables apart (their memory is shared
    all the same): one node per table lets inductor fuse differently, which moves gradients in the
    last bits (measured on Persimmon), and only ``merge_rope_subgraphs`` needs it.

    The result's ``report`` lists what was shared and skipped (also in ``gm.meta["rope_dedup_report"]``);
    ``watched_inputs`` and ``merged_inputs`` are what run-time interning needs (see
    :class:`~rope_dedup.passes.pass_base.RopePassResult`).
    """
    if store is None:
        store = CanonicalStore(share_persistent=share_persistent)
    elif share_persistent and not store.share_persistent:
        raise ValueError("share_persistent=True conflicts with the store's policy: make the store with it")
    return run_passes(gm, example_inputs, [GraphPass(rewrite)], PassContext(store, redirect_inputs))


def rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence | None, context: PassContext) -> RopePassResult:
    """Offer every state tensor the graph reads to the store, then point duplicate nodes at one per table.

    ``watched_inputs`` holds every state input except parameters that are not RoPE tables (see
    :func:`_worth_watching`): with regional compile one graph serves every block, so each block's tensor
    at that input is offered on first sight, shared, or skipped with the same reason (a written cache) or
    its own (a buffer not RoPE-like here may be a table in another block).
    """
    store = context.store
    if store is None:
        raise ValueError("dedup_rope shares through a canonical store: give PassContext(store=...)")
    candidates = find_candidates(gm, example_inputs)
    written = _written_candidates(candidates, find_mutations(gm))
    kept: list[Candidate] = []
    watched: dict[int, WatchedInput] = {}
    for candidate in candidates:
        how = WatchedInput(candidate.path, written.get(candidate.node), candidate.persistent, candidate.reach)
        owner = (candidate.owner, candidate.path.rpartition(".")[2]) if candidate.owner is not None else None
        skipped = store.offer(candidate.tensor, name=how.path, written=how.written, persistent=how.persistent,
                              owner=owner).action is Action.SKIP
        if not skipped and candidate.persistent:
            skipped = not guard_reload(candidate.owner, store, candidate.tensor)
        if not skipped:
            kept.append(candidate)
        if candidate.input_index is not None and (not skipped or _worth_watching(candidate)):
            watched[candidate.input_index] = how
    if not context.redirect_inputs:
        kept = [c for c in kept if c.input_index is None]
    duplicates, merged = duplicates_by_memory(kept) if not store.dry_run else ({}, [])
    modified = redirect_to_canonical(gm, duplicates)
    return RopePassResult(gm, modified, watched_inputs=watched, merged_inputs=merged)


def _worth_watching(candidate: Candidate) -> bool:
    """Whether another block's tensor at a skipped input deserves a look on every call.

    Buffers and tensor attributes are few, and another block's may be a table (or a written one the
    report should name). Parameters are mostly weights, frozen ones included (say, under LoRA): watched
    only when this one is a RoPE table kept apart, so that the hot path does not grow with the weights.
    """
    if candidate.origin is not Origin.PARAMETER:
        return True
    return not candidate.tensor.requires_grad and is_rope_table(candidate.tensor)


def _written_candidates(candidates: list[Candidate], mutations: dict[torch.fx.Node, str]) -> dict[torch.fx.Node, str]:
    """Writes per candidate node, extended to every candidate whose storage a written one shares.

    symbolic_trace turns ``self.cos[:2]`` into a constant that aliases ``cos``; dynamo may pass two
    aliasing buffers as two placeholders. Aliasing one away from the other would lose the write.
    """
    written = {c.node: mutations[c.node] for c in candidates if c.node in mutations}
    storages = {storage_ptr(c.tensor): c for c in candidates if c.node in written and has_storage(c.tensor)}
    for candidate in candidates:
        owner = storages.get(storage_ptr(candidate.tensor)) if has_storage(candidate.tensor) else None
        if owner is not None and candidate.node not in written:
            how = mutations[owner.node]
            same = candidate.tensor is owner.tensor
            written[candidate.node] = how if same else f"shares memory with {owner.path}, which is written: {how}"
    return written
