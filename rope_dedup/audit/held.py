"""The static audit's view: what each RoPE table the model holds encodes, read from the tables alone.

:mod:`rope_dedup.audit.applied` measures the tables a forward applies; this module measures the buffers and
plain tensor attributes the model holds, so the audit can run the moment a model is built, before any
forward. It also names the slots that should hold RoPE but do not (never filled after ``to_empty``, NaN,
garbage). The rule for such a slot, stated once here and in docs/audit.md, follows ownership, not shape
alone. A buffer or tensor attribute that is not a RoPE table is a slot when

- its name is a RoPE name models use (:data:`SLOT_NAMES`, or a name ending in ``inv_freq``, ``freqs_cis``,
  ``cos_cached`` or ``sin_cached``) and it is floating point or complex, whatever it holds; or
- it is *unfilled* (all zeros, NaN or inf, still on meta, or its storage freed) and held by a module that
  computes or applies RoPE:

  - a **rotary module** (its class name says Rotary / RoPE, or it holds a RoPE-named tensor): any unfilled
    tensor of two or more values, unless the module also holds a RoPE table to fill it from (a cache a
    forward fills: rotary-embedding-torch's ``cached_freqs`` beside its ``freqs``);
  - an **attention module** (its class name says Attention / Attn): an unfilled complex tensor (complex
    zeros can never be a RoPE table, nor a KV cache), or, under an expectation with a rotary dim, one with
    a RoPE table's shape for that dim: ``(dim/2,)`` frequencies, ``(L, dim/2 | dim | 2*dim)`` cos/sin,
    complex ``(L, dim/2)``, or ``(L, dim/2, 2)`` stacked, singleton dims aside.

Tensors held anywhere else (a MoE router's ``e_score_correction_bias``, norms, masks, KV caches of other
modules) are never slots, whatever their shape.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Callable

import torch

from rope_dedup.audit.applied import AppliedTable, table_parts
from rope_dedup.audit.layers import layer_of
from rope_dedup.tables.keys import infer_key
from rope_dedup.tables.layout import Arrangement
from rope_dedup.tables.recognize import NotRope, RopeTable, recognize_rope_table
from rope_dedup.audit.expectation import Expected, candidates
from rope_dedup.audit.spec import RopeSpec, Scaling
from rope_dedup.tensors import Origin, is_plain, local, module_state, readable

SLOT_NAMES = frozenset({"inv_freq", "cos", "sin", "cos_cached", "sin_cached", "freqs_cis", "rope_cache",
                        "cos_sin_cache", "embed_positions"})
_SLOT_SUFFIXES = ("inv_freq", "freqs_cis", "cos_cached", "sin_cached")
# Owners, by class name: LlamaRotaryEmbedding, torchtitan's RoPE, ESM's RotaryEmbedding; LlamaAttention, ...
_ROTARY = re.compile(r"Rotary|rotary|RoPE|Rope")
_ATTENTION = re.compile(r"Attention|Attn", re.IGNORECASE)
# A frequency vector has no positions: its angles are compared at positions 0..N-1 (dynamic NTK scaling
# changes nothing below the original length, which tables built at init have).
_FREQUENCY_POSITIONS = 4096
# A long table is compared at its first rows and at rows spread to its end, where errors are largest.
_HEAD_ROWS, _SPREAD_ROWS = 4096, 4096


@dataclass(frozen=True)
class EmptySlot:
    """A buffer or tensor attribute that should hold a RoPE table but holds something else."""

    path: str
    layer: str
    found: str  # "all zeros (never filled?)", "NaN or inf", "meta tensor (never initialized)", ...


@dataclass(frozen=True)
class Held:
    """What the static audit found held: tables measured, slots without a table, and RoPE-named tensors
    whose values are plausible but in a layout the audit cannot measure (path, why)."""

    tables: list[AppliedTable]
    empty: list[EmptySlot]
    unmeasured: list[tuple[str, str]]


def held_tables(model: torch.nn.Module, judge: Callable[[str, str], Expected] | None = None) -> Held:
    """Every RoPE table ``model`` holds (buffers and plain tensor attributes, not parameters), measured as
    the audit measures applied ones, and every slot (see the module doc) that holds none.

    Only tensors a RoPE module holds, or with a RoPE name, count as tables: table-like values elsewhere
    (MiniMax's lightning-attention decay rates) are not RoPE however they look. ``judge(layer, path)`` is
    the expectation for a tensor (None: not judged); it decides the positions a frequency vector is
    compared at and which slots count by shape."""
    state = [(path, local(tensor), origin, owner) for path, tensor, origin, _, owner in module_state(model)]
    found = {path: recognize_rope_table(tensor) if readable(tensor) else None for path, tensor, origin, owner in state
             if origin is not Origin.PARAMETER or _is_rotary(owner)}
    filled = {id(owner) for path, _, _, owner in state if isinstance(found.get(path), RopeTable)}
    held = Held([], [], [])
    for path, tensor, origin, owner in state:
        if origin is Origin.PARAMETER:
            continue
        layer = layer_of(path.rpartition(".")[0])
        named = _has_rope_name(path.rpartition(".")[2])
        specs = candidates(judge(layer, path)) if judge is not None else ()
        table = None
        recognized = found[path]
        if isinstance(recognized, RopeTable):
            if not (named or _is_rotary(owner)):
                continue
            table = _measured(layer, path, tensor, recognized, specs)
        elif named and _plausible(tensor):
            table = _reordered(layer, path, tensor)
            if table is None:
                held.unmeasured.append((path, recognized.reason if recognized is not None else "unreadable (freed, or on meta)"))
                continue
        if table is not None:
            held.tables.append(table)
        elif not isinstance(found[path], RopeTable) and _is_slot(path, tensor, owner, id(owner) in filled, specs):
            held.empty.append(EmptySlot(path, layer, _describe(tensor, found[path])))
    return held


def _plausible(tensor: torch.Tensor) -> bool:
    """Values a RoPE table could hold in a layout recognition does not read (frequencies in another order
    or with zeros for unrotated pairs, a 2-D axial table): finite, not all zero, within a cos/sin
    amplitude. Garbage and unfilled memory are not."""
    if not is_plain(tensor) or not readable(tensor) or tensor.numel() < 2 or tensor.dtype.is_complex:
        return False
    values = tensor.detach()
    return bool(torch.isfinite(values).all()) and bool(values.ne(0).any()) and float(values.abs().max()) <= 2.0


def _reordered(layer: str, path: str, tensor: torch.Tensor) -> AppliedTable | None:
    """A frequency vector that recognition refuses only for its order or its zeros (Ernie 4.5 VL's
    pre-rotated ``inv_freq``, Gemma 4's proportional RoPE with zeros for unrotated pairs), measured with
    its frequencies sorted from fastest to slowest, as tables and expectations are compared; None for
    anything else."""
    values = tensor.detach().to(torch.float64)
    if values.dim() != 1 or bool((values < 0).any()) or float(values.max()) > math.pi:
        return None
    ordered = values.sort(descending=True).values
    rotated = ordered[ordered > 0]
    found = recognize_rope_table(rotated.to(tensor.dtype))
    if not isinstance(found, RopeTable):
        return None
    positions = torch.arange(_FREQUENCY_POSITIONS, device="cpu")
    key = replace(infer_key(found, rotated.to(tensor.dtype)), dim=2 * values.numel())
    zeros = values.numel() - rotated.numel()
    source = f"{path} (frequencies sorted" + (f"; {zeros} unrotated pair(s) at 0)" if zeros else ")")
    return AppliedTable(layer, source, found, key, {"angle": positions[:, None].to(torch.float64) * ordered.cpu()},
                        positions, dtype=torch.float32, angle_dtype=tensor.dtype)


def _measured(layer: str, path: str, tensor: torch.Tensor, found: RopeTable,
              specs: tuple[RopeSpec, ...]) -> AppliedTable | None:
    """The table as :class:`AppliedTable` rows by position; None for shapes the audit does not compare
    (per-sequence tables)."""
    values = tensor.detach().squeeze()
    if found.layout.arrangement is Arrangement.FREQUENCIES:
        # Model code turns frequencies into angles in float32 whatever their dtype: that is what it applies.
        length = _FREQUENCY_POSITIONS
        for spec in specs:
            scaling = spec.scaling
            if isinstance(scaling, Scaling) and scaling.type == "dynamic" \
                    and scaling.original_max_position_embeddings is not None:
                length = min(length, scaling.original_max_position_embeddings)
        positions = torch.arange(length, device="cpu")
        parts = {"angle": positions[:, None].to(torch.float64) * values.to(device="cpu", dtype=torch.float64)}
        return AppliedTable(layer, path, found, infer_key(found, tensor), parts, positions,
                            dtype=torch.float32, angle_dtype=tensor.dtype)
    stacked = found.layout.arrangement is Arrangement.STACKED
    if values.dim() != (3 if stacked else 2):
        return None
    rows = found.filled or values.shape[0]
    positions = _positions(rows)
    selected = values.index_select(0, positions.to(values.device)).cpu()
    return AppliedTable(layer, path, found, infer_key(found, tensor), table_parts(selected, found.layout), positions,
                        dtype=tensor.dtype, angle_dtype=None)


def _positions(rows: int) -> torch.Tensor:
    if rows <= _HEAD_ROWS + _SPREAD_ROWS:
        return torch.arange(rows, device="cpu")
    spread = torch.linspace(_HEAD_ROWS, rows - 1, _SPREAD_ROWS, device="cpu").round().to(torch.int64)
    return torch.cat([torch.arange(_HEAD_ROWS, device="cpu"), spread]).unique()


def _is_slot(path: str, tensor: torch.Tensor, owner: torch.nn.Module, owner_holds_a_table: bool,
             specs: tuple[RopeSpec, ...]) -> bool:
    if not is_plain(tensor) or not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return False
    if _has_rope_name(path.rpartition(".")[2]):
        return True
    rotary = _is_rotary(owner)
    if not rotary and not _ATTENTION.search(type(owner).__name__):
        return False  # a router, a norm, a cache elsewhere: never a slot
    if tensor.numel() < 2 or not _unfilled(tensor):
        return False
    if rotary:
        return not owner_holds_a_table
    return tensor.dtype.is_complex or any(_rope_shaped(tensor, spec.rotary_dim) for spec in specs
                                          if spec.rotary_dim is not None)


def _has_rope_name(name: str) -> bool:
    return name in SLOT_NAMES or name.endswith(_SLOT_SUFFIXES)


def _is_rotary(module: torch.nn.Module) -> bool:
    """A module that computes RoPE: its class says so, or it holds a tensor with a RoPE name."""
    if _ROTARY.search(type(module).__name__):
        return True
    return any(_has_rope_name(name) for name in (*module._buffers, *module._parameters)) or any(
        _has_rope_name(name) for name, value in vars(module).items() if isinstance(value, torch.Tensor))


def _unfilled(tensor: torch.Tensor) -> bool:
    """Never written: still on meta, storage freed, NaN or inf anywhere, or all zeros."""
    if tensor.is_meta or not readable(tensor):
        return True
    values = tensor.detach()
    return not bool(torch.isfinite(values).all()) or not bool(values.ne(0).any())


def _rope_shaped(tensor: torch.Tensor, rotary_dim: int) -> bool:
    shape, half = [s for s in tensor.shape if s != 1], rotary_dim // 2
    if tensor.dtype.is_complex:
        return len(shape) == 2 and shape[1] == half
    return (shape == [half] or (len(shape) == 2 and shape[0] >= 2 and shape[1] in (half, 2 * half, 4 * half))
            or (len(shape) == 3 and shape[1:] == [half, 2]))


def _describe(tensor: torch.Tensor, found: RopeTable | NotRope | None) -> str:
    """What a slot holds instead of a RoPE table, in the words a user would search for."""
    if not is_plain(tensor):
        return f"{type(tensor).__name__}, not a plain tensor"
    if tensor.is_meta:
        return "meta tensor: never initialized (to_empty and init_weights not run?)"
    if found is None:
        return "storage freed in place (resize_(0)): nothing to read"
    values = tensor.detach()
    if not bool(torch.isfinite(values).all()):
        return "NaN or inf: uninitialized memory (to_empty without re-filling the RoPE buffers?)"
    if not bool(values.ne(0).any()):
        return "all zeros: never filled (to_empty without re-filling the RoPE buffers?)"
    return f"not a RoPE table: {found.reason}"  # type: ignore[union-attr]
