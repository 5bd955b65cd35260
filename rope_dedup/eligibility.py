"""Safety rules that decide, before any content is read, whether a tensor may be shared at all."""

from __future__ import annotations

import torch

from rope_dedup.tensors import is_dtensor, local


TRAINABLE_REASON = "trainable parameter (requires grad): never shared"
PERSISTENT_REASON = (
    "in the state_dict (persistent buffer or frozen parameter): shared storage would make safetensors' "
    "save_file refuse the state_dict and load_state_dict write every sharer; share_persistent=True opts in"
)


def why_not_shareable(tensor: torch.Tensor, kind: str, written: str | None, persistent: bool = False,
                      share_persistent: bool = False) -> str | None:
    """Return the reason a tensor must keep its own storage, or None if it may be shared.

    ``kind`` is where it lives (buffer, parameter, attribute, global); ``written`` describes an in-place
    write the graph performs on it, if any; ``persistent`` says the tensor is saved in its module's
    ``state_dict`` (a persistent buffer or a parameter), which is shared only when ``share_persistent``
    opts in.
    """
    if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
        return TRAINABLE_REASON
    if tensor.requires_grad:
        return "requires grad: aliasing would merge gradient flows"
    if written is not None:
        return (f"written in the graph ({written}): has its own storage whenever a graph that writes it runs, "
                f"shared only while graphs that just read it run")
    if persistent and not share_persistent:
        return PERSISTENT_REASON
    if is_dtensor(tensor):
        sharded = [p for p in tensor.placements if not p.is_replicate()]
        if sharded:
            return f"DTensor with {', '.join(map(str, sharded))} placement: only replicated tables are shared"
        tensor = local(tensor)
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass {type(tensor).__name__} is not supported"
    if tensor.is_meta:
        return "meta tensor: no data to compare"
    if torch.is_inference(tensor) and not torch.is_inference_mode_enabled():
        return "inference tensor: cannot be aliased outside inference mode"
    return None
