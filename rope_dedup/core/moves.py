"""Shared tables stay shared through ``Module._apply``: ``.to()``, ``.cuda()``, ``.half()``, ``to_empty()``.

``Module._apply(fn)`` converts every parameter and buffer on its own and writes the result into the module
directly (``_buffers[name] = fn(buf)``), which no registration hook sees: N layers sharing one table would
each receive a converted copy, N tables on the new device or dtype, and a peak of N on the way. So
``Module._apply`` is wrapped, once, when this module is imported (``rope_dedup`` imports it): while a call
runs, the conversion is memoized per group of shared tables. The first member of a group is converted by
``fn``; every other member receives the same converted memory as a tensor object of its own, so the device
or dtype never holds more than one table per group. When the outermost call returns, the store moves those
members into a group of their own (keyed by what the converted table holds; a conversion whose result is
no RoPE table yet, ``to_empty``, keeps the old key until the content is one again), so the report, run-time
interning and a later ``share()`` see them as shared, not as freed.

Tensors that no store shares go through ``fn`` unchanged: for them the wrapper costs a dict lookup. A move
that will swap parameters (``torch.utils.swap_tensors``: DTensors, or swap-on-conversion) first collects
garbage where a parameter has a weak reference: a compile leaves some in dynamo's tracing contexts (with
any backend) in reference cycles, and a swap refuses such a tensor.

Limits: the memo covers one call of ``_apply`` on one module tree (a model and its submodules), in one
thread; members of a group outside that tree (another model sharing through the same store) keep the old
table. A conversion is assumed to give equal results for equal inputs, which every ``_apply`` of torch's
(``to``, ``cuda``, ``cpu``, ``half``, ``float``, ``double``, ``bfloat16``, ``type``, ``to_empty``) does;
after ``to_empty`` the members share one uninitialized table, and re-init must write the same values into
each (the config they were built from does), or call :func:`rope_dedup.unshare` first. Plain tensor
attributes are not converted by ``_apply`` at all.
"""

from __future__ import annotations

import gc
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from rope_dedup.core.store import CanonicalStore, _Group, _Member, live_stores
from rope_dedup.tensors import memory_ptr

_original_apply = torch.nn.Module._apply
_state = threading.local()


@dataclass
class _Converted:
    """One group's conversion in the running ``_apply``: the converted table and the members given it."""

    store: CanonicalStore
    group: _Group
    table: torch.Tensor
    unchanged: bool  # fn returned its input: a no-op conversion, every member keeps its own tensor
    moved: list[tuple[_Member, torch.nn.Module, str, torch.Tensor]] = field(default_factory=list)


class _Traversal:
    """The state of one outermost ``_apply`` call: the conversion ``fn`` memoized per shared group."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], stores: list[CanonicalStore]) -> None:
        self.fn = fn
        self.stores = stores
        self.converted: dict[int, _Converted] = {}  # id(group) -> its conversion
        self.memoized = self.convert  # one bound method, passed down to every submodule's _apply

    def member(self, tensor: torch.Tensor) -> tuple[CanonicalStore, _Member] | None:
        for store in self.stores:
            member = store.member(tensor)
            if member is not None:
                return store, member
        return None

    def convert(self, tensor: torch.Tensor) -> torch.Tensor:
        found = self.member(tensor) if isinstance(tensor, torch.Tensor) else None
        if found is None:
            return self.fn(tensor)
        store, member = found
        done = self.converted.get(id(member.group))
        if done is None:
            table = self.fn(tensor)
            self.converted[id(member.group)] = _Converted(store, member.group, table, table is tensor)
            return table
        if done.unchanged:
            return self.fn(tensor)
        return done.table.detach()  # the converted memory, as a tensor object of this member's own

    def own_members(self, module: torch.nn.Module) -> list[tuple[str, _Member]]:
        """This module's own parameters and buffers that a store shares, before ``_apply`` replaces them."""
        found = []
        for holder in (module._parameters, module._buffers):
            for name, tensor in holder.items():
                member = self.member(tensor) if tensor is not None else None
                if member is not None:
                    found.append((name, member[1]))
        return found

    def record(self, module: torch.nn.Module, before: list[tuple[str, _Member]]) -> None:
        """After ``_apply`` ran on ``module``: which members now read their group's converted table."""
        for name, member in before:
            done = self.converted.get(id(member.group))
            tensor: torch.Tensor | None = module._parameters.get(name)
            if tensor is None:
                tensor = module._buffers.get(name)
            if done is None or done.unchanged or tensor is None:
                continue
            if memory_ptr(tensor) == memory_ptr(done.table) and tensor.shape == done.table.shape:
                done.moved.append((member, module, name, tensor))

    def finish(self) -> None:
        for done in self.converted.values():
            if done.moved and not done.unchanged:
                done.store.transfer(done.group, done.table, done.moved)


def _collect_before_swapping(module: torch.nn.Module) -> None:
    """``Module._apply`` swaps parameters (``torch.utils.swap_tensors``) under swap-on-conversion and always
    for DTensors, and a swap refuses a tensor with a weak reference. A compile leaves some (in dynamo's
    tracing contexts, with any backend) in reference cycles that only the garbage collector frees: collect
    them first, where a swap will happen and a weak reference is there (rope_dedup itself holds none). One
    collection may not be enough: objects a finalizer touched are freed only by the next one (PEP 442)."""
    params = [p for m in module.modules() for p in m._parameters.values() if p is not None]
    swaps = torch.__future__.get_swap_module_params_on_conversion() or any(
        is_traceable_wrapper_subclass(p) for p in params)
    while swaps and any(weakref.getweakrefcount(p) for p in params) and gc.collect():
        pass


def _apply(self: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
    traversal: _Traversal | None = getattr(_state, "traversal", None)
    if traversal is None:
        if recurse:
            _collect_before_swapping(self)
        stores = live_stores()
        if not stores:
            return _original_apply(self, fn, recurse)
        traversal = _state.traversal = _Traversal(fn, stores)
        try:
            return _apply(self, fn, recurse)
        finally:
            _state.traversal = None
            traversal.finish()
    if fn is not traversal.fn and fn is not traversal.memoized:  # another conversion, run from inside this one
        return _original_apply(self, fn, recurse)
    before = traversal.own_members(self)
    result = _original_apply(self, traversal.memoized, recurse)
    traversal.record(self, before)
    return result


_apply.__wrapped__ = _original_apply  # type: ignore[attr-defined]


def install() -> None:
    """Wrap ``torch.nn.Module._apply`` (idempotent)."""
    if torch.nn.Module._apply is not _apply:
        torch.nn.Module._apply = _apply  # type: ignore[method-assign]
