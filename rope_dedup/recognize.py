"""Decide from a tensor's content whether it is a RoPE table, and measure what it encodes.

Buffer names are never consulted: a table is RoPE-like when its values are reproduced, within the
precision of its dtype, by ``A * cos(p * f_j)`` / ``A * sin(p * f_j)`` (or the complex or angle form)
for positions ``p = 0..L-1`` and some positive frequencies ``f_j``. The frequencies are measured by
unwrapping the angle column by column at positions 1, 2, 4, ... (each step refines the previous
estimate), then the whole table is rebuilt in float64 and compared. Random buffers, masks, norms and
learned embeddings fail that rebuild by orders of magnitude, so the check is both strict and cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Relative rounding a float32 angle ``p * f`` picks up when a model computes its table: a few ulps.
_ANGLE_REL_ERR = 1e-6


@dataclass(frozen=True)
class RopeTable:
    """What a recognized table encodes: layout, measured frequencies, amplitude and length."""

    layout: str
    freqs: torch.Tensor  # float64 (n,), radians per position, measured from the content
    reliable: torch.Tensor  # bool (n,): columns whose angle moved far enough to measure f well
    freq_tol: torch.Tensor  # float64 (n,): absolute bound on the error of each measured frequency
    amplitude: float  # 1.0 except for attention-scaled tables (YaRN's mscale)
    length: int | None  # positions; None for a bare inv_freq vector


@dataclass(frozen=True)
class NotRope:
    """Why a tensor is not treated as a RoPE table."""

    reason: str


def _eps(dtype: torch.dtype) -> float:
    real = torch.empty((), dtype=dtype).real.dtype if dtype.is_complex else dtype
    return torch.finfo(real).eps


def recognize_rope_table(tensor: torch.Tensor) -> RopeTable | NotRope:
    """Return the :class:`RopeTable` a tensor holds, or :class:`NotRope` with the reason it is not one."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return NotRope(f"tensor subclass {type(tensor).__name__} is not supported")
    if tensor.is_meta:
        return NotRope("meta tensor: it has no data to compare")
    if tensor.numel() == 0:
        return NotRope("empty tensor")
    if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return NotRope(f"dtype {tensor.dtype} cannot hold a rotary table")
    # Leading/middle singleton dims are a broadcasting convenience: HF's (1, 1, L, d), Megatron's (L, 1, 1, d).
    x = tensor.detach().reshape([s for s in tensor.shape if s != 1])
    if x.dim() >= 2 and not _first_row_plausible(x[0]):
        return NotRope("position 0 is not cos = const / sin = 0")
    if not bool(torch.isfinite(x).all()):
        return NotRope("contains NaN or inf")
    eps = _eps(tensor.dtype)
    if x.is_complex():
        if x.dim() != 2:
            return NotRope(f"complex tensor of shape {tuple(tensor.shape)} is not (positions, freqs)")
        x = x.to(torch.complex128)
        return _from_parts("complex", {"cos": x.real, "sin": x.imag}, eps)
    x = x.to(torch.float64)
    if x.dim() == 1:
        return _from_inv_freq(x, eps)
    if x.dim() == 3 and x.shape[-1] == 2:
        first, second = x[..., 0], x[..., 1]
        names = (_kind(first), _kind(second))
        if set(names) != {"cos", "sin"}:
            return NotRope("last dim of 2 does not stack a cos and a sin table")
        layout = f"stacked({names[0]},{names[1]})"
        return _from_parts(layout, {names[0]: first, names[1]: second}, eps)
    if x.dim() == 2:
        return _from_columns(x, eps)
    return NotRope(f"shape {tuple(tensor.shape)} is not a rotary table layout")


def _first_row_plausible(row: torch.Tensor) -> bool:
    """Cheap pre-check before any float64 work: at position 0 every entry is 0 (sin, angle) or A (cos)."""
    row = torch.view_as_real(row) if row.is_complex() else row
    row = row.flatten().to(torch.float64)
    if not bool(torch.isfinite(row).all()):
        return False
    big = row[row.abs() > 1e-2 * row.abs().max().clamp_min(1e-30)]
    return big.numel() == 0 or bool(((big - big[0]).abs() <= 1e-2 * big[0].abs()).all())


def _kind(part: torch.Tensor) -> str | None:
    """Classify a (L, n) block by its first rows: cos starts at A, sin at 0, angle at 0 and grows linearly."""
    if part.shape[0] < 2:
        return None
    row0 = part[0]
    scale = part.abs().max().item()
    if scale == 0:
        return None
    if (row0 - row0[0]).abs().max().item() <= 1e-2 * scale and row0[0].item() > 0:
        return "cos"
    if row0.abs().max().item() <= 1e-2 * scale:
        last = part.shape[0] - 1
        if last >= 2 and torch.allclose(part[last], part[1] * last, rtol=1e-3, atol=1e-6):
            return "angle"
        return "sin"
    return None


def _repeat_mode(part: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Detect HF's cat([f, f]) ("halves") and the interleaved repeat; return the mode and the unique columns."""
    width = part.shape[-1]
    if width % 2 == 0 and width >= 4:
        half = width // 2
        if torch.equal(part[:, :half], part[:, half:]):
            return "halves", part[:, :half]
        if torch.equal(part[:, 0::2], part[:, 1::2]):
            return "interleaved", part[:, 0::2]
    return "", part


def _from_columns(x: torch.Tensor, eps: float) -> RopeTable | NotRope:
    """(L, W) real tables: one cos/sin/angle block, or two side by side (torchtitan cos|sin, GPT-J sin|cos)."""
    whole = _kind(x)
    if whole is not None:
        mode, cols = _repeat_mode(x)
        layout = whole + (f"-{mode}" if mode else "")
        found = _from_parts(layout, {whole: cols}, eps)
        if isinstance(found, RopeTable) or x.shape[-1] % 2:
            return found
    if x.shape[-1] % 2 == 0:
        left, right = x.split(x.shape[-1] // 2, dim=-1)
        names = (_kind(left), _kind(right))
        if set(names) == {"cos", "sin"}:
            (mode_l, left), (mode_r, right) = _repeat_mode(left), _repeat_mode(right)
            if mode_l == mode_r:
                suffix = f"-{mode_l}" if mode_l else ""
                layout = f"{names[0]}{suffix}|{names[1]}{suffix}"
                return _from_parts(layout, {names[0]: left, names[1]: right}, eps)
    return NotRope("values do not follow cos/sin of position x frequency")


def _from_parts(layout: str, parts: dict[str, torch.Tensor], eps: float) -> RopeTable | NotRope:
    """Measure frequencies and amplitude from cos and/or sin (or angle) blocks, then rebuild and compare."""
    any_part = next(iter(parts.values()))
    length, n = any_part.shape
    if length < 2:
        return NotRope("a single position: too short to identify")
    if n < 2:
        return NotRope("fewer than 2 frequencies: too few to identify")
    cos, sin, angle = parts.get("cos"), parts.get("sin"), parts.get("angle")
    if angle is not None:
        amplitude = 1.0
        noise = 4 * eps * (angle.abs().max().item() + 1)
    elif cos is not None:
        amplitude = cos[0].mean().item()
        # acos loses precision near 0 and pi: noise grows like sqrt(eps) there.
        noise = 4 * eps if sin is not None else math.sqrt(8 * eps)
    else:
        amplitude = _sin_amplitude(sin)
        noise = math.sqrt(8 * eps)
    if not amplitude > 0:
        return NotRope("non-positive amplitude")
    freqs = _measure_freqs(cos, sin, angle, amplitude)
    # A column whose angle never moves beyond the dtype's noise measures as ~0: unmeasurable, not wrong.
    if not bool(torch.isfinite(freqs).all()) or bool((freqs < -noise).any()):
        return NotRope("no positive frequency fits the values")
    freqs = freqs.clamp_min(0)
    if sin is not None and cos is None:
        phases = torch.sin(torch.arange(length, dtype=torch.float64, device=sin.device)[:, None] * freqs)
        amplitude = float((sin * phases).sum() / (phases * phases).sum())
    if not _rebuild_matches(parts, freqs, amplitude, eps):
        return NotRope("values do not follow cos/sin of position x frequency")
    freqs = freqs.cpu()
    reliable = (length - 1) * freqs > 50 * noise
    if int(reliable.sum()) < 2:
        return NotRope("fewer than 2 frequencies move measurably: constant, or too short to identify")
    return RopeTable(
        layout=layout,
        freqs=freqs,
        reliable=reliable,
        freq_tol=noise / (length - 1) + _ANGLE_REL_ERR * freqs,
        amplitude=amplitude,
        length=length,
    )


def _sin_amplitude(sin: torch.Tensor) -> float:
    """A sin-only table hides its amplitude: s2 / (2 s1) = cos f gives f, then A = s1 / sin f (column 0)."""
    if sin.shape[0] < 3 or sin[1, 0].item() == 0:
        return 1.0
    cos_f = max(-1.0, min(1.0, (sin[2, 0] / (2 * sin[1, 0])).item()))
    sin_f = math.sin(math.acos(cos_f))
    return abs(sin[1, 0].item() / sin_f) if sin_f > 0 else 1.0


def _measure_freqs(cos, sin, angle, amplitude: float) -> torch.Tensor:
    """Unwrap angles at positions 1, 2, 4, ..., L-1, each step refining the frequency estimate."""
    any_part = next(p for p in (cos, sin, angle) if p is not None)
    length = any_part.shape[0]
    if angle is not None:
        return angle[length - 1] / (length - 1)

    def branches(p: int) -> list[torch.Tensor]:
        # Angles at row p are known modulo 2*pi, and only up to a reflection when one of cos/sin is missing.
        if cos is not None and sin is not None:
            return [torch.atan2(sin[p], cos[p])]
        if cos is not None:
            base = torch.acos((cos[p] / amplitude).clamp(-1, 1))
            return [base, -base]
        base = torch.asin((sin[p] / amplitude).clamp(-1, 1))
        return [base, math.pi - base]

    two_pi = 2 * math.pi
    freqs = branches(1)[0]
    rows = [1 << k for k in range(1, max(1, (length - 1).bit_length())) if (1 << k) < length]
    if length - 1 > 1 and (not rows or rows[-1] != length - 1):
        rows.append(length - 1)
    for p in rows:
        predicted = freqs * p
        best = None
        for base in branches(p):
            candidate = base + two_pi * torch.round((predicted - base) / two_pi)
            if best is None:
                best = candidate
            else:
                best = torch.where((candidate - predicted).abs() < (best - predicted).abs(), candidate, best)
        freqs = best / p
    return freqs


def _rebuild_matches(parts: dict[str, torch.Tensor], freqs: torch.Tensor, amplitude: float, eps: float) -> bool:
    """Rebuild every block in float64 from (freqs, amplitude) and compare within dtype + angle precision."""
    any_part = next(iter(parts.values()))
    positions = torch.arange(any_part.shape[0], dtype=torch.float64, device=any_part.device)[:, None]
    angles = positions * freqs
    value_tol = 3 * eps * max(amplitude, 1.0)
    for name, part in parts.items():
        if name == "angle":
            ok = (part - angles).abs() <= value_tol * (1 + angles.abs()) + _ANGLE_REL_ERR * angles.abs()
        else:
            rebuilt = amplitude * (torch.cos(angles) if name == "cos" else torch.sin(angles))
            ok = (part - rebuilt).abs() <= value_tol + amplitude * (2 * _ANGLE_REL_ERR * angles + 2 * eps)
        if not bool(ok.all()):
            return False
    return True


def _from_inv_freq(x: torch.Tensor, eps: float) -> RopeTable | NotRope:
    """A bare inv_freq (d/2,): positive, strictly decreasing, its leading entries a geometric progression.

    Scaled variants (llama3, YaRN) bend the low frequencies but keep the high ones, so the head must be
    geometric while the tail may deviate.
    """
    n = x.shape[0]
    if n < 2:
        return NotRope("fewer than 2 frequencies: too few to identify")
    if bool((x <= 0).any()) or x[0].item() > math.pi:
        return NotRope("1-D values are not frequencies in (0, pi]")
    if not bool((x[1:] < x[:-1]).all()):
        return NotRope("1-D values are not strictly decreasing frequencies")
    head = x[: max(3, n // 4)]
    ratios = head[1:] / head[:-1]
    if ratios.numel() > 1 and (ratios - ratios[0]).abs().max().item() > 8 * eps + 1e-6:
        return NotRope("leading frequencies are not a geometric progression")
    return RopeTable(
        layout="inv_freq",
        freqs=x.cpu(),
        reliable=torch.ones(n, dtype=torch.bool),
        freq_tol=4 * eps * x,
        amplitude=1.0,
        length=None,
    )
