"""The canonical store: one storage per distinct RoPE table, shared with ``Tensor.set_``.

One store belongs to one backend instance and outlives the graphs it compiles, because with regional
compilation or graph breaks a single compiled graph serves every layer and only run-time interning
can reach the other layers' tables. It holds weak references only: dropping a model frees its tables.

``offer`` is the single entry point for both compile time and run time. It decides (via
:func:`rope_dedup.eligibility.why_not_shareable` and recognition), then shares; every tensor it is
offered ends up in a group or in ``skipped`` with a reason, which is what the report reads.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from rope_dedup.eligibility import TRAINABLE_REASON, why_not_shareable
from rope_dedup.keys import RopeKey, infer_key
from rope_dedup.recognize import NotRope, recognize_rope_table
from rope_dedup.tensors import local, memory_ptr, placement, same_values, storage_nbytes, storage_ptr

log = logging.getLogger("rope_dedup")


@dataclass
class _Member:
    ref: weakref.ref
    name: str
    original_nbytes: int  # storage it held alone when first offered (0 if already shared): the "before" side


@dataclass
class _Group:
    key: RopeKey
    shape: tuple[int, ...]  # of the local tensor
    stride: tuple[int, ...]
    placement: tuple | None  # DTensor (mesh, placements); tables share only within one
    members: dict[int, _Member] = field(default_factory=dict)  # id(tensor) -> member
    conflict_with: str | None = None  # name of a table with the same key but different content

    def canonical(self) -> torch.Tensor | None:
        for member in self.members.values():
            tensor = member.ref()
            if tensor is not None:
                return tensor
        return None


@dataclass(frozen=True)
class Offer:
    """Outcome of offering one tensor: ``shared`` (aliased onto a canonical), ``canonical`` (first of
    its content), ``known`` (already backed by a canonical), or ``skipped`` with ``reason``."""

    status: str
    key: RopeKey | None = None
    reason: str | None = None


class CanonicalStore:
    """Canonical RoPE tables by key, verified equal before any sharing, weakly referenced."""

    def __init__(self, dry_run: bool = False, share_persistent: bool = False) -> None:
        self.dry_run = dry_run  # decide and report, but alias nothing (rope_dedup.explain)
        self.share_persistent = share_persistent  # also share buffers saved in a state_dict (opt-in)
        self._groups: list[_Group] = []
        self._group_of: dict[int, _Group] = {}  # id(tensor) -> group
        self._ptr_count: dict[int, int] = {}  # data_ptr of live members -> how many
        self._excluded = WeakIdKeyDictionary()  # tensor -> why it must never be shared again (unshare())
        self.skipped: dict[str, str] = {}
        self._skipped_refs: dict[str, list[weakref.ref]] = {}  # name -> tensors skipped under it
        self._names: dict[str, int] = {}
        # Members freed while shared, by name without its "#n": a cache regrown in forward drops the shared
        # table for a new one of its own, and the report must say so rather than go quiet about it.
        self.departed: dict[str, tuple[int, RopeKey]] = {}
        self.freed_cpu_bytes = 0  # CPU storage let go by aliasing since the owner last took the count

    # -- the hot path -------------------------------------------------------------------------------
    def is_interned(self, tensor: torch.Tensor) -> bool:
        """Cheap check used on every call: is this tensor's memory a canonical table's?"""
        return memory_ptr(tensor) in self._ptr_count

    # -- deciding and sharing -----------------------------------------------------------------------
    def offer(self, tensor: torch.Tensor, name: str, kind: str = "buffer", written: str | None = None,
              persistent: bool = False) -> Offer:
        """Share ``tensor`` with an equal canonical table if it is an unwritten RoPE table; else record why not."""
        if id(tensor) in self._group_of:
            if written is None:
                return Offer("known", self._group_of[id(tensor)].key)
            # A graph that writes it is about to run (its compiled callable unshares it before every call
            # too): the write must land in this tensor's own storage, not in every sharer's.
            log.info("rope_dedup: %s is written by a graph compiled now; it gets its own storage back", name)
            self.release(tensor)
        if tensor in self._excluded:
            return self._skip(name, self._excluded[tensor], tensor)
        reason = why_not_shareable(tensor, kind, written, persistent, self.share_persistent)
        if reason is not None:
            return self._skip(name, reason, tensor)
        group = self._find_equal(tensor)
        if group is not None:
            return self._alias(tensor, group, self._unique_name(name))
        table = recognize_rope_table(local(tensor))
        if isinstance(table, NotRope):
            return self._skip(name, f"not RoPE-like: {table.reason}", tensor)
        return self._new_group(tensor, infer_key(table, local(tensor)), self._unique_name(name))

    def _find_equal(self, tensor: torch.Tensor) -> _Group | None:
        """The group whose canonical table equals ``tensor`` exactly (same shape, stride, dtype, device)."""
        mine = local(tensor)
        for group in self._groups:
            if group.shape != tuple(mine.shape) or group.stride != tuple(mine.stride()):
                continue
            if group.key.dtype != mine.dtype or group.key.device != mine.device:
                continue
            if group.placement != placement(tensor):
                continue
            canonical = group.canonical()
            if canonical is not None and same_values(local(canonical), mine):
                return group
        return None

    def _alias(self, tensor: torch.Tensor, group: _Group, name: str) -> Offer:
        canonical, mine = local(group.canonical()), local(tensor)
        # Memory this tensor held on its own before sharing: none if it already lived in the canonical storage.
        original = 0 if storage_ptr(canonical) == storage_ptr(mine) else storage_nbytes(mine)
        moved = storage_ptr(canonical) != storage_ptr(mine) or canonical.storage_offset() != mine.storage_offset()
        if moved and not self.dry_run:
            try:
                with torch.no_grad():
                    mine.set_(canonical.untyped_storage(), canonical.storage_offset(), mine.size(), mine.stride())
            except RuntimeError as error:
                return self._skip(name, f"could not alias its storage: {str(error).splitlines()[0]}", tensor)
            if mine.device.type == "cpu":
                self.freed_cpu_bytes += original
        self._add_member(group, tensor, name, original)
        return Offer("shared", group.key)

    def _new_group(self, tensor: torch.Tensor, key: RopeKey, name: str) -> Offer:
        mine = local(tensor)
        group = _Group(key, tuple(mine.shape), tuple(mine.stride()), placement(tensor))
        same_key = [g for g in self._groups if g.key == key]
        if same_key:
            first = next(iter(same_key[0].members.values())).name
            group.conflict_with = first
            log.warning("rope_dedup: %s has the same key as %s (%s) but different content; kept separate",
                        name, first, key)
        self._groups.append(group)
        self._add_member(group, tensor, name, storage_nbytes(tensor))
        return Offer("canonical", key)

    def _add_member(self, group: _Group, tensor: torch.Tensor, name: str, original_nbytes: int) -> None:
        ident = id(tensor)
        ptr = memory_ptr(tensor)
        group.members[ident] = _Member(weakref.ref(tensor, lambda _: self._forget(ident, ptr, departed=True)),
                                       name, original_nbytes)
        self._group_of[ident] = group
        self._ptr_count[ptr] = self._ptr_count.get(ptr, 0) + 1
        self.skipped.pop(name, None)
        self._skipped_refs.pop(name, None)

    def _forget(self, ident: int, ptr: int, departed: bool = False) -> None:
        group = self._group_of.pop(ident, None)
        if group is None:
            return
        member = group.members.pop(ident, None)
        if departed and member is not None:
            base = base_name(member.name)
            count, _ = self.departed.get(base, (0, group.key))
            self.departed[base] = (count + 1, group.key)
            log.info("rope_dedup: %s was freed while shared (its owner dropped or replaced it)", member.name)
        count = self._ptr_count.get(ptr, 0) - 1
        if count > 0:
            self._ptr_count[ptr] = count
        else:
            self._ptr_count.pop(ptr, None)
        if not group.members:
            self._groups.remove(group)

    def release(self, tensor: torch.Tensor, reason: str | None = None) -> bool:
        """Give a shared tensor its own storage back; with ``reason``, never share it again.

        Used before a graph that writes a shared table runs (it may be shared again once only graphs that
        read it run), and by :func:`rope_dedup.unshare`. Returns whether the tensor was a member.
        """
        if reason is not None:
            self._excluded[tensor] = reason
        group = self._group_of.get(id(tensor))
        if group is None:
            return False
        member = group.members[id(tensor)]
        self._forget(id(tensor), memory_ptr(tensor))
        if any(m.ref() is not None for m in group.members.values()):
            mine = local(tensor)
            with torch.no_grad():
                mine.set_(mine.clone(memory_format=torch.preserve_format))
            log.info("rope_dedup: %s has its own storage again", member.name)
        return True

    def _skip(self, name: str, reason: str, tensor: torch.Tensor) -> Offer:
        refs = self._skipped_refs.setdefault(name, [])
        refs[:] = [r for r in refs if r() is not None]
        if not any(r() is tensor for r in refs):
            refs.append(weakref.ref(tensor))
        if self.skipped.get(name) != reason:
            # Weights and activations-like state are the bulk of skips and expected; RoPE-relevant ones are not.
            routine = reason == TRAINABLE_REASON or reason.startswith("not RoPE-like")
            log.log(logging.DEBUG if routine else logging.INFO, "rope_dedup: skipped %s: %s", name, reason)
        self.skipped[name] = reason
        return Offer("skipped", reason=reason)

    def _unique_name(self, name: str) -> str:
        """Regional compile shows every block's table under the same relative path: number repeats."""
        count = self._names.get(name, 0)
        self._names[name] = count + 1
        return name if count == 0 else f"{name}#{count}"

    def canonical_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The table ``tensor``'s group is represented by (its first live member), or None if not a member.

        Lets a caller that removes duplicates instead of aliasing them (``dedup_exported``, dry runs)
        find the one tensor to keep."""
        group = self._group_of.get(id(tensor))
        return None if group is None else group.canonical()

    def take_freed_cpu_bytes(self) -> int:
        """CPU bytes aliasing let go since the last call (an upper bound: a view elsewhere may keep one)."""
        freed, self.freed_cpu_bytes = self.freed_cpu_bytes, 0
        return freed

    # -- what the report reads ------------------------------------------------------------------
    def skipped_tensors(self, name: str) -> list[torch.Tensor]:
        """The live tensors skipped under ``name`` (one per block when a graph serves every block)."""
        return [t for t in (r() for r in self._skipped_refs.get(name, ())) if t is not None]

    def snapshot(self) -> list[tuple[_Group, list[tuple[torch.Tensor, _Member]]]]:
        """Live groups with their live members, for the report."""
        result = []
        for group in self._groups:
            live = [(m.ref(), m) for m in group.members.values()]
            live = [(t, m) for t, m in live if t is not None]
            if live:
                result.append((group, live))
        return result


def base_name(name: str) -> str:
    """``attn.cos#3`` -> ``attn.cos``: the path a store name stands for, without its repeat number."""
    return name.rpartition("#")[0] if "#" in name and name.rpartition("#")[2].isdigit() else name
