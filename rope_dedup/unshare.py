"""Undo sharing for a model: every table any store aliased gets its own storage back."""

from __future__ import annotations

import warnings

import torch

from rope_dedup.backend import RopeDedupBackend
from rope_dedup.core.eligibility import Refusal, SkipReason
from rope_dedup.core.store import exclude, release_shared
from rope_dedup.recompute import RecomputedTable, restore_values
from rope_dedup.tensors import module_tensors


def unshare(model: torch.nn.Module, backend: RopeDedupBackend | None = None) -> list[str]:
    """Give every tensor of ``model`` that any store shared its own storage, and never share it again.

    Why: writes outside a compiled graph (user code between steps, eager code after a graph break)
    are invisible to the pass; a model about to be written that way must stop sharing first. Every store
    is asked (``share()``'s, each backend's), since a table shared by one and left shared by another would
    still take the write. Compiled graphs that merged these tables notice the broken sharing and run an
    un-merged graph. A recomputed table (``share(model, tables="recompute")``) gets a storage holding its
    values again. Returns the paths of the tensors that were unshared.
    """
    if backend is not None:
        warnings.warn("rope_dedup.unshare(model, backend): every store is asked now; backend= is not needed",
                      DeprecationWarning, stacklevel=2)
    released = Refusal(SkipReason.RELEASED)
    paths = restore_values(model)
    for path, tensor in module_tensors(model).values():
        if release_shared(tensor) and path not in paths:
            paths.append(path)
        exclude(tensor, released)
    return paths
