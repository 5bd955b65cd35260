"""The RoPE audit: what each layer's tables encode, which would share, and what was left alone and why.

Without example inputs, :func:`explain` is static: it measures the tables the model holds
(:mod:`rope_dedup.audit.held`) and asks a dry-run :func:`~rope_dedup.share` what would share; no forward runs,
so it fits right after ``init_weights``. With inputs, it compiles the model once with a dry-run backend
(nothing is aliased or rewritten) and runs the graphs once through
:class:`~rope_dedup.audit.applied.TableCapture` to see the tables each attention layer actually applies (its
own, passed down from model level, or computed in forward). Both arrange what they found by layer: a user
sees at a glance that layer 5 uses theta 1e6 while the others use 1e4. Told what was intended
(``expect=``), the audit judges every table against that, by value, and names what differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import linecache
import logging
import math
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from rope_dedup.audit.applied import AppliedTable, TableCapture
from rope_dedup.audit.compiled import CompiledCheck
from rope_dedup.audit.layers import MODEL, layers_of, natural_order, split_layer
from rope_dedup.backend import RopeDedupBackend
from rope_dedup.audit.check import MISMATCH_COLUMNS, Mismatch, RopeMismatch, check_expected
from rope_dedup.audit.expectation import (Expectation, Expected, Judging, NoRope, candidates, config_conflicts,
                                          describe, expectation_for)
from rope_dedup.audit.held import EmptySlot, held_tables
from rope_dedup.audit.precision import (DEFAULT_MAX_ANGLE_ERROR, CHECKPOINTS, TablePrecision, describe_distance,
                                        precision_of)
from rope_dedup.tables.keys import RopeKey
from rope_dedup.core.report import DedupReport, Skip
from rope_dedup.core.text import Row, Table, format_bytes, format_table, wrap
from rope_dedup.tensors import tensor_paths
from rope_dedup.recompute import values_in_place
from rope_dedup.share import share

log = logging.getLogger("rope_dedup")

# Without isolate_recompiles (torch < 2.13): entries a frame may hold while an audit compiles.
_AUDIT_RECOMPILE_LIMIT = 1024

_KEY_FIELDS = tuple(f.name for f in fields(RopeKey))
COLUMNS = ("layer", "table", "group", *_KEY_FIELDS)
APPLIED_COLUMNS = ("layer", "applies", "from", "theta", "dim", "scaling", "amplitude", "dtype", "positions")
# The static audit judges the tables held, not applied: the same columns, named for what they show.
HELD_COLUMNS = ("layer", "holds", "path", *APPLIED_COLUMNS[3:])
EXPECTED_COLUMNS = ("expected", "status")
PRECISION_COLUMNS = ("layer", "table", "dtype", "positions", "class", "to reference", "to float64",
                     "reference to float64")
COMPILED_COLUMNS = ("layer", "table from", "inductor vs eager", "allowed", "class")


@dataclass(frozen=True)
class TableRow:
    """One RoPE table: where it lives, its inferred key, and the group of identical tables it belongs to."""

    layer: str  # "layers.5" (up to the first numeric path component), else the owning module
    name: str  # the rest of the path inside the layer: "attention.rope.cos"
    key: RopeKey
    group: str  # "A", "B", ...: tables with the same letter have identical content


@dataclass(frozen=True)
class LayerRow:
    """A layer's own tables, the tables it applies (held, in a static audit), what was expected of it, and
    how its keys differ from the majority of layers (empty when they don't, when layers follow a pattern,
    or with an expectation)."""

    layer: str
    tables: tuple[TableRow, ...]
    differs: tuple[str, ...]
    applied: tuple[AppliedTable, ...] = ()
    expected: Expected = None  # None: no expectation, or none for this layer
    judged_as: tuple[Expected, ...] = ()  # per applied table: what it was judged by (Gemma 3's model-level
    # rotary embedding holds a table per layer type, each judged by its own)
    verdicts: tuple[tuple[str, ...], ...] = ()  # per applied table: the fields in which it differs ((): none)

    @property
    def odd(self) -> bool:
        return bool(self.differs)


@dataclass(frozen=True)
class Explanation:
    """Per-layer RoPE tables, share groups, skipped state with reasons, and the underlying report."""

    layers: tuple[LayerRow, ...]
    groups: dict[str, tuple[str, ...]]  # group letter -> full paths of its members
    skipped: tuple[Skip, ...]  # buffers and tensor attributes the pass examined and left alone
    parameters_skipped: int  # parameters (weights) skipped: counted, not listed; reasons in report.skipped
    unread: tuple[str, ...]  # buffers and tensor attributes no compiled graph read: not examined
    report: DedupReport
    mismatches: tuple[Mismatch, ...] = ()  # with an expectation: every way a layer differs from it
    pattern: str | None = None  # without one: a regular mix of tables (every k-th layer), described
    judged: bool = False  # whether an expectation was given
    static: bool = False  # no forward ran: ``applied`` holds the tables the model holds
    # RoPE-named tensors held (static), or cos/sin applied (dry run), in a layout not measured: (path or layer, why)
    unmeasured: tuple[tuple[str, str], ...] = ()
    recomputed: tuple[str, ...] = ()  # tables share(tables="recompute") replaced: audited as their values
    # explain(precision=True): each table's distance from its reference and from float64 math, and (with
    # inputs) each layer's compiled rotation against eager's; the threshold they were judged by (None: not audited)
    precision: tuple[TablePrecision, ...] = ()
    compiled: tuple[CompiledCheck, ...] = ()
    max_angle_error: float | None = None

    @property
    def odd_layers(self) -> list[LayerRow]:
        return [row for row in self.layers if row.odd]

    @property
    def applied(self) -> list[AppliedTable]:
        """Every table applied, layer by layer."""
        return [table for row in self.layers for table in row.applied]

    def check(self) -> None:
        """Raise :class:`~rope_dedup.RopeMismatch` (a readable table) if any layer differs from the expectation."""
        if self.mismatches:
            raise RopeMismatch(list(self.mismatches))

    def headline(self) -> str:
        tables = sum(len(row.tables) for row in self.layers)
        applying = sum(1 for row in self.layers if row.applied)
        audit = "RoPE audit (static: no forward ran)" if self.static else "RoPE audit"
        if not tables and not applying:
            where = "none held by the model" + ("" if self.static else ", none applied in its forward")
            line = f"{audit}: no RoPE table found ({where})"
            return line + (f"; {len(self.mismatches)} mismatch(es)" if self.mismatches else "")
        before, after = format_bytes(self.report.bytes_before), format_bytes(self.report.bytes_after)
        line = (f"{audit}: {tables} table(s) in {len(self.layers)} layer(s), {len(self.groups)} distinct; "
                f"sharing would take {before} -> {after}; {applying} layer(s) "
                + ("hold RoPE" if self.static else "apply RoPE"))
        if self.judged or self.mismatches:
            line += f"; {len(self.mismatches)} mismatch(es)" + (" with the expectation" if self.judged else "")
        if self.max_angle_error is not None:
            judged = [t for t in self.precision if t.verdict != "not judged"]
            line += (f"; precision: {len(judged)} table(s) judged, {sum(t.diverges for t in judged)} diverge from "
                     f"their reference")
            if self.compiled:
                line += f", {sum(c.differs for c in self.compiled)} compiled rotation(s) differ from eager"
        return line

    def applied_columns(self) -> tuple[str, ...]:
        """Columns of :meth:`applied_rows`."""
        return (HELD_COLUMNS if self.static else APPLIED_COLUMNS) + (EXPECTED_COLUMNS if self.judged else ())

    def applied_rows(self) -> list[tuple[bool, tuple[str, ...]]]:
        """(layer mismatches or differs, cells under :meth:`applied_columns`) per applied table."""
        rows = []
        for row in self.layers:
            bad = row.layer in self._wrong() or row.odd
            for i, cells in enumerate(self._applied_cells(row)):
                rows.append((bad, ((row.layer + (" *" if bad else "")) if i == 0 else "", *cells)))
        return rows

    def rows(self) -> list[tuple[bool, tuple[str, ...]]]:
        """(layer differs from the majority, cells under :data:`COLUMNS`) per table; the layer named once."""
        rows = []
        for row in self.layers:
            for i, table in enumerate(row.tables):
                layer = (row.layer + (" *" if row.odd else "")) if i == 0 else ""
                rows.append((row.odd, (layer, table.name, table.group, *key_cells(table.key))))
        return rows

    def tables(self) -> list[Table]:
        """The audit's tables as data: the tables each layer holds, and those it applies (static: what each
        held table encodes). A caption explains the ``*`` mark under a table only when a row carries it."""
        tables = []
        held = self.rows()
        if held:
            legend = "* key differs from most layers; one group letter = identical content"
            tables.append(Table("tables each layer holds", COLUMNS, _rows(held),
                                legend if _marks_a_row(held) else None))
        applied = self.applied_rows()
        if applied:
            legend = "* differs from the expectation (mismatches below)" if self.judged else "* differs from most layers"
            title = "what each held table encodes" if self.static else "tables each layer applies"
            tables.append(Table(title, self.applied_columns(), _rows(applied),
                                legend if _marks_a_row(applied) else None))
        return tables + self.precision_tables()

    def precision_tables(self) -> list[Table]:
        """With ``precision=True``: each table's distance from its references, how it grows with the position,
        and each compiled rotation against eager's."""
        judged = [t for t in self.precision if t.verdict != "not judged"]
        tables = []
        if judged:
            rows: list[tuple[bool, tuple[str, ...]]] = [
                (t.diverges, (t.layer, _table_name(t), _cell("dtype", t.dtype), str(t.length), _verdict(t),
                              describe_distance(t.to_reference), describe_distance(t.to_float64),
                              describe_distance(t.reference_to_float64))) for t in judged]
            tables.append(Table(f"precision (a finding past {self.max_angle_error:g} rad and the reference's own "
                                f"precision)", PRECISION_COLUMNS, _rows(_named_once(rows)),
                                "angle: largest difference, radians, and where; ulp: of the table's dtype at the "
                                "amplitude; reference to float64: its own limit, for information"))
            marks = [c for c in CHECKPOINTS if any(c < t.length for t in judged)]
            growth: list[tuple[bool, tuple[str, ...]]] = [
                (t.diverges, (t.layer, _table_name(t), *_growth(t, marks))) for t in judged]
            tables.append(Table("largest angle error below each position (to reference / to float64)",
                                ("layer", "table", *(f"< {_short(m)}" for m in marks), "all positions"),
                                _rows(_named_once(growth))))
        checked: list[tuple[bool, tuple[str, ...]]] = [
            (c.differs, (c.layer, c.source, f"{c.angle:.2g} rad at {c.position}",
                         f"{max(c.allowed, self.max_angle_error or 0):.2g} rad", c.verdict))
            for c in self.compiled if c.angle is not None]
        if checked:
            tables.append(Table("compiled rotation (inductor) against eager", COMPILED_COLUMNS,
                                _rows(_named_once(checked))))
        return tables

    def mismatch_table(self) -> Table | None:
        """The mismatches, shown after the notes; None when there are none."""
        if not self.mismatches:
            return None
        title = f"{len(self.mismatches)} mismatch(es)" + (" with the expectation" if self.judged else "")
        return Table(title, MISMATCH_COLUMNS, tuple(Row(m.cells(), flagged=True) for m in self.mismatches))

    def to_dict(self) -> dict[str, Any]:
        """What the audit found as plain values, for ``rope-dedup audit --format json``."""
        columns = self.applied_columns()[1:]
        return {
            "headline": self.headline(),
            "static": self.static,
            "judged": self.judged,
            "bytes_before": self.report.bytes_before,
            "bytes_after": self.report.bytes_after,
            "layers": [{
                "layer": row.layer,
                "differs": list(row.differs),
                "tables": [{"table": t.name, "group": t.group, **key_values(t.key)} for t in row.tables],
                "applied": [dict(zip(columns, cells)) for cells in self._applied_cells(row)],
            } for row in self.layers],
            "pattern": self.pattern,
            "groups": {letter: list(members) for letter, members in self.groups.items()},
            "mismatches": [{"layer": m.layer, "field": m.field, "expected": m.expected, "found": m.found,
                            "worst_position": m.worst_position, "error": m.error, "fix": m.fix}
                           for m in self.mismatches],
            "skipped": [{"path": s.path, "kind": s.kind.name, "reason": s.reason} for s in self.skipped],
            "parameters_skipped": self.parameters_skipped,
            "unread": list(self.unread),
            "recomputed": list(self.recomputed),
            "errors": list(self.report.errors),
            "max_angle_error": self.max_angle_error,
            "precision": [_precision_values(t) for t in self.precision],
            "compiled": [dataclasses.asdict(c) for c in self.compiled],
        }

    def _wrong(self) -> dict[str, str]:
        return {m.layer: m.field for m in self.mismatches}

    def _applied_cells(self, row: LayerRow) -> list[tuple[str, ...]]:
        """Cells under :meth:`applied_columns` but the layer, per table ``row`` applies (or holds)."""
        wrong = self._wrong()
        cells = []
        for i, table in enumerate(row.applied):
            # Held tables show their layout (inv_freq, cos|sin, complex); applied ones what reached the multiply.
            what = table.table.layout if self.static else table.part_names
            dtype = _cell("dtype", table.angle_dtype) if self.static and table.angle_dtype else _dtypes(table)
            line = [what, table.source, _cell("theta", table.key.theta), str(table.key.dim),
                    table.key.scaling or "-", f"{table.table.amplitude:.4g}", dtype, table.span]
            if self.judged:
                spec = row.judged_as[i] if i < len(row.judged_as) else row.expected
                status = f"MISMATCH: {wrong[row.layer]}" if row.layer in wrong else (
                    "ok" if spec is not None else "not judged")
                line += [describe(spec), status]
            cells.append(tuple(line))
        return cells

    def notes(self) -> list[str]:
        """What follows the table: odd layers (lines starting with ``*``), groups, warnings, skips."""
        report = self.report
        lines = [f"* {row.layer} differs from most layers: {'; '.join(row.differs)}" for row in self.odd_layers]
        if self.pattern:
            lines += self.pattern.splitlines()
        if self.groups:
            lines.append("groups (identical content; the tables of a group would share one storage):")
            lines += [f"  {letter}: " + (f"{len(members)} tables in {', '.join(layers_of(members))}"
                                         if len(members) > 1 else f"only {members[0]}")
                      for letter, members in self.groups.items()]
        lines += [f"WARNING: {group.members[0]} has the same key as {group.conflict_with} but different content: "
                  f"kept separate" for group in report.conflicts]
        lines += [f"ERROR: {error}" for error in report.errors]
        if self.skipped:
            lines.append(f"skipped ({len(self.skipped)}):")
            lines += [f"  {skip.path}: {skip.reason}" for skip in self.skipped]
        if self.parameters_skipped:
            lines.append(f"{self.parameters_skipped} parameter(s) skipped, not listed (weights; reasons in .report.skipped)")
        if self.unread:
            lines.append(f"not read by the compiled graph, not examined ({len(self.unread)}): {', '.join(self.unread)}")
        if self.recomputed:
            shown = ", ".join(self.recomputed[:4]) + (f", ... (+{len(self.recomputed) - 4})" if len(self.recomputed) > 4 else "")
            lines.append(f"recomputed where read ({len(self.recomputed)}), audited as the values they read; groups "
                         f"are tables of one frequency vector: {shown}")
        if self.unmeasured:
            lines.append(f"{'held' if self.static else 'applied'} but in a layout the audit does not measure "
                         f"({len(self.unmeasured)}):")
            lines += [f"  {path}: {why}" for path, why in self.unmeasured]
        unjudged = [t for t in self.precision if t.verdict == "not judged"]
        if unjudged:
            lines.append(f"precision not judged ({len(unjudged)}):")
            lines += [f"  {t.source}: {t.reference}" for t in unjudged]
        unchecked = list(dict.fromkeys(f"  {c.layer} ({c.source}): {c.cause}" for c in self.compiled if c.angle is None))
        if unchecked:  # queries and keys of a layer are not checked for one reason: said once
            lines.append(f"compiled rotation not checked ({len(unchecked)}):")
            lines += unchecked
        return lines

    def __str__(self) -> str:
        """The audit as plain text no wider than :data:`~rope_dedup.core.text.TEXT_WIDTH` columns."""
        lines = wrap(self.headline())
        for table in self.tables():
            lines += [f"{table.title}:", *format_table([table.columns, *table.cells()])]
            lines += wrap(table.caption) if table.caption else []
        for line in self.notes():
            lines += wrap(line)
        mismatches = self.mismatch_table()
        if mismatches is not None:
            lines += [f"{mismatches.title}:", *format_table([mismatches.columns, *mismatches.cells()])]
        return "\n".join(lines)


def explain(model: torch.nn.Module, *example_inputs: Any, expect: Expectation | None = None, strict: bool = False,
            precision: bool = False, max_angle_error: float = DEFAULT_MAX_ANGLE_ERROR,
            **example_kwargs: Any) -> Explanation:
    """Audit ``model``'s RoPE tables: shares nothing, rewrites nothing.

    With no example inputs the audit is static and no forward runs: every buffer and plain tensor attribute
    holding a RoPE table (``inv_freq`` included) is measured, and slots that should hold one but hold
    zeros, NaN or garbage are mismatches (:mod:`rope_dedup.audit.held` states the rule). It is the line to put
    right after a model is built and initialized. With example inputs, the forward runs once under
    ``torch.no_grad()`` through ``torch.compile`` with a dry-run :class:`RopeDedupBackend` (inner
    ``eager``), so what the audit sees is what the pass would see; the graphs run through an interpreter
    that records the tables each layer applies.

    ``expect`` (a :class:`~rope_dedup.RopeSpec`, a mapping from layer-name pattern to one, a callable
    ``layer -> RopeSpec | None`` or ``"config"``) is what every table should encode: ``.mismatches`` lists
    what differs. ``"config"`` reads the model's transformers config in every form transformers 5 and 4.x
    ship (:mod:`rope_dedup.audit.expectation`); a field it cannot read is a mismatch of its own (layer
    ``(config)``, field ``config``), as is a 5.x config that also carries a legacy field with another
    value. ``strict=True`` raises :class:`~rope_dedup.audit.spec.SpecError` on an unreadable field instead.

    ``precision=True`` also judges how exactly each table is computed (:mod:`rope_dedup.audit.precision`): its
    angle and value distance from the reference implementation and from float64 math, a divergence from the
    reference past ``max_angle_error`` radians (and past the reference's own precision) being a mismatch that
    names its cause and fix; with inputs, each layer's rotation under inductor is compared with eager's too.
    """
    if not (isinstance(max_angle_error, (int, float)) and 0 <= max_angle_error < math.inf):
        raise ValueError(f"max_angle_error must be a finite number of radians >= 0, got {max_angle_error!r}")
    judging = expectation_for(expect, model, strict=strict) if expect is not None else None  # bad input fails here
    findings = [Mismatch("(config)", "config", f"rope_parameters: {c.read}",
                         f"{c.name}={c.ignored} (a legacy field: transformers 5 ignores it)", None)
                for c in config_conflicts(model)] if isinstance(expect, str) else []
    findings += [Mismatch("(config)", "config", "RoPE parameters the audit can read", line, None)
                 for line in (judging.unreadable if judging is not None else ())]
    limit = float(max_angle_error) if precision else None
    with values_in_place(model) as recomputed:  # a recomputed table is judged as the values it reads
        explanation = _audit(model, example_inputs, example_kwargs, judging, findings, limit)
        if limit is not None:
            explanation = _with_precision(explanation, model, judging, limit)
    if recomputed:
        explanation = dataclasses.replace(explanation, recomputed=tuple(recomputed))
    log.info("rope_dedup: %s audit: %d layer(s), %d distinct table(s), %d layer(s) differ from the majority, "
             "%d mismatch(es)", "static" if explanation.static else "dry-run", len(explanation.layers),
             len(explanation.groups), len(explanation.odd_layers), len(explanation.mismatches))
    return explanation


def _audit(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict, judging: Judging | None,
           findings: list[Mismatch], max_angle_error: float | None) -> Explanation:
    """The static audit without inputs, else the dry-run forward: see :func:`explain`."""
    if not example_inputs and not example_kwargs:
        held = held_tables(model, judging.judge if judging else None)
        report = share(model, backend=RopeDedupBackend(inner="eager", dry_run=True))
        explanation = _arrange(report, model, held.tables, judging, static=True, empty=held.empty, findings=findings,
                               unmeasured=held.unmeasured)
    else:
        backend = RopeDedupBackend(inner="eager", dry_run=True)
        capture = TableCapture(backend, model, max_angle_error)
        with torch.no_grad():
            caller = _fresh_caller(model, len(example_inputs), list(example_kwargs))
            with _own_recompile_budget() as compile_kwargs:
                torch.compile(caller, backend=capture, **compile_kwargs)(*example_inputs, **example_kwargs)
        if backend.graphs_compiled == 0:
            raise RuntimeError("torch.compile traced no graph of this model (it ran eagerly), so there is nothing "
                               "to audit; TORCH_LOGS=graph_breaks,recompiles shows why")
        applied = capture.tables()
        unmeasured = [(f"{layer}: {source.split(' from ')[0]}", _UNMEASURED) for layer, source in capture.unmeasured]
        compiled = tuple(capture.compiled_checks)
        capture.release()
        explanation = _arrange(backend.report_for(model), model, applied, judging, findings=findings,
                               unmeasured=unmeasured)
        explanation = dataclasses.replace(explanation, compiled=compiled)
    return explanation


def _with_precision(explanation: Explanation, model: torch.nn.Module, judging: Judging | None,
                    max_angle_error: float) -> Explanation:
    """``explanation`` with each table's precision, and a mismatch for each divergence (a table's from its
    reference, a compiled rotation's from eager's)."""
    groups = {path: letter for letter, members in explanation.groups.items() for path in members}
    unmeasured = list(explanation.unmeasured) if explanation.static else []
    found = precision_of(model, explanation.applied, static=explanation.static,
                         judge=judging.judge if judging is not None else None, groups=groups, unmeasured=unmeasured,
                         max_angle_error=max_angle_error)
    mismatches = list(explanation.mismatches)
    for table in found:
        if table.diverges and table.to_reference is not None:
            what = "applied" if table.applied else "held"
            mismatches.append(Mismatch(table.layer, "precision", f"{table.source} ({what}) as its reference: "
                                       f"{table.reference}, within {max_angle_error:g} rad",
                                       table.cause, table.to_reference.position, table.to_reference.angle, table.fix))
    worst: dict[str, CompiledCheck] = {}  # queries and keys of a layer rotate alike: its worst one is the finding
    for check in explanation.compiled:
        if check.differs and (check.layer not in worst or check.angle > worst[check.layer].angle):  # type: ignore[operator]
            worst[check.layer] = check
    for check in worst.values():
        if check.differs:
            mismatches.append(Mismatch(check.layer, "compiled precision",
                                       f"inductor rotates as eager does (within {max(max_angle_error, check.allowed):.2g} rad)",
                                       f"{check.angle:.2g} rad from eager: {check.cause}", check.position, check.angle,
                                       check.fix))
    return dataclasses.replace(explanation, precision=tuple(found), mismatches=tuple(mismatches),
                               max_angle_error=max_angle_error)


_UNMEASURED = "computed from cos/sin, at rows no whole positions explain"


@contextlib.contextmanager
def _own_recompile_budget() -> Iterator[dict[str, Any]]:
    """Keyword arguments for the audit's ``torch.compile`` that keep its frames' compiled entries apart.

    A graph break inside a layer makes dynamo compile frames of code every transformers model shares
    (``GradientCheckpointingLayer.__call__``, ``dynamic_rope_update``'s wrapper, ``create_causal_mask``),
    one entry per architecture audited. The ninth such entry hits ``recompile_limit``, and dynamo then
    runs that frame and everything it calls eagerly (``RUN_ONLY``, recursively, for good): later audits
    saw no table applied. ``isolate_recompiles=True`` (torch 2.13+) gives each audit its own entries,
    limit and ``RUN_ONLY`` state. Older torch has no such option: there the limit is lifted while the
    audit compiles, so that audits cannot use it up, though their entries still count for later
    compiles of the same code (``torch._dynamo.reset()`` clears them).
    """
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        yield {"isolate_recompiles": True}
        return
    with torch._dynamo.config.patch(recompile_limit=_AUDIT_RECOMPILE_LIMIT):
        yield {}


def _fresh_caller(model: torch.nn.Module, arity: int, keywords: list[str]) -> Callable:
    """A function with a code object of its own that calls ``model`` with ``arity`` positional inputs.

    Dynamo keeps compiled entries on the code object it starts from, and stops compiling a code object
    after ``recompile_limit`` (8) entries. Compiling ``model`` itself would leave this dry run's entry
    on its ``forward`` for good: after eight audits in one process the user's own ``torch.compile`` of
    that class would silently run eagerly. A fresh code object takes its entry with it when dropped.
    Inputs are named parameters, not ``*args``: dynamo names ``*args`` items ``args[0]``, which reads
    as state, not as a forward input.
    """
    inputs = [f"input{i}" for i in range(arity)]
    call = ", ".join(inputs + [f"{k}={k}" for k in keywords])
    source = (f"def bind(model):\n"
              f"    def audit_forward({', '.join(inputs + keywords)}):\n"
              f"        return model({call})\n"
              f"    return audit_forward\n")
    namespace: dict[str, Any] = {}
    # torch 2.12 and older wrap a callable whose source file inspect cannot find and trace the wrapper,
    # which hides the model's sources (persistence unreadable) and shares one code object across audits.
    # A linecache entry makes the generated source findable, so every torch treats it as a function.
    filename = "<rope_dedup.explain>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return namespace["bind"](model)


def _arrange(report: DedupReport, model: torch.nn.Module, applied: list[AppliedTable], judging: Judging | None, *,
             static: bool = False, empty: Sequence[EmptySlot] = (), findings: Sequence[Mismatch] = (),
             unmeasured: Sequence[tuple[str, str]] = ()) -> Explanation:
    """Arrange by layer. ``applied`` are the tables applied, or held when ``static``: a held table is judged
    by its layer and its own path (a model-level table named for a layer type), an applied one by its layer."""
    letters = [_letter(i) for i in range(len(report.groups))]
    by_layer: dict[str, list[TableRow]] = {}
    for letter, group in zip(letters, report.groups):
        for member in group.members:
            layer, name = split_layer(member)
            by_layer.setdefault(layer, []).append(TableRow(layer, name, group.key, letter))
    applied_by_layer: dict[str, list[AppliedTable]] = {}
    for table in applied:
        applied_by_layer.setdefault(table.layer, []).append(table)
    names = sorted(set(by_layer) | set(applied_by_layer), key=natural_order)
    # Layers are compared by what they apply when anything was seen applied, else by what they hold.
    if applied_by_layer:
        signatures = {layer: _signature((t.part_names, t.key) for t in tables) for layer, tables in applied_by_layer.items()}
    else:
        signatures = {layer: _signature((r.name, r.key) for r in rows) for layer, rows in by_layer.items()}
    differs, pattern = ({}, None) if judging is not None else _compare_layers(
        [layer for layer in names if layer in signatures], signatures)

    mismatches: dict[tuple, Mismatch] = {(m.layer, m.field, m.found): m for m in findings}
    judged: dict[int, Expected] = {}
    verdicts: dict[int, tuple[str, ...]] = {}
    for table in applied:
        expected = judging.judge(table.layer, table.source if static else None) if judging else None
        if static and isinstance(expected, NoRope):
            expected = None  # a table held where none is applied: only a forward can tell
        judged[id(table)], found = check_expected(table, expected)
        verdicts[id(table)] = tuple(m.field for m in found)
        for mismatch in found:
            # Once per layer, field and expectation: cos and sin say the same, Gemma 3's two tables do not.
            mismatches.setdefault((mismatch.layer, mismatch.field, judged[id(table)]), mismatch)
    judged_as = {layer: tuple(judged[id(t)] for t in tables) for layer, tables in applied_by_layer.items()}
    expected_of = {layer: next((s for s in specs if s is not None), None) for layer, specs in judged_as.items()}
    layers = tuple(LayerRow(layer, tuple(sorted(by_layer.get(layer, []), key=lambda r: r.name)),
                            differs.get(layer, ()), tuple(applied_by_layer.get(layer, [])), expected_of.get(layer),
                            judged_as.get(layer, ()),
                            tuple(verdicts[id(t)] for t in applied_by_layer.get(layer, [])))
                   for layer in names)
    for slot in empty:
        mismatches[(slot.layer, "content", slot.path)] = Mismatch(slot.layer, "content", "a RoPE table",
                                                                  f"{slot.path}: {slot.found}", None)
    if judging is not None and not static:
        for mismatch in _layers_without_rope(model, judging, applied_by_layer):
            mismatches[(mismatch.layer, mismatch.field)] = mismatch
    # No layer expected to apply RoPE (all linear attention, a config saying none, one the reader could not
    # read: that is its own finding), no "nothing applied" line.
    expects_rope = judging is not None and not judging.unreadable and (
        not judging.stack or any(map(candidates, judging.stack.values())))
    if expects_rope and not applied and not empty:
        none = "no RoPE table held by the model" if static else "no RoPE table applied"
        if unmeasured and not static:  # applied, not absent: the audit says it could not read them
            none = f"RoPE applied that the audit cannot measure ({unmeasured[0][0]}: {unmeasured[0][1]})"
        mismatches[(MODEL, "rope")] = Mismatch(MODEL, "rope", "RoPE applied in attention layers", none, None)
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    skipped = tuple(s for s in report.skipped if s.path not in parameters)
    seen = {m for g in report.groups for m in g.members} | {s.path for s in report.skipped}
    unread = tuple(path for path in tensor_paths(model).values() if path not in seen and path not in parameters)
    return Explanation(
        layers=layers,
        groups={letter: tuple(g.members) for letter, g in zip(letters, report.groups)},
        skipped=skipped,
        parameters_skipped=len(report.skipped) - len(skipped),
        unread=unread,
        report=report,
        mismatches=tuple(mismatches.values()),
        pattern=pattern,
        judged=judging is not None,
        static=static,
        unmeasured=tuple(unmeasured),
    )


def _layers_without_rope(model: torch.nn.Module, judging: Judging,
                         applied_by_layer: dict[str, list[AppliedTable]]) -> list[Mismatch]:
    """Layers the expectation gives RoPE that applied none, where a layer built of the same modules did:
    the model's code turns RoPE off there (Flint's full-attention layers). Layers built otherwise (linear
    attention, Mamba, convolutions) apply none by design and are left alone."""
    def modules_of(layer: str) -> tuple[str, ...]:
        return tuple(sorted({type(m).__name__ for m in model.get_submodule(layer).modules()}))

    applying = {modules_of(layer): layer for layer in judging.stack if layer in applied_by_layer}
    found = []
    for layer, expected in judging.stack.items():
        if layer in applied_by_layer or not candidates(expected):
            continue
        other = applying.get(modules_of(layer))
        if other is None:
            continue
        kind = judging.kinds.get(layer)
        found.append(Mismatch(layer, "rope", describe(expected) + (f" (layer type {kind})" if kind else ""),
                              f"no RoPE table applied, though {other}"
                              + (f" ({judging.kinds[other]})" if judging.kinds.get(other) else "")
                              + ", built of the same modules, applies one: the model's code turns RoPE off here",
                              None))
    return found


def key_values(key: RopeKey) -> dict[str, Any]:
    """A key's fields as JSON values: numbers stay numbers, the rest is text."""
    return {name: value if value is None or isinstance(value, (int, float)) else _cell(name, value)
            for name, value in ((name, getattr(key, name)) for name in _KEY_FIELDS)}


def key_cells(key: RopeKey) -> list[str]:
    """A key's fields as short strings, in :class:`RopeKey` field order (for tables)."""
    return [_cell(name, getattr(key, name)) for name in _KEY_FIELDS]


def _cell(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name == "theta":
        return f"{value:g}"
    if name == "dtype":
        return str(value).removeprefix("torch.")
    return str(value)


def _signature(tables: Iterable[tuple[str, RopeKey]]) -> tuple:
    """What a layer's tables are, as sorted (name, key) pairs: layers with equal signatures are alike."""
    return tuple(sorted(tables, key=lambda item: (item[0], str(item[1]))))


def _compare_layers(layers: list[str], signatures: dict[str, tuple]) -> tuple[dict[str, tuple[str, ...]], str | None]:
    """Layers that differ from the majority, or, for a regular mix, a description of the pattern instead.

    A mix that repeats every k layers for at least two periods (Gemma 3's 5 local : 1 global), or one
    with no majority at all (ModernBERT's 2 + 2), is by design as often as not: described, nobody marked.
    """
    sequence = [signatures[layer] for layer in layers]
    counts = Counter(sequence).most_common()
    if len(counts) < 2:
        return {}, None
    period = next((k for k in range(2, len(sequence) // 2 + 1)
                   if all(sequence[i] == sequence[i + k] for i in range(len(sequence) - k))), None)
    if period is None and counts[0][1] > counts[1][1]:
        majority = counts[0][0]
        return {layer: _differences(signatures[layer], majority, "most layers") for layer in layers
                if signatures[layer] != majority}, None
    reference = counts[0][0]
    members = {sig: [layer for layer in layers if signatures[layer] == sig] for sig, _ in counts}
    others = ", ".join(members[reference])
    head = (f"layers follow a pattern that repeats every {period} layers (not marked as odd):" if period
            else "no majority among the layers (not marked as odd):")
    lines = [f"  {', '.join(members[sig])}: {'; '.join(_differences(sig, reference, others))}"
             for sig, _ in counts[1:]]
    return {}, "\n".join([head, *lines])


def _differences(signature: tuple, reference: tuple, label: str) -> tuple[str, ...]:
    """Key fields whose values here are not the reference's, e.g. ``theta 1e+06 (most layers: 10000)``."""
    differs = []
    for name in _KEY_FIELDS:
        mine = {_cell(name, getattr(key, name)) for _, key in signature}
        theirs = {_cell(name, getattr(key, name)) for _, key in reference}
        if mine != theirs:
            differs.append(f"{name} {', '.join(sorted(mine))} ({label}: {', '.join(sorted(theirs)) or 'none'})")
    if not differs:  # same keys, different tables: a layer with more, fewer or differently named tables
        names = sorted(name for name, _ in signature)
        differs.append(f"tables {', '.join(names)} ({label}: {', '.join(name for name, _ in reference)})")
    return tuple(differs)


def _rows(rows: list[tuple[bool, tuple[str, ...]]]) -> tuple[Row, ...]:
    """Flagged cells as table rows; a row that names its layer starts a section."""
    return tuple(Row(cells, flagged, section=bool(cells[0]) and i > 0) for i, (flagged, cells) in enumerate(rows))


def _marks_a_row(rows: list[tuple[bool, tuple[str, ...]]]) -> bool:
    return any(flagged for flagged, _ in rows)


def _dtypes(table: AppliedTable) -> str:
    dtype = _cell("dtype", table.dtype)
    if table.angle_dtype is not None and table.angle_dtype != table.dtype:
        dtype += f" (angles {_cell('dtype', table.angle_dtype)})"
    return dtype


def _verdict(table: TablePrecision) -> str:
    if table.diverges:
        return f"DIVERGES from {table.first_position}"
    return "matches" + (f" ({table.cause})" if table.cause else "")


def _short(position: int) -> str:
    """4096 -> 4k, 1048576 -> 1M."""
    return f"{position >> 20}M" if position >= 1 << 20 and position % (1 << 20) == 0 else f"{position >> 10}k"


def _growth(table: TablePrecision, marks: list[int]) -> list[str]:
    """At each mark and over all positions: the largest angle error to the reference / to float64."""
    mine = dict(table.to_reference.growth) if table.to_reference else {}
    exact = dict(table.to_float64.growth) if table.to_float64 else {}

    def cell(mark: int) -> str:
        if mark not in mine:
            return "-"
        return f"{mine[mark]:.2g} / " + (f"{exact[mark]:.2g}" if mark in exact else "-")

    end = table.to_reference.growth[-1][0] if table.to_reference else None
    return [cell(mark) if end is not None and mark < end else "-" for mark in marks] + [
        cell(end) if end is not None else "-"]


def _table_name(table: TablePrecision) -> str:
    """A held table's path inside its layer (the layer has its own column); an applied table's source."""
    return split_layer(table.source)[1] if not table.applied and table.source.startswith(table.layer + ".") \
        else table.source


def _named_once(rows: list[tuple[bool, tuple[str, ...]]]) -> list[tuple[bool, tuple[str, ...]]]:
    """Rows whose first cell (the layer) repeats the row above's show it blank."""
    named = []
    for i, (flagged, cells) in enumerate(rows):
        same = i > 0 and rows[i - 1][1][0] == cells[0]
        named.append((flagged, ("" if same else cells[0], *cells[1:])))
    return named


def _precision_values(table: TablePrecision) -> dict[str, Any]:
    """A :class:`TablePrecision` as JSON values (dtypes as their names)."""
    values = dataclasses.asdict(table)
    values["dtype"] = _cell("dtype", table.dtype)
    return values


def _letter(index: int) -> str:
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("A") + rest) + letters
    return letters
