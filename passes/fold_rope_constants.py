"""Fold RoPE tables computed from constants in ``forward`` into one shared constant each, at compile time.

Why: a RoPE module that builds its table from scratch on every call (``arange -> pow -> outer ->
cos/sin``, no state at all) makes every layer recompute the same table on every step, and under the
``eager`` / ``aot_eager`` inner backends materialize it each time. When a subgraph reads no
placeholder and no module attribute, its value is fixed when the graph is compiled: this pass computes
it once, with the very ops, dtypes and devices the graph names (so the constant is bit-identical to what
those ops compute at run time), and reads it with a ``get_attr`` instead. Identical subgraphs, one per
layer, become one tensor; tables equal in content across graphs share storage through the store.

Only values recognized as RoPE tables from their content are folded (never by name): masks and other
constant subgraphs stay with the inner backend. A subgraph that reads a buffer (an ``inv_freq``) or a
forward argument (positions) is never folded: the buffer may change later without a recompile. Those
are :mod:`merge_rope_subgraphs`' job. Under ``inductor`` a folded table is a constant the kernels load
rather than a chain they fuse and recompute; whether that pays is measured in docs/benchmarks.md.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.fx
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import _disable_current_modes

from rope_dedup.passes.find_candidates import duplicates_by_memory, find_candidates
from rope_dedup.passes.find_pure_nodes import find_pure_nodes, node_key
from rope_dedup.passes.pass_base import FoldedTable, GraphPass, PassContext, RopePassResult, run_passes
from rope_dedup.passes.redirect_to_canonical import redirect_to_canonical
from rope_dedup.tables.recognize import is_rope_table
from rope_dedup.core.sources import declare_constant_source, module_path
from rope_dedup.core.store import CanonicalStore

log = logging.getLogger("rope_dedup")

ATTRIBUTE_PREFIX = "_rope_folded"
# No value bigger than this is computed at compile time (dynamo's fake values give sizes beforehand): a
# constant subgraph that is not RoPE, a huge mask say, must not cost its memory while the graph compiles.
MAX_VALUE_BYTES = 1 << 30


def fold_rope_constants(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence | None = None,
    *,
    store: CanonicalStore | None = None,
) -> RopePassResult:
    """Replace each constant-only subgraph that ends in a RoPE table by a ``get_attr`` of its value.

    ``store`` (a backend's) receives each new constant as an ``attribute``: it appears in the report and
    shares storage with equal tables of other graphs. ``example_inputs`` is accepted for the pass
    signature's sake: folded subgraphs read no input by definition. The result's ``folded`` lists the
    constants created; replaced nodes are counted in ``counters["rope_dedup"]["folded_nodes"]`` and
    constants in ``["folded_tables"]``.
    """
    return run_passes(gm, example_inputs, [GraphPass(rewrite)], PassContext(store))


def rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence | None, context: PassContext) -> RopePassResult:
    pure = find_pure_nodes(gm)
    constant: list[torch.fx.Node] = []  # pure nodes outside autocast that read no placeholder or attribute
    constant_set: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node in pure and not pure[node].autocast and all(i in constant_set for i in node.all_input_nodes):
            constant.append(node)
            constant_set.add(node)
    representative = _representatives(constant, pure)
    frontier = [n for n in constant if any(u not in constant_set for u in n.users)]
    values = _Evaluator(representative)
    points: dict[torch.fx.Node, None] = {}  # representatives to fold, in graph order of discovery
    for node in frontier:
        if _may_be_table(node):
            for point in _fold_points(representative[node], values, constant_set):
                points.setdefault(point)
    if not points:
        return RopePassResult(gm, False)
    folded = _replace(gm, constant, representative, points, values, context.store)
    _erase_dead(gm, constant)
    # Constants the store aliased onto one memory: every reader reads the first one.
    attributes = {f.attribute for f in folded}
    readers = [c for c in find_candidates(gm) if c.node.target in attributes]
    redirect_to_canonical(gm, duplicates_by_memory(readers)[0])
    counters["rope_dedup"]["folded_nodes"] += sum(len(f.replaced) for f in folded)
    counters["rope_dedup"]["folded_tables"] += len(folded)
    return RopePassResult(gm, True, folded=folded)


def _representatives(constant: list[torch.fx.Node], pure: dict) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each constant node -> the first structurally identical one: identical subgraphs are evaluated once."""
    representative: dict[torch.fx.Node, torch.fx.Node] = {}
    first: dict = {}
    for node in constant:
        key = node_key(node, pure[node], lambda n: representative[n])
        representative[node] = node if key is None else first.setdefault(key, node)
    return representative


class _Evaluator:
    """Values of representative constant nodes, computed on demand by running the node's own op."""

    def __init__(self, representative: dict[torch.fx.Node, torch.fx.Node]) -> None:
        self.representative = representative
        self._values: dict[torch.fx.Node, Any] = {}
        self._failed: set[torch.fx.Node] = set()

    def __call__(self, node: torch.fx.Node) -> Any:
        """The node's value, or raises ``_Unavailable`` if running it (or an input) failed."""
        node = self.representative[node]
        if node in self._values:
            return self._values[node]
        if node in self._failed:
            raise _Unavailable(node.name)
        order = self._missing(node)
        for current in order:
            try:
                self._values[current] = self._run(current)
            except _Unavailable:
                self._failed.add(current)
            except Exception as error:  # an op that cannot run here: leave it (and its users) to run time
                log.debug("rope_dedup: not folding %s: %r", current.name, error)
                self._failed.add(current)
        if node not in self._values:
            raise _Unavailable(node.name)
        return self._values[node]

    def _missing(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """Representatives ``node`` needs that have no value yet, inputs first (iterative: chains are long)."""
        order: list[torch.fx.Node] = []
        seen: set[torch.fx.Node] = set()
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if expanded:
                order.append(current)
                continue
            if current in seen or current in self._values or current in self._failed:
                continue
            seen.add(current)
            stack.append((current, True))
            stack += [(self.representative[i], False) for i in current.all_input_nodes]
        return order

    def _run(self, node: torch.fx.Node) -> Any:
        def value(n: torch.fx.Node) -> Any:
            representative = self.representative[n]
            if representative in self._failed or representative not in self._values:
                raise _Unavailable(n.name)
            return self._values[representative]

        if _known_nbytes(node) > MAX_VALUE_BYTES:
            raise _Unavailable(f"{node.name} is larger than {MAX_VALUE_BYTES} bytes")
        args = torch.fx.node.map_arg(node.args, value)
        kwargs = torch.fx.node.map_arg(node.kwargs, value)
        # Real tensors, outside any fake or tracing mode dynamo may have left active; normal (not inference)
        # tensors, which run in and out of inference mode alike.
        with _disable_current_modes(), torch.inference_mode(False):
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)  # type: ignore[arg-type]
            return node.target(*args, **kwargs)  # type: ignore[operator]


class _Unavailable(Exception):
    pass


def _fold_points(node: torch.fx.Node, values: _Evaluator, constant: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """``node`` if its value is a RoPE table, else the nearest constant inputs (transitively) that are.

    Each node examined is recognized (a few ms for a long table): only chains that end outside the
    constant region are walked, from that end back.
    """
    points: list[torch.fx.Node] = []
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            value = values(current)
        except _Unavailable:  # too big, or failed to run: an input may still be a table
            value = None
        if value is not None and _is_rope_table(value):
            points.append(values.representative[current])
        else:
            stack += [i for i in current.all_input_nodes if i in constant]
    return points


def _meta_value(node: torch.fx.Node) -> Any:
    """The fake value dynamo (``example_value``) or make_fx (``val``) recorded, if any."""
    return node.meta.get("example_value", node.meta.get("val"))


def _known_nbytes(node: torch.fx.Node) -> int:
    value = _meta_value(node)
    if isinstance(value, torch.Tensor):
        try:
            return int(value.numel()) * value.element_size()
        except Exception:  # symbolic sizes: nothing known
            return 0
    return 0


def _may_be_table(node: torch.fx.Node) -> bool:
    """From the fake value alone: a floating or complex tensor of 1 to 4 dims (unknown: maybe)."""
    value = _meta_value(node)
    if not isinstance(value, torch.Tensor):
        return value is None
    return (value.dtype.is_floating_point or value.dtype.is_complex) and 1 <= value.dim() <= 4


def _is_rope_table(value: Any) -> bool:
    """A RoPE table that may become a constant: a plain tensor (a subclass, a DTensor say, carries run-time
    state) that needs no gradient."""
    return type(value) is torch.Tensor and not value.requires_grad and is_rope_table(value)


def _replace(gm: torch.fx.GraphModule, constant: list[torch.fx.Node], representative: dict,
             points: dict[torch.fx.Node, None], values: _Evaluator,
             store: CanonicalStore | None) -> list[FoldedTable]:
    """One ``get_attr`` per folded value, before the first node it replaces; every such node rerouted."""
    members: dict[torch.fx.Node, list[torch.fx.Node]] = {point: [] for point in points}
    for node in constant:
        if representative[node] in members:
            members[representative[node]].append(node)
    folded = []
    for point, nodes in members.items():
        tensor = _compact(values(point))
        attribute = _free_attribute(gm)
        # A buffer, as inductor's own constant folding registers its constants: aot_autograd lifts the
        # GraphModule's buffers as inputs (a plain tensor attribute would meet its fake mode as a real tensor).
        gm.register_buffer(attribute, tensor, persistent=False)
        declare_constant_source(gm, attribute)
        with gm.graph.inserting_before(nodes[0]):
            reader = gm.graph.get_attr(attribute)
        reader.meta.update(nodes[0].meta)
        for node in nodes:
            node.replace_all_uses_with(reader)
        name = f"{module_path(point) or 'forward'}:{point.name}"
        status = store.offer(tensor, name=name).action.value if store is not None else "canonical"
        folded.append(FoldedTable(attribute, name, tuple(n.name for n in nodes), status))
        log.debug("rope_dedup: folded %s (%d node(s)) into %s: %s", name, len(nodes), attribute, status)
    return folded


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """The value with its own storage when it is a slice of a larger one (``table[:seq]``), same strides."""
    if tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size():
        return tensor
    copy = tensor.clone(memory_format=torch.preserve_format)  # keeps the strides of a dense slice
    return copy if copy.stride() == tensor.stride() else tensor


def _free_attribute(gm: torch.fx.GraphModule) -> str:
    index = 0
    while hasattr(gm, f"{ATTRIBUTE_PREFIX}{index}"):
        index += 1
    return f"{ATTRIBUTE_PREFIX}{index}"


def _erase_dead(gm: torch.fx.GraphModule, constant: list[torch.fx.Node]) -> None:
    """Drop the constant nodes that the rewrite left without users (the rest of the graph is not touched)."""
    for node in reversed(constant):
        if not node.users:
            gm.graph.erase_node(node)
