"""Safety rules that decide, before any content is read, whether a tensor may be shared at all; and the
reasons a tensor keeps its own storage, one enum member each."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from rope_dedup.tensors import Origin, is_dtensor, is_plain, local, readable


class SkipReason(enum.Enum):
    """Why a tensor keeps its own storage; the value is the message, ``{detail}`` filled per tensor."""

    TRAINABLE = "trainable parameter (requires grad): never shared"
    REQUIRES_GRAD = "requires grad: aliasing would merge gradient flows"
    WRITTEN = ("written in the graph ({detail}): has its own storage whenever a graph that writes it runs, "
               "shared only while graphs that just read it run")
    PERSISTENT = ("in the state_dict (persistent buffer or frozen parameter): shared storage would make "
                  "safetensors' save_file refuse the state_dict and load_state_dict write every sharer; "
                  "share_persistent=True opts in")
    SHARDED = "DTensor with {detail} placement: only replicated tables are shared"
    SUBCLASS = "tensor subclass {detail} is not supported"
    META = "meta tensor: no data to compare; share after the tables are initialized (to_empty, init_weights)"
    FREED = "storage freed or shrunk in place (untyped_storage().resize_): nothing to compare"
    INFERENCE = "inference tensor: cannot be aliased outside inference mode"
    NOT_ROPE = "not RoPE-like: {detail}"
    ALIAS_FAILED = "could not alias its storage: {detail}"
    RELEASED = "released by rope_dedup.unshare: never shared again"
    RELOADED = ("load_state_dict brought a value that differs from the table it shared: it got its own storage "
                "first, so the checkpoint's value landed in it alone")
    FILLING = ("a cache filled in place on demand ({detail}): never shared without a graph to tell when it is "
               "written; compile, or share() once it is full")
    UNSEEN_ATTRIBUTE = ("plain tensor attribute: buffer registration hooks do not see it while the model is built; "
                        "rope_dedup.share(model) after the build reaches it")
    RECOMPUTED = "recomputed where it is read (tables=\"recompute\"): it holds no table to share"
    NOT_EXACT = "not recomputed ({detail}): it keeps its values"
    UNGUARDED = ("in the state_dict, and the module holding it could not be found to guard load_state_dict: kept "
                 "apart, since a reload copies into it in place and would write every table it shared")


# Tensor types that stand for a table without holding one (rope_dedup.recompute adds its RecomputedTable).
NO_TABLE: set[type] = set()


@dataclass(frozen=True)
class Refusal:
    """A :class:`SkipReason` with the detail of one tensor."""

    reason: SkipReason
    detail: str = ""

    @property
    def message(self) -> str:
        return self.reason.value.format(detail=self.detail)

    @property
    def routine(self) -> bool:
        """Weights and non-RoPE state are the bulk of any model's skips, expected and logged quietly."""
        return self.reason in (SkipReason.TRAINABLE, SkipReason.NOT_ROPE)


def in_state_dict(origin: Origin, persistent: bool | None) -> bool:
    """Whether module state of this origin is saved in a ``state_dict``: a parameter always, a buffer unless
    registered with ``persistent=False`` (``persistent`` None: not known, so assume saved)."""
    return origin is Origin.PARAMETER or (origin is Origin.BUFFER and persistent is not False)


def why_not_shareable(tensor: torch.Tensor, written: str | None, persistent: bool = False,
                      share_persistent: bool = False) -> Refusal | None:
    """Return why a tensor must keep its own storage, or None if it may be shared.

    ``written`` describes an in-place write the graph performs on it, if any; ``persistent`` says the
    tensor is saved in its module's ``state_dict`` (a persistent buffer or a parameter), which is
    shared only when ``share_persistent`` opts in.
    """
    if type(tensor) in NO_TABLE:
        return Refusal(SkipReason.RECOMPUTED)
    if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
        return Refusal(SkipReason.TRAINABLE)
    if tensor.requires_grad:
        return Refusal(SkipReason.REQUIRES_GRAD)
    if written is not None:
        return Refusal(SkipReason.WRITTEN, written)
    if persistent and not share_persistent:
        return Refusal(SkipReason.PERSISTENT)
    if is_dtensor(tensor):
        sharded = [p for p in tensor.placements if not p.is_replicate()]  # type: ignore[attr-defined]
        if sharded:
            return Refusal(SkipReason.SHARDED, ", ".join(map(str, sharded)))
        tensor = local(tensor)
    if not is_plain(tensor):
        return Refusal(SkipReason.SUBCLASS, type(tensor).__name__)
    if tensor.is_meta:
        return Refusal(SkipReason.META)
    if not readable(tensor):
        return Refusal(SkipReason.FREED)
    if torch.is_inference(tensor) and not torch.is_inference_mode_enabled():
        return Refusal(SkipReason.INFERENCE)
    return None
