"""What each attention layer applies: the RoPE tables its queries and keys are multiplied by.

Tables a layer owns are only part of the story: transformers 5 and litgpt compute cos/sin once per
forward at model level and pass them down, other code computes them inside each layer from an
``inv_freq`` and the positions. What matters is the value that reaches the rotary multiply. So the
audit runs each compiled graph once through :class:`TableCapture` (a ``torch.fx.Interpreter``) and
keeps, for every multiply with a RoPE table on one side and a larger tensor (queries, keys) on the
other, that table's value, measured with :func:`recognize_rope_table` at the positions it covers, and
names the layer from the multiply's ``nn_module_stack``: dynamo records the module each node ran in.

The positions are the integer tensors the table was computed from, in its graph or in the earlier graph
that computed it. Positions on several axes (M-RoPE's 3-D ``position_ids``, a vision tower's (h, w) grid)
give the table a 1-D sequence gets and the axis of each column (:mod:`rope_dedup.tables.axes`); cos/sin
applied where nothing could be measured are listed as unmeasured, never dropped in silence.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence, Union

import torch
import torch.fx
import torch.utils._pytree as pytree

from rope_dedup.audit.compiled import CompiledCheck, check_compiled, rotations
from rope_dedup.audit.layers import layer_of
from rope_dedup.tables.axes import axes_label, axis_positions, split_axes
from rope_dedup.tables.keys import RopeKey, infer_key
from rope_dedup.tables.layout import Arrangement, Layout, Part, Repeat
from rope_dedup.tables.recognize import RopeTable, recognize_rope_table
from rope_dedup.tensors import Origin, tensor_paths
from rope_dedup.core.sources import attribute_origin, module_path, module_root, placeholder_origin, source_root

_MULTIPLY = {operator.mul, torch.mul, torch.Tensor.mul, "mul"}
_TRIG = {torch.cos, torch.sin, torch.polar, torch.Tensor.cos, torch.Tensor.sin, "cos", "sin"}
# A table over several axes: (the axis of each column, None where the positions cannot tell; how many axes).
Axes = Union[tuple[tuple[Union[int, None], ...], int], None]


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
    # A table over several position axes (2-D axial, M-RoPE): the axis of each column of ``parts`` (None: any),
    # and how many axes the positions had; ``parts`` then holds the rows a 1-D sequence gets (axes.py).
    axes: tuple[int | None, ...] = ()
    axis_count: int = 0

    @property
    def part_names(self) -> str:
        return "+".join(self.parts)

    @property
    def span(self) -> str:
        return f"{int(self.positions.min())}..{int(self.positions.max())}"


class TableCapture:
    """A ``torch.compile`` backend that hands each graph to ``backend`` (for its report) and then runs
    it itself, through an interpreter that records the RoPE tables each layer applies. Given
    ``max_angle_error``, it also runs each graph compiled by inductor and compares every rotation with eager's
    (:mod:`rope_dedup.audit.compiled`)."""

    def __init__(self, backend: Callable, model: torch.nn.Module, max_angle_error: float | None = None) -> None:
        self.backend = backend
        self.max_angle_error = max_angle_error
        self.compiled_checks: list[CompiledCheck] = []
        self._inductor: dict[int, Any] = {}  # id(graph) -> its compiled copy that returns the rotations
        self.paths = tensor_paths(model)
        self.captured: list[_Candidate] = []
        self.computed: dict[int, tuple] = {}  # tables a graph returned, for the graphs that receive them
        # (layer, source) of cos/sin applied in a layer where no table could be measured: see tables()
        self.unmeasured: list[tuple[str, str]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence, **kwargs: Any) -> Callable:
        # Each placeholder's frame local and path from it, read now: dynamo drops the sources after compiling.
        sources = {node: (source_root(node), placeholder_origin(node).path) for node in gm.graph.nodes
                   if node.op == "placeholder"}
        compiled = self.backend(gm, example_inputs, **kwargs)
        intern = getattr(compiled, "check", None)  # the dry run still records tables seen at run time

        def run(*args: Any) -> Any:
            if intern is not None:
                intern(args)
            interpreter = _Interpreter(gm, self.paths, sources, self.computed)
            result = interpreter.run(*args)
            self.captured += interpreter.candidates
            if self.max_angle_error is not None:
                found = rotations(gm, interpreter.multiplies, _is_rope)
                if found:
                    self.compiled_checks += check_compiled(gm, example_inputs, args, found, self.max_angle_error,
                                                           self._inductor)
            self.computed.update((id(value), (value, *rest)) for value, *rest in interpreter.computed_outputs(result))
            return result

        return run

    def release(self) -> None:
        """Drop the values captured: the compiled entries dynamo keeps on shared code hold this backend."""
        self.captured.clear()
        self.computed.clear()
        self.unmeasured.clear()
        self._inductor.clear()

    def tables(self) -> list[AppliedTable]:
        """Every table applied, once per layer and source; a cos and a sin from one place are measured
        together (angles from both are exact where a lone cos or sin is not). Values computed from a cos or
        a sin and applied in a layer where nothing could be measured go to :attr:`unmeasured` (angles over
        coordinates that are not whole positions: DINOv3's patch centres in [-1, 1])."""
        found: list[AppliedTable | None] = []
        unread: list[_Candidate] = []
        lone: dict[tuple, list[tuple[str, _Candidate, torch.Tensor, torch.Tensor, Axes]]] = {}
        late: dict[tuple, list[tuple[_Candidate, torch.Tensor, torch.Tensor, Axes]]] = {}
        for candidate in self.captured:
            measured = _measure(candidate)
            if measured is None:
                rows_at = _late_rows(candidate)
                if rows_at is not None:  # measured with its partner: cos and sin together give the angles
                    waiting = late.setdefault((candidate.layer, rows_at[0].shape), [])
                    partner = next((entry for entry in waiting if not torch.equal(entry[1], rows_at[0])), None)
                    if partner is None:
                        waiting.append((candidate, *rows_at))
                    else:
                        waiting.remove(partner)
                        found.append(_from_late_pair(candidate, rows_at[0], partner[1], rows_at[1], rows_at[2]))
                elif candidate.angle_dtype is not None:
                    unread.append(candidate)
                continue
            kind, rows, positions, axes = measured
            if kind not in ("cos", "sin"):
                found.append(_applied(candidate, rows, positions, axes))
                continue
            alone = lone.setdefault((candidate.layer, rows.shape, positions.numel()), [])
            other = next((entry for entry in alone if entry[0] != kind), None)
            if other is None:
                alone.append((kind, candidate, rows, positions, axes))
                continue
            alone.remove(other)
            mine, theirs = (rows, candidate, axes), (other[2], other[1], other[4])
            (cos, cos_from, cos_axes), (sin, sin_from, sin_axes) = (mine, theirs) if kind == "cos" else (theirs, mine)
            source = cos_from.source if cos_from.source == sin_from.source else f"{cos_from.source} + {sin_from.source}"
            both = (cos_axes[0] + sin_axes[0], cos_axes[1]) if cos_axes is not None and sin_axes is not None else None
            pair = _applied(replace(candidate, source=source), torch.cat([cos, sin], dim=-1), positions, both)
            found += [pair] if pair is not None else [_applied(candidate, rows, positions, axes), _applied(*other[1:])]
        found += [_applied(*entry[1:]) for alone in lone.values() for entry in alone]
        unique: dict[tuple, AppliedTable] = {}
        for table in found:  # q and k of one layer read the same table: list it once
            if table is not None:
                unique.setdefault((table.layer, table.source, table.part_names, table.key), table)
        read = {table.layer for table in unique.values()}
        self.unmeasured = list(dict.fromkeys((c.layer, c.source) for c in unread if c.layer not in read))
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

    def __init__(self, gm: torch.fx.GraphModule, paths: dict[int, str],
                 sources: dict[torch.fx.Node, tuple[str | None, str]], computed: dict[int, tuple]) -> None:
        super().__init__(gm)
        self.paths = paths
        self.sources = sources
        # id(tensor) -> (tensor, where computed, angle dtype, integer tensors it was computed from), from earlier graphs
        self.computed = computed
        self.carried: dict[torch.fx.Node, tuple[str, torch.dtype]] = {}  # placeholders an earlier graph computed
        self.carried_ids: dict[torch.fx.Node, list[torch.Tensor]] = {}  # ... and the positions it computed them from
        self.integers: dict[torch.fx.Node, torch.Tensor] = {}  # small integer tensors: candidate positions
        self.state: dict[torch.fx.Node, str] = {}  # placeholders and attributes holding module state
        self.angle_dtypes: dict[torch.fx.Node, torch.dtype] = {}  # trig nodes -> dtype of their input
        # Frame locals -> their path in the model: "" for the audit's own ``model``, "model.layers.3.self_attn"
        # for ``self`` in a frame dynamo began inside an attention module after a graph break.
        self.roots: dict[str, str] = {}
        self.candidates: list[_Candidate] = []
        # multiply by a table -> (its other operand, the candidate kept): the rotations compiled.py checks
        self.multiplies: dict[torch.fx.Node, tuple[torch.fx.Node, _Candidate]] = {}
        self._seen: set[torch.fx.Node] = set()

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        if not isinstance(result, torch.Tensor):
            return result
        if node.op in ("placeholder", "get_attr"):
            self._note_state(node, result)
        if node.op == "placeholder":
            self._note_root(node, result)
            earlier = self.computed.get(id(result))
            if earlier is not None and earlier[0] is result:
                self.carried[node], self.carried_ids[node] = earlier[1:3], earlier[3]
        # A tensor escaped from a vmap (transformers builds masks with one) has no values to read.
        readable = not torch._C._functorch.is_functorch_wrapped_tensor(result)
        if readable and not (result.dtype.is_floating_point or result.dtype.is_complex or result.dtype == torch.bool) \
                and result.dim() <= 3:
            self.integers[node] = result
        elif readable and node.op in ("placeholder", "get_attr") and _whole_numbers(result):
            self.integers[node] = result  # positions a module keeps as floats (SAM 3's ViT: a buffer of grid coordinates)
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

    def _note_root(self, node: torch.fx.Node, value: torch.Tensor) -> None:
        """Learn where the frame local a module-state placeholder starts from sits in the model: the
        tensor's path in the model ends with its path from that local."""
        (root, relative), absolute = self.sources.get(node, (None, "")), self.paths.get(id(value))
        if root is None or absolute is None or root in self.roots:
            return
        if absolute == relative or absolute.endswith("." + relative):
            self.roots[root] = absolute[: len(absolute) - len(relative)].rstrip(".")

    def where(self, node: torch.fx.Node) -> str:
        """The module ``node`` ran in, as a path in the model whatever frame the graph came from."""
        relative, root = module_path(node), module_root(node)
        base = self.roots.get(root) if root is not None else self.roots.get("self")
        return ".".join(p for p in (base, relative) if p)

    def layer(self, node: torch.fx.Node) -> str:
        return layer_of(self.where(node))

    def _consider(self, multiply: torch.fx.Node, node: torch.fx.Node, value: Any, other: Any,
                  result: torch.Tensor) -> None:
        """Keep ``value`` if it is a table applied to ``other``: broadcast into it, not the other way round."""
        if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor)):
            return
        if not (value.dtype.is_floating_point or value.dtype.is_complex) or value.dim() < 2:
            return
        rotation = _rotation_matrices(value, other)
        if rotation is not None:
            value = rotation
        elif other.numel() < value.numel() or result.shape != other.shape:
            return
        if sum(1 for s in value.shape if s != 1) < 2:
            return
        self._seen.add(node)
        ancestors = _ancestors(node)
        source, angle_dtype = self.provenance(ancestors)
        self.candidates.append(_Candidate(
            layer=self.layer(multiply),
            source=source or "a forward input",
            value=value.detach().clone(),
            position_ids=self.position_ids(ancestors),
            angle_dtype=angle_dtype,
        ))
        partner = next(a for a in multiply.args if a is not node)
        if rotation is None and isinstance(partner, torch.fx.Node):
            self.multiplies[multiply] = (partner, self.candidates[-1])

    def provenance(self, ancestors: list[torch.fx.Node]) -> tuple[str | None, torch.dtype | None]:
        """(where a value was computed and from what state, the dtype of its angles) from its ancestors: a
        trig op in this graph, or a table an earlier graph computed and this one received (the layers of
        a frame dynamo began after a graph break get cos/sin from the model-level graph as inputs)."""
        trig = next((n for n in ancestors if n in self.angle_dtypes), None)
        states = [self.state[n] for n in ancestors if n in self.state]
        if trig is not None:
            where = f"computed in {self.where(trig) or 'forward'}"
            return where + (f" from {', '.join(states)}" if states else ""), self.angle_dtypes[trig]
        carried = next((self.carried[n] for n in ancestors if n in self.carried), None)
        return carried if carried is not None else (", ".join(states) or None, None)

    def position_ids(self, ancestors: list[torch.fx.Node]) -> list[torch.Tensor]:
        """The integer tensors a value was computed from, nearest first: in this graph, then in the earlier
        graphs that computed its inputs."""
        return [self.integers[n] for n in ancestors if n in self.integers] \
            + [ids for n in ancestors if n in self.carried_ids for ids in self.carried_ids[n]]

    def computed_outputs(self, output: Any) -> list[tuple[torch.Tensor, str | None, torch.dtype, list[torch.Tensor]]]:
        """(tensor, where computed, angle dtype, the integer tensors among its inputs) for each output of this run
        computed from a trig op: a vision tower's cos/sin reach its blocks' graphs without their (h, w) grid."""
        out_node = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        found = []
        for node, value in zip(pytree.tree_leaves(out_node.args[0]), pytree.tree_leaves(output)):
            if isinstance(node, torch.fx.Node) and isinstance(value, torch.Tensor):
                ancestors = _ancestors(node)
                source, angle_dtype = self.provenance(ancestors)
                if angle_dtype is not None:
                    found.append((value, source, angle_dtype, self.position_ids(ancestors)))
        return found


def _is_rope(candidate: _Candidate) -> bool:
    """Whether a multiply's table operand is a RoPE table at the positions it was applied at."""
    return _measure(candidate) is not None or _late_rows(candidate) is not None


def _rotation_matrices(value: torch.Tensor, other: torch.Tensor) -> torch.Tensor | None:
    """A table of 2x2 rotations ``[[cos, -sin], [sin, cos]]`` applied to pairs as ``(x[..., None, :] * R).sum(-1)``
    (PE Audio), as the complex table ``cos + i sin`` it holds; None for anything else."""
    if value.dim() < 3 or value.shape[-2:] != (2, 2) or other.shape[-2:] != (1, 2) or value.dtype.is_complex:
        return None
    cos, sin = value[..., 0, 0], value[..., 1, 0]
    if not (torch.equal(value[..., 1, 1], cos) and torch.equal(value[..., 0, 1], -sin)):
        return None
    return torch.complex(cos.to(torch.float32), sin.to(torch.float32)) if value.dtype != torch.float64 \
        else torch.complex(cos, sin)


def _whole_numbers(value: torch.Tensor) -> bool:
    """A small real tensor of whole numbers >= 0: what a grid of positions kept as floats holds."""
    if not value.dtype.is_floating_point or value.dim() > 3 or not 2 <= value.numel() <= 1 << 16 or value.is_meta:
        return False
    return bool((value >= 0).all()) and bool((value == value.round()).all())


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


def _measure(candidate: _Candidate) -> tuple[str, torch.Tensor, torch.Tensor, Axes] | None:
    """(kind, rows by position, positions, the axis of each column) of a recognized candidate; None if it is
    no RoPE table here."""
    value = candidate.value.reshape([s for s in candidate.value.shape if s != 1])
    if value.dim() not in (2, 3):
        return None
    batch = value.reshape(-1, value.shape[-1])
    # The positions are the nearest integer input shaped like the rows (position_ids, cache_position), when
    # they cover 0..L-1, or 0, s, 2s, ... (DeepSeek-V4's compressed windows, one every s tokens); else the
    # rows are positions 0, 1, ... themselves (a cached table sliced [:seq]).
    strided = False
    for ids in candidate.position_ids + [None]:
        if ids is None:
            if strided or value.dim() == 3 and not bool((value == value[:1]).all()):
                return _measure_axes(candidate, batch)  # rows at positions on several axes, or none to measure
            rows = value if value.dim() == 2 else value[0]
            positions = torch.arange(rows.shape[0], device="cpu")
        else:
            if ids.numel() != batch.shape[0]:
                continue
            flat = ids.reshape(-1).to(torch.int64).cpu()
            positions, first = _first_occurrence(flat)
            step = _stride(positions)
            if step is None:
                continue
            strided = strided or step > 1
            rows = batch[first.to(batch.device)]
            if not torch.equal(rows[torch.searchsorted(positions, flat).to(batch.device)], batch):
                continue  # tokens at one position with different rows: these ids are one axis of several (Pixtral's h)
        kind = _kind(rows)
        if kind is not None:
            return kind, rows, positions, None
    return _measure_axes(candidate, batch)


def _measure_axes(candidate: _Candidate, batch: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor, Axes] | None:
    """A table over several position axes: rows whose tokens sit at positions on 2 to 4 axes (an integer input
    of shape (axes, tokens) or (tokens, axes): M-RoPE's 3-D position_ids, a vision tower's (h, w) grid),
    measured as the table a 1-D sequence gets (:func:`split_axes`)."""
    for rows, of_column, start, count in _axes_splits(candidate, batch):
        kind = _kind(rows) if start == 0 else None
        if kind is not None:
            return kind, rows, torch.arange(rows.shape[0], device="cpu"), (of_column, count)
    return None


def _axes_splits(candidate: _Candidate, batch: torch.Tensor) -> Iterator[tuple[torch.Tensor, tuple[int | None, ...], int, int]]:
    """Each (rows, axis of each column, first position, number of axes) :func:`split_axes` reads from the
    candidate's integer inputs. The rows may hold a few more tokens than the grid, first or last (MLCD's
    class token), or come in another order: windowed towers (Qwen2.5-VL) reorder the rows in blocks by a
    permutation, which is then one of the integer inputs too."""
    orders = [ids.reshape(-1).to(torch.int64).cpu() for ids in candidate.position_ids if ids.dim() <= 1]
    orders = [o for o in orders if 1 < o.numel() and torch.equal(o.sort().values, torch.arange(o.numel(), device="cpu"))]
    for ids in candidate.position_ids:
        for tokens in dict.fromkeys((batch.shape[0], ids.numel() // 2, ids.numel() // 3, ids.numel() // 4)):
            positions = axis_positions(ids, tokens) if 0 < tokens <= batch.shape[0] else None
            if positions is None:
                continue
            positions = positions.cpu()
            for order in [None, *(o for o in orders if tokens % o.numel() == 0 and o.numel() < tokens)]:
                placed = positions if order is None else \
                    positions.reshape(positions.shape[0], order.numel(), -1)[:, order].reshape(positions.shape)
                for rows in (batch[:tokens], batch[batch.shape[0] - tokens:]):
                    split = split_axes(rows, placed)
                    if split is not None:
                        yield (*split, placed.shape[0])


def _kind(rows: torch.Tensor) -> str | None:
    """``cos`` / ``sin`` for a lone part, the layout for a whole table, None when recognition refuses the rows."""
    found = recognize_rope_table(rows)
    if not (isinstance(found, RopeTable) and found.length is not None):
        return None
    single = found.layout.single
    return single.value if single in (Part.COS, Part.SIN) else str(found.layout)


def _late_rows(candidate: _Candidate) -> tuple[torch.Tensor, torch.Tensor, Axes] | None:
    """(rows, positions, axes) of a table applied at positions p, p+1, ... with p > 0 (PaliGemma counts
    positions from 1, Muse's vision tower its grid), which recognition cannot read alone: its first row is not
    position 0."""
    value = candidate.value.reshape([s for s in candidate.value.shape if s != 1])
    if value.dim() not in (2, 3):
        return None
    batch = value.reshape(-1, value.shape[-1])
    for ids in candidate.position_ids:
        if ids.numel() != batch.shape[0]:
            continue
        positions, first = _first_occurrence(ids.reshape(-1).to(torch.int64).cpu())
        start = int(positions[0])
        if start > 0 and positions.numel() >= 2 and torch.equal(positions, start + torch.arange(positions.numel(), device="cpu")):
            return batch[first.to(batch.device)], positions, None
    for rows, of_column, start, count in _axes_splits(candidate, batch):
        if start > 0:
            return rows, start + torch.arange(rows.shape[0], device="cpu"), (of_column, count)
    return None


def _from_late_pair(candidate: _Candidate, rows: torch.Tensor, other: torch.Tensor,
                    positions: torch.Tensor, axes: Axes) -> AppliedTable | None:
    """A cos and a sin applied from position p > 0, turned to the same table from position 0: with
    z = cos + i sin = A exp(i (p + k) f), z * conj(z[0]) / |z[0]| = A exp(i k f). Either may be the cos."""
    for cos, sin in ((rows, other), (other, rows)):
        z = torch.complex(cos.to(torch.float64), sin.to(torch.float64))
        first = z[:1]
        if bool((first.abs() == 0).any()):
            continue
        shifted = z * first.conj() / first.abs()
        table = torch.cat([shifted.real, shifted.imag], dim=-1).to(rows.dtype)
        source = f"{candidate.source} (positions {int(positions[0])}..{int(positions[-1])}, measured from the first)"
        both = (axes[0] + axes[0], axes[1]) if axes is not None else None  # the cos's and the sin's columns
        applied = _applied(replace(candidate, source=source), table, torch.arange(positions.numel(), device="cpu"), both)
        if applied is not None and applied.part_names == "cos+sin":
            return applied
    return None


def _stride(positions: torch.Tensor) -> int | None:
    """s when ``positions`` are 0, s, 2s, ... (s >= 1), else None."""
    if positions.numel() < 2 or int(positions[0]) != 0:
        return None
    step = int(positions[1])
    return step if step >= 1 and torch.equal(positions, torch.arange(positions.numel(), device="cpu") * step) else None


def _first_occurrence(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct values of ``flat`` and the index of each one's first occurrence."""
    positions, inverse = torch.unique(flat, return_inverse=True)
    first = torch.full((positions.numel(),), flat.numel(), dtype=torch.int64, device=flat.device)
    first.scatter_reduce_(0, inverse, torch.arange(flat.numel(), device=flat.device), reduce="amin")
    return positions, first


def _applied(candidate: _Candidate, rows: torch.Tensor, positions: torch.Tensor,
             axes: Axes = None) -> AppliedTable | None:
    found = recognize_rope_table(rows)
    if not isinstance(found, RopeTable):
        return None
    step = _stride(positions) or 1
    # Rows s positions apart encode s times the frequencies: the key names the table's own.
    keyed = found if step == 1 else replace(found, freqs=found.freqs / step, freq_tol=found.freq_tol / step)
    key = infer_key(keyed, rows)
    of_column: tuple[int | None, ...] = ()
    count = 0
    if axes is not None:
        every, count = axes
        of_column = tuple(every[c] for c in _part_columns(len(every), found.layout))
        key = _axes_key(found, rows, of_column, count)
    return AppliedTable(
        layer=candidate.layer,
        source=candidate.source,
        table=found,
        key=key,
        parts=table_parts(rows.cpu(), found.layout),  # compared with expectations computed on CPU
        positions=positions,
        dtype=rows.dtype,
        angle_dtype=candidate.angle_dtype,
        axes=of_column,
        axis_count=count,
    )


def _axes_key(found: RopeTable, rows: torch.Tensor, of_column: tuple[int | None, ...], count: int) -> RopeKey:
    """The key of a table over several axes: theta from one axis's distinct frequencies where every axis rotates
    by the same ones (a 2-D axial table), else from all of them fastest first (M-RoPE's sections, Pixtral's
    alternating split of one progression); the dim is the whole table's, and the key names the axes."""
    columns = [[c for c, a in enumerate(of_column) if a == axis] for axis in range(count)]
    columns = [c for c in columns if c] or [list(range(len(of_column)))]  # no column of known axis: all of them
    same = all(len(c) == len(columns[0]) and torch.allclose(found.freqs[c], found.freqs[columns[0]], rtol=1e-4)
               for c in columns)
    order: list[int] = []
    for c in (columns[0] if same else found.freqs.argsort(descending=True).tolist()):
        if not any(abs(float(found.freqs[c] - found.freqs[k])) <= float(found.freq_tol[c] + found.freq_tol[k])
                   for k in order):
            order.append(c)  # a frequency twice in one axis (SAM's pairs, read as halves) counts once
    picked = replace(found, freqs=found.freqs[order], reliable=found.reliable[order], freq_tol=found.freq_tol[order])
    return replace(infer_key(picked, rows), dim=2 * found.freqs.numel(), axes=axes_label(of_column, count))


def _part_columns(width: int, layout: Layout) -> list[int]:
    """The columns of a ``width``-wide table that hold its first part's distinct frequencies, in the order
    :func:`table_parts` gives them."""
    if layout.arrangement is not Arrangement.COLUMNS:
        return list(range(width))
    block = width // len(layout.parts)
    if layout.repeat is Repeat.HALVES:
        return list(range(block // 2))
    if layout.repeat is Repeat.INTERLEAVED:
        return list(range(0, block, 2))
    return list(range(block))


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
