"""Find how a recognized table was computed, exactly: the float32 frequencies and steps that give its bits.

Recognition measures frequencies in float64 to within a tolerance; recomputing needs the very float32
vector the model used, since one ulp of a frequency moves the angle at a far position by more than one ulp
of the angle. The search tries the textbook ``1 / theta ** (arange(0, dim, 2) / dim)`` first (most tables),
then solves each column on its own among the float32 values within the measured tolerance (scaled tables:
linear, llama3, YaRN). A recipe is accepted only when it reproduces every value of the table bit for bit on
the table's own device, checked a chunk of rows at a time so that the peak grows by one chunk at most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from rope_dedup.tables.layout import Arrangement, Part, Repeat
from rope_dedup.tables.recognize import RopeTable
from rope_dedup.tensors import bits, is_plain, same_values

# Rows computed and compared at a time while verifying, and by a read of many rows (a few MiB of float32).
CHUNK_ROWS = 4096
# Float32 neighbours tried per column on each side of the measured frequency (wider for the columns the
# narrower window did not solve), and the rows they are tried on.
_WINDOWS = (64, 1024, 16384)
_ROUNDS = 4
_PROBE_ROWS = 48
_COMPLEX_STEPS = ("polar", "complex")  # torch.polar(ones, angle) (torchtitan) or torch.complex(cos, sin)


@dataclass(frozen=True, eq=False)
class Recipe:
    """How to compute any rows of one table: ``part(fl32(p) * inv_freq) * amplitude`` laid out as the table.

    ``shape`` is the table's own (unit dims included), ``pos_dim`` the dim that counts positions.
    """

    layout_parts: tuple[Part, ...]
    arrangement: Arrangement
    repeat: Repeat
    complex_step: str  # "polar" or "complex"; unused for real tables
    inv_freq: torch.Tensor  # float32 (n,), on the table's device
    amplitude: float | None  # a float32 value multiplied into cos/sin, None when the table has none
    precision: torch.dtype  # what the angles and their cos/sin are computed in: float32, or float64 then cast
    via: torch.dtype  # the dtype the table was verified in: rows are rounded to it first
    shape: tuple[int, ...]
    pos_dim: int
    casts: tuple[torch.dtype, ...] = ()  # ``table.to(dtype)`` since, in order: each rounds the rows again
    strides: tuple[int, ...] | None = None  # the table's strides where it is not contiguous (HF's matmul route)

    @property
    def dtype(self) -> torch.dtype:
        return self.casts[-1] if self.casts else self.via

    @cached_property
    def fields(self) -> tuple[tuple[str, object], ...]:
        """Every field but the vector, as (name, value) pairs: what a traced graph depends on. Kept, since
        ``__tensor_flatten__`` asks for it on every call of a compiled graph."""
        return tuple((name, getattr(self, name)) for name in Recipe.__dataclass_fields__ if name != "inv_freq")

    @property
    def length(self) -> int:
        return self.shape[self.pos_dim]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[:self.pos_dim] + self.shape[self.pos_dim + 1:]

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The table's rows at ``positions`` (int64, any shape), stacked on a first dim in the table's dtype,
        each row in the table's row shape: ``table.movedim(pos_dim, 0)[positions]``."""
        flat = positions.reshape(-1)
        t = flat.to(device=self.inv_freq.device, dtype=self.precision)
        values = self._layout(torch.outer(t, self.inv_freq.to(self.precision)))
        values = values.to(self.via)
        for dtype in self.casts:
            values = values.to(dtype)
        return values.reshape(tuple(positions.shape) + self.row_shape)

    def rows_in_place(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows at ``positions`` where the table holds them: ``positions``' dims take the position dim's
        place (every dim before it has size 1), as a slice or an index of the table along it gives them."""
        d = self.pos_dim
        return self.rows(positions).reshape(self.shape[:d] + tuple(positions.shape) + self.shape[d + 1:])

    def _part(self, part: Part, angle: torch.Tensor) -> torch.Tensor:
        if part is Part.ANGLE:
            return angle
        values = angle.cos() if part is Part.COS else angle.sin()
        return values if self.amplitude is None else values * self.amplitude

    def _layout(self, angle: torch.Tensor) -> torch.Tensor:
        if self.arrangement is Arrangement.COMPLEX:
            if self.complex_step == "polar":
                size = torch.full((), 1.0 if self.amplitude is None else self.amplitude, device=angle.device,
                                  dtype=angle.dtype)
                return torch.polar(size.expand_as(angle), angle)
            return torch.complex(self._part(Part.COS, angle), self._part(Part.SIN, angle))
        blocks = [self._part(p, angle) for p in self.layout_parts]
        if self.repeat is Repeat.HALVES:
            blocks = [torch.cat([b, b], dim=-1) for b in blocks]
        elif self.repeat is Repeat.INTERLEAVED:
            blocks = [b.repeat_interleave(2, dim=-1) for b in blocks]
        if self.arrangement is Arrangement.STACKED:
            return torch.stack(blocks, dim=-1)
        return torch.cat(blocks, dim=-1) if len(blocks) > 1 else blocks[0]

    def with_inv_freq(self, inv_freq: torch.Tensor) -> Recipe:
        return replace(self, inv_freq=inv_freq)

    def cast(self, dtype: torch.dtype) -> Recipe:
        """The rows of this table cast to ``dtype``: as ``table.to(dtype)`` would hold them."""
        return self if dtype == self.dtype else replace(self, casts=self.casts + (dtype,))


def position_dim(shape: Sequence[int]) -> int | None:
    """The dim that counts positions: the first one longer than 1 (recognition squeezes the others away)."""
    return next((d for d, size in enumerate(shape) if size > 1), None)


# How each read checks its positions, as torch checks them: (lowest position allowed, IndexError message).
_BOUNDS = {
    "index": (True, "index {p} is out of bounds for dimension {dim} with size {length}"),
    "index_select": (False, "index out of range in self"),
    "embedding": (False, "index out of range in self"),
}


def check_positions(positions: torch.Tensor, length: int, dim: int, op: str, table: str) -> torch.Tensor:
    """``positions`` (int64), once checked against a table of ``length`` positions as torch checks ``op``'s
    indices: ``IndexError`` in eager on the CPU; elsewhere, and in a graph being traced (compiled or exported), an
    assert in the graph (``_assert_async``, which inductor keeps), as torch's own kernels assert on a device."""
    negative, message = _BOUNDS[op]
    low = -length if negative else 0
    where = f" (rope_dedup: recomputed table {table}, {length} positions)"
    tracing = is_fake(positions) or get_proxy_mode() is not None
    if not tracing and positions.device.type == "cpu":
        if positions.numel():
            least, most = torch.aminmax(positions)  # one pass; the mask only to name the first bad one
            if int(least) < low or int(most) >= length:
                bad = positions[(positions < low) | (positions >= length)]
                raise IndexError(message.format(p=int(bad[0]), dim=dim, length=length) + where)
        return positions
    inside = ((positions >= low) & (positions < length)).all()
    torch._assert_async(inside, f"a position is outside [{low}, {length}) of a RoPE table read by {op}" + where)
    return positions


def row_chunks(recipe: Recipe, device: torch.device) -> Iterator[tuple[slice, torch.Tensor]]:
    """The table's rows :data:`CHUNK_ROWS` at a time: (the slice, its positions as int64 on ``device``)."""
    for start in range(0, recipe.length, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, recipe.length)
        yield slice(start, stop), torch.arange(start, stop, device=device, dtype=torch.int64)


def reproduces(recipe: Recipe, tensor: torch.Tensor) -> bool:
    """Whether ``recipe`` gives every value of ``tensor`` bit for bit, a chunk of rows at a time."""
    table = tensor.detach().movedim(recipe.pos_dim, 0)
    return all(same_values(recipe.rows(positions), table[rows]) for rows, positions in row_chunks(recipe, tensor.device))


def find_recipe(tensor: torch.Tensor, table: RopeTable, theta: float | None, dim: int | None,
                vectors: Sequence[torch.Tensor] = ()) -> Recipe | str:
    """The recipe that reproduces ``tensor`` bit for bit, or why there is none.

    ``theta`` and ``dim`` are the key's (None when the key has none): the textbook frequencies are tried first.
    ``vectors`` (float32, on the table's device) are tried before them: the frequencies of a sibling table
    converted already (the cos of the same module, whose sin a bf16 table measures less well).
    """
    if not is_plain(tensor) or tensor.is_meta:
        return "no values to reproduce"
    if table.filled is not None:
        return f"a cache being filled ({table.filled} of {table.length} positions written)"
    if table.layout.arrangement is Arrangement.FREQUENCIES:
        return "a bare inv_freq vector, not a table of positions"
    pos_dim = position_dim(tensor.shape)
    if pos_dim is None or tensor.shape[pos_dim] != table.length:
        return f"shape {tuple(tensor.shape)}: no dim of {table.length} positions"
    if table.length > 1 << 24:
        return f"{table.length} positions: float32 counts positions exactly only up to 2**24"
    base = Recipe(
        layout_parts=table.layout.parts, arrangement=table.layout.arrangement, repeat=table.layout.repeat,
        complex_step="polar", inv_freq=torch.empty(0, device=tensor.device, dtype=torch.float32),
        amplitude=None, precision=torch.float32, via=tensor.dtype, shape=tuple(tensor.shape), pos_dim=pos_dim,
        strides=None if tensor.is_contiguous() else tuple(tensor.stride()),
    )
    steps = _COMPLEX_STEPS if base.arrangement is Arrangement.COMPLEX else ("polar",)
    given = [v for v in vectors if v.numel() == table.freqs.numel() and v.device == tensor.device]
    for precision, step in ((p, s) for p in (torch.float32, torch.float64) for s in steps):
        for amplitude in _amplitudes(tensor, table, base):
            recipe = replace(base, complex_step=step, amplitude=amplitude, precision=precision)
            for inv_freq in (*given, *_frequency_candidates(recipe, tensor, table, theta, dim)):
                candidate = recipe.with_inv_freq(inv_freq)
                if reproduces(candidate, tensor):
                    return candidate
    return ("no float32 frequencies reproduce it bit for bit, with angles in float32 or float64 (computed "
            "another way, or from positions that are not whole numbers)")


def _amplitudes(tensor: torch.Tensor, table: RopeTable, base: Recipe) -> list[float | None]:
    """The amplitude candidates: none, or float32 values next to the measured one (YaRN's mscale). A bf16 or
    fp16 table measures an amplitude of 1 only to its own precision (1.0003 from bf16 sines): none comes first
    there."""
    if base.layout_parts == (Part.ANGLE,) or abs(table.amplitude - 1.0) <= 1e-6:
        return [None]
    real = torch.float16 if tensor.dtype == torch.complex32 else tensor.dtype
    near_one = 2 * torch.finfo(real).eps if real in (torch.float16, torch.bfloat16) else 1e-6
    measured = torch.tensor(table.amplitude, dtype=torch.float32, device="cpu")
    near = _float32_neighbours(measured.reshape(1), 4).reshape(-1)
    found: list[float | None] = [float(a) for a in sorted(near.tolist(), key=lambda a: abs(a - table.amplitude))]
    return [None, *found] if abs(table.amplitude - 1.0) <= near_one else found


def _float32_neighbours(values: torch.Tensor, k: int) -> torch.Tensor:
    """(n, 2k+1): each float32 value and the k float32 values on either side (positive values only)."""
    bits = values.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    steps = torch.arange(-k, k + 1, device=values.device, dtype=torch.int64)
    return (bits[:, None] + steps).clamp(1, 0x7F7FFFFF).to(torch.int32).view(torch.float32)


def _frequency_candidates(recipe: Recipe, tensor: torch.Tensor, table: RopeTable, theta: float | None,
                          dim: int | None):
    """Float32 frequency vectors to verify, most likely first: the textbook formula (for the key's theta, and for
    the same theta to fewer digits: a bf16 table measures 1e4 as 9999), then a column-wise solve."""
    n = table.freqs.numel()
    device = tensor.device
    if theta is not None and dim is not None and dim == 2 * n:
        for rounded in dict.fromkeys([theta, *(float(f"{theta:.{d}g}") for d in (3, 2, 1))]):
            exponents = torch.arange(0, dim, 2, device=device, dtype=torch.int64).to(torch.float32) / dim
            yield 1.0 / (rounded ** exponents)
            yield (1.0 / (rounded ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))).to(
                torch.float32)
    solved = _solve_columns(recipe, tensor, table)
    if solved is not None:
        yield solved


def _solve_columns(recipe: Recipe, tensor: torch.Tensor, table: RopeTable) -> torch.Tensor | None:
    """Per column, the float32 frequency nearest the measured one whose values match the table at probe rows
    (the last rows, where an ulp of frequency shows most, and a spread of others); None if a column has none.
    A column that then differs at some other row is solved again with those rows among the probes.

    A slow column measured from cos alone can be a few hundred ulps off: columns with no match are searched
    again in wider windows, alone, so the candidates stay a few million values at most."""
    length, device = recipe.length, tensor.device
    probes = torch.unique(torch.cat([
        torch.linspace(0, length - 1, _PROBE_ROWS // 2, device=device, dtype=torch.float64).round().to(torch.int64),
        torch.arange(max(0, length - _PROBE_ROWS // 2), length, device=device, dtype=torch.int64),
    ]))
    measured = table.freqs.to(device=device, dtype=torch.float64)
    solved = torch.zeros(measured.numel(), device=device, dtype=torch.float32)
    todo = torch.arange(measured.numel(), device=device)
    for _ in range(_ROUNDS):
        if not _solve_at(recipe, tensor, measured, probes, todo, solved):
            return None
        rows, todo = _differing(recipe.with_inv_freq(solved), tensor)
        if todo.numel() == 0:
            return solved
        probes = torch.unique(torch.cat([probes, rows]))
    return None


def _solve_at(recipe: Recipe, tensor: torch.Tensor, measured: torch.Tensor, probes: torch.Tensor,
              todo: torch.Tensor, solved: torch.Tensor) -> bool:
    """Solve columns ``todo`` into ``solved`` on rows ``probes``; False if one has no match in any window."""
    want = _blocks(recipe, tensor.detach().movedim(recipe.pos_dim, 0)[probes])  # (probes, blocks, n)
    for window in _WINDOWS:
        candidates = _float32_neighbours(measured[todo], window)  # (m, C)
        wide = recipe.with_inv_freq(candidates.reshape(-1))
        computed = wide._layout(torch.outer(probes.to(recipe.precision), wide.inv_freq.to(recipe.precision)))
        got = _blocks(recipe, computed.to(recipe.dtype)).reshape(len(probes), -1, len(todo), candidates.shape[1])
        same = bits(got).eq(bits(want[..., todo])[..., None]).all(dim=1).all(dim=0)  # (m, C)
        distance = (candidates.to(torch.float64) - measured[todo, None]).abs()
        distance = torch.where(same, distance, torch.full_like(distance, math.inf))
        found = same.any(dim=1)
        solved[todo[found]] = candidates.gather(1, distance.argmin(dim=1, keepdim=True)).reshape(-1)[found]
        todo = todo[~found]
        if todo.numel() == 0:
            return True
    return False


def _differing(recipe: Recipe, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(some rows where ``recipe`` differs from ``tensor``, the columns that differ anywhere), a chunk at a time."""
    table = tensor.detach().movedim(recipe.pos_dim, 0)
    rows, columns = [], torch.zeros(recipe.inv_freq.numel(), device=tensor.device, dtype=torch.bool)
    for chunk, positions in row_chunks(recipe, tensor.device):
        differ = bits(_blocks(recipe, recipe.rows(positions))).ne(bits(_blocks(recipe, table[chunk])))
        differ = differ.any(dim=1)  # (rows, n)
        columns |= differ.any(dim=0)
        rows.append(positions[differ.any(dim=1)][:_PROBE_ROWS])
    return torch.cat(rows)[:_PROBE_ROWS], columns.nonzero().reshape(-1)


def _blocks(recipe: Recipe, values: torch.Tensor) -> torch.Tensor:
    """Rows ``values`` (probes, *row) as (probes, blocks, columns): cos and sin (or real and imaginary) apart,
    each frequency's column once, whatever the layout repeats."""
    probes = values.shape[0]
    if values.is_complex():
        return torch.view_as_real(values).reshape(probes, -1, 2).permute(0, 2, 1)
    if recipe.arrangement is Arrangement.STACKED:
        return values.reshape(probes, -1, 2).permute(0, 2, 1)
    blocks = values.reshape(probes, len(recipe.layout_parts), -1)
    if recipe.repeat is Repeat.HALVES:
        return blocks[..., :blocks.shape[-1] // 2]
    if recipe.repeat is Repeat.INTERLEAVED:
        return blocks[..., 0::2]
    return blocks
