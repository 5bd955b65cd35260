"""The RoPE audit: what each layer's tables encode, which would share, and what was left alone and why.

:func:`explain` compiles the model once with a dry-run backend (nothing is aliased or rewritten) and
arranges the report by layer, so that a user sees at a glance that layer 5 uses theta 1e6 while the
others use 1e4, or that a theta they configured never reached the tables.
"""

from __future__ import annotations

import linecache
import logging
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from rope_dedup.backend import RopeDedupBackend
from rope_dedup.keys import RopeKey
from rope_dedup.report import DedupReport, Skip, format_bytes, format_table, tensor_paths

log = logging.getLogger("rope_dedup")

_KEY_FIELDS = tuple(f.name for f in fields(RopeKey))
COLUMNS = ("layer", "table", "group", *_KEY_FIELDS)


@dataclass(frozen=True)
class TableRow:
    """One RoPE table: where it lives, its inferred key, and the group of identical tables it belongs to."""

    layer: str  # "layers.5" (up to the first numeric path component), else the owning module
    name: str  # the rest of the path inside the layer: "attention.rope.cos"
    key: RopeKey
    group: str  # "A", "B", ...: tables with the same letter have identical content


@dataclass(frozen=True)
class LayerRow:
    """A layer's tables, and how its keys differ from the majority of layers (empty when they don't)."""

    layer: str
    tables: tuple[TableRow, ...]
    differs: tuple[str, ...]

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

    @property
    def odd_layers(self) -> list[LayerRow]:
        return [row for row in self.layers if row.odd]

    def headline(self) -> str:
        tables = sum(len(row.tables) for row in self.layers)
        return (f"RoPE audit: {tables} table(s) in {len(self.layers)} layer(s), {len(self.groups)} distinct; "
                f"sharing would take {format_bytes(self.report.bytes_before)} -> {format_bytes(self.report.bytes_after)}")

    def rows(self) -> list[tuple[bool, tuple[str, ...]]]:
        """(layer differs from the majority, cells under :data:`COLUMNS`) per table; the layer named once."""
        rows = []
        for row in self.layers:
            for i, table in enumerate(row.tables):
                layer = (row.layer + (" *" if row.odd else "")) if i == 0 else ""
                rows.append((row.odd, (layer, table.name, table.group, *key_cells(table.key))))
        return rows

    def notes(self) -> list[str]:
        """What follows the table: odd layers (lines starting with ``*``), groups, warnings, skips."""
        report = self.report
        lines = [f"* {row.layer} differs from most layers: {'; '.join(row.differs)}" for row in self.odd_layers]
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
        return lines

    def __str__(self) -> str:
        table = format_table([COLUMNS] + [cells for _, cells in self.rows()]) if self.layers else []
        return "\n".join([self.headline(), *table, *self.notes()])


def explain(model: torch.nn.Module, *example_inputs: Any, **example_kwargs: Any) -> Explanation:
    """Audit ``model``'s RoPE tables with one dry-run forward: shares nothing, rewrites nothing.

    The forward runs once under ``torch.no_grad()`` through ``torch.compile`` with a dry-run
    :class:`RopeDedupBackend` (inner ``eager``), so what the audit sees is what the pass would see.
    """
    backend = RopeDedupBackend(inner="eager", dry_run=True)
    with torch.no_grad():
        caller = _fresh_caller(model, len(example_inputs), list(example_kwargs))
        torch.compile(caller, backend=backend)(*example_inputs, **example_kwargs)
    if backend.graphs_compiled == 0:
        raise RuntimeError("torch.compile traced no graph of this model (it ran eagerly), so there is nothing "
                           "to audit; TORCH_LOGS=graph_breaks,recompiles shows why")
    explanation = _arrange(backend.report_for(model), model)
    log.info("rope_dedup: audit: %d layer(s), %d distinct table(s), %d layer(s) differ from the majority",
             len(explanation.layers), len(explanation.groups), len(explanation.odd_layers))
    return explanation


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


def _arrange(report: DedupReport, model: torch.nn.Module) -> Explanation:
    letters = [_letter(i) for i in range(len(report.groups))]
    by_layer: dict[str, list[TableRow]] = {}
    for letter, group in zip(letters, report.groups):
        for member in group.members:
            layer, name = split_layer(member)
            by_layer.setdefault(layer, []).append(TableRow(layer, name, group.key, letter))
    signatures = {layer: _signature(rows) for layer, rows in by_layer.items()}
    majority = Counter(signatures.values()).most_common(1)[0][0] if signatures else ()
    layers = tuple(LayerRow(layer, tuple(sorted(rows, key=lambda r: r.name)), _differences(rows, majority))
                   for layer, rows in sorted(by_layer.items(), key=lambda item: _natural(item[0])))
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
    )


def split_layer(path: str) -> tuple[str, str]:
    """``layers.5.attention.rope.cos`` -> (``layers.5``, ``attention.rope.cos``); no index: (owner, attribute)."""
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1]), ".".join(parts[i + 1:])
    return ".".join(parts[:-1]) or "(model)", parts[-1]


def layers_of(paths: tuple[str, ...] | list[str]) -> list[str]:
    """Distinct layers of ``paths``, in model order."""
    return sorted({split_layer(p)[0] for p in paths}, key=_natural)


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


def _signature(rows: list[TableRow]) -> tuple:
    return tuple(sorted((row.name, row.key) for row in rows))


def _differences(rows: list[TableRow], majority: tuple) -> tuple[str, ...]:
    """Key fields whose values in this layer are not the majority's, e.g. ``theta 1e+06 (most layers: 10000)``."""
    if _signature(rows) == majority:
        return ()
    differs = []
    for name in _KEY_FIELDS:
        mine = {_cell(name, getattr(row.key, name)) for row in rows}
        theirs = {_cell(name, getattr(key, name)) for _, key in majority}
        if mine != theirs:
            differs.append(f"{name} {', '.join(sorted(mine))} (most layers: {', '.join(sorted(theirs)) or 'none'})")
    if not differs:  # same keys, different tables: a layer with more, fewer or differently named tables
        names = sorted(row.name for row in rows)
        differs.append(f"tables {', '.join(names)} (most layers: {', '.join(name for name, _ in majority)})")
    return tuple(differs)


def _letter(index: int) -> str:
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("A") + rest) + letters
    return letters


def _natural(path: str) -> tuple:
    """Sort ``layers.10`` after ``layers.9``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))
