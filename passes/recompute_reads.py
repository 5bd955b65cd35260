"""Give every read of a RoPE table input the rows it reads, computed from a frequency vector instead.

``dedup_exported(ep, tables="recompute")``: a table input that is only read by rows (a slice or ``select``
along its positions, indexing by a position tensor, ``index_select``, ``embedding``) is no longer needed;
each read becomes the computation of those rows, traced from the table's exact
:class:`~rope_dedup.recompute.recipe.Recipe`, so that the program computes what the table held, bit for bit.
A table read any other way keeps its input: computing it whole on every call is not what a user wants here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from rope_dedup.recompute.recipe import Recipe, check_positions

aten = torch.ops.aten


def recompute_reads(gm: torch.fx.GraphModule, table: torch.fx.Node, vector: torch.fx.Node,
                    recipe: Recipe, label: str | None = None) -> str | None:
    """Rewrite each read of ``table`` into rows computed from ``vector`` (an input holding ``recipe.inv_freq``,
    its ``meta["val"]`` a fake tensor of the program's fake mode, as the position inputs' are). A read by
    positions asserts them inside the table, as indexing the table would (``label`` names it in the message).

    Returns None once every read is rewritten (``table`` is then unused), else why not, the graph unchanged.
    The caller lints and recompiles."""
    plans = []
    for use in list(table.users):
        plan = _plan(use, recipe, label or table.name)
        if isinstance(plan, str):
            return f"{use.name} ({use.target}) {plan}"
        plans.append((use, plan))
    for use, (compute, position_nodes) in plans:
        # Traced on the program's own fake values, so the new nodes' metadata is of the program's fake mode.
        examples = [node.meta["val"] for node in (vector, *position_nodes)]
        traced = make_fx(compute, tracing_mode="fake")(*examples)
        inputs = [node for node in traced.graph.nodes if node.op == "placeholder"]
        with gm.graph.inserting_before(use):
            rows = gm.graph.graph_copy(traced.graph, dict(zip(inputs, [vector, *position_nodes])))
        use.replace_all_uses_with(rows)  # type: ignore[arg-type]
        gm.graph.erase_node(use)
    return None


def _plan(use: torch.fx.Node, recipe: Recipe, label: str
          ) -> tuple[Callable[..., torch.Tensor], list[torch.fx.Node]] | str:
    """How to compute what ``use`` reads: (a function of the vector and the position inputs, those inputs)."""
    dim_count = len(recipe.shape)
    args: list[Any] = list(use.args) + [None] * 4
    if use.target is aten.slice.Tensor:
        dim, start, end, step = args[1] or 0, args[2], args[3], args[4] or 1
        if not all(v is None or isinstance(v, int) for v in (start, end, step)):
            return "slices with bounds that are symbols"
        dim %= dim_count
        if dim != recipe.pos_dim:
            return f"slices dim {dim}, not the positions"
        begin, stop, _ = slice(start, end, step).indices(recipe.length)
        return (lambda v: recipe.with_inv_freq(v).rows_in_place(
            torch.arange(begin, max(begin, stop), step, device=v.device, dtype=torch.int64))), []
    if use.target is aten.select.int:
        dim, index = args[1] % dim_count, args[2]
        if dim != recipe.pos_dim or not isinstance(index, int):
            return f"selects along dim {dim}" if dim != recipe.pos_dim else "selects a position that is a symbol"
        index %= recipe.length
        return (lambda v: recipe.with_inv_freq(v).rows_in_place(
            torch.arange(index, index + 1, device=v.device, dtype=torch.int64)).squeeze(dim)), []
    if use.target is aten.index.Tensor:
        indices = args[1]
        if len(indices) != recipe.pos_dim + 1 or any(i is not None for i in indices[:recipe.pos_dim]):
            return "indexes dims other than the positions"
        return _at_positions(recipe, indices[recipe.pos_dim], "index", label)
    if use.target is aten.index_select.default:
        if args[1] % dim_count != recipe.pos_dim:
            return "selects along another dim"
        return _at_positions(recipe, args[2], "index_select", label)
    if use.target is aten.embedding.default and dim_count == 2 and recipe.pos_dim == 0:
        return _at_positions(recipe, args[1], "embedding", label)
    return "reads the whole table: it keeps its input"


def _at_positions(recipe: Recipe, positions: Any, op: str, label: str
                  ) -> tuple[Callable[..., torch.Tensor], list[torch.fx.Node]] | str:
    value = positions.meta.get("val") if isinstance(positions, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int64, torch.int32) \
            or not all(isinstance(s, int) for s in value.shape):
        return "indexes with positions that are not an integer tensor of a static shape"

    def rows(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        p = check_positions(p.to(torch.int64), recipe.length, recipe.pos_dim, op, label)
        # A negative position counts from the end, where indexing the table lets it.
        return recipe.with_inv_freq(v).rows_in_place(torch.where(p < 0, p + recipe.length, p))

    return rows, [positions]

