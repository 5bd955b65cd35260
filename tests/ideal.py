"""The ideal RoPE storage count of a toy decoder, computed from its construction (never by the pass)."""

from __future__ import annotations

from typing import Callable

import torch
from rope_dedup.testing.toy_decoder import rope_tensors

from rope_dedup.tensors import same_values


def ideal_storages(model: torch.nn.Module, keeps_own: Callable[[torch.Tensor], bool] = lambda _: False) -> int:
    """One storage per distinct table, plus one each for what must keep its own.

    Written caches (``cached_freqs``) keep theirs; ``original_inv_freq`` is never read by forward, so no
    compiled graph (and no compile-time pass) sees it. ``keeps_own`` names more such tables.
    """
    distinct: list[torch.Tensor] = []
    own = 0
    for name, tensor in rope_tensors(model):
        if name.endswith(("cached_freqs", "original_inv_freq")) or keeps_own(tensor):
            own += 1
        elif not any(t.dtype == tensor.dtype and t.shape == tensor.shape and same_values(t, tensor) for t in distinct):
            distinct.append(tensor)
    return own + len(distinct)
