"""How a recognized table is laid out and how its frequencies are scaled, as typed values.

Both are ``str`` subclasses: a key, a report or a log prints ``cos-halves``, ``cos|sin``,
``stacked(cos,sin)``, ``complex``, ``inv_freq`` or ``linear x4, mscale 1.2`` as before, and compares
equal to that text, but code reads their fields and never parses the text back.
"""

from __future__ import annotations

import enum


class Part(str, enum.Enum):
    """What one block of a table holds per position and frequency."""

    COS = "cos"
    SIN = "sin"
    ANGLE = "angle"  # the angle itself (rotary-embedding-torch's freqs), cos/sin taken later

    def __str__(self) -> str:
        return self.value


class Repeat(str, enum.Enum):
    """How each frequency's column repeats inside a block: HF's cat([f, f]), GPT-NeoX-style, or interleaved."""

    NONE = ""
    HALVES = "halves"
    INTERLEAVED = "interleaved"


class Arrangement(enum.Enum):
    COLUMNS = "columns"  # blocks side by side on the last dim (one block, or torchtitan's cos|sin)
    STACKED = "stacked"  # two blocks on a last dim of 2
    COMPLEX = "complex"  # cos + i sin in one complex value (freqs_cis)
    FREQUENCIES = "frequencies"  # a bare inv_freq vector: no positions


class Layout(str):
    """A table's layout: its :class:`Arrangement`, its blocks' :class:`Part` in order, and their
    :class:`Repeat`. Build one with :meth:`columns` or :meth:`stacked`, or use :data:`COMPLEX` and
    :data:`FREQUENCIES`."""

    arrangement: Arrangement
    parts: tuple[Part, ...]
    repeat: Repeat

    def __new__(cls, arrangement: Arrangement, parts: tuple[Part, ...] = (), repeat: Repeat = Repeat.NONE) -> Layout:
        parts = tuple(Part(p) for p in parts)
        if arrangement is Arrangement.COLUMNS:
            suffix = f"-{repeat.value}" if repeat is not Repeat.NONE else ""
            text = "|".join(f"{p.value}{suffix}" for p in parts)
        elif arrangement is Arrangement.STACKED:
            text = f"stacked({parts[0].value},{parts[1].value})"
        else:
            text = "complex" if arrangement is Arrangement.COMPLEX else "inv_freq"
        layout = super().__new__(cls, text)
        layout.arrangement, layout.parts, layout.repeat = arrangement, parts, repeat
        return layout

    @classmethod
    def columns(cls, *parts: Part, repeat: Repeat = Repeat.NONE) -> Layout:
        return cls(Arrangement.COLUMNS, parts, repeat)

    @classmethod
    def stacked(cls, first: Part, second: Part) -> Layout:
        return cls(Arrangement.STACKED, (first, second))

    @property
    def single(self) -> Part | None:
        """The part of a one-block table laid out in columns (``cos``, ``sin-halves``), else None."""
        return self.parts[0] if self.arrangement is Arrangement.COLUMNS and len(self.parts) == 1 else None

    def __reduce__(self):  # pickle and deepcopy rebuild it from its fields, not from the text
        return Layout, (self.arrangement, self.parts, self.repeat)


COMPLEX = Layout(Arrangement.COMPLEX, (Part.COS, Part.SIN))
FREQUENCIES = Layout(Arrangement.FREQUENCIES)


class MeasuredScaling(str):
    """How measured frequencies depart from ``theta ** (-2j / dim)``, as a key names it: ``linear x4``
    (every frequency divided alike), ``nonuniform low/8 #a1b2c3`` (llama3, YaRN: the low ones bent; a
    digest of the bend keeps two bends apart), ``mscale 1.2`` (amplitude), and ``theta approximate`` when
    too few positions pin theta."""

    linear_factor: float | None
    bend: str | None  # "low/8 #a1b2c3"
    mscale: float | None
    rough: bool

    def __new__(cls, *, linear_factor: float | None = None, bend: str | None = None, mscale: float | None = None,
                rough: bool = False) -> MeasuredScaling:
        words = []
        if linear_factor is not None:
            words.append(f"linear x{linear_factor:g}")
        if bend is not None:
            words.append(f"nonuniform {bend}")
        if rough:
            words.append("theta approximate (too few positions)")
        if mscale is not None:
            words.append(f"mscale {mscale:g}")
        scaling = super().__new__(cls, ", ".join(words))
        scaling.linear_factor, scaling.bend, scaling.mscale, scaling.rough = linear_factor, bend, mscale, rough
        return scaling

    @property
    def bends_frequencies(self) -> bool:
        """Whether the frequencies themselves are scaled (linearly or not), not only the amplitude."""
        return self.linear_factor is not None or self.bend is not None

    def __reduce__(self):
        return _measured_scaling, (self.linear_factor, self.bend, self.mscale, self.rough)


def _measured_scaling(linear_factor, bend, mscale, rough) -> MeasuredScaling:
    return MeasuredScaling(linear_factor=linear_factor, bend=bend, mscale=mscale, rough=rough)
