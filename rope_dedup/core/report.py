"""The dedup report: what was shared, what was skipped and why, and the bytes it saved.

Bytes are counted by unique storages (``untyped_storage().data_ptr()`` / ``nbytes()``): views and
aliases make per-tensor sums lie.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from rope_dedup.core.eligibility import Refusal, SkipReason
from rope_dedup.tables.keys import RopeKey
from rope_dedup.core.store import CanonicalStore, base_name
from rope_dedup.core.text import format_bytes, wrap
from rope_dedup.tensors import describe_placement, module_tensors, storage_nbytes


@dataclass(frozen=True)
class Group:
    """Tables of identical content now backed by one storage; ``members`` are module paths."""

    key: RopeKey
    members: list[str]
    table_bytes: int
    bytes_before: int
    bytes_after: int
    conflict_with: str | None = None  # a table with the same key but different content
    placement: str | None = None  # for DTensor tables: placements and mesh; bytes are per rank

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after


@dataclass(frozen=True)
class Skip:
    """A tensor the pass examined and left alone, and why: one :class:`Refusal` (a :class:`SkipReason` and
    this tensor's detail), read as ``kind`` (the reason, to test) and ``reason`` (its message, to read)."""

    path: str
    refusal: Refusal

    @property
    def kind(self) -> SkipReason:
        return self.refusal.reason

    @property
    def reason(self) -> str:
        return self.refusal.message


@dataclass(frozen=True)
class Departed:
    """A shared table freed since: its owner replaced it (a cache regrown in forward) or dropped it."""

    path: str
    key: RopeKey
    times: int  # shared tensors freed under this path
    replacement_bytes: int | None = None  # own storage of the unshared tensor now at ``path``; None: none seen

    @property
    def replaced(self) -> bool:
        return self.replacement_bytes is not None


@dataclass(frozen=True)
class Recomputed:
    """A table that holds no values any more: ``share(model, tables="recompute")`` computes its rows where
    they are read. ``table_bytes``: what its storage held."""

    path: str
    key: RopeKey
    table_bytes: int


@dataclass(frozen=True)
class DedupReport:
    """Every RoPE table seen, grouped by shared storage, plus every skipped tensor with its reason."""

    groups: list[Group] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # pass failures that made a graph compile unshared
    departed: list[Departed] = field(default_factory=list)  # shared, then freed, and not shared again
    pass_seconds: dict[str, float] = field(default_factory=dict)  # pass name -> seconds, all graphs together
    newly_shared: list[str] | None = None  # rope_dedup.share(): the paths this call shared (None: not a share())
    recomputed: list[Recomputed] = field(default_factory=list)  # share(tables="recompute"): tables with no values
    recomputed_bytes: int = 0  # what those tables hold instead: their distinct frequency vectors

    @property
    def bytes_before(self) -> int:
        return sum(g.bytes_before for g in self.groups)

    @property
    def bytes_after(self) -> int:
        return sum(g.bytes_after for g in self.groups)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    @property
    def conflicts(self) -> list[Group]:
        return [g for g in self.groups if g.conflict_with is not None]

    @classmethod
    def from_stores(cls, stores: Iterable[CanonicalStore], model: torch.nn.Module | None = None, errors: Sequence[str] = (),
                    pass_seconds: Mapping[str, float] | None = None) -> DedupReport:
        """One report over several stores (a backend keeps one per storage policy its compiles asked for)."""
        parts = [cls.from_store(store, model) for store in stores]
        return cls([g for p in parts for g in p.groups], [s for p in parts for s in p.skipped], list(errors),
                   [d for p in parts for d in p.departed], dict(pass_seconds or {}))

    @classmethod
    def from_store(cls, store: CanonicalStore, model: torch.nn.Module | None = None, errors: Sequence[str] = ()) -> DedupReport:
        """Snapshot a :class:`~rope_dedup.core.store.CanonicalStore`'s live groups and its skip list.

        With ``model``, members and skipped tensors are named by their full path in it: under regional
        compilation the backend sees one block, so the names it recorded are relative to that block
        (``attn.cos#3``), and one skip name stands for that table in every block. It also tells which
        departed tables were replaced by a tensor that is not shared (a cache regrown in forward).
        """
        tensors = module_tensors(model) if model is not None else {}

        def path_in_model(ident: int, matches: Callable[[torch.Tensor], bool]) -> str | None:
            found = tensors.get(ident)
            return found[0] if found is not None and matches(found[1]) else None

        groups = []
        snapshot = store.snapshot()
        for group, live, storage_bytes in snapshot:
            groups.append(Group(
                key=group.key,
                members=[path_in_model(m.ident, _is_member(store, m)) or m.name for m in live],
                table_bytes=math.prod(group.shape) * group.key.dtype.itemsize,
                bytes_before=sum(m.original_nbytes for m in live),
                bytes_after=storage_bytes,  # one storage per group; in a dry run, what sharing would leave
                conflict_with=group.conflict_with,
                placement=describe_placement(group.placement),
            ))
        skipped = []
        for path, refusal, marks in store.skips():
            named = sorted(p for p in (path_in_model(mark.ident, mark.matches) for mark in marks) if p is not None)
            skipped += [Skip(p, refusal) for p in (named or [path])]
        shared = {base_name(m.name) for _, live, _ in snapshot for m in live}
        shared |= {m for g in groups for m in g.members}
        return cls(groups, skipped, list(errors), _departed(store, shared, tensors))

    def __str__(self) -> str:
        """The report as plain text no wider than :data:`~rope_dedup.core.text.TEXT_WIDTH` columns: per
        distinct table its key, then its tensors, bytes and members; then errors, skips and departures."""
        lines = [f"rope_dedup: {len(self.groups)} distinct RoPE table(s), "
                 f"{sum(len(g.members) for g in self.groups)} tensor(s); "
                 f"{format_bytes(self.bytes_before)} -> {format_bytes(self.bytes_after)} "
                 f"(saved {format_bytes(self.bytes_saved)})"]
        for g in self.groups:
            members = ", ".join(g.members[:3]) + (f", ... (+{len(g.members) - 3})" if len(g.members) > 3 else "")
            lines += [f"  {g.key}",
                      f"    {len(g.members)} tensor(s), {format_bytes(g.bytes_before)} -> "
                      f"{format_bytes(g.bytes_after)}: {members}"]
        for error in self.errors:
            lines.append(f"ERROR: {error}")
        for g in self.conflicts:
            lines.append(f"WARNING: {g.members[0]} has the same key as {g.conflict_with} ({g.key}) "
                         f"but different content: kept separate")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)}:")
            # Weights are the bulk of any model's skips and never a RoPE table: one line, so RoPE news stands out.
            trainable = sum(s.kind is SkipReason.TRAINABLE for s in self.skipped)
            by_reason = Counter(s.reason for s in self.skipped if s.kind is not SkipReason.TRAINABLE)
            if trainable:
                lines.append(f"  {trainable} trainable parameter(s) (requires grad): never shared, not listed")
            for reason in by_reason:
                lines.append(f"  {reason}: {_listed([s.path for s in self.skipped if s.reason == reason])}")
        if self.departed:
            lines.append(f"freed after sharing {len(self.departed)}:")
            replaced = [d for d in self.departed if d.replaced]
            if replaced:
                replacement = format_bytes(sum(d.replacement_bytes or 0 for d in replaced))
                lines.append(f"  replaced by a tensor with its own storage ({replacement} in all), shared again when "
                             f"a compiled graph reads it, not while dynamo runs the frame eagerly (past its "
                             f"recompile limit): {_listed([d.path for d in replaced])}")
            gone = [d.path for d in self.departed if not d.replaced]
            if gone:
                lines.append(f"  freed: the owner dropped or replaced it (report_for(model) tells which): "
                             f"{_listed(gone)}")
        if self.recomputed:
            before = format_bytes(sum(r.table_bytes for r in self.recomputed))
            lines.append(f"recomputed {len(self.recomputed)} table(s), rows computed where they are read: {before} "
                         f"of tables -> {format_bytes(self.recomputed_bytes)} of frequency vectors: "
                         f"{_listed([r.path for r in self.recomputed])}")
        if self.newly_shared is not None:
            lines.append(f"this share() call shared {len(self.newly_shared)} tensor(s)" if self.newly_shared else
                         "this share() call shared nothing new: every RoPE table was already shared, recomputed "
                         "or skipped")
        if not self.groups and not self.errors and not self.recomputed:
            lines.append("no RoPE table found")
        if self.pass_seconds:
            lines.append("pass time: " + ", ".join(f"{name} {s:.3f} s" for name, s in self.pass_seconds.items()))
        return "\n".join(part for line in lines for part in wrap(line))


def _is_member(store: CanonicalStore, member: object) -> Callable[[torch.Tensor], bool]:
    return lambda tensor: store.member(tensor) is member


def _listed(paths: list[str]) -> str:
    return ", ".join(paths[:4]) + (f", ... (+{len(paths) - 4})" if len(paths) > 4 else "")


def _departed(store: CanonicalStore, shared: set[str], tensors: dict[int, tuple[str, torch.Tensor]]) -> list[Departed]:
    """The store's freed members whose path (store name, or full path) has no shared tensor now: a shared
    replacement closes the story."""
    at = {path: tensor for path, tensor in tensors.values()}
    departed = []
    for path, (times, key) in store.departed.items():
        if path in shared:
            continue
        now = at.get(path)
        departed.append(Departed(path, key, times, None if now is None else storage_nbytes(now)))
    return departed
