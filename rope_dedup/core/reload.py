"""``load_state_dict`` into shared tables: a member whose incoming value differs is unshared before the copy.

``load_state_dict`` copies each checkpoint tensor into the module's tensor in place, so tables that share
one storage would all end up holding the last one written. With ``share_persistent=True`` the tables that
are saved in a ``state_dict`` may be shared, so each owning module gets a ``load_state_dict`` pre-hook
(torch's public ``register_load_state_dict_pre_hook``): before the copy, every shared tensor of that
module whose incoming value differs (bitwise) gets its own storage back (same content), and the copy then
lands in it alone; the report lists it as skipped for that reason. Equal values, the usual checkpoint, stay
shared. Every saved member is guarded so, however it joined (compile time, run time, ``share()``,
``sharing()``); one whose module cannot be found is not shared at all. With ``assign=True`` torch puts the
checkpoint's tensors in place of the module's, so nothing is written into a shared storage and nothing
needs unsharing; ``strict=False`` leaves missing keys alone.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from rope_dedup.core.eligibility import Refusal, SkipReason
from rope_dedup.core.store import CanonicalStore, orphaned_alias, release_orphaned
from rope_dedup.tensors import same_values

log = logging.getLogger("rope_dedup")

# module -> the stores that already guard it (one hook per module and store).
_guarded: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet] = weakref.WeakKeyDictionary()


def guard_reload(module: torch.nn.Module | None, store: CanonicalStore, tensor: torch.Tensor) -> bool:
    """Guard ``tensor`` (saved in ``module``'s state_dict, just offered to ``store``) against reloads: if it is
    shared there, ``module.load_state_dict`` unshares, before copying, each of its tensors shared there whose
    incoming value differs. Without a module to hook, the store refuses it (``UNGUARDED``) and it keeps its
    own storage. Returns whether it may stay shared. Idempotent per (module, store); a dry run shares nothing
    and hooks nothing."""
    name = store.member_name(tensor)
    if name is None or store.dry_run:
        return True
    if module is None:
        store.refuse(tensor, name, Refusal(SkipReason.UNGUARDED))
        return False
    stores = _guarded.setdefault(module, weakref.WeakSet())
    if store in stores:
        return True
    stores.add(store)
    store_ref = weakref.ref(store)

    def before_load(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict,
                    *_: Any) -> None:
        store = store_ref()
        if store is None or local_metadata.get("assign_to_params_buffers", False):
            return
        for name, tensor in [*module._buffers.items(), *module._parameters.items()]:
            if tensor is None:
                continue
            incoming = state_dict.get(prefix + name)
            member = store.member_name(tensor)
            if not isinstance(incoming, torch.Tensor) or incoming.shape != tensor.shape:
                continue
            if member is None:
                if orphaned_alias(tensor) and not same_values(incoming.detach().to(device=tensor.device,
                                                                                 dtype=tensor.dtype), tensor):
                    log.info("rope_dedup: load_state_dict brings %s a value of its own: it leaves the storage it "
                             "shared before that was freed in place", prefix + name)
                    release_orphaned(tensor)
                continue
            if not same_values(incoming.detach().to(device=tensor.device, dtype=tensor.dtype), tensor):
                log.info("rope_dedup: load_state_dict brings %s a value of its own: it leaves its group first",
                         prefix + name)
                store.refuse(tensor, member, Refusal(SkipReason.RELOADED))

    module.register_load_state_dict_pre_hook(before_load)
    return True
