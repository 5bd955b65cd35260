"""How exactly each table is computed: its distance from the model's reference and from float64 math.

Every recognized table is judged against two references, built for the RoPE the audit expects of it (the
expectation given, else the theta, dim and scaling it measures: a table never judges itself):

- the **reference implementation**: transformers' construction, float32 frequencies (its own
  ``ROPE_INIT_FUNCTIONS`` for ``expect="config"``, else the same steps in :mod:`rope_dedup.audit.spec`),
  float32 positions and angles, cos/sin in float32, on the table's device. A held table is compared with it
  as transformers holds it, in float32; an applied one as transformers applies it, cast to the applied dtype;
- **float64 math**: frequencies from theta and scaling in float64, exact positions, cos/sin in float64, each
  value rounded once to the table's dtype.

A table **diverges** from its reference where its angle differs from the reference's by more than both
``max_angle_error`` and the reference's own precision there (:func:`own_precision`: how far the float32
construction itself may sit from float64 math, which another correct float32 build may differ by on the
other side). Past that it is a finding that names the cause, found by reproducing the table with one fault
at a time, and its fix. The distance from float64 math is for information: how far precision carries.

Tables are read a chunk at a time (:data:`~rope_dedup.recompute.recipe.CHUNK_ROWS` rows of 16 frequencies,
fewer rows of a wider table): the peak grows by one chunk's float64 temporaries, a few MiB whatever the table's
length; tables of identical content (one share group) are measured once. Nothing here writes a model tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from rope_dedup.audit.applied import AppliedTable, table_parts
from rope_dedup.audit.check import check_expected
from rope_dedup.audit.expectation import ConfigSpec, Expected, Judge, NoRope, _call_init, candidates
from rope_dedup.audit.layers import layer_of, natural_order
from rope_dedup.audit.spec import SCALING_TYPES, RopeSpec, Scaling, _frequencies
from rope_dedup.recompute.recipe import CHUNK_ROWS
from rope_dedup.tables.keys import RopeKey
from rope_dedup.tables.layout import COMPLEX, Arrangement, Layout, Part, Repeat
from rope_dedup.tensors import local, module_state

# Largest angle difference from the reference that is never a finding (radians): 2.4x below the smallest
# precision fault known to hurt (a cos/sin table rounded to fp16: up to 2.4e-4 rad; bf16: 2.0e-3 rad),
# 400x above what two correct float32 builds of the same angle differ by (1-2 float32 ulps, 1e-7 to 2.4e-7).
DEFAULT_MAX_ANGLE_ERROR = 1e-4
# Positions the error is reported at, so that its growth shows (those within the table, and its last).
CHECKPOINTS = (4096, 32768, 131072, 1 << 20)
# A frequency vector holds no positions: it is judged up to the length of a table beside it, else the config's
# max_position_embeddings, else 1M positions, at this many spread positions plus the last ones (its error
# grows with the position).
_VECTOR_CONTEXT, _VECTOR_ROWS, _LAST_ROWS = 1 << 20, 4096, 64
# Rows reproduced per fault model when naming a cause: spread over the table, plus its last and worst rows.
_DIAGNOSIS_ROWS = 256
_EPS32 = torch.finfo(torch.float32).eps
_HALVES = (torch.bfloat16, torch.float16)
# Integers a half-precision dtype holds exactly: 2**(mantissa bits + 1).
_EXACT_INTEGERS = {torch.float16: 2048, torch.bfloat16: 256}


@dataclass(frozen=True)
class Reference:
    """A table's two references: the float32 construction and float64 math, for the spec named by ``label``."""

    label: str  # "theta=10000 dim=64 (config)", what the reference is built for
    inv_freq: torch.Tensor  # float32 (n,): the reference implementation's frequencies
    amplitude: float | None  # the attention factor multiplied in, None for 1
    exact: torch.Tensor | None  # float64 (n,) from the formulas; None where none is known (the rope_type's)
    exact_amplitude: float
    context: int | None = None  # how far a frequency vector is judged: a table beside it, max_position_embeddings
    measured: bool = False  # built for the theta the table's key measures (to 4 significant digits), no expectation


@dataclass(frozen=True)
class Distance:
    """How far a table's values are from one reference."""

    angle: float  # largest angle difference, radians
    position: int  # where it occurs
    column: int  # which frequency (0: the fastest)
    ulps: float  # largest value difference, in ulps of the table's dtype (at the amplitude; a frequency's own)
    growth: tuple[tuple[int, float], ...]  # (n, largest angle difference at positions < n) per checkpoint, and the end
    curve: tuple[tuple[int, float], ...]  # (last position of a bin, largest angle difference in it): for the plot


@dataclass(frozen=True)
class TablePrecision:
    """One table's precision: its distance from each reference, its class, and the cause and fix of a divergence."""

    layer: str
    source: str  # the held table's path, or where an applied one came from
    dtype: torch.dtype
    length: int  # positions judged (a frequency vector: the context it is judged up to)
    reference: str  # what the references are built for; why not, when not judged
    verdict: str  # "matches" (its reference), "diverges" (a finding) or "not judged"
    to_reference: Distance | None = None
    to_float64: Distance | None = None
    reference_to_float64: Distance | None = None  # for information: the reference's own limit
    cause: str = ""  # a divergence's cause; for a match, how it differs within the reference's precision
    fix: str = ""
    first_position: int | None = None  # first position past the limit
    applied: bool = False  # the values a layer applied (dynamic audit), not a table held

    @property
    def diverges(self) -> bool:
        return self.verdict == "diverges"


# -- references ----------------------------------------------------------------------------------------------

def reference_for(spec: RopeSpec | None, key: RopeKey, length: int) -> Reference | str:
    """The references of a table keyed ``key``, for ``spec`` (None: the theta, dim and scaling it measures),
    or why there are none."""
    if key.axes:  # a held vector of one axis is judged as any vector; a table over its axes is not
        return "a table over several position axes: its precision is not judged yet"
    origin = "measured" if spec is None else "config" if isinstance(spec, ConfigSpec) else "expected"
    if spec is None:
        measured = _measured_spec(key)
        if isinstance(measured, str):
            return measured
        spec = measured
    if spec.rotary_dim is not None and spec.rotary_dim != key.dim:
        return f"rotary dim {key.dim} where {spec.rotary_dim} is expected (see the mismatch): no reference of its dim"
    dim = key.dim
    context = getattr(getattr(spec, "config", None), "max_position_embeddings", None)
    exponent_dim, scaling = _exponent_dim(spec, dim), _scaling(spec)
    if isinstance(spec, ConfigSpec) and spec.init is not None:
        inv_freq, amplitude = _call_init(spec.init, spec.config, spec.layer_type, length)
        inv_freq = inv_freq.to(torch.float32)
    else:
        inv_freq, amplitude = _frequencies(spec.theta, exponent_dim, scaling, spec.attention_factor, length,
                                           dtype=torch.float32)
    if 2 * inv_freq.numel() != dim:
        return f"the reference has {inv_freq.numel()} frequencies for a table of {dim // 2}"
    exact, exact_amplitude = None, float(amplitude)
    if not isinstance(spec, ConfigSpec) or spec.rope_type == "default" or spec.rope_type in SCALING_TYPES:
        exact, exact_amplitude = _frequencies(spec.theta, exponent_dim, scaling, spec.attention_factor, length,
                                              dtype=torch.float64)
        if exact.numel() != inv_freq.numel():
            exact = None
    factor = float(torch.tensor(amplitude, dtype=torch.float32, device="cpu"))
    return Reference(f"{spec} ({origin})", inv_freq, None if factor == 1.0 else factor, exact, exact_amplitude,
                     context if isinstance(context, int) else None, measured=origin == "measured")


def _scaling(spec: RopeSpec) -> Scaling | None:
    """A spec's scaling (its ``__post_init__`` made any mapping one)."""
    return spec.scaling if isinstance(spec.scaling, Scaling) else None


def _exponent_dim(spec: RopeSpec, dim: int) -> int:
    return (spec.exponent_dim if isinstance(spec, ConfigSpec) else None) or dim


def _measured_spec(key: RopeKey) -> RopeSpec | str:
    """The spec a table's own key names, to build its references from named values: its theta, dim, a linear
    factor and an amplitude. A bent table (llama3, YaRN) names no formula: judged only with ``expect=``."""
    scaling = key.scaling
    if scaling is not None and scaling.rough:
        return "too few positions to name its theta: pass expect= to judge its precision"
    if scaling is not None and scaling.bend is not None:
        return "scaled frequencies the audit cannot name (llama3, YaRN): pass expect= to judge their precision"
    linear = Scaling("linear", factor=scaling.linear_factor) if scaling is not None and scaling.linear_factor else None
    mscale = scaling.mscale if scaling is not None else None
    return RopeSpec(key.theta, rotary_dim=key.dim, scaling=linear, attention_factor=mscale)


def own_precision(reference: Reference, positions: torch.Tensor) -> torch.Tensor:
    """(positions, n) radians: how far the float32 reference may be from float64 math at each angle, which a
    correct float32 build may differ from it by. Its frequencies' own error (pow in float32) plus one float32
    ulp of each, times the position; one ulp of the float32 angle; a few ulps of cos/sin."""
    f = reference.inv_freq.to(device=positions.device, dtype=torch.float64)
    exact = reference.exact.to(positions.device) if reference.exact is not None else None
    off = (f - exact).abs() if exact is not None else 8 * _ulp32(f)
    p = positions.to(torch.float64)[:, None]
    return p * (off + _ulp32(f)) + _ulp32(p * f) + 8 * _EPS32


def _ulp32(values: torch.Tensor) -> torch.Tensor:
    """The float32 spacing at each value (float64 in and out)."""
    exponent = torch.frexp(values.abs().to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny))[1]
    return torch.ldexp(torch.ones_like(values), (exponent - 24).to(values.dtype))


# -- one table, a chunk at a time -------------------------------------------------------------------------------

# The curve keeps the largest error per quarter octave of positions (bin 0: position 0): enough points to see
# growth on a log axis, a few dozen whatever the length, and each checkpoint (a power of two) is a bin edge.
_BINS_PER_OCTAVE, _BINS = 4, 4 * 40 + 2


def _bins(positions: torch.Tensor) -> torch.Tensor:
    p = positions.to(torch.float64)
    return torch.where(p > 0, torch.floor(_BINS_PER_OCTAVE * torch.log2(p.clamp_min(1))) + 1, 0).to(torch.int64)


@dataclass
class _Worst:
    """Running maxima of one comparison over the chunks: the worst entry, and the worst per bin of positions."""

    angle: float = -1.0
    position: int = 0
    column: int = 0
    ulps: float = 0.0

    def __post_init__(self) -> None:
        self.by_bin = torch.full((_BINS,), -1.0, dtype=torch.float64, device="cpu")
        self.last = torch.full((_BINS,), -1, dtype=torch.int64, device="cpu")

    def add_zero(self, positions: torch.Tensor) -> None:
        """A chunk that differs nowhere."""
        if self.angle < 0:
            self.angle, self.position = 0.0, int(positions[0])
        bins = _bins(positions).cpu()
        self.by_bin.scatter_reduce_(0, bins, torch.zeros(bins.shape, dtype=torch.float64, device="cpu"), "amax")
        self.last.scatter_reduce_(0, bins, positions.cpu(), "amax")

    def add(self, angles: torch.Tensor, ulps: torch.Tensor, positions: torch.Tensor) -> None:
        rows = angles.amax(dim=1)
        row = int(rows.argmax())
        if float(rows[row]) > self.angle:
            self.angle, self.position, self.column = float(rows[row]), int(positions[row]), int(angles[row].argmax())
        self.ulps = max(self.ulps, float(ulps.max()))
        bins = _bins(positions).cpu()
        self.by_bin.scatter_reduce_(0, bins, rows.cpu(), "amax")
        self.last.scatter_reduce_(0, bins, positions.cpu(), "amax")

    @property
    def seen(self) -> bool:
        return self.angle >= 0

    def distance(self) -> Distance:
        used = self.last >= 0
        curve = tuple(zip(self.last[used].tolist(), self.by_bin[used].tolist()))
        end = curve[-1][0]
        growth = [(mark, max(e for p, e in curve if p < mark)) for mark in CHECKPOINTS if mark <= end]
        growth.append((end + 1, self.angle))
        return Distance(self.angle, self.position, self.column, self.ulps, tuple(growth), curve)


@dataclass(frozen=True)
class _Values:
    """A chunk of a table's rows as float64 blocks (``cos`` / ``sin`` / ``angle``, one column per frequency)."""

    parts: dict[str, torch.Tensor]
    angles: torch.Tensor  # (rows, n) float64: the angles these values were computed at (a reference's), or None
    amplitude: float


def _reference_values(reference: Reference, positions: torch.Tensor, parts: tuple[str, ...], dtype: torch.dtype | None,
                      *, exact: bool, polar: bool = False, inv_freq: torch.Tensor | None = None,
                      position_dtype: torch.dtype | None = None) -> _Values:
    """The reference's blocks at ``positions`` (rounded to ``dtype`` when given). ``exact``: float64 math;
    ``polar``: a complex table, built as torchtitan builds one (``torch.polar``, whose kernel may round a value
    otherwise than cos/sin). The other arguments build a faulty variant: other float32 frequencies, positions
    held in a half dtype."""
    if exact:
        freqs, amplitude = reference.exact.to(positions.device), reference.exact_amplitude  # type: ignore[union-attr]
        angles = positions.to(torch.float64)[:, None] * freqs
    else:
        freqs = (reference.inv_freq if inv_freq is None else inv_freq).to(positions.device)
        p = positions.to(torch.float32)
        if position_dtype is not None:
            p = p.to(position_dtype).to(torch.float32)
        angles = torch.outer(p, freqs.to(torch.float32))
        amplitude = reference.amplitude if reference.amplitude is not None else 1.0
    values: dict[str, torch.Tensor] = {}
    if polar and not exact:
        table = torch.polar(torch.full_like(angles, amplitude), angles)
        values = {"cos": table.real, "sin": table.imag}
        parts = ()
    for part in parts:
        if part == "angle":
            value = angles
        else:
            value = angles.cos() if part == "cos" else angles.sin()  # in the angles' dtype
            if amplitude != 1.0:
                value = value * amplitude
        values[part] = value
    values = {part: (value.to(dtype) if dtype is not None else value).to(torch.float64) for part, value in values.items()}
    return _Values(values, angles.to(torch.float64), amplitude)


def _angle_differences(table: dict[str, torch.Tensor], other: _Values) -> torch.Tensor:
    """(rows, n): the angle by which ``table``'s values differ from ``other``'s. A cos and a sin give it exactly;
    a lone cos or sin only where its slope is at least half the amplitude (a value pins its angle to
    value error / slope), and 0 elsewhere. In place where it can: a chunk's transient stays a few arrays."""
    if "angle" in table:
        return (table["angle"] - other.parts["angle"]).abs_()
    if "cos" in table and "sin" in table:
        c, s, rc, rs = table["cos"], table["sin"], other.parts["cos"], other.parts["sin"]
        cross = (s * rc).sub_(c * rs)
        dot = (c * rc).add_(s * rs)
        return torch.atan2(cross, dot, out=cross).abs_()
    part = "cos" if "cos" in table else "sin"
    slope = (other.angles.sin() if part == "cos" else other.angles.cos()).abs_().mul_(other.amplitude)
    steep = slope >= other.amplitude / 2
    return (table[part] - other.parts[part]).abs_().div_(slope.clamp_min_(1e-300)).mul_(steep)


def _ulps(table: dict[str, torch.Tensor], other: _Values, dtype: torch.dtype, rounded: bool = False) -> torch.Tensor:
    """(rows, n): the largest value difference of each entry, in ulps of ``dtype`` at the amplitude (an angle:
    at its own magnitude). ``rounded``: ``other``'s values rounded to ``dtype`` first."""
    real = dtype.to_real()
    eps = torch.finfo(real).eps
    worst: torch.Tensor | None = None
    for part, values in table.items():
        theirs = other.parts[part].to(real).to(torch.float64) if rounded else other.parts[part]
        ulps = (values - theirs).abs_()
        if part == "angle":
            ulps.div_(torch.ldexp(torch.full_like(values, eps), torch.frexp(theirs.abs().clamp_min_(1e-30))[1] - 1))
        else:
            ulps.div_(eps / 2 * max(abs(other.amplitude), 1e-30))
        worst = ulps if worst is None else torch.maximum(worst, ulps, out=worst)
    return worst  # type: ignore[return-value]


RowReader = Callable[[torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class _Rows:
    """A table to judge: ``read(positions)`` gives its rows there as float64 blocks (``parts``)."""

    read: RowReader
    parts: tuple[str, ...]
    dtype: torch.dtype  # the table's
    device: torch.device
    polar: bool = False  # a complex table, whose reference torchtitan builds with torch.polar


def measure(rows: _Rows, positions: Iterator[torch.Tensor], reference: Reference, *,
            applied_dtype: torch.dtype | None, max_angle_error: float
            ) -> tuple[Distance, Distance | None, Distance | None, int | None, tuple[int, float]]:
    """Compare a table's rows with both references, one chunk of
    ``positions`` at a time: (to the reference, to float64, the reference to float64, the first position past
    the limit, (the worst position past it, its angle difference)). A chunk equal to the reference's bit for
    bit (the common case) is as far from float64 as the reference: measured once."""
    to_reference, to_exact, reference_exact = _Worst(), _Worst(), _Worst()
    first, beyond = None, (0, 0.0)
    rounding = 2 * torch.finfo(applied_dtype).eps if applied_dtype is not None and applied_dtype.is_floating_point \
        and torch.finfo(applied_dtype).eps > _EPS32 else 0.0  # both rounded to the applied dtype
    parts, dtype = rows.parts, rows.dtype
    for chunk in positions:
        table = rows.read(chunk)
        ref = _reference_values(reference, chunk, parts, applied_dtype, exact=False, polar=rows.polar)
        same = all(torch.equal(table[part], ref.parts[part]) for part in parts)
        if same:
            to_reference.add_zero(chunk)
        else:
            differences = _angle_differences(table, ref)
            to_reference.add(differences, _ulps(table, ref, dtype), chunk)
            excess = differences - own_precision(reference, chunk).clamp_min_(max_angle_error).add_(rounding)
            over = (excess > 0).any(dim=1)
            if bool(over.any()):
                if first is None:
                    first = int(chunk[over.nonzero()[0, 0]])
                row = int(excess.amax(dim=1).argmax())
                if float(differences[row].max()) > beyond[1]:
                    beyond = (int(chunk[row]), float(differences[row].max()))
            del differences, excess
        if reference.exact is not None:
            exact = _reference_values(reference, chunk, parts, None, exact=True)
            own = _angle_differences(ref.parts, exact), _ulps(ref.parts, exact, dtype, rounded=True)
            reference_exact.add(*own, chunk)
            to_exact.add(*(own if same else (_angle_differences(table, exact), _ulps(table, exact, dtype, rounded=True))),
                         chunk)
    exact_distance = to_exact.distance() if to_exact.seen else None
    reference_distance = reference_exact.distance() if reference_exact.seen else None
    return to_reference.distance(), exact_distance, reference_distance, first, beyond


# -- naming the cause -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Fault:
    """One way to build a table wrong: the cause and fix a finding states, and how it changes the build."""

    cause: str
    fix: str
    inv_freq: Callable[[torch.Tensor], torch.Tensor] | None = None
    position_dtype: torch.dtype | None = None
    cast: torch.dtype | None = None


def _rounded_to(half: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda inv_freq: inv_freq.to(half).to(torch.float32)


def _faults(dtype: torch.dtype, held: bool) -> list[_Fault]:
    """The faults tried, the most common first. A half-precision dtype named for the values means the table's
    values carry that precision, whatever dtype holds them."""
    faults = []
    for half in _HALVES:
        name = str(half).removeprefix("torch.")
        held_as = f"held as {str(dtype).removeprefix('torch.')}"
        keep = "keep float32 not bf16" if half is torch.bfloat16 else "keep float32 not fp16"
        faults.append(_Fault(f"a cast: values rounded to {name} ({held_as}); the same relative error at every "
                             f"position", f"{keep}: build and hold the table in float32, cast where it is applied"
                             if held else f"{keep}: apply the table in float32", cast=half))
        faults.append(_Fault(f"positions held in {name}: exact up to {_EXACT_INTEGERS[half]}, steps past it",
                             "build as the reference builds: positions as int64 or float32 (torch.arange(n, "
                             "dtype=torch.float32))", position_dtype=half))
        faults.append(_Fault(f"frequencies (inv_freq) rounded to {name}: an error that grows in proportion to "
                             f"position", f"{keep}: keep inv_freq in float32 when the model is cast",
                             inv_freq=_rounded_to(half)))
        faults.append(_Fault(f"positions held in {name} and values rounded to {name}",
                             f"build as the reference builds: positions as int64 or float32, and {keep}",
                             position_dtype=half, cast=half))
    return faults


def diagnose(rows: _Rows, sample: torch.Tensor, reference: Reference, applied_dtype: torch.dtype | None,
             key: RopeKey | None, to_reference: Distance) -> tuple[str, str]:
    """(cause, fix) of a divergence: the first fault whose build reproduces the table at the ``sample``
    positions, else the shape of the error (a frequency that differs, a cast, cos/sin computed another way)."""
    table = rows.read(sample)
    allowed = own_precision(reference, sample).clamp_min(4 * _EPS32)
    for fault in _faults(rows.dtype, applied_dtype is None):
        inv_freq = fault.inv_freq(reference.inv_freq) if fault.inv_freq is not None else None
        cast = fault.cast or applied_dtype
        built = _reference_values(reference, sample, rows.parts, cast, exact=False, polar=rows.polar, inv_freq=inv_freq,
                                  position_dtype=fault.position_dtype)
        rounding = 2 * torch.finfo(cast).eps if cast is not None and torch.finfo(cast).eps > _EPS32 else 0.0
        if bool((_angle_differences(table, built) <= allowed + rounding).all()):
            return fault.cause, fault.fix
    return _shape(to_reference, reference, key)


def _sample(positions: torch.Tensor, worst: int) -> torch.Tensor:
    """Up to :data:`_DIAGNOSIS_ROWS` of the sorted ``positions``, spread, with the last ones and ``worst``."""
    spread = torch.linspace(0, positions.numel() - 1, min(positions.numel(), _DIAGNOSIS_ROWS), dtype=torch.float64,
                            device="cpu").round().to(torch.int64)
    extra = torch.tensor([worst], dtype=torch.int64, device=positions.device)
    return torch.unique(torch.cat([positions[spread.to(positions.device)], positions[-_LAST_ROWS:], extra]))


_FREQUENCY_DIFFERS = "a frequency that differs"


def _shape(distance: Distance, reference: Reference, key: RopeKey | None) -> tuple[str, str]:
    """Name a cause no fault model reproduced, from how the error grows with the position."""
    build = "build as the reference builds"
    if key is not None and reference.exact is not None and key.theta > 0:
        expected = _theta_of(reference)
        if expected is not None and abs(key.theta / expected - 1) > 1e-3:
            return (f"{_FREQUENCY_DIFFERS}: theta {key.theta:g} where the reference has {expected:g} (an error "
                    f"that grows in proportion to position)", f"{build}: theta {expected:g}")
    early = [angle for position, angle in distance.curve if position < max(1, distance.curve[-1][0]) / 8]
    late = [angle for position, angle in distance.curve if position >= distance.curve[-1][0] / 2]
    if early and late and max(late) > 4 * max(max(early), 1e-12):
        return (f"{_FREQUENCY_DIFFERS} (inv_freq computed or rounded another way): an error that grows in "
                "proportion to position", f"{build}: float32 inv_freq as the reference computes it")
    return ("values that differ at every position, not in proportion to it: cos/sin computed another way (a fast "
            "approximation, another kernel), or a cast", f"{build}: cos/sin in float32, the cast kept")


def _theta_of(reference: Reference) -> float | None:
    """The theta of the reference's float64 frequencies (f_1 = theta ** (-2 / dim))."""
    exact = reference.exact
    if exact is None or exact.numel() < 2 or not float(exact[0]) > 0:
        return None
    n = exact.numel()
    return float((exact[0] / exact[1]) ** n)


# -- what the audit calls ---------------------------------------------------------------------------------------

def held_precision(layer: str, path: str, tensor: torch.Tensor, table: AppliedTable, reference: Reference | str,
                   max_angle_error: float) -> TablePrecision:
    """The precision of a table ``layer`` holds at ``path`` (``table`` is what the static audit measured)."""
    dtype = tensor.dtype
    if isinstance(reference, str):
        return TablePrecision(layer, path, dtype, table.key.length or 0, reference, "not judged")
    layout = table.table.layout
    if layout.arrangement is Arrangement.FREQUENCIES:
        return _vector_precision(layer, path, tensor, table.key, reference, max_angle_error)
    values = tensor.detach().squeeze()
    length = table.table.filled or values.shape[0]
    return _judged(layer, path, length, _held_rows(values, layout), _chunks(length, table.key.dim // 2, values.device),
                   reference, None, max_angle_error, table.key)


def _held_rows(values: torch.Tensor, layout: Layout) -> _Rows:
    """The rows of a held table (squeezed to positions first) in ``layout``."""
    def read(positions: torch.Tensor) -> dict[str, torch.Tensor]:
        return table_parts(values.index_select(0, positions), layout)

    return _Rows(read, _parts(layout), values.dtype, values.device, layout.arrangement is Arrangement.COMPLEX)


def _rows_per_chunk(width: int) -> int:
    """:data:`CHUNK_ROWS` rows of 16 frequencies, fewer rows of more: a float64 block of a chunk is 512 KiB."""
    return max(1, CHUNK_ROWS * 16 // max(1, width))


def _chunks(length: int, width: int, device: torch.device) -> Iterator[torch.Tensor]:
    """Positions 0..length-1, a chunk at a time."""
    rows = _rows_per_chunk(width)
    return (torch.arange(start, min(start + rows, length), device=device, dtype=torch.int64)
            for start in range(0, length, rows))


def applied_precision(table: AppliedTable, reference: Reference | str, max_angle_error: float) -> TablePrecision:
    """The precision of the values a layer applied at the positions it used (the dynamic audit's rows)."""
    if isinstance(reference, str):
        return TablePrecision(table.layer, table.source, table.dtype, table.positions.numel(), reference,
                              "not judged", applied=True)
    positions = table.positions.to(torch.int64)
    row_of = {int(p): i for i, p in enumerate(positions.tolist())}

    def read(at: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = torch.tensor([row_of[int(p)] for p in at.tolist()], dtype=torch.int64, device="cpu")
        return {part: values.index_select(0, rows) for part, values in table.parts.items()}

    ordered = positions.sort().values
    chunks = iter(ordered.split(_rows_per_chunk(table.key.dim // 2)))
    rows = _Rows(read, tuple(table.parts), table.dtype, torch.device("cpu"))
    return _judged(table.layer, table.source, int(ordered[-1]) + 1, rows, chunks, reference, table.dtype,
                   max_angle_error, table.key, sample=ordered)


def _judged(layer: str, source: str, length: int, rows: _Rows, chunks: Iterator[torch.Tensor], reference: Reference,
            applied_dtype: torch.dtype | None, max_angle_error: float, key: RopeKey | None,
            sample: torch.Tensor | None = None) -> TablePrecision:
    """Measure, classify, and name the cause of a divergence; ``applied_dtype``: the rows a layer applied in it
    (None: a held table), ``sample``: the positions it used."""
    to_reference, to_exact, own, first, beyond = measure(rows, chunks, reference, applied_dtype=applied_dtype,
                                                         max_angle_error=max_angle_error)
    found = TablePrecision(layer, source, rows.dtype, length, reference.label, "matches", to_reference, to_exact, own,
                           applied=applied_dtype is not None)
    if first is None:
        if to_reference.angle > 0 and to_exact is not None and own is not None and to_exact.angle < own.angle:
            return replace(found, cause="closer to float64 math than the reference (within its precision)")
        return found
    every = sample if sample is not None else torch.arange(length, device=rows.device, dtype=torch.int64)
    cause, fix = diagnose(rows, _sample(every, beyond[0]), reference, applied_dtype, key, to_reference)
    return _diverging(found, cause, fix, first, reference)


def _diverging(found: TablePrecision, cause: str, fix: str, first: int, reference: Reference) -> TablePrecision:
    """``found`` as a divergence, unless only its frequencies differ from a reference built for a measured theta:
    the key names theta to 4 significant digits, so a theta that is no round number (1593.49) cannot be told
    from a wrong one; such a table is judged only against an expectation."""
    if reference.measured and cause.startswith(_FREQUENCY_DIFFERS):
        return replace(found, verdict="not judged",
                       reference=f"its frequencies follow {reference.label} only to the 4 significant digits a "
                                 f"measured theta has: pass expect= to judge its precision")
    return replace(found, verdict="diverges", cause=cause, fix=fix, first_position=first)


def _vector_precision(layer: str, path: str, tensor: torch.Tensor, key: RopeKey, reference: Reference,
                      max_angle_error: float) -> TablePrecision:
    """A frequency vector, judged by the angles model code computes from it: ``float32(p) * float32(f)`` at
    positions up to the context (its error grows with the position, so spread rows and the last ones)."""
    vector = tensor.detach().reshape(-1)
    context = reference.context or _VECTOR_CONTEXT
    device = vector.device
    positions = torch.unique(torch.cat([
        torch.linspace(0, context - 1, _VECTOR_ROWS, device=device, dtype=torch.float64).round().to(torch.int64),
        torch.tensor([c - 1 for c in CHECKPOINTS if c <= context], device=device, dtype=torch.int64),
        torch.arange(max(0, context - _LAST_ROWS), context, device=device, dtype=torch.int64)]))
    applied = vector.to(torch.float32)

    def read(at: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"angle": torch.outer(at.to(torch.float32), applied).to(torch.float64)}

    chunks = iter(positions.split(_rows_per_chunk(vector.numel())))
    to_reference, to_exact, own, first, beyond = measure(_Rows(read, ("angle",), torch.float32, device), chunks,
                                                         reference, applied_dtype=None, max_angle_error=max_angle_error)
    # A frequency's own ulps tell a cast vector: half a bf16 ulp is the rounding of inv_freq.to(bfloat16).
    ulps = float(((vector.to(torch.float64).cpu() - reference.inv_freq.to(torch.float64)).abs()
                  / _ulp_of(reference.inv_freq.to(torch.float64), tensor.dtype)).max())
    found = TablePrecision(layer, path, tensor.dtype, context, reference.label, "matches",
                           replace(to_reference, ulps=ulps), to_exact, own)
    if first is None:
        return found
    rounded = (f for f in _faults(tensor.dtype, True) if f.inv_freq is not None
               and torch.equal(vector.to(torch.float32).cpu(), f.inv_freq(reference.inv_freq)))
    fault = next(rounded, None)
    cause, fix = (fault.cause, fault.fix) if fault is not None else _shape(to_reference, reference, key)
    return _diverging(found, cause, fix, first, reference)


def _ulp_of(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else _EPS32
    exponent = torch.frexp(values.abs().clamp_min(1e-300))[1]
    return eps * torch.ldexp(torch.ones_like(values), exponent - 1)


def _parts(layout: Layout) -> tuple[str, ...]:
    if layout.arrangement is Arrangement.COMPLEX:
        return ("cos", "sin")
    return tuple(part.value for part in layout.parts if part in (Part.COS, Part.SIN, Part.ANGLE))


def describe_distance(distance: Distance | None) -> str:
    """``0.0039 at 4290, 3.3e+04 ulp``; ``0 (bit for bit)``; ``-`` when not measured."""
    if distance is None:
        return "-"
    if distance.angle == 0 and distance.ulps == 0:
        return "0 (bit for bit)"
    return f"{distance.angle:.2g} at {distance.position}, {distance.ulps:.2g} ulp"


# -- the whole model -------------------------------------------------------------------------------------------------

def precision_of(model: torch.nn.Module, tables: list[AppliedTable], *, static: bool, judge: Judge | None,
                 groups: dict[str, str], unmeasured: list[tuple[str, str]], max_angle_error: float
                 ) -> list[TablePrecision]:
    """The precision of every table the audit measured: held ones (``static``) read from the model a chunk at a
    time, applied ones at the rows the layer used; and of the RoPE-named tables held that recognition refused
    (``unmeasured``: computed from half-precision positions, say), judged where an expectation names them.
    ``groups`` maps a held table's path to its share group: tables of identical content are measured once."""
    held = {path: local(tensor) for path, tensor, *_ in module_state(model)} if static else {}
    # A frequency vector is judged up to the length of a table its module holds beside it (torchtune's theta
    # beside its cache), else the config's max_position_embeddings, else 1M positions.
    beside: dict[str, int] = {}
    for table in tables:
        if table.key.length:
            owner = table.source.rpartition(".")[0]
            beside[owner] = max(beside.get(owner, 0), table.key.length)
    done: dict[tuple, TablePrecision] = {}
    found = []
    for table in tables:
        expected = judge(table.layer, table.source if static else None) if judge is not None else None
        spec = _spec_judged_by(table, expected)
        length = table.key.length or 0
        if static and table.source not in held:  # a vector measured with its frequencies sorted
            found.append(_reordered(table, held.get(table.source.split(" (")[0]), spec, max_angle_error))
            continue
        tag = (groups.get(table.source, table.source) if static else id(table), _spec_tag(spec),
               beside.get(table.source.rpartition(".")[0]))
        known = done.get(tag)
        if known is not None:
            found.append(replace(known, layer=table.layer, source=table.source))
            continue
        reference = reference_for(spec, table.key, length)
        context = beside.get(table.source.rpartition(".")[0])
        if context and isinstance(reference, Reference):
            reference = replace(reference, context=context)
        result = held_precision(table.layer, table.source, held[table.source], table, reference, max_angle_error) \
            if static else applied_precision(table, reference, max_angle_error)
        done[tag] = result
        found.append(result)
    for path, _ in unmeasured if static else ():
        tensor, layer = held.get(path), layer_of(path.rpartition(".")[0])
        specs = candidates(judge(layer, path)) if judge is not None else ()
        if tensor is not None and specs:
            found.append(_unrecognized(layer, path, tensor, specs[0], max_angle_error))
    return sorted(found, key=lambda t: natural_order(t.layer))


def _reordered(table: AppliedTable, tensor: torch.Tensor | None, spec: RopeSpec | None,
               max_angle_error: float) -> TablePrecision:
    """A vector held in another order than fastest first (Ernie 4.5 VL's pre-rotated one, proportional RoPE's
    zeros for unrotated pairs), judged frequency by frequency against the expectation's vector: in the order
    the expectation's own function builds it, or, for a formula's (fastest first), put in the held order.
    Not judged without an expectation."""
    path = table.source.split(" (")[0]
    reference = reference_for(spec, table.key, 0) if spec is not None and tensor is not None else \
        "frequencies held in another order: judged only against an expectation (pass expect=)"
    if isinstance(reference, str) or tensor is None:
        return TablePrecision(table.layer, table.source, table.dtype, 0, str(reference), "not judged")
    held = tensor.detach().reshape(-1).cpu()
    ranked = reference.inv_freq.argsort(descending=True)
    fastest_first = torch.equal(ranked, torch.arange(held.numel(), device="cpu", dtype=torch.int64))
    order = held.argsort(descending=True) if fastest_first else ranked

    def placed(values: torch.Tensor) -> torch.Tensor:
        """``values`` (fastest first) at the places ``order`` gives them."""
        out = torch.empty_like(values)
        out[order] = values.sort(descending=True).values
        return out

    exact = placed(reference.exact) if reference.exact is not None else None
    reference = replace(reference, inv_freq=placed(reference.inv_freq), exact=exact)
    return _vector_precision(table.layer, path, tensor, table.key, reference, max_angle_error)


def _spec_judged_by(table: AppliedTable, expected: Expected) -> RopeSpec | None:
    """The spec the audit judged ``table`` by, when the expectation gives one."""
    if expected is None or isinstance(expected, NoRope):
        return None
    spec, _ = check_expected(table, expected)
    return spec if isinstance(spec, RopeSpec) else None


def _spec_tag(spec: RopeSpec | None) -> object:
    """What tells two references apart: the spec as written, and which config and layer type it reads."""
    return None if spec is None else (str(spec), getattr(spec, "layer_type", None), id(getattr(spec, "config", None)))


def _unrecognized(layer: str, path: str, tensor: torch.Tensor, spec: RopeSpec, max_angle_error: float) -> TablePrecision:
    """A RoPE-named table recognition refused, judged in the layout of its shape whose reference its first rows
    follow (rows a half-precision position still counts exactly). Not judged when none fits."""
    values = tensor.detach().squeeze()
    if values.dim() < 2 or values.shape[0] < 2:
        return TablePrecision(layer, path, tensor.dtype, 0, "no layout of its shape to judge it in", "not judged")
    length = values.shape[0]
    head = torch.arange(min(length, 64), device=values.device, dtype=torch.int64)
    best, fit = math.inf, None
    width = values.shape[1]
    # Every other column of a table is a table of half its dim: the widest reading that fits is the one.
    counts = [spec.rotary_dim // 2] if spec.rotary_dim else sorted({width, width // 2, width // 4} - {0}, reverse=True)
    for n in counts:
        reference = reference_for(spec, RopeKey(spec.theta, 2 * n, length, tensor.dtype, tensor.device, COMPLEX), length)
        if isinstance(reference, str):
            continue
        for layout in _layouts(values, n):
            rows = table_parts(values.index_select(0, head), layout)
            built = _reference_values(reference, head, tuple(rows), None, exact=False,
                                      polar=layout.arrangement is Arrangement.COMPLEX)
            distance = max(float((rows[part] - built.parts[part]).abs().max()) for part in rows)
            if distance < best:
                best, fit = distance, (reference, layout)
    if fit is None or best > 1e-2:
        return TablePrecision(layer, path, tensor.dtype, length, f"no layout of its shape follows {spec}", "not judged")
    reference, layout = fit
    return _judged(layer, path, length, _held_rows(values, layout), _chunks(length, reference.inv_freq.numel(),
                                                                             values.device),
                   reference, None, max_angle_error, None)


def _layouts(values: torch.Tensor, n: int) -> list[Layout]:
    """The layouts a (positions, ...) tensor of ``n`` frequencies can hold."""
    if values.is_complex():
        return [COMPLEX] if values.dim() == 2 and values.shape[1] == n else []
    if values.dim() == 3:
        return [Layout.stacked(Part.COS, Part.SIN), Layout.stacked(Part.SIN, Part.COS)] if values.shape[1:] == (n, 2) else []
    width = values.shape[1]
    single = [Layout.columns(p, repeat=r) for p in (Part.COS, Part.SIN, Part.ANGLE) for r in Repeat
              if width == n * (1 if r is Repeat.NONE else 2)]
    pairs = [Layout.columns(a, b, repeat=r) for a, b in ((Part.COS, Part.SIN), (Part.SIN, Part.COS)) for r in Repeat
             if width == 2 * n * (1 if r is Repeat.NONE else 2)]
    return single + pairs
