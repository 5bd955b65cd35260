"""Judge an applied RoPE table against a :class:`RopeSpec`: by values, then say which field is off.

The decision compares values, not labels: the cos/sin the spec implies at the positions the layer used,
against the values it applied, within what the table's dtype can hold (:func:`value_tolerance`). Only
a table that fails is then diagnosed, to name the field a human should look at: the rotary dim, the
amplitude (YaRN's attention factor), frequencies that are the expected ones rounded to half precision,
theta, or else the scaling. A table over several position axes (2-D axial, M-RoPE) is judged as the
rows a 1-D sequence gets, and its columns' axes against the ones the model's recomposition gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rope_dedup.audit.applied import AppliedTable
from rope_dedup.tables.axes import axes_label
from rope_dedup.tables.keys import infer_key
from rope_dedup.tables.layout import FREQUENCIES
from rope_dedup.tables.recognize import RopeTable, value_tolerance
from rope_dedup.core.text import format_table
from rope_dedup.audit.expectation import ConfigSpec, Expected, NoRope, candidates
from rope_dedup.audit.spec import RopeSpec

MISMATCH_COLUMNS = ("layer", "field", "expected", "found", "worst position")


@dataclass(frozen=True)
class Mismatch:
    """One way a layer's applied RoPE differs from what was expected."""

    layer: str
    field: str  # rotary_dim, attention_factor, frequency dtype, theta, scaling, rope
    expected: str
    found: str
    worst_position: int | None  # where the values differ most (None: not compared by value)
    error: float | None = None  # the largest |applied - expected| there (a precision finding: its angle, radians)
    fix: str | None = None  # what to change, where the finding names it (the precision audit's)

    def cells(self) -> tuple[str, ...]:
        where = "-" if self.worst_position is None else f"{self.worst_position} (|Δ| {self.error:.2g})"
        found = self.found if self.fix is None else f"{self.found}; fix: {self.fix}"
        return self.layer, self.field, self.expected, found, where


class RopeMismatch(AssertionError):
    """Raised by :meth:`Explanation.check`: some layer applies RoPE other than expected."""

    def __init__(self, mismatches: list[Mismatch]) -> None:
        self.mismatches = list(mismatches)
        lines = [f"{len(self.mismatches)} RoPE mismatch(es):",
                 *format_table([MISMATCH_COLUMNS] + [m.cells() for m in self.mismatches])]
        super().__init__("\n".join(lines))


def check_expected(applied: AppliedTable, expected: Expected) -> tuple[Expected, list[Mismatch]]:
    """(the expectation the table was judged by, what differs from it). Where several specs are allowed
    (a layer that applies a ``main`` and a ``compress`` table), the table is judged by the one it matches,
    else by the one it differs from least, one of its own rotary dim first. A table applied where
    :class:`NoRope` is expected is one mismatch, field ``rope``."""
    if isinstance(expected, NoRope):
        return expected, [Mismatch(applied.layer, "rope", str(expected), f"RoPE applied: {applied.source}", None)]
    judged = [(spec, check_table(applied, spec)) for spec in candidates(expected)]
    if not judged:
        return None, []
    # The first clean one, if any; else the one of the table's own dim that differs least.
    return min(judged, key=lambda item: (len(item[1]), any(m.field == "rotary_dim" for m in item[1])))


def check_table(applied: AppliedTable, spec: RopeSpec) -> list[Mismatch]:
    """What in ``applied`` differs from ``spec`` (empty when every value is within tolerance)."""
    layer, found = applied.layer, applied.key
    if spec.rotary_dim is not None and spec.rotary_dim != found.dim:
        return [Mismatch(layer, "rotary_dim", str(spec.rotary_dim), str(found.dim), None)]
    positions = applied.positions.to(torch.float64)
    inv_freq, amplitude = spec.frequencies(found.dim, int(positions.max()) + 1)
    if inv_freq.numel() * 2 != found.dim:
        return [Mismatch(layer, "rotary_dim", str(2 * inv_freq.numel()), str(found.dim), None)]
    angles = positions[:, None] * inv_freq
    tolerance = value_tolerance(applied.dtype, amplitude, angles)
    excess, worst, error = _excess(applied, angles, amplitude, amplitude, tolerance)
    if excess <= 0:
        return _axes(applied, spec)
    # The expected frequencies in another order: a model that keeps them pre-permuted for a multimodal
    # layout (Ernie 4.5 VL's inv_freq) applies, and a held vector is measured, fastest first.
    ordered = inv_freq.sort(descending=True).values
    if not torch.equal(ordered, inv_freq):
        ordered_angles = positions[:, None] * ordered
        if _excess(applied, ordered_angles, amplitude, amplitude,
                   value_tolerance(applied.dtype, amplitude, ordered_angles))[0] <= 0:
            return _axes(applied, spec)
    mismatches = _axes(applied, spec)
    half = _carried_half(applied)
    if half is not None:  # values that carry only half precision: one finding that says so, not amplitude or scaling
        return mismatches + [Mismatch(layer, "table dtype", f"{_name(applied.dtype)} values",
                                      f"values rounded to {_name(half)} (held as {_name(applied.dtype)})", worst, error)]
    applied_amplitude = applied.table.amplitude
    # Amplitude first, on its own: values rescaled to the expected amplitude then show the frequencies alone.
    if abs(applied_amplitude - amplitude) > float(tolerance.min()):
        mismatches.append(Mismatch(layer, "attention_factor", _g(amplitude), _g(applied_amplitude), worst, error))
    excess, worst, error = _excess(applied, angles, amplitude, applied_amplitude, tolerance)
    if excess > 0:
        field, expected, found_text = _diagnose(applied, spec, inv_freq, amplitude, tolerance)
        mismatches.append(Mismatch(layer, field, expected, found_text, worst, error))
    return mismatches


def _carried_half(applied: AppliedTable) -> torch.dtype | None:
    """bfloat16 or float16 when every cos/sin value applied round-trips through it exactly while the table's dtype
    is wider (a table cast to half precision and back); None otherwise."""
    if applied.dtype.to_real() in (torch.bfloat16, torch.float16):
        return None
    values = [v for kind, v in applied.parts.items() if kind != "angle"]
    for half in (torch.bfloat16, torch.float16):
        if values and all(torch.equal(v, v.to(half).to(v.dtype)) for v in values):
            return half
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _axes(applied: AppliedTable, spec: RopeSpec) -> list[Mismatch]:
    """A table over several axes whose columns rotate by other axes than the model's recomposition puts
    there (height and width swapped, an ``mrope_section`` not followed); a column of unknown axis passes."""
    if not (applied.axes and isinstance(spec, ConfigSpec)):
        return []
    expected = spec.axes(applied.key.dim)
    if expected is None or len(expected) != len(applied.axes):
        return []
    if all(found is None or found == want for found, want in zip(applied.axes, expected)):
        return []
    return [Mismatch(applied.layer, "axes", axes_label(expected, spec.axis_count),
                     axes_label(applied.axes, applied.axis_count), None)]


def _excess(applied: AppliedTable, angles: torch.Tensor, expected_amplitude: float, applied_amplitude: float,
            tolerance: torch.Tensor) -> tuple[float, int, float]:
    """(largest error beyond tolerance, its position, the error there) with the applied values rescaled
    from ``applied_amplitude`` to the expected one."""
    worst_excess, worst_row, worst_error = -math.inf, 0, 0.0
    for kind, values in applied.parts.items():
        if kind == "angle":
            diff = (values - angles).abs()
            allowed = tolerance * (1 + angles.abs())
        else:
            exact = torch.cos(angles) if kind == "cos" else torch.sin(angles)
            diff = (values * (expected_amplitude / applied_amplitude) - expected_amplitude * exact).abs()
            allowed = tolerance
        per_row = (diff - allowed).amax(dim=1)
        row = int(per_row.argmax())
        if float(per_row[row]) > worst_excess:
            worst_excess, worst_row, worst_error = float(per_row[row]), row, float(diff[row].max())
    return worst_excess, int(applied.positions[worst_row]), worst_error


def _diagnose(applied: AppliedTable, spec: RopeSpec, inv_freq: torch.Tensor, amplitude: float,
              tolerance: torch.Tensor) -> tuple[str, str, str]:
    """(field, expected, found) for frequencies that do not match: the first simple fault that reproduces
    the applied values (inv_freq rounded to half precision, the scaling left out, another theta), else the
    field where the applied table's key and the expected one's differ."""
    positions = applied.positions.to(torch.float64)[:, None]
    dim, seq_len = applied.key.dim, int(applied.positions.max()) + 1
    found = applied.key

    def reproduces(freqs: torch.Tensor) -> bool:
        return _excess(applied, positions * freqs, amplitude, applied.table.amplitude, tolerance)[0] <= 0

    for half in (torch.bfloat16, torch.float16):
        if reproduces(inv_freq.to(half).to(torch.float64)):
            return "frequency dtype", "float32", f"{str(half).removeprefix('torch.')} (inv_freq rounded)"
    if spec.scaling is not None and reproduces(RopeSpec(spec.theta).frequencies(dim, seq_len)[0]):
        return "scaling", str(spec.scaling), "none"
    if reproduces(RopeSpec(found.theta, scaling=spec.scaling).frequencies(dim, seq_len)[0]):
        return "theta", _g(spec.theta), _g(found.theta)
    if spec.scaling is None and found.scaling is not None and found.scaling.bends_frequencies:  # the head of a bent table pins theta poorly: the scaling is the news
        return "scaling", "none", found.scaling
    expected_key = infer_key(_exact_table(inv_freq), inv_freq)
    if abs(found.theta / expected_key.theta - 1) > 1e-3:
        return "theta", _g(spec.theta), _g(found.theta)
    return "scaling", str(spec.scaling or "none"), found.scaling or "none"


def _exact_table(inv_freq: torch.Tensor) -> RopeTable:
    """A :class:`RopeTable` of known frequencies, to name them with :func:`infer_key` as a measured one is."""
    n = inv_freq.numel()
    return RopeTable(layout=FREQUENCIES, freqs=inv_freq, reliable=torch.ones(n, dtype=torch.bool, device=inv_freq.device),
                     freq_tol=1e-12 * inv_freq + 1e-300, amplitude=1.0, length=None)


def _g(value: float) -> str:
    return f"{value:g}"
