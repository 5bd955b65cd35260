"""What a layer's RoPE is meant to be: :class:`RopeSpec`, its scaling, and the frequencies it implies.

A ``RopeSpec`` is one form of ``expect=`` for :func:`rope_dedup.audit.explain`; every form ends up as
expected frequencies and amplitude per layer (:mod:`rope_dedup.audit.expectation`), which
:mod:`rope_dedup.audit.check` compares with what the layer applied.

The formulas follow transformers' ``modeling_rope_utils`` (linear, dynamic NTK, llama3, YaRN, longrope)
so that torch stays the only dependency. They serve specs written by hand and configs read without
transformers installed; ``expect="config"`` with transformers installed computes with transformers' own
functions instead, and ``tests/test_expect.py`` fails where the two disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

SCALING_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")
# Parameters each scaling type cannot do without (the others have transformers' defaults).
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
# ``--expect scaling=TYPE:A:B...``: the positional parameters of each type, in this order.
_CLI_PARAMETERS = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"),
}


class SpecError(ValueError):
    """An expectation that cannot be used (unknown scaling, missing config field); the message names it."""


@dataclass(frozen=True)
class Scaling:
    """A RoPE scaling variant with transformers' parameter names and defaults.

    ``type`` is one of linear, dynamic (NTK, applied past ``original_max_position_embeddings``), llama3,
    yarn or longrope; each uses the parameters its name in transformers' ``rope_parameters`` says.
    """

    type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek): the attention factor is mscale over mscale_all_dim
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    short_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors up to the original length
    long_factor: tuple[float, ...] | None = None  # longrope: beyond it

    def __post_init__(self) -> None:
        if self.type not in SCALING_TYPES:
            raise SpecError(f"unknown scaling type {self.type!r}; choose from {', '.join(SCALING_TYPES)}")
        missing = [name for name in _REQUIRED[self.type] if getattr(self, name) is None]
        if missing:
            raise SpecError(f"{self.type} scaling needs {', '.join(missing)}")
        for name in ("short_factor", "long_factor"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))

    @classmethod
    def from_mapping(cls, parameters: Mapping[str, Any]) -> Scaling | None:
        """From transformers' ``rope_parameters`` / ``rope_scaling`` dict; None for ``rope_type: default``."""
        parameters = dict(parameters)
        kind = parameters.pop("rope_type", None) or parameters.pop("type", None)
        for spec_level in ("rope_theta", "partial_rotary_factor", "attention_factor"):
            parameters.pop(spec_level, None)
        if kind in (None, "default"):
            return None
        known = {f.name for f in fields(cls)} - {"type"}
        unknown = sorted(set(parameters) - known)
        if unknown:
            raise SpecError(f"{kind} scaling: unknown parameter(s) {', '.join(unknown)}")
        return cls(kind, **parameters)

    def __str__(self) -> str:
        """The command line's form: ``llama3:8:1:4:8192``, ``yarn:4:4096:32:1``, ``linear:4``."""
        if self.type == "longrope":
            return f"longrope (original {self.original_max_position_embeddings})"
        return ":".join([self.type, *(_number(getattr(self, name)) for name in _CLI_PARAMETERS[self.type])])


@dataclass(frozen=True)
class RopeSpec:
    """The RoPE one layer should apply: ``theta``, the rotary dim, a scaling, the cos/sin amplitude.

    ``rotary_dim`` None accepts the dim the layer uses (2 x its number of frequencies); ``scaling`` is a
    :class:`Scaling` or transformers' dict form (``{"rope_type": "llama3", "factor": 8, ...}``);
    ``attention_factor`` None means the scaling's own (YaRN's ``0.1 ln(factor) + 1``, longrope's), else 1.
    """

    theta: float
    rotary_dim: int | None = None
    scaling: Scaling | Mapping[str, Any] | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.scaling, Mapping):
            object.__setattr__(self, "scaling", Scaling.from_mapping(self.scaling))
        if not self.theta > 0:
            raise SpecError(f"theta must be positive, got {self.theta}")
        if self.rotary_dim is not None and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise SpecError(f"rotary_dim must be even and at least 2, got {self.rotary_dim}")

    def frequencies(self, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
        """(inv_freq as float64 of shape (dim/2,), attention factor) for a table covering ``seq_len`` positions."""
        return _frequencies(self.theta, dim, self.scaling, self.attention_factor, seq_len)  # type: ignore[arg-type]

    def __str__(self) -> str:
        parts = [f"theta={_number(self.theta)}"]
        if self.rotary_dim is not None:
            parts.append(f"dim={self.rotary_dim}")
        if self.scaling is not None:
            parts.append(str(self.scaling))
        if self.attention_factor is not None:
            parts.append(f"attention_factor={_number(self.attention_factor)}")
        return " ".join(parts)


def parse_spec(text: str) -> RopeSpec:
    """``theta=5e5,dim=64,scaling=llama3:8:1:4:8192,attention_factor=1.2`` (the CLI's ``--expect``)."""
    items: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, value = item.partition("=")
        if not equals or not value:
            raise SpecError(f"--expect: {item!r} is not NAME=VALUE")
        items[name.strip()] = value.strip()
    unknown = sorted(set(items) - {"theta", "dim", "scaling", "attention_factor"})
    if unknown:
        raise SpecError(f"--expect: unknown field(s) {', '.join(unknown)}; use theta, dim, scaling, attention_factor")
    if "theta" not in items:
        raise SpecError("--expect: theta is missing (e.g. --expect theta=5e5)")
    try:
        theta = float(items["theta"])
        dim = int(items["dim"]) if "dim" in items else None
        factor = float(items["attention_factor"]) if "attention_factor" in items else None
    except ValueError as error:
        raise SpecError(f"--expect: {error}") from None
    scaling = _parse_scaling(items["scaling"]) if "scaling" in items else None
    return RopeSpec(theta, rotary_dim=dim, scaling=scaling, attention_factor=factor)


def _parse_scaling(text: str) -> Scaling:
    kind, *values = text.split(":")
    if kind == "longrope":
        raise SpecError("--expect: longrope's short/long factor lists do not fit on the command line; "
                        "use --expect config or rope_dedup.RopeSpec")
    if kind not in _CLI_PARAMETERS:
        raise SpecError(f"--expect: unknown scaling type {kind!r}; choose from {', '.join(_CLI_PARAMETERS)}")
    names = _CLI_PARAMETERS[kind]
    if len(values) > len(names):
        raise SpecError(f"--expect: {kind} takes at most {':'.join(names)}, got {text!r}")
    try:
        parsed = {name: int(value) if name == "original_max_position_embeddings" else float(value)
                  for name, value in zip(names, values)}
    except ValueError as error:
        raise SpecError(f"--expect: scaling {text!r}: {error}") from None
    try:
        return Scaling(kind, **parsed)  # type: ignore[arg-type]
    except SpecError as error:
        raise SpecError(f"--expect: {error} (scaling={kind}:{':'.join(names)})") from None


def _frequencies(theta: float, dim: int, scaling: Scaling | None, attention_factor: float | None,
                 seq_len: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, float]:
    """transformers' formulas, in float64; in float32 they are transformers' own steps (integer exponents
    made float32, then pow and divide in float32), which give the very vector transformers builds."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype) / dim
    kind = scaling.type if scaling is not None else None
    if kind == "dynamic" and seq_len > scaling.original_max_position_embeddings:  # type: ignore[operator, union-attr]
        # NTK: a larger base once the sequence outgrows the original length.
        theta = theta * ((scaling.factor * seq_len / scaling.original_max_position_embeddings)  # type: ignore[operator, union-attr]
                         - (scaling.factor - 1)) ** (dim / (dim - 2))  # type: ignore[operator, union-attr]
    inv_freq = 1.0 / theta ** exponents
    default_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / scaling.factor  # type: ignore[operator, union-attr]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)  # type: ignore[arg-type]
    elif kind == "yarn":
        inv_freq, default_factor = _yarn(inv_freq, theta, dim, scaling)  # type: ignore[arg-type]
    elif kind == "longrope":
        long = seq_len > scaling.original_max_position_embeddings  # type: ignore[operator, union-attr]
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor,  # type: ignore[union-attr]
                               dtype=dtype, device="cpu")
        if factors.numel() != inv_freq.numel():
            raise SpecError(f"longrope: {factors.numel()} factors for a rotary dim of {dim}")
        inv_freq = inv_freq / factors
        factor = scaling.factor or 1.0  # type: ignore[union-attr]
        if factor > 1:
            default_factor = math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position_embeddings))  # type: ignore[arg-type, union-attr]
    return inv_freq, default_factor if attention_factor is None else float(attention_factor)


def _llama3(inv_freq: torch.Tensor, s: Scaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor  # type: ignore[operator]
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor  # type: ignore[operator]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)  # type: ignore[operator]
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)  # type: ignore[arg-type, operator]
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled  # type: ignore[operator]
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, theta: float, dim: int, s: Scaling) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        attention_factor = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)  # type: ignore[arg-type]
    else:
        attention_factor = mscale(s.factor)  # type: ignore[arg-type]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))  # type: ignore[operator]

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=inv_freq.dtype, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / s.factor * (1 - extrapolate) + inv_freq * extrapolate, attention_factor  # type: ignore[operator]


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
