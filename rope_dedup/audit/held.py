"""The static audit's view: what each RoPE table the model holds encodes, read from the tables alone.

:mod:`rope_dedup.audit.applied` measures the tables a forward applies; this module measures the buffers and
plain tensor attributes the model holds, so the audit can run the moment a model is built, before any
forward. It also names the slots that should hold RoPE but do not (never filled after ``to_empty``, NaN,
garbage). The rule for such a slot, stated once here and in the README: a buffer or tensor attribute that
is not a RoPE table is a slot when

- its name is a RoPE name models use (:data:`SLOT_NAMES`, or a name ending in ``inv_freq``, ``freqs_cis``,
  ``cos_cached`` or ``sin_cached``) and it is floating point or complex, or
- the expectation judges its layer with a known rotary dim, and it has a RoPE table's shape for that dim:
  ``(dim/2,)`` frequencies, ``(L, dim/2 | dim | 2*dim)`` cos/sin, complex ``(L, dim/2)``, or
  ``(L, dim/2, 2)`` stacked, singleton dims aside.

Tensors held in any other slot (masks, KV caches, counters) are never flagged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rope_dedup.audit.applied import AppliedTable, table_parts
from rope_dedup.audit.layers import layer_of
from rope_dedup.tables.keys import infer_key
from rope_dedup.tables.layout import Arrangement
from rope_dedup.tables.recognize import NotRope, RopeTable, recognize_rope_table
from rope_dedup.audit.spec import RopeSpec
from rope_dedup.tensors import Origin, is_plain, local, module_state, readable

SLOT_NAMES = frozenset({"inv_freq", "cos", "sin", "cos_cached", "sin_cached", "freqs_cis", "rope_cache",
                        "cos_sin_cache", "embed_positions"})
_SLOT_SUFFIXES = ("inv_freq", "freqs_cis", "cos_cached", "sin_cached")
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


def held_tables(model: torch.nn.Module, judge: Callable[[str, str], RopeSpec | None] | None = None
                ) -> tuple[list[AppliedTable], list[EmptySlot]]:
    """Every RoPE table ``model`` holds (buffers and plain tensor attributes, not parameters), measured as
    the audit measures applied ones, and every slot (see the module doc) that holds none.

    ``judge(layer, path)`` is the expectation for a tensor (None: not judged); it decides the positions a
    frequency vector is compared at and which unnamed slots count."""
    tables, empty = [], []
    for path, tensor, origin, _, _ in module_state(model):
        if origin is Origin.PARAMETER:
            continue
        layer = layer_of(path.rpartition(".")[0])
        spec = judge(layer, path) if judge is not None else None
        inner = local(tensor)
        found = recognize_rope_table(inner) if readable(inner) else None
        if isinstance(found, RopeTable):
            table = _measured(layer, path, inner, found, spec)
            if table is not None:
                tables.append(table)
        elif _is_slot(path, inner, spec):
            empty.append(EmptySlot(path, layer, _describe(inner, found)))
    return tables, empty


def _measured(layer: str, path: str, tensor: torch.Tensor, found: RopeTable,
              spec: RopeSpec | None) -> AppliedTable | None:
    """The table as :class:`AppliedTable` rows by position; None for shapes the audit does not compare
    (per-sequence tables)."""
    values = tensor.detach().squeeze()
    if found.layout.arrangement is Arrangement.FREQUENCIES:
        # Model code turns frequencies into angles in float32 whatever their dtype: that is what it applies.
        length = _FREQUENCY_POSITIONS
        if spec is not None and spec.scaling is not None and spec.scaling.type == "dynamic":  # type: ignore[union-attr]
            length = min(length, spec.scaling.original_max_position_embeddings)  # type: ignore[assignment, type-var, union-attr]
        positions = torch.arange(length)
        parts = {"angle": positions[:, None].to(torch.float64) * values.to(torch.float64)}
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
        return torch.arange(rows)
    spread = torch.linspace(_HEAD_ROWS, rows - 1, _SPREAD_ROWS).round().to(torch.int64)
    return torch.cat([torch.arange(_HEAD_ROWS), spread]).unique()


def _is_slot(path: str, tensor: torch.Tensor, spec: RopeSpec | None) -> bool:
    if not is_plain(tensor) or not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return False
    name = path.rpartition(".")[2]
    if name in SLOT_NAMES or name.endswith(_SLOT_SUFFIXES):
        return True
    if spec is None or spec.rotary_dim is None:
        return False
    shape, half = [s for s in tensor.shape if s != 1], spec.rotary_dim // 2
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
