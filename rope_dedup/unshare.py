"""Undo sharing for a model: every table a backend aliased gets its own storage back."""

from __future__ import annotations

import torch

from rope_dedup.backend import RopeDedupBackend, rope_dedup_backend
from rope_dedup.report import tensor_paths


def unshare(model: torch.nn.Module, backend: RopeDedupBackend = rope_dedup_backend) -> list[str]:
    """Give every tensor of ``model`` that ``backend`` shared its own storage, and never share it again.

    Why: writes outside a compiled graph (user code between steps, eager code after a graph break)
    are invisible to the pass; a model about to be written that way must stop sharing first. Compiled
    graphs that merged these tables notice the broken sharing and run an un-merged graph. Returns the
    paths of the tensors that were unshared.
    """
    tensors: dict[int, torch.Tensor] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        attributes = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in [*module._parameters.values(), *module._buffers.values(), *attributes]:
            if tensor is not None:
                tensors.setdefault(id(tensor), tensor)
    paths = tensor_paths(model)
    return [paths[ident] for ident, tensor in tensors.items()
            if backend.store.release(tensor, reason="released by rope_dedup.unshare: never shared again")]
