"""A RoPE table that holds no table: a tensor subclass whose reads compute the rows they read.

A wrapper subclass (``_make_wrapper_subclass``) with the table's shape and dtype, holding only the float32
frequency vector of its :class:`~rope_dedup.recompute.recipe.Recipe`. Its ops are a table, one function per
op, as torchao's quantized tensors keep them: reads of rows (slice, select, advanced indexing, index_select,
embedding) compute those rows; views that only add or drop unit dims, ``detach`` and ``clone`` stay
recomputed; a dtype cast stays recomputed (the rows are cast on the way out). Any other op on the whole table
computes the whole table for that op only, with a warning naming table and op, counted on the table.

A write (any op whose schema writes an argument that is this table) first computes the table into a storage
of its own, then writes there; from then on every op reads that storage, as an ordinary table would.
``__tensor_flatten__`` makes it traceable, so ``torch.compile`` folds a read into the graph as the computation
of the rows read. The flatten context holds only what is equal across layers with equal recipes (no name),
so a regional compile does not recompile per layer.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from rope_dedup.core.eligibility import NO_TABLE

from rope_dedup.recompute.recipe import Recipe, position_dim, reproduces, row_chunks
from rope_dedup.tables.keys import RopeKey
from rope_dedup.tensors import same_values

aten = torch.ops.aten


@dataclass(eq=False)
class _State:
    """What aliases of one table share: its name, its storage once written, and what was computed whole."""

    name: str
    key: RopeKey | None = None  # what recognition found when the table was converted
    materialized: torch.Tensor | None = None  # the table's values, in its base shape, once written
    whole_reads: dict[str, int] = field(default_factory=dict)  # op -> times it computed the whole table
    written_by: str | None = None


class RecomputedTable(torch.Tensor):
    """A RoPE table whose values are computed from ``inv_freq`` where they are read (see the module doc)."""

    recipe: Recipe
    inv_freq: torch.Tensor
    state: _State
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, recipe: Recipe, state: _State) -> RecomputedTable:
        return torch.Tensor._make_wrapper_subclass(
            cls, recipe.shape, dtype=recipe.dtype, device=recipe.inv_freq.device, requires_grad=False)

    def __init__(self, recipe: Recipe, state: _State) -> None:
        self.recipe, self.inv_freq, self.state = recipe, recipe.inv_freq, state

    def __repr__(self) -> str:  # type: ignore[override]
        held = "written, holds its values" if self.state.materialized is not None else "recomputed"
        return (f"RecomputedTable({self.state.name or 'table'}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, {held})")

    @property
    def is_recomputed(self) -> bool:
        """False once a write gave the table a storage of its own."""
        return self.state.materialized is None

    def values(self) -> torch.Tensor:
        """The whole table as a plain tensor (its storage once written, else computed now)."""
        if self.state.materialized is not None:
            return self.state.materialized.reshape(self.shape)
        positions = torch.arange(self.recipe.length, device=self.inv_freq.device, dtype=torch.int64)
        return self.recipe.rows(positions).reshape(self.shape)

    # -- tracing ---------------------------------------------------------------------------------------------
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        if self.state.materialized is not None:
            return ["inv_freq", "materialized"], _context(self.recipe, True)
        return ["inv_freq"], _context(self.recipe, False)

    @property
    def materialized(self) -> torch.Tensor | None:
        return self.state.materialized

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], context: tuple, outer_size: Any,
                             outer_stride: Any) -> RecomputedTable:
        fields, _ = context
        recipe = Recipe(**dict(fields), inv_freq=inner["inv_freq"])
        return RecomputedTable(recipe, _State("", materialized=inner.get("materialized")))

    def __reduce_ex__(self, protocol: Any) -> tuple:  # pickle, torch.save: the recipe, not the values
        return _rebuild, (_context(self.recipe, False)[0], self.inv_freq, self.state.name, self.state.materialized,
                          self.state.key)

    # -- dispatch --------------------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None  # type: ignore[override]
                           ) -> Any:
        kwargs = kwargs or {}
        if func is aten.copy_.default and _copies_own_values(args[0], args[1]):
            return args[0]  # a reload of equal values (load_state_dict) changes nothing: stays recomputed
        written = [a for a in _written(func, args, kwargs) if isinstance(a, RecomputedTable)]
        for table in written:
            table._materialize(str(func.overloadpacket.__name__))
        first = args[0] if args and isinstance(args[0], RecomputedTable) else None
        if first is not None and first.state.materialized is None and func in _OPS:
            found = _OPS[func](first, *args[1:], **kwargs)
            if found is not NotImplemented:
                return found
        out = func(*tree_map(_plain_for(func), args), **tree_map(_plain_for(func), kwargs))
        return args[0] if written and func._schema.name.endswith("_") else out

    def __deepcopy__(self, memo: dict) -> RecomputedTable:
        if id(self) in memo:
            return memo[id(self)]
        # Copies of tables that use one frequency vector use one copy of it, as deepcopy keeps aliasing.
        recipe = self.recipe.with_inv_freq(copy.deepcopy(self.inv_freq, memo))
        held = None if self.state.materialized is None else self.state.materialized.clone()
        memo[id(self)] = copied = RecomputedTable(recipe, _State(self.state.name, self.state.key, held))
        return copied

    def _stable_hash_for_caching(self) -> str:
        """What AOTAutograd's cache keys on besides the inner tensors: the recipe, not the table's name."""
        return hashlib.sha256(repr(_context(self.recipe, self.state.materialized is not None)).encode()).hexdigest()

    def _materialize(self, op: str) -> None:
        if is_fake(self.inv_freq):
            raise RuntimeError(f"rope_dedup: a compiled graph writes a recomputed table ({op}): a table that is "
                               f"written is not recomputed. Build this model without tables=\"recompute\", or call "
                               f"rope_dedup.unshare(model) before compiling")
        if self.state.materialized is None:
            self.state.materialized = self.values().clone()  # aliases read it in their shapes (unit dims apart)
            self.state.written_by = op
            warnings.warn(f"rope_dedup: recomputed table {self.state.name or '(unnamed)'} was written by {op}: it "
                          f"now holds its values in a storage of its own ({self.nbytes} bytes)", stacklevel=4)


def _context(recipe: Recipe, materialized: bool) -> tuple:
    return recipe.fields, materialized


def _rebuild(fields: tuple, inv_freq: torch.Tensor, name: str, materialized: torch.Tensor | None,
             key: RopeKey | None = None) -> RecomputedTable:
    return RecomputedTable(Recipe(**dict(fields), inv_freq=inv_freq), _State(name, key, materialized=materialized))


def _copies_own_values(table: Any, source: Any) -> bool:
    """Whether ``table.copy_(source)`` would write what a still recomputed ``table`` already reads, bit for bit."""
    if not isinstance(table, RecomputedTable) or table.state.materialized is not None:
        return False
    if isinstance(source, RecomputedTable) or not isinstance(source, torch.Tensor):
        return False
    if source.shape != table.shape or source.dtype != table.dtype or source.device != table.device:
        return False
    return reproduces(table.recipe, source)


def _plain_for(func: Any) -> Callable[[Any], Any]:
    """Unwrap each table argument: its storage once written, else the whole table computed for this op."""
    def plain(value: Any) -> Any:
        if not isinstance(value, RecomputedTable):
            return value
        if value.state.materialized is not None:
            return value.state.materialized.reshape(value.shape)
        op = str(func.overloadpacket.__name__)
        value.state.whole_reads[op] = value.state.whole_reads.get(op, 0) + 1
        warnings.warn(f"rope_dedup: {op} reads recomputed table {value.state.name or '(unnamed)'} whole: it is "
                      f"computed in full for this op ({value.nbytes} bytes); read rows of it (slice, index) to "
                      f"compute only those", stacklevel=5)
        return value.values()
    return plain


class RecomputedRows(torch.Tensor):
    """Rows of a recomputed table read through a view (slice, select, narrow, and views of those): computed
    values that still write through to the table. Any read unwraps to the rows; a write first gives the table
    a storage of its own, then lands in it through the same views, as it would in the table itself."""

    rows: torch.Tensor
    table: RecomputedTable | None  # None: rows that crossed a compiled graph's boundary, cut off from the table
    steps: tuple  # (view op, args, kwargs, item of a list result or None) from the table to these rows
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, rows: torch.Tensor, table: RecomputedTable | None, steps: tuple) -> RecomputedRows:
        return torch.Tensor._make_wrapper_subclass(cls, rows.shape, strides=rows.stride(), dtype=rows.dtype,
                                                   device=rows.device, requires_grad=False)

    def __init__(self, rows: torch.Tensor, table: RecomputedTable | None, steps: tuple) -> None:
        self.rows, self.table, self.steps = rows, table, steps

    def __repr__(self) -> str:  # type: ignore[override]
        return f"RecomputedRows({self.rows!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["rows"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], context: None, outer_size: Any,
                             outer_stride: Any) -> RecomputedRows:
        return RecomputedRows(inner["rows"], None, ())

    def __reduce_ex__(self, protocol: Any) -> tuple:  # what pickling a view of a table gives: its values
        return _plain_copy, (self.rows,)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None  # type: ignore[override]
                           ) -> Any:
        kwargs = kwargs or {}
        written = [a for a in _written(func, args, kwargs) if isinstance(a, RecomputedRows)]
        for rows in written:
            rows._write_through(str(func.overloadpacket.__name__))
        out = func(*tree_map(_rows_of, args), **tree_map(_rows_of, kwargs))
        if written:
            return args[0] if func._schema.name.endswith("_") else out
        first = args[0] if args else None
        # Rows of a table written since read its storage (``_rows_of``): a view of them is a plain view of it.
        if isinstance(first, RecomputedRows) and first.steps and _returns_view(func):
            if isinstance(out, (list, tuple)):
                return type(out)(RecomputedRows(o, first.table, first.steps + ((func, args[1:], kwargs, i),))
                                 for i, o in enumerate(out))
            return RecomputedRows(out, first.table, first.steps + ((func, args[1:], kwargs, None),))
        return out

    def _write_through(self, op: str) -> None:
        """Point these rows at the table's own storage, through the same views, before ``op`` writes them."""
        if self.table is None:
            raise RuntimeError(f"rope_dedup: {op} writes rows of a recomputed table that a compiled graph returned: "
                               f"they no longer lead to the table, and the write would be lost; call "
                               f"rope_dedup.unshare(model) before writing RoPE tables")
        self.table._materialize(op)
        self._see_storage()

    def _see_storage(self) -> None:
        """Read through the views from the table's storage from now on (it has one since a write)."""
        view = self.table.state.materialized.reshape(self.table.shape)  # type: ignore[union-attr]
        for func, args, kwargs, item in self.steps:
            view = func(view, *args, **kwargs)
            view = view if item is None else view[item]
        self.rows, self.steps = view, ()


def _rows_of(value: Any) -> Any:
    """The rows to compute with: once the table was written (through any view), its storage's, as a view of
    a written table would read."""
    if not isinstance(value, RecomputedRows):
        return value
    if value.steps and value.table is not None and value.table.state.materialized is not None:
        value._see_storage()
    return value.rows


def _plain_copy(rows: torch.Tensor) -> torch.Tensor:
    return rows.clone()


def _returns_view(func: Any) -> bool:
    returns = func._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments ``func``'s schema writes."""
    found = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            found.append(args[i] if i < len(args) else kwargs.get(argument.name))
    return found


# -- the op table: one function per op, each returning NotImplemented to fall back to the whole table ----------
_OPS: dict[Any, Callable[..., Any]] = {}


def _implements(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            _OPS[op] = fn
        return fn
    return register


def _alias(table: RecomputedTable, shape: tuple[int, ...] | None = None) -> RecomputedTable | Any:
    """The same table seen with unit dims added or dropped; NotImplemented for any other reshape."""
    shape = tuple(table.shape) if shape is None else tuple(shape)
    if [s for s in shape if s != 1] != [s for s in table.shape if s != 1]:
        return NotImplemented
    pos_dim = position_dim(shape)
    if pos_dim is None:
        return NotImplemented
    return RecomputedTable(replace(table.recipe, shape=shape, pos_dim=pos_dim), table.state)


# Rows computed while one graph is traced, per tracer: a layer reads its table's rows once for q and once for
# k, and the graph computes them once (each layer's table comes into the trace as its own input).
_TRACED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _once_per_graph(table: RecomputedTable, read: tuple, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``compute()``, or the rows this graph's trace already computed for the same vector, recipe and read.

    Only while a graph is traced (a proxy mode): there, rows are never written (a write is refused), so one
    computation can serve every read. Bounds that are symbols (dynamic shapes) are computed each time."""
    mode = get_proxy_mode()
    if mode is None or not all(type(v) in (int, str) for v in read):
        return compute()
    seen = _TRACED.setdefault(mode, {})
    key = (id(table.inv_freq), _context(table.recipe, False), read)
    if key not in seen:
        seen[key] = (table.inv_freq, compute())  # the vector held: its id stays its own while the trace lasts
    return seen[key][1]


def _positions(start: int, stop: int, step: int, table: RecomputedTable) -> torch.Tensor:
    return torch.arange(start, stop, step, device=table.inv_freq.device, dtype=torch.int64)


@_implements(aten.detach.default, aten.alias.default)
def _same(table: RecomputedTable) -> Any:
    return RecomputedTable(table.recipe, table.state)


@_implements(aten.clone.default)
def _clone(table: RecomputedTable, **kwargs: Any) -> Any:
    """A table of its own (``deepcopy`` calls clone): a write to the copy must not reach this one."""
    if kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
        return NotImplemented
    return RecomputedTable(table.recipe, _State(table.state.name, table.state.key))


@_implements(aten.slice.Tensor)
def _slice(table: RecomputedTable, dim: int = 0, start: int | None = None, end: int | None = None,
           step: int = 1) -> Any:
    dim %= table.dim()
    size = table.shape[dim]
    # torch.sym_min/sym_max, not slice.indices(): under dynamic shapes the bounds are symbols, and turning
    # them into ints would specialize the graph to one length.
    begin, stop = _bound(start, size, 0), _bound(end, size, size)
    if dim != table.recipe.pos_dim:
        return _alias(table) if (begin, stop, step) == (0, size, 1) else NotImplemented
    rows = _once_per_graph(table, ("slice", dim, begin, stop, step),
                           lambda: table.recipe.rows_in_place(
                               _positions(begin, torch.sym_max(begin, stop), step, table)))
    return RecomputedRows(rows, table, ((aten.slice.Tensor, (dim, start, end, step), {}, None),))


def _bound(index: Any, size: int, default: int) -> Any:
    """A slice bound clamped into [0, size], a negative one counted from the end, as Python slicing does."""
    if index is None:
        return default
    if index < 0:
        index = torch.sym_max(index + size, 0)
    return torch.sym_min(index, size)


@_implements(aten.select.int)
def _select(table: RecomputedTable, dim: int, index: int) -> Any:
    dim %= table.dim()
    if dim != table.recipe.pos_dim:
        return _alias(table, tuple(table.shape[:dim]) + tuple(table.shape[dim + 1:]))
    index = index + table.shape[dim] if index < 0 else index
    rows = _once_per_graph(table, ("select", dim, index),
                           lambda: table.recipe.rows_in_place(_positions(index, index + 1, 1, table)).squeeze(dim))
    return RecomputedRows(rows, table, ((aten.select.int, (dim, index), {}, None),))


@_implements(aten.index.Tensor)
def _index(table: RecomputedTable, indices: list[torch.Tensor | None]) -> Any:
    dim = table.recipe.pos_dim
    if len(indices) != dim + 1 or any(i is not None for i in indices[:dim]):
        return NotImplemented
    positions = indices[dim]
    if positions is None or positions.dtype not in (torch.int64, torch.int32):
        return NotImplemented
    positions = positions.to(torch.int64)
    return table.recipe.rows_in_place(torch.where(positions < 0, positions + table.recipe.length, positions))


@_implements(aten.index_select.default)
def _index_select(table: RecomputedTable, dim: int, index: torch.Tensor) -> Any:
    dim %= table.dim()
    if dim != table.recipe.pos_dim or index.dim() > 1:
        return NotImplemented
    return table.recipe.rows_in_place(index.to(torch.int64).reshape(-1))


@_implements(aten.embedding.default)
def _embedding(table: RecomputedTable, indices: torch.Tensor, *args: Any) -> Any:
    if table.dim() != 2 or table.recipe.pos_dim != 0:
        return NotImplemented
    return table.recipe.rows(indices.to(torch.int64))


@_implements(aten.unsqueeze.default)
def _unsqueeze(table: RecomputedTable, dim: int) -> Any:
    dim %= table.dim() + 1
    return _alias(table, tuple(table.shape[:dim]) + (1,) + tuple(table.shape[dim:]))


@_implements(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(table: RecomputedTable, dims: Any = None) -> Any:
    if dims is None:
        dims = range(table.dim())
    dims = {d % table.dim() for d in ([dims] if isinstance(dims, int) else dims)}
    return _alias(table, tuple(s for d, s in enumerate(table.shape) if not (d in dims and s == 1)))


@_implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(table: RecomputedTable, shape: list[int]) -> Any:
    shape = list(shape)
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        shape[shape.index(-1)] = table.numel() // max(known, 1)
    return _alias(table, tuple(shape))


@_implements(aten.expand.default)
def _expand(table: RecomputedTable, size: list[int], implicit: bool = False) -> Any:
    size = [table.shape[d - (len(size) - table.dim())] if s == -1 else s for d, s in enumerate(size)]
    return _alias(table, tuple(size)) if len(size) == table.dim() and tuple(size) == tuple(table.shape) \
        else NotImplemented


@_implements(aten._to_copy.default)
def _to_copy(table: RecomputedTable, dtype: torch.dtype | None = None, device: Any = None, **kwargs: Any) -> Any:
    """A cast stays recomputed (rows are cast on the way out); a move to another device computes the values
    there only after checking, a chunk at a time, that they come out the same bits as here."""
    if any(v not in (None, False, torch.strided, torch.preserve_format) for v in kwargs.values()):
        return NotImplemented
    target = torch.device(device) if device is not None else table.device
    if target.type == "meta":  # no values there to compute: the empty tensor any move to meta gives
        return torch.empty(table.shape, dtype=dtype or table.dtype, device=target)
    recipe = table.recipe
    if target != table.device:
        moved = recipe.with_inv_freq(recipe.inv_freq.to(target))
        if not _same_on(recipe, moved):
            return NotImplemented  # its values computed here, copied there: an ordinary table
        recipe = moved
    if dtype is not None and dtype != table.dtype:
        recipe = recipe.cast(dtype)
    key = table.state.key
    if key is not None:  # the key names what the table holds now: its dtype and device
        key = replace(key, dtype=recipe.dtype, device=recipe.inv_freq.device)
    return RecomputedTable(recipe, _State(table.state.name, key))


def _same_on(here: Recipe, there: Recipe) -> bool:
    """Whether ``there`` (on another device) computes ``here``'s rows bit for bit, a chunk at a time."""
    device = there.inv_freq.device
    return all(same_values(here.rows(positions).to(device), there.rows(positions.to(device)))
               for _, positions in row_chunks(here, here.inv_freq.device))


NO_TABLE.add(RecomputedTable)
