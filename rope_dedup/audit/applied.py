"""What each attention layer applies: the RoPE tables its queries and keys are multiplied by.

Tables a layer owns are only part of the story: transformers 5 and litgpt compute cos/sin once per
forward at model level and pass them down, other code computes them inside each layer from an
``inv_freq`` and the positions. What matters is the value that reaches the rotary multiply. So the
audit runs each compiled graph once through :class:`TableCapture` (a ``torch.fx.Interpreter``) and
keeps, for every multiply with a RoPE table on one side and a larger tensor (queries, keys) on the
other, that table's value, measured with :func:`recognize_rope_table` at the positions it covers, and
names the layer from the multiply's ``nn_module_stack``: dynamo records the module each node ran in.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.fx

from rope_dedup.audit.layers import layer_of
from rope_dedup.tables.keys import RopeKey, infer_key
from rope_dedup.tables.layout import Arrangement, Layout, Part, Repeat
from rope_dedup.tables.recognize import RopeTable, recognize_rope_table
from rope_dedup.tensors import Origin, tensor_paths
from rope_dedup.core.sources import attribute_origin, module_path, placeholder_origin

_MULTIPLY = {operator.mul, torch.mul, torch.Tensor.mul, "mul"}
_TRIG = {torch.cos, torch.sin, torch.polar, torch.Tensor.cos, torch.Tensor.sin, "cos", "sin"}


@dataclass(frozen=True)
class AppliedTable:
    """A RoPE table one layer applied: where it came from, what it encodes, its values by position."""

    layer: str  # "model.layers.5": the module path of the multiply, up to its first numeric component
    source: str  # "computed in model.rotary_emb from model.rotary_emb.inv_freq (float32)", or a buffer's path
    table: RopeTable  # what recognition measured
    key: RopeKey
    parts: dict[str, torch.Tensor]  # "cos" / "sin" / "angle" -> (positions, dim/2) float64 values
    positions: torch.Tensor  # int64 (positions,): the position of each row of ``parts``
    dtype: torch.dtype  # of the applied values
    angle_dtype: torch.dtype | None  # of the angles cos/sin were taken of, when computed in the graph

    @property
    def part_names(self) -> str:
        return "+".join(self.parts)

    @property
    def span(self) -> str:
        return f"{int(self.positions.min())}..{int(self.positions.max())}"


class TableCapture:
    """A ``torch.compile`` backend that hands each graph to ``backend`` (for its report) and then runs
    it itself, through an interpreter that records the RoPE tables each layer applies."""

    def __init__(self, backend: Callable, model: torch.nn.Module) -> None:
        self.backend = backend
        self.paths = tensor_paths(model)
        self.captured: list[_Candidate] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence, **kwargs: Any) -> Callable:
        compiled = self.backend(gm, example_inputs, **kwargs)
        intern = getattr(compiled, "intern_inputs", None)  # the dry run still records tables seen at run time

        def run(*args: Any) -> Any:
            if intern is not None:
                intern(args)
            interpreter = _Interpreter(gm, self.paths)
            result = interpreter.run(*args)
            self.captured += interpreter.candidates
            return result

        return run

    def tables(self) -> list[AppliedTable]:
        """Every table applied, once per layer and source; a cos and a sin from one place are measured
        together (angles from both are exact where a lone cos or sin is not)."""
        found: list[AppliedTable | None] = []
        lone: dict[tuple, list[tuple[str, _Candidate, torch.Tensor, torch.Tensor]]] = {}
        for candidate in self.captured:
            measured = _measure(candidate)
            if measured is None:
                continue
            kind, rows, positions = measured
            if kind not in ("cos", "sin"):
                found.append(_applied(candidate, rows, positions))
                continue
            waiting = lone.setdefault((candidate.layer, rows.shape, positions.numel()), [])
            partner = next((entry for entry in waiting if entry[0] != kind), None)
            if partner is None:
                waiting.append((kind, candidate, rows, positions))
                continue
            waiting.remove(partner)
            mine, theirs = (rows, candidate), (partner[2], partner[1])
            (cos, cos_from), (sin, sin_from) = (mine, theirs) if kind == "cos" else (theirs, mine)
            source = cos_from.source if cos_from.source == sin_from.source else f"{cos_from.source} + {sin_from.source}"
            pair = _applied(replace(candidate, source=source), torch.cat([cos, sin], dim=-1), positions)
            found += [pair] if pair is not None else [_applied(candidate, rows, positions), _applied(*partner[1:])]
        found += [_applied(*entry[1:]) for waiting in lone.values() for entry in waiting]
        unique: dict[tuple, AppliedTable] = {}
        for table in found:  # q and k of one layer read the same table: list it once
            if table is not None:
                unique.setdefault((table.layer, table.source, table.part_names, table.key), table)
        return list(unique.values())


@dataclass
class _Candidate:
    layer: str
    source: str
    value: torch.Tensor  # the multiply's table operand, as applied
    position_ids: list[torch.Tensor]  # integer tensors among its inputs, nearest first
    angle_dtype: torch.dtype | None


class _Interpreter(torch.fx.Interpreter):
    """Runs a graph and keeps each multiply's RoPE-shaped operand, with what it was computed from."""

    def __init__(self, gm: torch.fx.GraphModule, paths: dict[int, str]) -> None:
        super().__init__(gm)
        self.paths = paths
        self.integers: dict[torch.fx.Node, torch.Tensor] = {}  # small integer tensors: candidate positions
        self.state: dict[torch.fx.Node, str] = {}  # placeholders and attributes holding module state
        self.angle_dtypes: dict[torch.fx.Node, torch.dtype] = {}  # trig nodes -> dtype of their input
        self.candidates: list[_Candidate] = []
        self._seen: set[torch.fx.Node] = set()

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        if not isinstance(result, torch.Tensor):
            return result
        if node.op in ("placeholder", "get_attr"):
            self._note_state(node, result)
        if not (result.dtype.is_floating_point or result.dtype.is_complex or result.dtype == torch.bool) \
                and result.dim() <= 3:
            self.integers[node] = result
        if node.target in _TRIG and node.args and isinstance(self.env.get(node.args[0]), torch.Tensor):  # type: ignore[arg-type]
            self.angle_dtypes[node] = self.env[node.args[0]].dtype  # type: ignore[index]
        if node.target in _MULTIPLY and node.op in ("call_function", "call_method") and len(node.args) == 2:
            for mine, other in (node.args, node.args[::-1]):
                if isinstance(mine, torch.fx.Node) and isinstance(other, torch.fx.Node) and mine not in self._seen:
                    self._consider(node, mine, self.env.get(mine), self.env.get(other), result)
        return result

    def _note_state(self, node: torch.fx.Node, value: torch.Tensor) -> None:
        path = self.paths.get(id(value))
        if path is None:
            where = placeholder_origin(node) if node.op == "placeholder" else attribute_origin(self.module, node.target)  # type: ignore[arg-type]
            path = where.path if where is not None and where.origin is not Origin.INPUT else None
        if path is not None:
            self.state[node] = f"{path} ({str(value.dtype).removeprefix('torch.')})"

    def _consider(self, multiply: torch.fx.Node, node: torch.fx.Node, value: Any, other: Any,
                  result: torch.Tensor) -> None:
        """Keep ``value`` if it is a table applied to ``other``: broadcast into it, not the other way round."""
        if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor)):
            return
        if not (value.dtype.is_floating_point or value.dtype.is_complex) or value.dim() < 2:
            return
        if other.numel() < value.numel() or result.shape != other.shape:
            return
        if sum(1 for s in value.shape if s != 1) < 2:
            return
        self._seen.add(node)
        ancestors = _ancestors(node)
        trig = next((n for n in ancestors if n in self.angle_dtypes), None)
        states = [self.state[n] for n in ancestors if n in self.state]
        if trig is not None:
            source = f"computed in {module_path(trig) or 'forward'}" + (f" from {', '.join(states)}" if states else "")
        else:
            source = ", ".join(states) or "a forward input"
        self.candidates.append(_Candidate(
            layer=layer_of(module_path(multiply)),
            source=source,
            value=value.detach().clone(),
            position_ids=[self.integers[n] for n in ancestors if n in self.integers],
            angle_dtype=self.angle_dtypes.get(trig) if trig is not None else None,
        ))


def _ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes ``node`` depends on, nearest first (breadth-first)."""
    order, seen, queue = [], {node}, deque([node])
    while queue:
        current = queue.popleft()
        order.append(current)
        for parent in current.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return order


def _measure(candidate: _Candidate) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """(kind, rows by position, positions) of a recognized candidate; None if it is no RoPE table here."""
    value = candidate.value.reshape([s for s in candidate.value.shape if s != 1])
    if value.dim() not in (2, 3):
        return None
    batch = value.reshape(-1, value.shape[-1])
    # The positions are the nearest integer input shaped like the rows (position_ids, cache_position), when
    # they cover 0..L-1; else the rows are positions 0, 1, ... themselves (a cached table sliced [:seq]).
    for ids in candidate.position_ids + [None]:
        if ids is None:
            if value.dim() == 3 and not bool((value == value[:1]).all()):
                return None  # per-sequence tables without their positions: nothing to measure against
            rows = value if value.dim() == 2 else value[0]
            positions = torch.arange(rows.shape[0])
        else:
            if ids.numel() != batch.shape[0]:
                continue
            flat = ids.reshape(-1).to(torch.int64).cpu()
            positions, first = _first_occurrence(flat)
            if not torch.equal(positions, torch.arange(positions.numel())):
                continue
            rows = batch[first.to(batch.device)]
        found = recognize_rope_table(rows)
        if isinstance(found, RopeTable) and found.length is not None:
            single = found.layout.single
            kind = single.value if single in (Part.COS, Part.SIN) else str(found.layout)
            return kind, rows, positions
    return None


def _first_occurrence(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct values of ``flat`` and the index of each one's first occurrence."""
    positions, inverse = torch.unique(flat, return_inverse=True)
    first = torch.full((positions.numel(),), flat.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(flat.numel()), reduce="amin")
    return positions, first


def _applied(candidate: _Candidate, rows: torch.Tensor, positions: torch.Tensor) -> AppliedTable | None:
    found = recognize_rope_table(rows)
    if not isinstance(found, RopeTable):
        return None
    return AppliedTable(
        layer=candidate.layer,
        source=candidate.source,
        table=found,
        key=infer_key(found, rows),
        parts=table_parts(rows, found.layout),
        positions=positions,
        dtype=rows.dtype,
        angle_dtype=candidate.angle_dtype,
    )


def table_parts(rows: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """A recognized (positions, width) table as float64 ``cos`` / ``sin`` / ``angle`` blocks of unique columns."""
    if layout.arrangement is Arrangement.COMPLEX:
        rows = rows.to(torch.complex128)
        return {"cos": rows.real, "sin": rows.imag}
    rows = rows.to(torch.float64)
    if layout.arrangement is Arrangement.STACKED:
        return {part.value: rows[..., i] for i, part in enumerate(layout.parts)}
    parts = {}
    for part, piece in zip(layout.parts, rows.split(rows.shape[-1] // len(layout.parts), dim=-1)):
        if layout.repeat is Repeat.HALVES:
            piece = piece[:, : piece.shape[-1] // 2]
        elif layout.repeat is Repeat.INTERLEAVED:
            piece = piece[:, 0::2]
        parts[part.value] = piece
    return parts
