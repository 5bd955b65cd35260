"""The ideal RoPE storage count of a toy decoder, computed from its construction (never by the pass)."""

from __future__ import annotations

from typing import Callable

import torch
from rope_dedup.testing.toy_decoder import rope_tensors

from rope_dedup.tensors import same_values


def ideal_storages(model: torch.nn.Module, keeps_own: Callable[[torch.Tensor], bool] = lambda _: False,
                   unread_seen: bool = False) -> int:
    """One storage per distinct table, plus one each for what must keep its own.

    Written caches (``cached_freqs``) keep theirs; ``original_inv_freq`` is never read by forward, so no
    compiled graph (and no compile-time pass) sees it, unless ``unread_seen`` (``share()`` saw the model).
    ``keeps_own`` names more such tables.
    """
    distinct: list[torch.Tensor] = []
    own = 0
    unread = ("cached_freqs",) if unread_seen else ("cached_freqs", "original_inv_freq")
    for name, tensor in rope_tensors(model):
        if name.endswith(unread) or keeps_own(tensor):
            own += 1
        elif not any(t.dtype == tensor.dtype and t.shape == tensor.shape and same_values(t, tensor) for t in distinct):
            distinct.append(tensor)
    return own + len(distinct)
