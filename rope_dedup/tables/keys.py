"""Name a recognized RoPE table: theta, rotary dim, length, dtype, device, layout and scaling.

A key is for bucketing and for humans; content equality (``torch.equal``) decides sharing. Numbers in
a key are rounded to 4 significant digits so that tables built the same way by different code paths
land in one bucket, where a content mismatch is then reported instead of silently kept apart.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from rope_dedup.tables.layout import Layout, MeasuredScaling
from rope_dedup.tables.recognize import RopeTable


@dataclass(frozen=True)
class RopeKey:
    """Identity of a RoPE table as a human would state it.

    ``dim`` is the rotary dimension (2 x the number of frequencies); ``length`` the number of
    positions (None for a bare ``inv_freq``), of which a cache being filled has written only ``filled``
    so far; ``scaling`` is None for a plain geometric progression
    ``f_j = theta ** (-2j / dim)``, else a signature such as ``linear x4``, ``mscale 1.2`` or
    ``nonuniform low/8 #a1b2c3`` (llama3, YaRN: high frequencies kept, low ones bent). A table over
    several position axes (2-D axial, M-RoPE) names its columns' ``axes``; its theta is one axis's where
    every axis rotates by the same frequencies.
    """

    theta: float
    dim: int
    length: int | None
    dtype: torch.dtype
    device: torch.device
    layout: Layout
    scaling: MeasuredScaling | None = None
    filled: int | None = None  # a cache being filled: positions written so far, of ``length``
    axes: str | None = None  # a table over several position axes: its columns' axes (``h8,w8``, ``t16,h24,w24``)

    def __str__(self) -> str:
        length = f"filled={self.filled}/{self.length}" if self.filled else f"len={self.length}"
        parts = [f"theta={self.theta:g}", f"dim={self.dim}", length, _dtype_name(self.dtype),
                 str(self.device), self.layout]
        if self.scaling:
            parts.append(self.scaling)
        if self.axes:
            parts.append(f"axes={self.axes}")
        return " ".join(parts)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _round_sig(value: float, digits: int = 4) -> float:
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


def _weighted_line(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """Weighted least-squares fit y = a + b x; returns (a, b)."""
    sw = w.sum()
    mx, my = (w * x).sum() / sw, (w * y).sum() / sw
    b = (w * (x - mx) * (y - my)).sum() / (w * (x - mx) ** 2).sum()
    return float(my - b * mx), float(b)


def _intercept_error(x: torch.Tensor, w: torch.Tensor) -> float:
    """Error of the fitted intercept when each y is known to 1 / sqrt(w)."""
    sw = w.sum()
    mx = (w * x).sum() / sw
    return math.sqrt(float(1 / sw + mx**2 / (w * (x - mx) ** 2).sum()))


def infer_key(table: RopeTable, tensor: torch.Tensor) -> RopeKey:
    """Infer the :class:`RopeKey` of a recognized table (recognition guarantees >= 2 measurable columns)."""
    freqs, reliable, tol = table.freqs, table.reliable, table.freq_tol
    n = freqs.numel()
    index = torch.arange(n, dtype=torch.float64, device=freqs.device)
    safe = torch.where(reliable, freqs, torch.ones_like(freqs))
    rel_tol = tol / safe
    log_f = torch.log(safe)
    # Fit on measurable columns, weighted by how well each frequency is known.
    weights = torch.where(reliable, 1.0 / rel_tol.clamp_min(1e-12) ** 2, torch.zeros_like(freqs))
    intercept, slope = _weighted_line(index, log_f, weights)
    geometric = torch.exp(intercept + slope * index)
    deviation = (safe / geometric - 1).abs()
    linear, bend = None, None
    if bool((deviation[reliable] <= 4 * rel_tol[reliable] + 1e-6).all()):
        # bf16/fp16 frequencies pin f_0 only to their own precision: a smaller offset is rounding, not scaling.
        if abs(math.exp(intercept) - 1) > max(1e-4, _intercept_error(index, weights)):
            linear = _round_sig(math.exp(-intercept))
        else:
            # f_0 = 1: fit the line through it, which pins theta better than a free intercept.
            slope = float((weights * index * log_f).sum() / (weights * index**2).sum())
    else:
        intercept, slope, bend = _head_fit(index, log_f, weights, reliable)
    mscale = _round_sig(table.amplitude) if abs(table.amplitude - 1) > 1e-3 else None
    scaling = None
    if linear is not None or bend is not None or table.rough or mscale is not None:
        scaling = MeasuredScaling(linear_factor=linear, bend=bend, mscale=mscale, rough=table.rough)
    theta = math.exp(-slope * n)
    return RopeKey(
        theta=_round_sig(theta),
        dim=2 * n,
        length=table.length,
        dtype=tensor.dtype,
        device=tensor.device,
        layout=table.layout,
        scaling=scaling,
        filled=table.filled,
    )


def _head_fit(index, log_f, weights, reliable) -> tuple[float, float, str]:
    """Frequencies bent by llama3/YaRN scaling: theta from the unbent high-frequency head, plus a profile.

    The profile names how far the lowest measurable frequency sits below the geometric line, and a short
    digest of the whole bend so that two different bends never share a key by accident.
    """
    n = index.numel()
    head = torch.zeros(n, dtype=torch.bool, device=reliable.device)
    head[: max(2, n // 8)] = True  # the share recognition requires to be unbent
    head &= reliable
    if int(head.sum()) < 2:
        head = reliable
    intercept, slope = _weighted_line(index, log_f, torch.where(head, weights, torch.zeros_like(weights)))
    bend = log_f - (intercept + slope * index)
    last = int(torch.nonzero(reliable).max())
    low = math.exp(-float(bend[last]))
    bend_milli = torch.round(bend[reliable] * 1e3).to(torch.int64).tolist()  # plain ints: torch needs no numpy
    digest = hashlib.sha1(repr(bend_milli).encode()).hexdigest()[:6]
    return intercept, slope, f"low/{_round_sig(low, 3):g} #{digest}"
