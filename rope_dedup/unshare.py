"""Undo sharing for a model: every table a backend aliased gets its own storage back."""

from __future__ import annotations

import torch

from rope_dedup.backend import RopeDedupBackend, rope_dedup_backend
from rope_dedup.core.eligibility import Refusal, SkipReason
from rope_dedup.tensors import module_tensors


def unshare(model: torch.nn.Module, backend: RopeDedupBackend = rope_dedup_backend) -> list[str]:
    """Give every tensor of ``model`` that ``backend`` shared its own storage, and never share it again.

    Why: writes outside a compiled graph (user code between steps, eager code after a graph break)
    are invisible to the pass; a model about to be written that way must stop sharing first. Compiled
    graphs that merged these tables notice the broken sharing and run an un-merged graph. Returns the
    paths of the tensors that were unshared.
    """
    released = Refusal(SkipReason.RELEASED)
    # A list, not a generator: every store must release the tensor, not just the first that held it.
    return [path for path, tensor in module_tensors(model).values()
            if any([store.release(tensor, reason=released) for store in backend.stores])]
