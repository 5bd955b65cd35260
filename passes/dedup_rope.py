"""The RoPE dedup pass over one GraphModule: candidates -> keys -> shared storage -> rewritten graph."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from rope_dedup.passes.find_mutations import find_mutations
from rope_dedup.passes.find_rope_tables import Candidate, find_rope_candidates
from rope_dedup.passes.redirect_to_canonical import redirect_to_canonical
from rope_dedup.report import DedupReport
from rope_dedup.store import CanonicalStore, is_routine
from rope_dedup.tensors import has_storage, local, memory_ptr, placement, storage_ptr


class RopeDedupResult(PassResult):
    """A ``PassResult`` that also carries the report and what run-time interning needs.

    ``rope_inputs``: example-input position -> (path, kind, persistent) of each shared RoPE table, and of
    each non-RoPE buffer (another block's tensor fed to the same input may be a table), to offer to the
    store at run time.
    ``merged_inputs``: groups of input positions whose uses now read the first one; valid only while
    they share memory, which the backend checks on every call.
    ``skipped_inputs``: example-input position -> (path, reason) of RoPE-relevant tables kept apart
    (written, persistent, ...), so that other blocks' tables fed to the same input are reported too.
    """

    report: DedupReport
    rope_inputs: dict[int, tuple[str, str, bool]]
    merged_inputs: list[tuple[int, ...]]
    skipped_inputs: dict[int, tuple[str, str]]


def dedup_rope(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence | None = None,
    *,
    store: CanonicalStore | None = None,
    share_persistent: bool = False,
) -> RopeDedupResult:
    """Share identical RoPE tables read by ``gm`` and rewrite the graph to read one node per table.

    Why: every attention layer that builds its own RoPE cache holds an identical copy; at long context
    that is gigabytes. Buffers and tensor attributes are recognized from their content, keyed, verified
    equal with ``torch.equal`` and aliased with ``Tensor.set_`` (module attributes keep their identity,
    so dynamo guards hold). Written tables, trainable parameters and non-RoPE tensors are left alone
    and listed in the report with the reason. ``example_inputs`` are needed for dynamo graphs, whose
    state arrives as placeholders; ``store`` lets a backend share across the graphs it compiles.
    Buffers saved in a ``state_dict`` are shared only with ``share_persistent=True`` (or a store made
    with it); note that ``symbolic_trace`` registers every buffer it copies as persistent.
    """
    if store is None:
        store = CanonicalStore(share_persistent=share_persistent)
    elif share_persistent and not store.share_persistent:
        raise ValueError("share_persistent=True conflicts with the store's policy: make the store with it")
    candidates = find_rope_candidates(gm, example_inputs)
    written = _written_candidates(candidates, find_mutations(gm))
    kept: list[Candidate] = []
    examine: list[Candidate] = []  # not RoPE-like here; another block's tensor at this input may be
    skipped_inputs: dict[int, tuple[str, str]] = {}
    for candidate in candidates:
        offer = store.offer(candidate.tensor, candidate.path, candidate.kind, written.get(candidate.node),
                            candidate.persistent)
        if offer.status != "skipped":
            kept.append(candidate)
        elif candidate.input_index is None:
            continue
        elif offer.reason.startswith("not RoPE-like"):
            examine.append(candidate)
        elif not is_routine(offer.reason):
            skipped_inputs[candidate.input_index] = (candidate.path, offer.reason)
    duplicates, merged = _duplicates_by_memory(kept) if not store.dry_run else ({}, [])
    modified = redirect_to_canonical(gm, duplicates)
    result = RopeDedupResult(gm, modified)
    result.report = DedupReport.from_store(store)
    result.rope_inputs = {c.input_index: (c.path, c.kind, c.persistent)
                          for c in kept + examine if c.input_index is not None}
    result.merged_inputs = merged
    result.skipped_inputs = skipped_inputs
    gm.meta["rope_dedup_report"] = result.report
    return result


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


def _duplicates_by_memory(kept: list[Candidate]) -> tuple[dict, list[tuple[int, ...]]]:
    """Nodes reading the very same memory (after sharing) -> the first such node in graph order."""
    first: dict[tuple, Candidate] = {}
    duplicates: dict[torch.fx.Node, torch.fx.Node] = {}
    merged: dict[tuple, list[int]] = {}
    for candidate in kept:
        t = candidate.tensor
        where = (memory_ptr(t), t.dtype, tuple(local(t).shape), tuple(local(t).stride()), placement(t))
        if where not in first:
            first[where] = candidate
            merged[where] = [candidate.input_index]
            continue
        canonical = first[where]
        if candidate.node is canonical.node:
            continue
        duplicates[candidate.node] = canonical.node
        merged[where].append(candidate.input_index)
    groups = [tuple(g) for g in merged.values() if len(g) > 1 and None not in g]
    return duplicates, groups
