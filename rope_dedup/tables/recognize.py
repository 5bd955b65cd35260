"""Decide from a tensor's content whether it is a RoPE table, and measure what it encodes.

Buffer names are never consulted: a table is RoPE-like when its values are reproduced, within the
precision of its dtype, by ``A * cos(p * f_j)`` / ``A * sin(p * f_j)`` (or the complex or angle form)
for positions ``p = 0..L-1`` and some positive frequencies ``f_j``. The frequencies are measured by
unwrapping the angle column by column at positions 1, 2, 4, ... (each step refines the previous
estimate), then the table is rebuilt in float64 and compared. Random buffers, masks, norms and
learned embeddings fail that rebuild by orders of magnitude, so the check is both strict and cheap.

Recognition never copies a whole table: it runs while every layer's copy is still alive, at the moment
memory is fullest, so a float64 copy would raise the peak by up to four tables' worth. Blocks stay views
of the tensor in its own dtype; only the rows a step reads are converted to float64, on the tensor's
device, a chunk at a time (:func:`_chunk_rows`). Whole-table scans (finite, written rows, maximum,
repeated halves) are reductions or chunked. The transient stays within a quarter of the table, or a few
hundred KiB for a small one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import EllipsisType
from typing import Iterator

import torch

from rope_dedup.tables.layout import COMPLEX, FREQUENCIES, Layout, Part, Repeat
from rope_dedup.tensors import is_plain, local

# Positions the rebuild check looks at in a long table (all of them in a short one).
_CHECKED_ROWS = 4096
# Values handled at a time: 1/256 of the table's bytes (a chunk's float64 temporaries, about six of them,
# stay within a quarter of it), but at least 4096 (32 KiB each: tiny tables need not be cut finer) and at most
# 65536 (512 KiB each, whatever the table's size).
_CHUNK_MIN, _CHUNK_MAX = 1 << 12, 1 << 16
# Relative rounding a float32 angle ``p * f`` picks up when a model computes its table: a few ulps.
_ANGLE_REL_ERR = 1e-6


@dataclass(frozen=True)
class RopeTable:
    """What a recognized table encodes: layout, measured frequencies, amplitude and length."""

    layout: Layout
    freqs: torch.Tensor  # float64 (n,), radians per position, measured from the content
    reliable: torch.Tensor  # bool (n,): columns whose angle moved far enough to measure f well
    freq_tol: torch.Tensor  # float64 (n,): absolute bound on the error of each measured frequency
    amplitude: float  # 1.0 except for attention-scaled tables (YaRN's mscale)
    length: int | None  # positions; None for a bare inv_freq vector
    rough: bool = False  # too few positions to measure theta precisely: the key says so
    filled: int | None = None  # a cache being filled: only its first ``filled`` positions are written yet


@dataclass(frozen=True)
class NotRope:
    """Why a tensor is not treated as a RoPE table."""

    reason: str


def _eps(dtype: torch.dtype) -> float:
    """Relative precision of the values: the dtype's, but never finer than float32's, since tables are
    computed in float32 by most model code and keep that rounding after ``model.double()``."""
    real = dtype.to_real()
    return max(torch.finfo(real).eps, torch.finfo(torch.float32).eps)


def _floor(dtype: torch.dtype) -> float:
    """Spacing of the dtype's subnormals: fp16 rounds the slowest frequencies (~1e-6) to a few of them."""
    real = dtype.to_real()
    return torch.finfo(real).smallest_normal * torch.finfo(real).eps


def is_rope_table(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds a RoPE table (a DTensor: its local shard): the test every pass applies."""
    return isinstance(recognize_rope_table(local(tensor)), RopeTable)


def recognize_rope_table(tensor: torch.Tensor) -> RopeTable | NotRope:
    """Return the :class:`RopeTable` a tensor holds, or :class:`NotRope` with the reason it is not one."""
    if not is_plain(tensor):
        return NotRope(f"tensor subclass {type(tensor).__name__} is not supported")
    if tensor.is_meta:
        return NotRope("meta tensor: it has no data to compare")
    if tensor.numel() == 0:
        return NotRope("empty tensor")
    if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return NotRope(f"dtype {tensor.dtype} cannot hold a rotary table")
    # Leading/middle singleton dims are a broadcasting convenience: HF's (1, 1, L, d), Megatron's (L, 1, 1, d).
    # squeeze() is always a view; reshape would copy a non-contiguous table.
    x = tensor.detach().squeeze()
    if x.dim() >= 2 and not _first_row_plausible(x[0]):
        return NotRope("position 0 is not cos = const / sin = 0")
    if not all(bool(torch.isfinite(x[rows]).all()) for rows in _row_chunks(x, x)):
        return NotRope("contains NaN or inf")
    if x.dim() < 2:
        return _recognize(x, tensor)
    # A cache filled lazily (rotary-embedding-torch: zeros at init, the first seq_len rows written by the
    # first forward): RoPE rows followed by rows never written. No RoPE row after position 0 is all zeros.
    if bool(x[-1].ne(0).any()):  # the last row is written: the whole table is
        return _recognize(x, tensor)
    written = torch.cat([x[rows].reshape(rows.stop - rows.start, -1).ne(0).any(dim=1) for rows in _row_chunks(x, x)])  # type: ignore[union-attr]
    filled = int(written.nonzero().max()) + 1 if bool(written.any()) else 0
    if filled < 2:
        return NotRope("all zeros after position 0: a cache not filled yet")
    found = _recognize(x[:filled], tensor)
    return replace(found, length=x.shape[0], filled=filled) if isinstance(found, RopeTable) else found


def _chunk_rows(part: torch.Tensor, width: int) -> int:
    """Rows of ``width`` values to handle at a time, for a block of ``part``'s size (see _CHUNK_MIN)."""
    elements = min(_CHUNK_MAX, max(_CHUNK_MIN, part.numel() * part.element_size() // 256))
    return max(1, elements // max(1, width))


def _row_chunks(x: torch.Tensor, part: torch.Tensor) -> Iterator[slice | EllipsisType]:
    """Slices of ``x``'s first dim, sized by :func:`_chunk_rows` for ``part``."""
    if x.dim() == 0:
        yield ...  # a scalar (a (1, 1) buffer squeezed): the whole of it
        return
    step = _chunk_rows(part, x[0].numel() * (2 if x.is_complex() else 1))
    for start in range(0, x.shape[0], step):
        yield slice(start, min(start + step, x.shape[0]))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` a chunk at a time: on strided views it copies both operands whole."""
    return all(torch.equal(a[rows], b[rows]) for rows in _row_chunks(a, a))


def _f64(values: torch.Tensor) -> torch.Tensor:
    """A few rows of a block, in float64 (the only copies recognition makes)."""
    return values.to(torch.float64)


def _abs_max(part: torch.Tensor) -> float:
    """``part.abs().max()`` a chunk at a time: a reduction over a strided view copies it whole first."""
    chunks = (part[rows] for rows in _row_chunks(part, part))
    return max(max(chunk.max().item(), -chunk.min().item()) for chunk in chunks)


def _carried_dtype(x: torch.Tensor) -> torch.dtype:
    """The precision ``x``'s values carry: bfloat16 or float16 when every value round-trips through it
    exactly (a half-precision table upcast by ``model.double()`` or ``.float()``), else its dtype. A chunk at
    a time, stopping at the first that does not round-trip: a table computed in float32 stops at once."""
    real = torch.view_as_real(x) if x.is_complex() else x
    if real.dtype not in (torch.float32, torch.float64) or real.dim() == 0:
        return x.dtype
    for half in (torch.bfloat16, torch.float16):
        if all(torch.equal(real[rows], real[rows].to(half).to(real.dtype)) for rows in _row_chunks(real, real)):
            return half
    return x.dtype


def _recognize(x: torch.Tensor, tensor: torch.Tensor) -> RopeTable | NotRope:
    """Recognition proper, on the squeezed values ``x`` of ``tensor`` (views, never copies)."""
    carried = _carried_dtype(x)
    eps, floor = _eps(carried), _floor(carried)
    if x.is_complex():
        if x.dim() != 2:
            return NotRope(f"complex tensor of shape {tuple(tensor.shape)} is not (positions, freqs)")
        pairs = torch.view_as_real(x)
        return _from_parts(COMPLEX, {Part.COS: pairs[..., 0], Part.SIN: pairs[..., 1]}, eps)
    if x.dim() == 1:
        return _from_inv_freq(_f64(x), eps, floor)
    if x.dim() == 3 and x.shape[-1] == 2:
        first, second = x[..., 0], x[..., 1]
        names = (_kind(first, eps, floor), _kind(second, eps, floor))
        if set(names) != {Part.COS, Part.SIN}:
            return NotRope("last dim of 2 does not stack a cos and a sin table")
        return _from_parts(Layout.stacked(*names), {names[0]: first, names[1]: second}, eps)  # type: ignore[arg-type, dict-item]
    if x.dim() == 2:
        return _from_columns(x, eps, floor)
    return NotRope(f"shape {tuple(tensor.shape)} is not a rotary table layout")


def _first_row_plausible(row: torch.Tensor) -> bool:
    """Cheap pre-check before any float64 work: at position 0 every entry is 0 (sin, angle) or A (cos)."""
    row = torch.view_as_real(row) if row.is_complex() else row
    row = _f64(row.flatten())
    if not bool(torch.isfinite(row).all()):
        return False
    big = row[row.abs() > 1e-2 * row.abs().max().clamp_min(1e-30)]
    return big.numel() == 0 or bool(((big - big[0]).abs() <= 1e-2 * big[0].abs()).all())


def _kind(part: torch.Tensor, eps: float, floor: float) -> Part | None:
    """Classify a (L, n) block by its first rows: cos starts at A, sin at 0, angle at 0 and grows linearly."""
    if part.shape[0] < 2:
        return None
    row0 = _f64(part[0])
    scale = _abs_max(part)
    if scale == 0:
        return None
    if (row0 - row0[0]).abs().max().item() <= 1e-2 * scale and row0[0].item() > 0:
        return Part.COS
    if row0.abs().max().item() <= 1e-2 * scale:
        last = part.shape[0] - 1
        # Both rows are rounded to the table's dtype (row 1 of slow columns to subnormals in fp16): fixed
        # tolerances would turn half-precision angle tables into "sin".
        rtol, atol = max(1e-3, 4 * eps), max(1e-6, last * floor)
        if last >= 2 and torch.allclose(_f64(part[last]), _f64(part[1]) * last, rtol=rtol, atol=atol):
            return Part.ANGLE
        return Part.SIN
    return None


def _repeat_mode(part: torch.Tensor) -> tuple[Repeat, torch.Tensor]:
    """Detect HF's cat([f, f]) (halves) and the interleaved repeat; return the mode and the unique columns."""
    width = part.shape[-1]
    if width % 2 == 0 and width >= 4:
        half = width // 2
        if _equal(part[:, :half], part[:, half:]):
            return Repeat.HALVES, part[:, :half]
        if _equal(part[:, 0::2], part[:, 1::2]):
            return Repeat.INTERLEAVED, part[:, 0::2]
    return Repeat.NONE, part


def _from_columns(x: torch.Tensor, eps: float, floor: float) -> RopeTable | NotRope:
    """(L, W) real tables: one cos/sin/angle block, or two side by side (torchtitan cos|sin, GPT-J sin|cos)."""
    whole = _kind(x, eps, floor)
    if whole is not None:
        mode, cols = _repeat_mode(x)
        found = _from_parts(Layout.columns(whole, repeat=mode), {whole: cols}, eps)
        if isinstance(found, RopeTable) or x.shape[-1] % 2:
            return found
    else:
        found = NotRope("values do not follow cos/sin of position x frequency")
    if x.shape[-1] % 2 == 0:
        left, right = x.split(x.shape[-1] // 2, dim=-1)
        names = (_kind(left, eps, floor), _kind(right, eps, floor))
        if set(names) == {Part.COS, Part.SIN}:
            (mode_l, left), (mode_r, right) = _repeat_mode(left), _repeat_mode(right)
            if mode_l == mode_r:
                return _from_parts(Layout.columns(*names, repeat=mode_l), {names[0]: left, names[1]: right}, eps)  # type: ignore[arg-type, dict-item]
    # Not two blocks side by side: the reason the whole table failed is the one to report.
    return found


def _from_parts(layout: Layout, parts: dict[Part, torch.Tensor], eps: float) -> RopeTable | NotRope:
    """Measure frequencies and amplitude from cos and/or sin (or angle) blocks, then rebuild and compare."""
    any_part = next(iter(parts.values()))
    length, n = any_part.shape
    if length < 2:
        return NotRope("a single position: too short to identify")
    if n < 2:
        return NotRope("fewer than 2 frequencies: too few to identify")
    cos, sin, angle = parts.get(Part.COS), parts.get(Part.SIN), parts.get(Part.ANGLE)
    if angle is not None:
        amplitude = 1.0
        # Per column: an angle table rounds each value relatively, so a slow column is as exact as a fast one.
        noise = 4 * eps * (_f64(angle[-1]).abs() + 1)
    elif cos is not None:
        amplitude = _f64(cos[0]).mean().item()
        # acos loses precision near 0 and pi: noise grows like sqrt(eps) there.
        noise = 4 * eps if sin is not None else math.sqrt(8 * eps)  # type: ignore[assignment]
    else:
        amplitude = _sin_amplitude(sin)  # type: ignore[arg-type]
        noise = math.sqrt(8 * eps)  # type: ignore[assignment]
    if not amplitude > 0:
        return NotRope("non-positive amplitude")
    freqs = _measure_freqs(cos, sin, angle, amplitude, eps)
    # A column whose angle never moves beyond the dtype's noise measures as ~0: unmeasurable, not wrong.
    if not bool(torch.isfinite(freqs).all()) or bool((freqs < -noise).any()):
        return NotRope("no positive frequency fits the values")
    freqs = freqs.clamp_min(0)
    if sin is not None and cos is None:
        # The first guess (two entries of a half-precision column) can be ~1% off, and asin bends the slow
        # columns' frequencies by as much: refit the amplitude on the checked rows and measure once more.
        # Each value weighs by how well it is known: a large angle carries its float32 rounding (and a coarse
        # kernel's range reduction) into the value, and unweighted, those rows bias the fit.
        for again in (True, False):
            fitted = projected = 0.0
            for rows in _checked_rows(sin, freqs.numel()):
                angles = rows.to(torch.float64)[:, None] * freqs
                phases, weights = torch.sin(angles), _value_tolerance(eps, 1.0, angles) ** -2
                fitted += float((weights * _f64(sin[rows]) * phases).sum())
                projected += float((weights * phases * phases).sum())
            if not projected > 0:  # every measured frequency is 0: the values never move
                return NotRope("fewer than 2 frequencies move measurably: constant, or too short to identify")
            amplitude = fitted / projected
            if again:
                freqs = _measure_freqs(cos, sin, angle, amplitude, eps).clamp_min(0)
    if not _rebuild_matches(parts, freqs, amplitude, eps):
        return NotRope("values do not follow cos/sin of position x frequency")
    if (cos is None) != (sin is None) and angle is None:
        # The sqrt(eps) bound holds only at an extremum of cos/sin; elsewhere a value pins its angle to
        # eps / |slope|. Judge each column at its last position, capped by the extremum bound.
        last = (length - 1) * freqs
        slope = (torch.sin(last) if cos is not None else torch.cos(last)).abs()
        noise = (2 * eps / slope.clamp_min(1e-30)).clamp(max=noise)
    freqs = freqs.cpu()
    noise = noise.cpu() if isinstance(noise, torch.Tensor) else noise
    # A column is usable for the key once its angle has swept well past the measurement noise; short
    # half-precision tables have few such columns, and their key's theta is correspondingly rough.
    span = (length - 1) * freqs
    reliable, rough = span > 8 * noise, False
    if int(reliable.sum()) < 2:
        # A few positions of a half-precision table: the values are RoPE (the rebuild matched) but pin theta
        # only roughly. Every column whose values moved at all then counts, weighted by how well it is known.
        reliable, rough = freqs > 0, True
    if int(reliable.sum()) < 2:
        return NotRope("fewer than 2 frequencies move measurably: constant, or too short to identify")
    freq_tol = noise / (length - 1) + _ANGLE_REL_ERR * freqs
    # RoPE's frequencies fall geometrically (theta ** (-2i / d)); columns that all turn at one rate are
    # positions broadcast over a row (an expanded position_ids, a ramp), whatever their layout fits.
    moving = freqs[reliable]
    if bool(((moving - moving[0]).abs() <= freq_tol[reliable]).all()):
        return NotRope("every column turns at the same rate: positions, not RoPE frequencies")
    return RopeTable(
        layout=layout,
        freqs=freqs,
        reliable=reliable,
        freq_tol=freq_tol,
        amplitude=amplitude,
        length=length,
        rough=rough,
    )


def _sin_amplitude(sin: torch.Tensor) -> float:
    """A sin-only table hides its amplitude: s2 / (2 s1) = cos f gives f, then A = s1 / sin f (column 0)."""
    if sin.shape[0] < 3 or sin[1, 0].item() == 0:
        return 1.0
    s1, s2 = float(sin[1, 0].item()), float(sin[2, 0].item())
    cos_f = max(-1.0, min(1.0, s2 / (2 * s1)))
    sin_f = math.sin(math.acos(cos_f))
    return abs(s1 / sin_f) if sin_f > 0 else 1.0


def _measure_freqs(cos, sin, angle, amplitude: float, eps: float) -> torch.Tensor:
    """Unwrap angles at positions 1, 2, 4, ..., L-1, each step refining the frequency estimate."""
    any_part = next(p for p in (cos, sin, angle) if p is not None)
    length = any_part.shape[0]
    if angle is not None:
        return _f64(angle[length - 1]) / (length - 1)
    # Per value, relative to the amplitude: cos/sin computed in float32 (~1 ulp) and rounded to the dtype
    # (eps / 2). Realistic, not padded: rows are ranked by it, and padding favours the sqrt regime below.
    value_err = eps

    def measure(p: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        # Angles at row p are known modulo 2*pi, and only up to a reflection when one of cos/sin is missing.
        if cos is not None and sin is not None:
            base = torch.atan2(_f64(sin[p]), _f64(cos[p]))
            return [base], torch.full_like(base, value_err)
        if cos is not None:
            value = (_f64(cos[p]) / amplitude).clamp(-1, 1)
            base = torch.acos(value)
            branches = [base, -base]
        else:
            value = (_f64(sin[p]) / amplitude).clamp(-1, 1)
            base = torch.asin(value)
            branches = [base, math.pi - base]
        # A lone cos (sin) pins the angle poorly near its reflection points 0, pi (+-pi/2): the error is
        # value_err / |slope|, at most sqrt(2 * value_err) there.
        slope = (1 - value * value).sqrt()
        return branches, (value_err / slope).clamp_max(math.sqrt(2 * value_err))

    two_pi = 2 * math.pi
    branches, err = measure(1)
    freqs = branches[0]
    rows = [1 << k for k in range(1, max(1, (length - 1).bit_length())) if (1 << k) < length]
    if length - 1 > 1 and (not rows or rows[-1] != length - 1):
        rows.append(length - 1)
    # With one of cos/sin, also each row's predecessor: p - 1 and p are coprime, so a frequency near a rational
    # multiple of pi (say pi/8), whose angles at every power of two sit on a reflection point, is still pinned.
    if cos is None or sin is None:
        rows = sorted({q for p in rows for q in (p - 1, p) if q >= 2})
    for p in rows:
        predicted = freqs * p
        branches, row_err = measure(p)
        best = None
        for base in branches:
            candidate = base + two_pi * torch.round((predicted - base) / two_pi)
            if best is None:
                best = candidate
            else:
                best = torch.where((candidate - predicted).abs() < (best - predicted).abs(), candidate, best)
        # Keep the earlier estimate where this row knows the frequency worse (a lone cos near 0 or pi): taking
        # it anyway can throw away a good estimate just before the last row.
        better = row_err / p < err
        freqs = torch.where(better, best / p, freqs)  # type: ignore[operator]
        err = torch.where(better, row_err / p, err)
    return freqs


def _checked_rows(part: torch.Tensor, width: int) -> list[torch.Tensor]:
    """The positions of ``part`` the rebuild check reads, as index chunks of :func:`_chunk_rows` rows.

    Long tables are checked at _CHECKED_ROWS evenly spaced positions plus the last ones: enough to tell
    a RoPE table from anything else, at a fraction of the cost (the pass's time is dominated by this
    check at 128K positions). Sharing never rests on it: equal content is verified element by element.
    """
    length, device = part.shape[0], part.device
    rows = torch.arange(length, device=device)
    if length > 2 * _CHECKED_ROWS:
        spaced = torch.linspace(0, length - 1, _CHECKED_ROWS, device=device).long()
        rows = torch.unique(torch.cat([spaced, rows[-16:]]))
    return list(rows.split(_chunk_rows(part, width)))


def _rebuild_matches(parts: dict[Part, torch.Tensor], freqs: torch.Tensor, amplitude: float, eps: float) -> bool:
    """Rebuild every block in float64 from (freqs, amplitude) and compare within dtype + angle precision,
    a chunk of the checked rows at a time."""
    any_part = next(iter(parts.values()))
    for rows in _checked_rows(any_part, freqs.numel()):
        angles = rows.to(torch.float64)[:, None] * freqs
        for name, part in parts.items():
            part = _f64(part[rows])
            if name is Part.ANGLE:
                rounding = 3 * eps * max(amplitude, 1.0) * (1 + angles.abs())
                ok = (part - angles).abs() <= rounding + _ANGLE_REL_ERR * angles.abs()
            else:
                rebuilt = amplitude * (torch.cos(angles) if name is Part.COS else torch.sin(angles))
                ok = (part - rebuilt).abs() <= _value_tolerance(eps, amplitude, angles)
            if not bool(ok.all()):
                return False
    return True


def value_tolerance(dtype: torch.dtype, amplitude: float, angles: torch.Tensor) -> torch.Tensor:
    """How far a cos/sin value of ``angles`` (float32 math, stored in ``dtype``) may sit from the exact one."""
    return _value_tolerance(_eps(dtype), amplitude, angles)


def _value_tolerance(eps: float, amplitude: float, angles: torch.Tensor) -> torch.Tensor:
    # Rounding of the value to the dtype, plus a few float32 ulps of the angle p * f it was computed from.
    return 3 * eps * max(amplitude, 1.0) + amplitude * (2 * _ANGLE_REL_ERR * angles.abs() + 2 * eps)


def _from_inv_freq(x: torch.Tensor, eps: float, floor: float) -> RopeTable | NotRope:
    """A bare inv_freq (d/2,): positive, strictly decreasing, its leading entries a geometric progression.

    Scaled variants (llama3, YaRN) bend the low frequencies but keep the high ones, so only the head must be
    geometric while the tail may deviate.
    """
    n = x.shape[0]
    if n < 2:
        return NotRope("fewer than 2 frequencies: too few to identify")
    if bool((x <= 0).any()) or x[0].item() > math.pi:
        return NotRope("1-D values are not frequencies in (0, pi]")
    if not bool((x[1:] < x[:-1]).all()):
        return NotRope("1-D values are not strictly decreasing frequencies")
    # YaRN at small rotary dims bends all but the first two or three frequencies: only the first
    # eighth must be geometric (at least two entries, so short vectors need only be decreasing).
    head = x[: max(2, n // 8)]
    ratios = head[1:] / head[:-1]
    if ratios.numel() > 1 and (ratios - ratios[0]).abs().max().item() > 8 * eps + 1e-6:
        return NotRope("leading frequencies are not a geometric progression")
    freqs = x.cpu()  # a RopeTable's measurements live on CPU, whatever the table's device
    return RopeTable(
        layout=FREQUENCIES,
        freqs=freqs,
        reliable=torch.ones(n, dtype=torch.bool, device="cpu"),
        freq_tol=4 * eps * freqs + floor,  # fp16 keeps the slowest frequencies of a large theta as subnormals
        amplitude=1.0,
        length=None,
    )
