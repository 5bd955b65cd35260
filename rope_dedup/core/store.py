"""The canonical store: one storage per distinct RoPE table, shared with ``Tensor.set_``.

One store belongs to one backend instance and outlives the graphs it compiles, because with regional
compilation or graph breaks a single compiled graph serves every layer and only run-time interning
can reach the other layers' tables.

It holds no reference of any kind to a user tensor, strong or weak: a weak reference makes
``torch.utils.swap_tensors`` refuse the tensor, and ``Module._apply`` swaps (DTensor models, FSDP2's
``to_empty``, ``set_swap_module_params_on_conversion``). A member is known by ``id()`` and by its
TensorImpl (``_cdata``), checked together, since an ``id`` is reused once its tensor is gone; the
canonical memory by a weak reference to its *storage* (:class:`~torch.multiprocessing.reductions.StorageWeakRef`,
which no swap checks), turned back into a tensor only for the moment a comparison or an alias needs it.
Dropping a model frees its tables. A member is live while its storage is: where its owning module is known
(a weak reference to the module, and the attribute's name), also only while that module still holds it.

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
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from rope_dedup.core.eligibility import Refusal, SkipReason, why_not_shareable
from rope_dedup.tables.keys import RopeKey, infer_key
from rope_dedup.tables.recognize import NotRope, RopeTable, recognize_rope_table
from rope_dedup.tensors import (TensorMark, has_storage, is_plain, local, memory_key, memory_ptr, placement, same_values,
                                storage_nbytes, storage_ptr)

log = logging.getLogger("rope_dedup")

# Names kept per skip name for report_for(model): one per block under regional compile; a bound, since the
# tensors behind them come and go (a cache regrown on every call) and nothing says when one is gone.
_SKIPPED_IDS_PER_NAME = 4096
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_expired = torch.UntypedStorage._expired  # a storage's weak reference has no strong one left
# One lock for every store: a write protection or unshare() that reaches into every store (a table shared by
# share() and written by another backend's graph) must not wait on two locks taken in opposite orders.
_LOCK = threading.RLock()


class Epoch:
    """A count of every change that may alter what a compiled graph finds when it looks at its inputs: a
    member joining or leaving any store, a tensor excluded, a buffer or parameter registered anywhere
    (:mod:`rope_dedup.interning`). Graphs that found their inputs resolved at this count need not look
    again while it stands."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0

    def bump(self) -> None:
        # No lock: dynamo traces this inside a forward that registers a buffer, and a lock is a graph break.
        # Two bumps at once may collapse into one; either still moves the count, and graphs look at any move.
        self.now += 1


EPOCH = Epoch()
# Tensors unshare() released, in every store: never shared again (id -> its mark and the refusal).
_EXCLUDED: dict[int, tuple[TensorMark, Refusal]] = {}
# Shared storages freed in place and dropped from their store, by storage: :func:`orphaned_alias`.
_ORPHANED: dict[int, StorageWeakRef] = {}


@dataclass(eq=False)
class _Member:
    ident: int  # id(tensor)
    impl: int  # tensor._cdata: id() alone is reused once the tensor is gone
    name: str
    original_nbytes: int  # storage it held alone when first offered (0 if already shared): the "before" side
    ptr: int  # memory_ptr when it joined
    storage: StorageWeakRef  # its storage when it joined (the canonical one, except in a dry run)
    offset: int  # its storage_offset then
    group: _Group
    plain: bool  # a tensor or parameter, whose own data_ptr is its memory (decided once, not per call)
    owner: weakref.ref | None = None  # the module holding it, where known (modules may be weakly referenced)
    attr: str | None = None  # its name in that module
    storage_cdata: int = field(init=False)  # the weak reference's address, read once for unshared()

    def __post_init__(self) -> None:
        self.storage_cdata = self.storage.cdata


@dataclass(eq=False)
class _Group:
    key: RopeKey
    shape: tuple[int, ...]  # of the local tensor
    stride: tuple[int, ...]
    placement: tuple | None  # DTensor (mesh, placements); tables share only within one
    members: dict[int, _Member] = field(default_factory=dict)  # id(tensor) -> member
    conflict_with: str | None = None  # name of a table with the same key but different content
    # Moved by a conversion whose result is not a RoPE table (to_empty: uninitialized until re-init): the
    # key is the one before the move until the content is recognized again.
    pending: bool = False


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
    """Canonical RoPE tables by key, verified equal before any sharing; no reference to a user tensor kept."""

    def __init__(self, dry_run: bool = False, share_persistent: bool = False) -> None:
        self.dry_run = dry_run  # decide and report, but alias nothing (rope_dedup.explain)
        self.share_persistent = share_persistent  # also share buffers saved in a state_dict (opt-in)
        self._groups: list[_Group] = []
        self._members: dict[int, _Member] = {}  # id(tensor) -> member (checked against the tensor's impl)
        self._ptrs: dict[tuple[torch.device, int], _Group] = {}  # memory_key of a member -> its group
        self.skipped: dict[str, Refusal] = {}
        self._skipped_marks: dict[str, dict[tuple[int, int], TensorMark]] = {}  # name -> tensors skipped under it
        self._names: dict[str, int] = {}
        # Members freed while shared, by name without its "#n": a cache regrown in forward drops the shared
        # table for a new one of its own, and the report must say so rather than go quiet about it.
        self._departed: dict[str, tuple[int, RopeKey]] = {}
        self.freed_cpu_bytes = 0  # CPU storage let go by aliasing since the owner last took the count
        # Deciding and applying happen under the stores' one lock: threads that run compiled models intern their
        # inputs while others compile, and two threads offering equal tables unlocked could both found a group,
        # or join one the other is giving up. The per-call check of a reading graph reads dicts, unlocked.
        self.lock = _LOCK

    # -- the hot path -------------------------------------------------------------------------------
    def is_interned(self, tensor: torch.Tensor) -> bool:
        """Cheap check used on every call: is this tensor's memory a live group's table?"""
        group = self._ptrs.get(memory_key(tensor))
        return group is not None and any(not m.storage.expired() for m in list(group.members.values()))

    def unshared(self, tensors: Sequence[torch.Tensor], positions: Sequence[int]) -> list[int]:
        """The hot path, once per call of a compiled graph: the positions whose tensor is not a shared member
        (this very tensor in a group, reading the memory it joined with, whose storage lives: id and impl alone
        are reused by the next tensor made, and with the storage alive no other tensor can have that memory).
        Memory alone does not say either: a tensor that shared with members since forgotten points there too."""
        members, expired = self._members, _expired
        found: list[int] = []
        for position in positions:
            tensor = tensors[position]
            member = members.get(id(tensor))
            # Once id and impl match, this is the member's own object: its type is the member's.
            if member is None or member.impl != tensor._cdata or expired(member.storage_cdata) or member.ptr != (
                    tensor.data_ptr() if member.plain else memory_ptr(tensor)):
                found.append(position)
        return found

    def member(self, tensor: torch.Tensor) -> _Member | None:
        """The record of ``tensor`` if it is a member of a group (this very tensor, not an equal one).

        id() and the TensorImpl's address are both reused as soon as a tensor is gone, often by the next tensor
        made (the same sizes come from the same free lists); the storage is what tells them apart: the store's
        weak reference keeps the member's StorageImpl from being reused while the member is recorded."""
        member = self._members.get(id(tensor))
        if member is None or member.impl != tensor._cdata or not has_storage(tensor):
            return None
        # The same storage is not enough: one freed and regrown in place (sleep mode) reads new memory, which
        # :meth:`unshared` already calls unshared; a member then is one no offer would share again.
        if local(tensor).untyped_storage()._cdata != member.storage.cdata or memory_ptr(tensor) != member.ptr:
            return None
        return member

    # -- deciding and sharing -----------------------------------------------------------------------
    def offer(self, tensor: torch.Tensor, *, name: str, written: str | None = None, persistent: bool = False,
              owner: tuple[torch.nn.Module, str] | None = None) -> Plan:
        """Share ``tensor`` with an equal canonical table if it is an unwritten RoPE table; else record why not.

        ``name`` is what the report calls it; ``written`` how a graph writes it (None: only read);
        ``persistent`` whether it is saved in a state_dict; ``owner`` the module holding it and the name it
        holds it under, where known (the store then knows when the module lets it go). The rules that decide
        read the tensor itself. Returns the plan that was applied."""
        with self.lock:
            plan = self.decide(tensor, written=written, persistent=persistent)
            self.apply(plan, tensor, name, owner)
        return plan

    def decide(self, tensor: torch.Tensor, *, written: str | None = None, persistent: bool = False) -> Plan:
        """What :meth:`apply` would do with ``tensor``: reads the store and the tensor, and changes neither,
        except that groups whose storage is gone are forgotten before a canonical table is read."""
        member = self.member(tensor)
        if member is not None and written is None:
            if member.group.pending:
                self._rekey(member.group)
            return Plan(Action.KNOWN)
        # A table about to be written must leave every store that shares it, not only this one.
        release = member is not None or (written is not None and shared_anywhere(tensor))
        excluded = _EXCLUDED.get(id(tensor))
        if excluded is not None and excluded[0].matches(tensor):
            return Plan(Action.SKIP, release, refusal=excluded[1])
        refusal = why_not_shareable(tensor, written, persistent, self.share_persistent)
        if refusal is not None:
            return Plan(Action.SKIP, release, refusal=refusal)
        group = self._find_equal(tensor)
        if group is not None:
            return Plan(Action.JOIN, group=group)
        table = recognize_rope_table(local(tensor))
        if isinstance(table, NotRope):
            return Plan(Action.SKIP, refusal=Refusal(SkipReason.NOT_ROPE, table.reason))
        return Plan(Action.NEW, key=infer_key(table, local(tensor)))

    def apply(self, plan: Plan, tensor: torch.Tensor, name: str,
              owner: tuple[torch.nn.Module, str] | None = None) -> None:
        """Carry out ``plan`` for ``tensor``: the store's bookkeeping, and storage changes unless a dry run."""
        if plan.release_first:  # even in a dry run: the write would land in every store's sharers
            log.info("rope_dedup: %s is written by a graph compiled now; it gets its own storage back", name)
            self._leave(tensor)
            release_shared(tensor)
        if plan.action is Action.SKIP:
            self._skip(name, plan.refusal, tensor)  # type: ignore[arg-type]
        elif plan.action is Action.JOIN:
            self._alias(tensor, plan.group, self._unique_name(name), owner)  # type: ignore[arg-type]
        elif plan.action is Action.NEW:
            self._new_group(tensor, plan.key, self._unique_name(name), owner)  # type: ignore[arg-type]

    def _canonical(self, group: _Group) -> torch.Tensor | None:
        """The group's table as a tensor of its own (nothing else holds it), checked before anything reads it:
        a group whose storage was freed, or freed or shrunk in place, is forgotten (its members departed)."""
        for member in list(group.members.values()):
            storage = torch.UntypedStorage._new_with_weak_ptr(member.storage.cdata)
            if storage is None:  # this member's storage is gone (in a dry run members keep their own)
                continue
            # Checked before set_, which would grow a storage freed in place (resize_(0)) back, with garbage.
            extent = 1 + sum((size - 1) * stride for size, stride in zip(group.shape, group.stride))
            if storage.device.type != "meta" and storage.nbytes() >= (member.offset + extent) * group.key.dtype.itemsize:
                return torch.empty(0, dtype=group.key.dtype, device=storage.device).set_(
                    storage, member.offset, group.shape, group.stride)
            log.warning("rope_dedup: %s was freed or shrunk in place while shared: dropped from the store", member.name)
            with _LOCK:  # its members still read one storage: a reload of one must not write the others
                _ORPHANED[member.storage.cdata] = member.storage
            break
        self._drop(group)
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
            canonical = self._canonical(group)
            if canonical is None:
                continue
            # The very same memory (a table a move left aliased, offered again) is equal without a read.
            if canonical.data_ptr() == mine.data_ptr() or (_may_equal(canonical, mine) and same_values(canonical, mine)):
                return group
        return None

    def _alias(self, tensor: torch.Tensor, group: _Group, name: str,
               owner: tuple[torch.nn.Module, str] | None) -> None:
        canonical, mine = self._canonical(group), local(tensor)
        if canonical is None:  # freed since decide(), by another thread
            self._skip(name, Refusal(SkipReason.FREED), tensor)
            return
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
        self._add_member(group, tensor, name, original, owner)

    def _new_group(self, tensor: torch.Tensor, key: RopeKey, name: str, owner: tuple[torch.nn.Module, str] | None,
                   original: int | None = None, pending: bool = False) -> _Group:
        mine = local(tensor)
        group = _Group(key, tuple(mine.shape), tuple(mine.stride()), placement(tensor), pending=pending)
        same_key = [g for g in self._groups if g.key == key and not g.pending] if not pending else []
        if same_key:
            first = next(iter(same_key[0].members.values())).name
            group.conflict_with = first
            log.warning("rope_dedup: %s has the same key as %s (%s) but different content; kept separate",
                        name, first, key)
        self._groups.append(group)
        self._add_member(group, tensor, name, storage_nbytes(tensor) if original is None else original, owner)
        if not self.dry_run:
            _SHARING.add(self)
        return group

    def _add_member(self, group: _Group, tensor: torch.Tensor, name: str, original_nbytes: int,
                    owner: tuple[torch.nn.Module, str] | None) -> None:
        stale = self._members.get(id(tensor))
        if stale is not None:  # a tensor gone since, whose id this one has now (or this one, joining again)
            # If it was the group's last member, the group lives on with this one.
            self._forget(stale, departed=self.member(tensor) is not stale, keep_group=stale.group is group)
        mine = local(tensor)
        member = _Member(id(tensor), tensor._cdata, name, original_nbytes, memory_ptr(tensor),
                         StorageWeakRef(mine.untyped_storage()), int(mine.storage_offset()), group,
                         type(tensor) in _PLAIN)
        if owner is not None:
            member.owner, member.attr = weakref.ref(owner[0]), owner[1]
        group.members[member.ident] = member
        self._members[member.ident] = member
        EPOCH.bump()
        self._ptrs[(mine.device, member.ptr)] = group
        self.skipped.pop(name, None)
        self._skipped_marks.pop(name, None)

    def _forget(self, member: _Member, departed: bool = False, keep_group: bool = False) -> None:
        group = member.group
        if group.members.get(member.ident) is not member:
            return
        del group.members[member.ident]
        if self._members.get(member.ident) is member:
            del self._members[member.ident]
        EPOCH.bump()
        if departed:
            base = base_name(member.name)
            count, _ = self._departed.get(base, (0, group.key))
            self._departed[base] = (count + 1, group.key)
            log.info("rope_dedup: %s was freed while shared (its owner dropped or replaced it)", member.name)
        where = (group.key.device, member.ptr)
        if not any(m.ptr == member.ptr for m in group.members.values()) and self._ptrs.get(where) is group:
            del self._ptrs[where]
        if not group.members and not keep_group and group in self._groups:
            self._groups.remove(group)

    def _drop(self, group: _Group) -> None:
        """Forget a group whose storage is gone: every member departed with it."""
        for member in list(group.members.values()):
            self._forget(member, departed=True)

    def _prune(self) -> None:
        """Forget what is gone: groups whose storage died, members whose owning module let them go."""
        for group in list(self._groups):
            if self._canonical(group) is None:
                continue
            for member in list(group.members.values()):
                if not _still_held(member):
                    self._forget(member, departed=True)

    def _rekey(self, group: _Group) -> None:
        """A group moved while its content was not a RoPE table (to_empty): key it once it is one again."""
        canonical = self._canonical(group)
        if canonical is None:
            return
        found = recognize_rope_table(canonical)
        if isinstance(found, RopeTable):
            group.key, group.pending = infer_key(found, canonical), False

    def release(self, tensor: torch.Tensor) -> bool:
        """Forget ``tensor`` here and give it its own storage back, in every store (:func:`release_shared`):
        what a refusal found after sharing needs. Returns whether the tensor was shared."""
        with self.lock:
            was_member = self._leave(tensor)
            released = release_shared(tensor) if not self.dry_run else False
            return was_member or released

    def _leave(self, tensor: torch.Tensor) -> bool:
        """Forget ``tensor`` as a member of this store; its storage is untouched. Returns whether it was one."""
        member = self.member(tensor)
        if member is not None:
            self._forget(member)
        return member is not None

    def member_name(self, tensor: torch.Tensor) -> str | None:
        """The name ``tensor`` was shared under, or None if it is not a member of a group."""
        member = self.member(tensor)
        return None if member is None else member.name

    def refuse(self, tensor: torch.Tensor, name: str, refusal: Refusal) -> None:
        """Give a member its own storage back and skip it for ``refusal``: a rule that could only be checked
        after the tensor was shared (a buffer's persistence, set after torch's registration hook runs)."""
        with self.lock:
            self.release(tensor)
            self._skip(name, refusal, tensor)

    def _skip(self, name: str, refusal: Refusal, tensor: torch.Tensor) -> None:
        # Marked, never referenced: the report names skipped tensors by their path in a model later.
        seen = self._skipped_marks.setdefault(name, {})
        seen[(id(tensor), tensor._cdata)] = TensorMark(tensor)
        if len(seen) > _SKIPPED_IDS_PER_NAME:
            del seen[next(iter(seen))]
        if self.skipped.get(name) != refusal:
            log.log(logging.DEBUG if refusal.routine else logging.INFO, "rope_dedup: skipped %s: %s", name,
                    refusal.message)
        self.skipped[name] = refusal

    def _unique_name(self, name: str) -> str:
        """Regional compile shows every block's table under the same relative path: number repeats."""
        count = self._names.get(name, 0)
        self._names[name] = count + 1
        return name if count == 0 else f"{name}#{count}"

    def group_of(self, tensor: torch.Tensor) -> _Group | None:
        """The group ``tensor`` is a member of, or None: lets a caller that removes duplicates instead of
        aliasing them (``dedup_exported``, dry runs) keep one tensor per group."""
        member = self.member(tensor)
        return None if member is None else member.group

    def take_freed_cpu_bytes(self) -> int:
        """CPU bytes aliasing let go since the last call (an upper bound: a view elsewhere may keep one)."""
        freed, self.freed_cpu_bytes = self.freed_cpu_bytes, 0
        return freed

    # -- moves: Module._apply converts one table per group (rope_dedup.core.moves) ---------------------------
    def transfer(self, group: _Group, converted: torch.Tensor,
                 moved: list[tuple[_Member, torch.nn.Module, str, torch.Tensor]]) -> None:
        """Members of ``group`` that a conversion (``.to()``, ``.half()``, ``to_empty()``) turned into tensors
        reading ``converted``'s memory: they leave ``group`` (not departed: moved) and form a group of their
        own, keyed by what ``converted`` holds now, or by the old key if that is no RoPE table (yet)."""
        with self.lock:
            for member, _, _, _ in moved:
                # Moved to meta: nothing left to share or compare, as when each module gets a meta tensor.
                self._forget(member, departed=not has_storage(converted))
            if not has_storage(converted):
                return
            table = recognize_rope_table(local(converted))
            pending = not isinstance(table, RopeTable)
            key = infer_key(table, local(converted)) if isinstance(table, RopeTable) \
                else replace(group.key, dtype=converted.dtype, device=local(converted).device)
            nbytes = storage_nbytes(converted)
            new: _Group | None = None
            for member, module, attr, tensor in moved:
                if new is None:
                    new = self._new_group(tensor, key, member.name, (module, attr), original=nbytes, pending=pending)
                else:
                    self._add_member(new, tensor, member.name, nbytes, (module, attr))

    # -- what the report reads ------------------------------------------------------------------
    @property
    def departed(self) -> dict[str, tuple[int, RopeKey]]:
        """Members freed while shared, by name without its "#n": (how many, their key). A copy, taken under
        the lock: other threads intern while a report reads it."""
        with self.lock:
            self._prune()
            return dict(self._departed)

    def skips(self) -> list[tuple[str, Refusal, list[TensorMark]]]:
        """Each skip name with its refusal and the marks of the tensors skipped under it (one per block when
        a graph serves every block): a copy, taken under the lock."""
        with self.lock:
            return [(name, refusal, list(self._skipped_marks.get(name, {}).values()))
                    for name, refusal in self.skipped.items()]

    def snapshot(self) -> list[tuple[_Group, list[_Member], int]]:
        """Live groups, each with its live members and the bytes of the storage it reads, for the report."""
        with self.lock:
            self._prune()
            result = []
            for group in self._groups:
                canonical = self._canonical(group)
                if canonical is not None and group.members:
                    result.append((group, list(group.members.values()), canonical.untyped_storage().nbytes()))
            return result


# Stores that alias tables, held strongly while any of their tables lives: a move must keep those shared even
# when the backend that shared them is gone (share(model, backend=RopeDedupBackend()) drops its backend at once).
_SHARING: set[CanonicalStore] = set()


def shared_anywhere(tensor: torch.Tensor) -> bool:
    """Whether any store shares ``tensor``'s memory as a live table: what a graph about to write it asks."""
    with _LOCK:
        return any(store.is_interned(tensor) for store in _SHARING)


def release_shared(tensor: torch.Tensor) -> bool:
    """Forget ``tensor`` in every store, and give it its own storage (same content) if its memory is still a
    table others read: a write then lands in it alone. Returns whether it was shared anywhere."""
    with _LOCK:
        stores = list(_SHARING)
        names = []
        for store in stores:
            member = store.member(tensor)
            if member is not None:
                store._forget(member)
                names.append(member.name)
        if not any(store.is_interned(tensor) for store in stores):
            return bool(names)
        _own_storage(local(tensor))
        log.info("rope_dedup: %s has its own storage again", names[0] if names else "a table read by shared ones")
        return True


def orphaned_alias(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` reads a storage that several tables shared until it was freed in place and the store
    dropped them (sleep modes free and refill in place): they still read one memory, unknown to every store."""
    with _LOCK:
        for cdata, ref in list(_ORPHANED.items()):
            if ref.expired():
                del _ORPHANED[cdata]
        return is_plain(local(tensor)) and local(tensor).untyped_storage()._cdata in _ORPHANED


def release_orphaned(tensor: torch.Tensor) -> None:
    """Give a table of an orphaned shared storage (:func:`orphaned_alias`) a storage of its own, same content."""
    with _LOCK:
        _own_storage(local(tensor))


def exclude(tensor: torch.Tensor, reason: Refusal) -> None:
    """Never share ``tensor`` again, in any store, for ``reason`` (marked with the storage it has now)."""
    with _LOCK:
        _EXCLUDED[id(tensor)] = (TensorMark(tensor), reason)
        EPOCH.bump()


def live_stores() -> list[CanonicalStore]:
    """Every store that shares a live table now: what a conversion must keep shared. A store whose every
    storage is gone leaves the set here (without reading any table)."""
    live = []
    for store in list(_SHARING):
        with store.lock:
            if any(not m.storage.expired() for g in store._groups for m in g.members.values()):
                live.append(store)
            else:
                _SHARING.discard(store)
    return live


def _held(module: torch.nn.Module, attr: str) -> torch.Tensor | None:
    for holder in (module._parameters, module._buffers, module.__dict__):
        tensor = holder.get(attr)
        if isinstance(tensor, torch.Tensor):
            return tensor
    return None


def _still_held(member: _Member) -> bool:
    """Whether the member's owning module (where known) still holds it, reading the memory it joined with."""
    if member.owner is None or member.attr is None:
        return True
    module = member.owner()
    tensor = _held(module, member.attr) if module is not None else None
    return tensor is not None and id(tensor) == member.ident and tensor._cdata == member.impl \
        and memory_ptr(tensor) == member.ptr


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
