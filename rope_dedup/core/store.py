"""The canonical store: one storage per distinct RoPE table, shared with ``Tensor.set_``.

One store belongs to one backend instance and outlives the graphs it compiles, because with regional
compilation or graph breaks a single compiled graph serves every layer and only run-time interning
can reach the other layers' tables. It holds weak references only: dropping a model frees its tables.

``offer`` is the single entry point for both compile time and run time: :meth:`CanonicalStore.decide`
makes a :class:`Plan` from the store's state, the safety rules
(:func:`rope_dedup.core.eligibility.why_not_shareable`) and recognition without changing anything, and
:meth:`CanonicalStore.apply` carries it out; storage is re-pointed in one place (``_share_storage`` /
``_own_storage``), never in a dry run. Every tensor offered ends up in a group or in ``skipped`` with
a :class:`~rope_dedup.core.eligibility.Refusal`, which is what the report reads.
"""

from __future__ import annotations

import enum
import logging
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from rope_dedup.core.eligibility import Refusal, SkipReason, why_not_shareable
from rope_dedup.tables.keys import RopeKey, infer_key
from rope_dedup.tables.recognize import NotRope, recognize_rope_table
from rope_dedup.tensors import local, memory_ptr, placement, readable, same_values, storage_nbytes, storage_ptr

log = logging.getLogger("rope_dedup")


@dataclass
class _Member:
    ref: weakref.ref
    name: str
    original_nbytes: int  # storage it held alone when first offered (0 if already shared): the "before" side
    ptr: int  # memory_ptr when it joined: the key of the store's pointer count


@dataclass
class _Group:
    key: RopeKey
    shape: tuple[int, ...]  # of the local tensor
    stride: tuple[int, ...]
    placement: tuple | None  # DTensor (mesh, placements); tables share only within one
    members: dict[int, _Member] = field(default_factory=dict)  # id(tensor) -> member
    conflict_with: str | None = None  # name of a table with the same key but different content


class Action(enum.Enum):
    """What offering a tensor does: the value is the status the report and the passes' logs print."""

    KNOWN = "known"  # already a member of a group: nothing to do
    JOIN = "shared"  # equal to a group's canonical table: its storage becomes the canonical one
    NEW = "canonical"  # the first table of its content: a new group
    SKIP = "skipped"  # keeps its own storage, for ``refusal``


@dataclass(frozen=True)
class Plan:
    """What the store will do with one offered tensor, decided without changing anything.

    ``release_first``: the tensor is shared but a graph compiled now writes it, so it gets its own
    storage back before the rest of the plan applies (the write must land in its own storage only).
    """

    action: Action
    release_first: bool = False
    group: _Group | None = None  # JOIN: the group whose canonical table it equals
    key: RopeKey | None = None  # NEW: the key of the new group
    refusal: Refusal | None = None  # SKIP: why


class CanonicalStore:
    """Canonical RoPE tables by key, verified equal before any sharing, weakly referenced."""

    def __init__(self, dry_run: bool = False, share_persistent: bool = False) -> None:
        self.dry_run = dry_run  # decide and report, but alias nothing (rope_dedup.explain)
        self.share_persistent = share_persistent  # also share buffers saved in a state_dict (opt-in)
        self._groups: list[_Group] = []
        self._group_of: dict[int, _Group] = {}  # id(tensor) -> group
        self._ptr_count: dict[int, int] = {}  # data_ptr of live members -> how many
        self._excluded = WeakIdKeyDictionary()  # tensor -> Refusal: never share it again (unshare())
        self.skipped: dict[str, Refusal] = {}
        self._skipped_refs: dict[str, list[weakref.ref]] = {}  # name -> tensors skipped under it (see _skip)
        self._names: dict[str, int] = {}
        # Members freed while shared, by name without its "#n": a cache regrown in forward drops the shared
        # table for a new one of its own, and the report must say so rather than go quiet about it.
        self.departed: dict[str, tuple[int, RopeKey]] = {}
        self.freed_cpu_bytes = 0  # CPU storage let go by aliasing since the owner last took the count
        # Deciding and applying happen under one lock: threads that run compiled models intern their inputs
        # while others compile, and two threads offering equal tables unlocked could both found a group, or
        # join one the other is giving up. The per-call pointer check (is_interned) reads a dict and takes
        # no lock. Reentrant: a weak-reference callback may forget a member while this thread holds it.
        self.lock = threading.RLock()

    # -- the hot path -------------------------------------------------------------------------------
    def is_interned(self, tensor: torch.Tensor) -> bool:
        """Cheap check used on every call: is this tensor's memory a canonical table's?"""
        return memory_ptr(tensor) in self._ptr_count

    def is_shared_member(self, tensor: torch.Tensor) -> bool:
        """Cheap check used on every call: is this very tensor a member of a group, and its memory still a
        canonical table's? (Memory alone does not say: a tensor that shared with members the store has since
        forgotten points there too; membership alone does not either: a member's memory can be replaced.)"""
        return id(tensor) in self._group_of and memory_ptr(tensor) in self._ptr_count

    # -- deciding and sharing -----------------------------------------------------------------------
    def offer(self, tensor: torch.Tensor, *, name: str, written: str | None = None, persistent: bool = False) -> Plan:
        """Share ``tensor`` with an equal canonical table if it is an unwritten RoPE table; else record why not.

        ``name`` is what the report calls it; ``written`` how a graph writes it (None: only read);
        ``persistent`` whether it is saved in a state_dict. The rules that decide read the tensor itself.
        Returns the plan that was applied."""
        with self.lock:
            plan = self.decide(tensor, written=written, persistent=persistent)
            self.apply(plan, tensor, name)
        return plan

    def decide(self, tensor: torch.Tensor, *, written: str | None = None, persistent: bool = False) -> Plan:
        """What :meth:`apply` would do with ``tensor``: reads the store and the tensor, and changes neither,
        except that members whose storage is gone are forgotten before a canonical table is read."""
        member = id(tensor) in self._group_of
        if member and written is None:
            return Plan(Action.KNOWN)
        if tensor in self._excluded:
            return Plan(Action.SKIP, member, refusal=self._excluded[tensor])
        refusal = why_not_shareable(tensor, written, persistent, self.share_persistent)
        if refusal is not None:
            return Plan(Action.SKIP, member, refusal=refusal)
        group = self._find_equal(tensor)
        if group is not None:
            return Plan(Action.JOIN, group=group)
        table = recognize_rope_table(local(tensor))
        if isinstance(table, NotRope):
            return Plan(Action.SKIP, refusal=Refusal(SkipReason.NOT_ROPE, table.reason))
        return Plan(Action.NEW, key=infer_key(table, local(tensor)))

    def apply(self, plan: Plan, tensor: torch.Tensor, name: str) -> None:
        """Carry out ``plan`` for ``tensor``: the store's bookkeeping, and storage changes unless a dry run."""
        if plan.release_first:
            log.info("rope_dedup: %s is written by a graph compiled now; it gets its own storage back", name)
            self.release(tensor)
        if plan.action is Action.SKIP:
            self._skip(name, plan.refusal, tensor)  # type: ignore[arg-type]
        elif plan.action is Action.JOIN:
            self._alias(tensor, plan.group, self._unique_name(name))  # type: ignore[arg-type]
        elif plan.action is Action.NEW:
            self._new_group(tensor, plan.key, self._unique_name(name))  # type: ignore[arg-type]

    def _live_canonical(self, group: _Group) -> torch.Tensor | None:
        """The group's canonical table, checked before anything reads it: a member whose storage was freed or
        shrunk in place, or moved to meta, is forgotten (counted as departed) and the next one stands in."""
        for ident, member in list(group.members.items()):
            tensor = member.ref()
            if tensor is None:
                continue
            if readable(tensor):
                return tensor
            log.warning("rope_dedup: %s was freed or shrunk in place while shared: dropped from the store", member.name)
            self._forget(ident, member.ptr, departed=True)
        return None

    def _find_equal(self, tensor: torch.Tensor) -> _Group | None:
        """The group whose canonical table equals ``tensor`` exactly (same shape, stride, dtype, device)."""
        mine = local(tensor)  # readable: decide's safety rules refused it otherwise
        for group in list(self._groups):
            if group.shape != tuple(mine.shape) or group.stride != tuple(mine.stride()):
                continue
            if group.key.dtype != mine.dtype or group.key.device != mine.device:
                continue
            if group.placement != placement(tensor):
                continue
            canonical = self._live_canonical(group)
            if canonical is not None and _may_equal(local(canonical), mine) and same_values(local(canonical), mine):
                return group
        return None

    def _alias(self, tensor: torch.Tensor, group: _Group, name: str) -> None:
        canonical, mine = local(self._live_canonical(group)), local(tensor)  # type: ignore[arg-type]
        # Memory this tensor held on its own before sharing: none if it already lived in the canonical storage.
        original = 0 if storage_ptr(canonical) == storage_ptr(mine) else storage_nbytes(mine)
        moved = storage_ptr(canonical) != storage_ptr(mine) or canonical.storage_offset() != mine.storage_offset()
        if moved and not self.dry_run:
            try:
                _share_storage(mine, canonical)
            except RuntimeError as error:
                self._skip(name, Refusal(SkipReason.ALIAS_FAILED, str(error).splitlines()[0]), tensor)
                return
            if mine.device.type == "cpu":
                self.freed_cpu_bytes += original
        self._add_member(group, tensor, name, original)

    def _new_group(self, tensor: torch.Tensor, key: RopeKey, name: str) -> None:
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

    def _add_member(self, group: _Group, tensor: torch.Tensor, name: str, original_nbytes: int) -> None:
        ident = id(tensor)
        ptr = memory_ptr(tensor)
        group.members[ident] = _Member(weakref.ref(tensor, lambda _: self._forget(ident, ptr, departed=True)),
                                       name, original_nbytes, ptr)
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

    def release(self, tensor: torch.Tensor, reason: Refusal | None = None) -> bool:
        """Give a shared tensor its own storage back; with ``reason``, never share it again.

        Used before a graph that writes a shared table runs (it may be shared again once only graphs that
        read it run), and by :func:`rope_dedup.unshare`. Returns whether the tensor was a member.
        """
        with self.lock:
            if reason is not None:
                self._excluded[tensor] = reason
            group = self._group_of.get(id(tensor))
            if group is None:
                return False
            member = group.members[id(tensor)]
            self._forget(id(tensor), memory_ptr(tensor))
            if any(m.ref() is not None for m in group.members.values()) and not self.dry_run:
                _own_storage(local(tensor))
                log.info("rope_dedup: %s has its own storage again", member.name)
            return True

    def member_name(self, tensor: torch.Tensor) -> str | None:
        """The name ``tensor`` was shared under, or None if it is not a member of a group."""
        group = self._group_of.get(id(tensor))
        return None if group is None else group.members[id(tensor)].name

    def refuse(self, tensor: torch.Tensor, name: str, refusal: Refusal) -> None:
        """Give a member its own storage back and skip it for ``refusal``: a rule that could only be checked
        after the tensor was shared (a buffer's persistence, set after torch's registration hook runs)."""
        with self.lock:
            self.release(tensor)
            self._skip(name, refusal, tensor)

    def _skip(self, name: str, refusal: Refusal, tensor: torch.Tensor) -> None:
        refs = self._skipped_refs.setdefault(name, [])
        refs[:] = [r for r in refs if r() is not None]
        # No weak reference to a trainable parameter: torch.utils.swap_tensors refuses a tensor that has one,
        # and Module._apply swaps parameters (to_empty under FSDP2, or with swap_module_params_on_conversion).
        # The report counts those skips without naming them; frozen ones (RoPE tables may be) are named.
        trainable = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
        if not trainable and not any(r() is tensor for r in refs):
            refs.append(weakref.ref(tensor))
        if self.skipped.get(name) != refusal:
            log.log(logging.DEBUG if refusal.routine else logging.INFO, "rope_dedup: skipped %s: %s", name,
                    refusal.message)
        self.skipped[name] = refusal

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
        return None if group is None else self._live_canonical(group)

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
        return result  # type: ignore[return-value]


def _may_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two rows first (the middle and the last position): a table of another theta, or a cos beside a sin of
    the same shape, differs there, and the full comparison of a large table costs milliseconds."""
    if a.dim() == 0:
        return True
    rows = (a.shape[0] // 2, a.shape[0] - 1)
    return all(same_values(a[r], b[r]) for r in rows)


def base_name(name: str) -> str:
    """``attn.cos#3`` -> ``attn.cos``: the path a store name stands for, without its repeat number."""
    return name.rpartition("#")[0] if "#" in name and name.rpartition("#")[2].isdigit() else name


# The only two places storage is re-pointed: sharing, and giving a table its own copy back.
def _share_storage(mine: torch.Tensor, canonical: torch.Tensor) -> None:
    with torch.no_grad():
        mine.set_(canonical.untyped_storage(), canonical.storage_offset(), mine.size(), mine.stride())


def _own_storage(mine: torch.Tensor) -> None:
    with torch.no_grad():
        mine.set_(mine.clone(memory_format=torch.preserve_format))  # type: ignore[call-overload]
