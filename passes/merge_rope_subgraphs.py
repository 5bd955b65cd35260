"""Merge identical RoPE computations: one copy of a table computed in ``forward`` instead of one per layer.

Why: a RoPE module that builds its table in ``forward`` (HF's rotary embedding: ``inv_freq @ positions``,
then ``cos``/``sin``) repeats that work in every layer, twice per layer when queries and keys each call
it. Once :func:`~rope_dedup.passes.dedup_rope.dedup_rope` has pointed every layer's ``inv_freq`` at one
canonical node, those computations read the same nodes and are structurally identical: common
subexpression elimination keeps the first and points the others' users at it. Unlike constant folding
this is valid whatever the inputs hold at run time (positions passed as arguments, buffers changed
after compiling), so it is the transform for tables that depend on run-time values.

Scope: pure nodes (:func:`~rope_dedup.passes.find_pure_nodes.find_pure_nodes`) computed only from
constants, RoPE tables and forward arguments, and from at least one table or from constants alone.
Anything that reads weights or other module state is left to the inner backend. aot_autograd runs its
own CSE on the graphs it traces (``functorch.config.cse``); this pass matters where nothing else does
(the ``eager`` inner backend), and shrinks the graph every later stage has to trace.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch
import torch.fx
from torch._dynamo.utils import counters

from rope_dedup.tensors import Origin
from rope_dedup.passes.find_candidates import find_candidates
from rope_dedup.passes.find_pure_nodes import find_pure_nodes, node_key
from rope_dedup.passes.pass_base import GraphPass, PassContext, RopePassResult, run_passes
from rope_dedup.tables.recognize import is_rope_table
from rope_dedup.core.sources import placeholder_origin
from rope_dedup.core.store import CanonicalStore


def merge_rope_subgraphs(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence | None = None,
    *,
    store: CanonicalStore | None = None,
) -> RopePassResult:
    """Replace every RoPE computation that repeats an earlier identical one by that earlier node.

    The RoPE tables among the module state the graph reads (``example_inputs`` for dynamo graphs) are
    those ``store`` holds (after :func:`dedup_rope` with it: a pointer lookup), or without a store those
    recognized from their content. The result's ``merged_nodes`` says how many nodes went; they are also
    counted in ``counters["rope_dedup"]["merged_nodes"]``.
    """
    return run_passes(gm, example_inputs, [GraphPass(rewrite)], PassContext(store))


def rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence | None, context: PassContext) -> RopePassResult:
    is_table = _table_nodes(gm, example_inputs, context.store).__contains__
    pure = find_pure_nodes(gm)
    roles: dict[torch.fx.Node, str] = {}
    first: dict[Hashable, torch.fx.Node] = {}
    merged = 0
    for node in list(gm.graph.nodes):
        role = roles[node] = _role(node, roles, pure, is_table)
        if role not in ("table", "constant", "input") or node not in pure:
            continue
        key = node_key(node, pure[node], lambda n: n)  # inputs already point at their representatives
        if key is None:
            continue
        representative = first.setdefault(key, node)
        if representative is not node:
            node.replace_all_uses_with(representative)
            gm.graph.erase_node(node)
            merged += 1
    counters["rope_dedup"]["merged_nodes"] += merged
    return RopePassResult(gm, bool(merged), merged_nodes=merged)


def _role(node: torch.fx.Node, roles: dict[torch.fx.Node, str], pure: dict,
          is_table: Callable[[torch.fx.Node], bool]) -> str:
    """``table``: computed from a RoPE table (and constants, inputs); ``constant``: from nothing;
    ``input``: from forward arguments only; ``other``: reads weights or other state, or is impure."""
    if node.op in ("placeholder", "get_attr"):
        if is_table(node):
            return "table"
        if node.op == "placeholder" and placeholder_origin(node).origin is Origin.INPUT:
            return "input"
        return "other"
    if node not in pure:
        return "other"
    inputs = {roles[i] for i in node.all_input_nodes}
    if "other" in inputs:
        return "other"
    for role in ("table", "input"):
        if role in inputs:
            return role
    return "constant"


def _table_nodes(gm: torch.fx.GraphModule, example_inputs: Sequence | None,
                 store: CanonicalStore | None) -> set[torch.fx.Node]:
    """Nodes reading module state that holds a RoPE table: known to ``store``, or recognized from content."""
    candidates = find_candidates(gm, example_inputs)
    if store is not None:
        return {c.node for c in candidates if store.is_interned(c.tensor)}
    return {c.node for c in candidates if is_rope_table(c.tensor)}
