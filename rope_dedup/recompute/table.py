"""A RoPE table that holds no table: a tensor subclass whose reads compute the rows they read.

A wrapper subclass (``_make_wrapper_subclass``) with the table's shape and dtype, holding only the float32
frequency vector of its :class:`~rope_dedup.recompute.recipe.Recipe`. It behaves as the plain table it
replaces, or raises an error that says so. The rule:

- **Exact reads, computed.** Rows (slice, select and narrow along the positions; a position tensor,
  ``index_select``, ``embedding``, each checked against the table's length as torch checks it), casts (a new
  dtype; a move to a device that computes the same bits), views that only add or drop unit dims, ``detach``,
  ``clone``. One function per op, in a table (``_OPS``), as torchao's quantized tensors keep theirs.
- **Any other op does what torch does to the plain table, with torch's aliasing.** An op that returns new values
  computes the values it reads (on the whole table: a warning, counted in ``whole_reads``). A view is a view
  (:class:`RecomputedTable` too, with torch's shape, strides, offset, conj and neg bits): its values are computed
  when it is made, and a write through it lands in the table.
- **A write materializes.** An op that writes a table or any view of it (in place, ``out=``, ``set_``,
  ``.data =``, a metadata change such as ``t_`` or ``resize_``) first gives the table a storage holding its
  values, then writes there, with a warning; from then on every view of it reads that storage, as views of a
  plain table do. A graph dynamo traces gives the real table its values as it meets the write, and breaks there.

Views keep the ops that made them (``steps``), so once the table holds a storage each replays them on it.
``__tensor_flatten__`` makes it traceable: ``torch.compile`` folds a read into the graph as the computation of
the rows read. The flatten context holds only what is equal across layers with equal recipes (no name), so a
regional compile does not recompile per layer.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import threading
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import _disable_current_modes, get_alias_info, return_and_correct_aliasing
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from rope_dedup.core.eligibility import NO_TABLE

from rope_dedup.recompute.recipe import Recipe, check_positions, position_dim, reproduces, row_chunks
from rope_dedup.tables.keys import RopeKey
from rope_dedup.tensors import same_values

aten = torch.ops.aten

UNSHARE = ("call rope_dedup.unshare(model) first (each table becomes a plain tensor holding its values), or "
           "build with tables=\"share\"")


@dataclass(eq=False)
class _State:
    """One table's memory, shared by every view of it: how its values are computed, and ``materialized``, the
    storage that holds them once something needed one (a write, ``numpy()``, a written ``state_dict`` entry)."""

    name: str
    recipe: Recipe | None  # None: memory that is not a recipe's (``set_`` pointed a view elsewhere, or cut off)
    key: RopeKey | None = None  # what recognition found when the table was converted
    materialized: torch.Tensor | None = None  # the values: in ``recipe.shape``, or the tensor ``set_`` gave
    written_by: str | None = None
    whole_reads: dict[str, int] = field(default_factory=dict)  # op -> times it computed the whole table
    entry: tuple[weakref.ref, int] | None = None  # the live state_dict entry and its version when it was made
    owner: tuple[weakref.ref, str] | None = None  # the module and attribute the table was put in
    link: weakref.ref | None = None  # while a graph is traced: the real table this traced one stands for
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def label(self) -> str:
        return self.name or "(unnamed)"

    def materialize(self, op: str) -> torch.Tensor:
        """The table's storage, made now (its values computed) if it has none: thread-safe, once."""
        self.sync()
        if self.materialized is not None:
            return self.materialized
        if self.recipe is None:
            raise RuntimeError(f"rope_dedup: {op} writes a view of a recomputed table that no longer leads to the "
                               f"table (rows a compiled graph returned without aliasing its input): the write would "
                               f"be lost; {UNSHARE}")
        if is_fake(self.recipe.inv_freq):
            real = self.link() if self.link is not None else None
            if real is not None and _dynamo_tracing():
                _written_while_traced(real, op)
            raise RuntimeError(f"rope_dedup: a graph being traced writes a recomputed table ({op}) it cannot give "
                               f"a storage: a table that is written is not recomputed. Build this model without "
                               f"tables=\"recompute\", or call rope_dedup.unshare(model) before tracing")
        with self.lock:
            if self.materialized is None:
                self.materialized = whole_values(self.recipe)
                self.written_by = op
                warnings.warn(f"rope_dedup: recomputed table {self.label} was written by {op}: it now holds its "
                              f"values in a storage of its own ({self.materialized.nbytes} bytes)", stacklevel=5)
        return self.materialized

    def adopt(self, values: torch.Tensor, why: str) -> None:
        """Make ``values`` (the table's shape) the table's storage: a tensor written outside the table that
        torch would have written into it (its ``state_dict`` entry, its builder's own reference)."""
        with self.lock:
            if self.materialized is None:
                self.materialized, self.written_by, self.entry = values, why, None
                warnings.warn(f"rope_dedup: recomputed table {self.label} was written through {why}: it now holds "
                              f"those values in that storage ({values.nbytes} bytes)", stacklevel=4)

    def entry_for_state_dict(self) -> torch.Tensor:
        """The values a ``state_dict`` entry holds: one storage while an entry lives (entries alias each other,
        as torch's do), watched so that a write to it reaches the table (:meth:`sync`)."""
        assert self.recipe is not None
        self.sync()
        memory = self.entry[0]() if self.entry is not None else None
        if memory is None:
            memory = whole_values(self.recipe)
            memory = memory if memory._base is None else memory._base  # what every view of it keeps alive
            self.entry = (weakref.ref(memory), memory._version)  # views share their base's version counter
        return memory.view(self.recipe.shape)

    def sync(self) -> None:
        """A ``state_dict`` entry written since it was made becomes the table's storage (unless it still holds
        the recipe's values): torch's entry is the table's memory, so the write shows at the next read."""
        if self.entry is None:
            return
        memory = self.entry[0]()
        if memory is None:
            self.entry = None
        elif memory._version != self.entry[1] and self.recipe is not None:
            values = memory.view(self.recipe.shape)
            if reproduces(self.recipe, values):
                self.entry = (self.entry[0], memory._version)
            else:
                self.adopt(values, "its state_dict entry")


def _dynamo_tracing() -> bool:
    """Whether dynamo is tracing a frame now (its fake-tensor run of an op calls into this dispatch)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx() is not None
    except Exception:  # no frame being traced
        return False


def _written_while_traced(real: _State, op: str) -> None:
    """A graph dynamo traces writes a recomputed table: give the real table its storage now, as the write would
    in eager, and every table held under the same name by a module of the same class (the graph of every such
    block writes it alike: one recompile, not one per block), then trace again, with tables that hold values."""
    from torch._dynamo.exc import Unsupported

    from rope_dedup.core.sources import compiling_modules

    states = [real]
    owner = real.owner[0]() if real.owner is not None else None
    if owner is not None:
        name = real.owner[1]  # type: ignore[index]
        for root in compiling_modules(owner) or [owner]:
            for module in root.modules():
                held = module._buffers.get(name, vars(module).get(name)) if type(module) is type(owner) else None
                if isinstance(held, RecomputedTable):
                    states.append(held.state)
    with _disable_current_modes():  # real tables, computed outside the trace's fake mode
        for state in states:
            state.materialize(op)
    # A graph break: dynamo traces the frame again, and finds the tables holding their values.
    raise Unsupported(f"rope_dedup: recomputed table {real.label} is written by the graph ({op}): it holds its "
                      f"values now")


class _Link:
    """The real table a traced one stands for, carried in the flatten context. Every link equals every other
    (guards and caches compare contexts across layers) and pickles as an empty one."""

    __slots__ = ("state",)

    def __init__(self, state: _State | None = None) -> None:
        self.state = weakref.ref(state) if state is not None else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Link)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "link"

    def __reduce__(self) -> tuple:
        return _Link, ()


def whole_values(recipe: Recipe) -> torch.Tensor:
    """Every row of ``recipe``'s table, in its shape and, where it was not contiguous, its strides."""
    positions = torch.arange(recipe.length, device=recipe.inv_freq.device, dtype=torch.int64)
    values = recipe.rows(positions).reshape(recipe.shape)
    if recipe.strides is None:
        return values
    laid = torch.empty_strided(recipe.shape, recipe.strides, dtype=values.dtype, device=values.device)
    return laid.copy_(values)


def _laid_out(values: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``values`` with its dims in memory in the order ``strides`` give them, densely (as ``empty_like`` keeps a
    tensor's layout): rows of a table that is not contiguous, so that ops on them lay out results as torch
    would for the table's own rows."""
    order = sorted(range(values.dim()), key=lambda d: -strides[d])  # outermost first; ties keep dim order
    if order == list(range(values.dim())):
        return values
    back = sorted(range(values.dim()), key=lambda d: order[d])
    return values.permute(order).contiguous().permute(back)


Step = tuple[Any, tuple, dict, "int | None"]  # (view op, its other arguments, kwargs, item of a list result)


class RecomputedTable(torch.Tensor):
    """A RoPE table whose values are computed from ``inv_freq`` where they are read, or a view of one (see the
    module doc)."""

    state: _State
    steps: tuple[Step, ...]  # view ops from the table's memory to this tensor
    recipe: Recipe | None  # a view of the whole table that still computes any rows it is asked for
    rows: torch.Tensor | None  # otherwise this view's values: computed when made, or (``live``) a view of memory
    live: bool
    _flat: tuple  # the flatten context, with the recipe and state it was made for
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, recipe: Recipe, state: _State) -> RecomputedTable:
        return _make(state, (), recipe=recipe)

    def __init__(self, recipe: Recipe, state: _State) -> None:  # made whole by __new__
        pass

    def __repr__(self) -> str:  # type: ignore[override]
        if self.state.materialized is not None:
            held = "written, holds its values"
        else:
            held = "recomputed" if self.recipe is not None else "rows computed when read"
        return (f"RecomputedTable({self.state.name or 'table'}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, {held})")

    @property
    def inv_freq(self) -> torch.Tensor:
        """The float32 frequency vector the table's values are computed from."""
        recipe = self.recipe or self.state.recipe
        if recipe is None:
            raise AttributeError(f"recomputed table {self.state.label} views memory set to other values: no "
                                 f"frequency vector computes them")
        return recipe.inv_freq

    @property
    def is_recomputed(self) -> bool:
        """False once the table holds a storage of its own (written)."""
        self.state.sync()
        return self.state.materialized is None and self.state.recipe is not None

    @property
    def materialized(self) -> torch.Tensor | None:
        """The table's storage once written (None while recomputed)."""
        return self.state.materialized

    def values(self) -> torch.Tensor:
        """This tensor's values as a plain tensor: a view of the table's storage once written, else computed."""
        self.state.sync()
        if self.state.materialized is not None:
            return self._plain()
        if self.recipe is not None:
            return whole_values(self.recipe)
        assert self.rows is not None
        return self.rows

    # -- what torch does with a tensor's memory, as the plain table would -----------------------------------
    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """``t.data = new``: ``t`` now reads ``new``'s memory, as a plain tensor would."""
        if new.dtype != self.dtype or new.device != self.device:
            raise RuntimeError(f"rope_dedup: .data = a {new.dtype} tensor on {new.device} for recomputed table "
                               f"{self.state.label} ({self.dtype}, {self.device}): a recomputed table cannot change "
                               f"its dtype or device in place; {UNSHARE}")
        with torch.no_grad():
            aten.set_.source_Tensor(self, new)

    def tolist(self) -> Any:
        return self.values().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """An array sharing the table's memory, as torch's is: the table is given a storage first."""
        self.state.materialize("numpy")
        return self._plain().numpy(force=force)

    def __array__(self, dtype: Any = None) -> Any:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    # -- tracing ---------------------------------------------------------------------------------------------
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        self.state.sync()
        # A view's offset in the table's memory travels in the context (a graph's output rebuilt from its flattened
        # parts must keep it: AOTAutograd gives back a view of a table input by its offset).
        if self.state.materialized is not None:
            self._plain()
            return ["rows"], ("memory", self.storage_offset())
        if self.recipe is None:
            return ["rows"], ("rows", self.storage_offset())
        # Guards and AOTAutograd's runtime wrapper flatten every table input on every call: one context per
        # recipe and state, made once (building it each call cost a decode step 2-3% over 40 layers).
        flat = self.__dict__.get("_flat")
        if flat is None or flat[0] is not self.recipe or flat[1] is not self.state:
            flat = self._flat = (self.recipe, self.state, (*_context(self.recipe), _Link(self.state)))
        return ["inv_freq"], flat[2]

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], context: tuple, outer_size: Any,
                             outer_stride: Any) -> RecomputedTable:
        if context[0] in ("memory", "rows"):
            rows = inner["rows"]
            state = _State("", None, materialized=rows if context[0] == "memory" else None)
            return _make(state, (), rows=rows, offset=context[1], live=context[0] == "memory")
        fields, _, link = context
        recipe = Recipe(**dict(fields), inv_freq=inner["inv_freq"])
        return _make(_State("", recipe, link=link.state), (), recipe=recipe)

    def __reduce_ex__(self, protocol: Any) -> tuple:  # pickle, torch.save: the recipe, not the values
        if self.recipe is None or self.steps:  # a view: its values, as pickling a view of a table gives
            return _plain_copy, (self.values(),)
        return _rebuild, (_context(self.recipe)[0], self.inv_freq, self.state.name, self.state.materialized,
                          self.state.key)

    def __deepcopy__(self, memo: dict) -> RecomputedTable:
        if id(self) in memo:
            return memo[id(self)]
        state = memo.get(id(self.state))
        if state is None:  # views of one table copied together read one copy of it, as deepcopy keeps aliasing
            recipe = self.state.recipe
            held = self.state.materialized
            state = memo[id(self.state)] = _State(
                self.state.name, None if recipe is None else recipe.with_inv_freq(copy.deepcopy(recipe.inv_freq, memo)),
                self.state.key, None if held is None else held.clone(), self.state.written_by)
        recipe = None if self.recipe is None or state.recipe is None else \
            self.recipe.with_inv_freq(state.recipe.inv_freq)
        rows = None if self.rows is None or self.live else self.rows.clone()
        copied = _make(state, self.steps, recipe=recipe, rows=rows, offset=self.storage_offset(), like=self)
        memo[id(self)] = copied
        return copied

    def _stable_hash_for_caching(self) -> str:
        """What AOTAutograd's cache keys on besides the inner tensors: the recipe, not the table's name."""
        return hashlib.sha256(repr(self.__tensor_flatten__()[1]).encode()).hexdigest()

    # -- dispatch --------------------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None  # type: ignore[override]
                           ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func is aten.copy_.default and _copies_own_values(first, args[1]):
            return first  # a reload of equal values (load_state_dict) changes nothing: stays recomputed
        if func is aten.detach_.default:
            return first  # a table never requires grad: nothing to detach
        written = [a for a in written_arguments(func, args, kwargs) if isinstance(a, RecomputedTable)]
        if written:
            return _write(func, args, kwargs, written)
        if isinstance(first, RecomputedTable) and first.recipe is not None and func in _OPS:
            first.state.sync()
            if first.state.materialized is None:
                found = _OPS[func](first, *args[1:], **kwargs)
                if found is not NotImplemented:
                    return return_and_correct_aliasing(func, args, kwargs, found)
        return _read(func, args, kwargs)

    # -- memory ----------------------------------------------------------------------------------------------
    def _plain(self) -> torch.Tensor:
        """This tensor as a view of the table's storage (which must exist): its steps replayed once, then kept."""
        if not self.live:
            self.rows, self.live = self._replay(self.state.materialized), True  # type: ignore[arg-type]
        return self.rows  # type: ignore[return-value]

    def _replay(self, memory: torch.Tensor) -> torch.Tensor:
        """This tensor's view of ``memory`` (a plain tensor in the shape of the table's memory)."""
        view = aten.alias.default(memory)
        for func, args, kwargs, item in self.steps:
            view = func(view, *args, **kwargs)
            view = view if item is None else view[item]
        return view

    def state_dict_entry(self) -> torch.Tensor:
        """What ``state_dict()`` holds for this table: a plain tensor of its values (a checkpoint loads anywhere)
        that is its memory, as torch's entry is: its storage once written; else values computed once while the
        entry lives, which become the table's storage if written (the next read of the table sees the write)."""
        self.state.sync()
        if self.state.materialized is not None:
            return self._plain().detach()
        if self.recipe is None:
            return self.values().detach()
        return self._replay(self.state.entry_for_state_dict())

    def _rebase(self, memory: torch.Tensor) -> None:
        """This tensor now reads ``memory`` (a plain tensor), with its metadata: after ``set_``, ``.data =``,
        ``resize_``, ``t_`` and every other op that changes what a tensor views."""
        self.state = _State(self.state.name, None, self.state.key, memory, self.state.written_by)
        self.steps, self.recipe, self.rows, self.live = (), None, memory, True
        _set_metadata(self, memory)


def _make(state: _State, steps: tuple[Step, ...], recipe: Recipe | None = None, rows: torch.Tensor | None = None,
          offset: Any = 0, live: bool = False, like: torch.Tensor | None = None,
          strides: tuple[int, ...] | None = None) -> RecomputedTable:
    """A view of ``state``: the whole table computed on demand (``recipe``), or values already computed
    (``rows``, with the storage offset, and strides where they are not the rows' own, that torch would give the
    view). ``like`` gives the metadata instead."""
    if like is not None:
        table = torch.Tensor._make_wrapper_subclass(RecomputedTable, like.shape, strides=like.stride(),
                                                    storage_offset=like.storage_offset(), dtype=like.dtype,
                                                    device=like.device, requires_grad=False)
        conj, neg = like.is_conj(), like.is_neg()
    elif rows is None:
        assert recipe is not None
        table = torch.Tensor._make_wrapper_subclass(RecomputedTable, recipe.shape, strides=recipe.strides,
                                                    dtype=recipe.dtype, device=recipe.inv_freq.device,
                                                    requires_grad=False)
        conj = neg = False
    else:
        table = torch.Tensor._make_wrapper_subclass(RecomputedTable, rows.shape, strides=strides or rows.stride(),
                                                    storage_offset=offset, dtype=rows.dtype, device=rows.device,
                                                    requires_grad=False)
        conj, neg = rows.is_conj(), rows.is_neg()
    if conj:
        torch._C._set_conj(table, True)
    if neg:
        torch._C._set_neg(table, True)
    table.state, table.steps, table.recipe, table.rows, table.live = state, steps, recipe, rows, live
    return table


def _set_metadata(table: RecomputedTable, like: torch.Tensor) -> None:
    """Give ``table`` (the wrapper itself) ``like``'s sizes, strides, offset, conj and neg bits, in place, as an
    in-place metadata op changes a plain tensor. Only the wrapper's metadata changes (no dispatch, meta kernels),
    after its placeholder storage is made large enough."""
    extent = like.storage_offset() + sum((s - 1) * st for s, st in zip(like.shape, like.stride())) + 1
    if like.numel() and extent * like.element_size() > table.untyped_storage().nbytes():
        room = torch.Tensor._make_wrapper_subclass(RecomputedTable, (extent,), dtype=like.dtype, device=like.device)
        torch._functionalize_unsafe_set(table, room)
    with no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            aten.as_strided_.default(table, like.shape, like.stride(), like.storage_offset())
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)
    torch._C._set_conj(table, like.is_conj())
    torch._C._set_neg(table, like.is_neg())


def _context(recipe: Recipe) -> tuple:
    return recipe.fields, "recomputed"


def _rebuild(fields: tuple, inv_freq: torch.Tensor, name: str, materialized: torch.Tensor | None,
             key: RopeKey | None = None) -> RecomputedTable:
    recipe = Recipe(**dict(fields), inv_freq=inv_freq)
    return RecomputedTable(recipe, _State(name, recipe, key, materialized=materialized))


def _plain_copy(values: torch.Tensor) -> torch.Tensor:
    return values.clone()


def _copies_own_values(table: Any, source: Any) -> bool:
    """Whether ``table.copy_(source)`` would write what a still recomputed ``table`` already reads, bit for bit."""
    if not isinstance(table, RecomputedTable) or table.recipe is None or not table.is_recomputed:
        return False
    if isinstance(source, RecomputedTable) or not isinstance(source, torch.Tensor):
        return False
    if source.shape != table.shape or source.dtype != table.dtype or source.device != table.device:
        return False
    return reproduces(table.recipe, source)


# -- reads: the values an op computes with, and views of tables as views ---------------------------------------

# Ops that read only a tensor's metadata: computing a whole table for them would be waste.
_METADATA_ONLY = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                  aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
                  aten.randint_like.low_dtype, aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
                  aten.new_full.default, aten.new_empty_strided.default}


def _op_name(func: Any) -> str:
    return str(func.overloadpacket.__name__)


def _read(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on the values of its table arguments; a view of a table comes back as a view of it."""
    op = _op_name(func)
    seen: dict[int, torch.Tensor] = {}

    def values(arg: Any) -> Any:
        if not isinstance(arg, RecomputedTable):
            return arg
        if id(arg) not in seen:
            if func in _METADATA_ONLY:
                seen[id(arg)] = torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype, device=arg.device)
            elif func.overloadpacket is aten.set_:  # a plain tensor set_ to a table reads the table's memory
                arg.state.materialize(op)
                seen[id(arg)] = arg._plain()
            else:
                seen[id(arg)] = _values_for(arg, op, func in _READ_MEMORY)
        return seen[id(arg)]

    plain_args, plain_kwargs = tree_map(values, args), tree_map(values, kwargs)
    out = func(*plain_args, **plain_kwargs)
    views = _aliased_inputs(func)
    if not views:
        return out
    for arg_index, out_index in views:
        table = _argument(func, args, kwargs, arg_index)
        if not isinstance(table, RecomputedTable):
            continue
        computed = _argument(func, plain_args, plain_kwargs, arg_index)
        rest = tuple(tree_map(lambda a: seen.get(id(a), a), args[1:]))
        made = out[out_index] if isinstance(out, tuple) else out
        if not _same_memory(made, computed):  # an op that may alias and made a copy (``to`` another dtype)
            return out
        if isinstance(made, (list, tuple)):
            made = type(made)(_view_of(table, computed, (func, rest, kwargs, i), o) for i, o in enumerate(made))
        else:
            made = _view_of(table, computed, (func, rest, kwargs, None), made)
        out = tuple(made if i == out_index else o for i, o in enumerate(out)) if isinstance(out, tuple) else made
    return return_and_correct_aliasing(func, args, kwargs, out)


def _same_memory(made: Any, computed: torch.Tensor) -> bool:
    """Whether ``made`` (a tensor, or a list of them) views ``computed``'s memory."""
    first = made[0] if isinstance(made, (list, tuple)) and made else made
    # The storage's own identity (``_cdata``): fake tensors have storages, not addresses.
    return isinstance(first, torch.Tensor) and first.untyped_storage()._cdata == computed.untyped_storage()._cdata


# Ops that read memory by position (a storage offset and strides), not a tensor's elements: a view of a table that
# holds no memory is read through the whole table's values, laid out as the table's memory.
_READ_MEMORY = {aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default}


def _values_for(table: RecomputedTable, op: str, memory: bool = False) -> torch.Tensor:
    """The values ``op`` reads of ``table``: its storage once written, its rows, or the whole table computed
    (``memory``: the values at this tensor's place in the table's memory, for an op that reads memory)."""
    table.state.sync()
    if table.state.materialized is not None:
        return table._plain()
    recipe = table.state.recipe
    if memory and (table.recipe is None or table.steps) and recipe is not None:
        return whole_values(recipe).as_strided(table.shape, table.stride(), table.storage_offset())
    if table.recipe is None:
        return table.rows  # type: ignore[return-value]
    state = table.state
    state.whole_reads[op] = state.whole_reads.get(op, 0) + 1
    warnings.warn(f"rope_dedup: {op} reads recomputed table {state.label} whole: it is computed in full for this op "
                  f"({table.nbytes} bytes); read rows of it (slice, index) to compute only those", stacklevel=5)
    return whole_values(table.recipe)


def _view_of(table: RecomputedTable, computed: torch.Tensor, step: Step, value: torch.Tensor) -> RecomputedTable:
    """``value`` (a view of ``computed``, the values ``table`` was read as) as a view of ``table``: at torch's
    offset in the table's memory, and a view of that memory once there is one."""
    if step[0] is aten.as_strided.default:  # positions in memory itself: from the table's own storage offset
        offset = value.storage_offset()
    else:  # in bytes: a view may change the dtype (view_as_real, .real)
        offset = (table.storage_offset() * table.element_size() + value.storage_offset() * value.element_size()
                  - computed.storage_offset() * computed.element_size()) // value.element_size()
    return _make(table.state, table.steps + (step,), rows=value, offset=offset, live=table.live)


def _aliased_inputs(func: Any) -> list[tuple[int, int]]:
    """(argument, return) pairs where ``func`` returns a view of that argument (its schema says so, as torch's
    own aliasing correction reads it)."""
    return get_alias_info(func).read_only_alias_match_indexes


def _argument(func: Any, args: tuple, kwargs: dict, index: int) -> Any:
    return args[index] if index < len(args) else kwargs.get(func._schema.arguments[index].name)


# -- writes ----------------------------------------------------------------------------------------------------

@functools.cache
def _written_indices(func: Any) -> tuple[int, ...]:
    """Which arguments ``func``'s schema writes: read once per op, since every op on a table asks."""
    return tuple(i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def written_arguments(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments ``func``'s schema writes."""
    found: list[Any] = []
    for i in _written_indices(func):
        value = _argument(func, args, kwargs, i)
        found.extend(value if isinstance(value, (list, tuple)) else [value])
    return found


def _write(func: Any, args: tuple, kwargs: dict, written: list[RecomputedTable]) -> Any:
    """Give each written table a storage, run ``func`` on it, and carry any metadata change to the wrapper."""
    op = _op_name(func)
    repoints = func.overloadpacket is aten.set_  # set_ replaces what the tensor views: its old values are not read
    reshapes = _may_change_metadata(func)
    if not repoints:
        for table in written:
            table.state.materialize(op)
    targets: dict[int, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}

    def values(arg: Any) -> Any:
        if not isinstance(arg, RecomputedTable):
            return arg
        if any(arg is t for t in written):
            if id(arg) not in targets:  # a fresh alias where metadata may change: it must reach this wrapper alone
                targets[id(arg)] = torch.empty(0, dtype=arg.dtype, device=arg.device) if repoints \
                    else aten.alias.default(arg._plain()) if reshapes else arg._plain()
            return targets[id(arg)]
        if id(arg) not in seen:
            if repoints:  # set_'s source is aliased, not read: it needs its memory
                arg.state.materialize(op)
                seen[id(arg)] = arg._plain()
            else:
                seen[id(arg)] = _values_for(arg, op)
        return seen[id(arg)]

    ran = False
    try:
        out = func(*tree_map(values, args), **tree_map(values, kwargs))
        ran = True
    finally:  # a metadata change stays made when the op then raises (torch resizes an out= before it checks)
        for table in written:
            memory = targets.get(id(table))
            if memory is not None and ((repoints and ran) or (not repoints and _metadata(memory) != _metadata(table))):
                table._rebase(memory)
    return _returned(func, args, kwargs, out)


def _metadata(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.storage_offset(), t.is_conj(), t.is_neg()


def _may_change_metadata(func: Any) -> bool:
    """Whether ``func`` may change what a tensor it writes views (``t_``, ``resize_``, an ``out=`` resized)."""
    return torch.Tag.inplace_view in func.tags or func.overloadpacket in (aten.resize_, aten.resize_as_) or \
        any(a.alias_info is not None and a.alias_info.is_write and a.kwarg_only for a in func._schema.arguments)


def _returned(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """What an in-place or out= op returns: the very tensors it wrote (its schema's write aliases)."""
    returns = func._schema.returns
    if not returns or any(r.alias_info is None or not r.alias_info.is_write for r in returns):
        return out
    arguments = func._schema.arguments
    by_alias = {frozenset(arguments[i].alias_info.before_set): _argument(func, args, kwargs, i)
                for i in _written_indices(func)}
    found = [by_alias[frozenset(r.alias_info.before_set)] for r in returns]
    return found[0] if len(found) == 1 else tuple(found)


# -- the op table: exact reads of a whole recomputed table, one function per op (NotImplemented: a plain read) -

_OPS: dict[Any, Callable[..., Any]] = {}


def _implements(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            _OPS[op] = fn
        return fn
    return register


def _alias(table: RecomputedTable, step: Step, shape: tuple[int, ...] | None = None) -> RecomputedTable | Any:
    """The same table seen with unit dims added or dropped; NotImplemented for any other reshape."""
    assert table.recipe is not None
    shape = tuple(table.shape) if shape is None else tuple(shape)
    if [s for s in shape if s != 1] != [s for s in table.shape if s != 1] or \
            (table.recipe.strides is not None and shape != tuple(table.shape)):
        return NotImplemented  # a table that is not contiguous: its views' strides are torch's to compute
    pos_dim = position_dim(shape)
    if pos_dim is None:
        return NotImplemented
    return _make(table.state, table.steps + (step,), recipe=replace(table.recipe, shape=shape, pos_dim=pos_dim))


# Rows computed while one graph is traced, per tracer: a layer reads its table's rows once for q and once for
# k, and the graph computes them once (each layer's table comes into the trace as its own input).
_TRACED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _once_per_graph(table: RecomputedTable, read: tuple, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``compute()``, or the rows this graph's trace already computed for the same vector, recipe and read.

    Only while a graph is traced (a proxy mode): there, rows of a table without values are never written (a write
    gives the table its values first, and the trace starts again), so one computation can serve every read. Bounds that are symbols (dynamic shapes) are computed each time."""
    mode = get_proxy_mode()
    if mode is None or not all(type(v) in (int, str) for v in read):
        return compute()
    seen = _TRACED.setdefault(mode, {})
    key = (id(table.inv_freq), _context(table.recipe), read)  # type: ignore[arg-type]
    if key not in seen:
        seen[key] = (table.inv_freq, compute())  # the vector held: its id stays its own while the trace lasts
    return seen[key][1]


def _positions(start: Any, stop: Any, table: RecomputedTable) -> torch.Tensor:
    return torch.arange(start, stop, device=table.device, dtype=torch.int64)


def _rows(table: RecomputedTable, step: Step, begin: Any, stop: Any, every: int, offset: Any) -> RecomputedTable:
    """The view of rows ``begin:stop:every`` along the positions, computed (once per graph while traced)."""
    recipe = table.recipe
    assert recipe is not None
    dim = recipe.pos_dim

    strides = None if recipe.strides is None else \
        tuple(st * every if d == dim else st for d, st in enumerate(table.stride()))

    def compute() -> torch.Tensor:
        rows = recipe.rows_in_place(_positions(begin, torch.sym_max(begin, stop), table))
        rows = rows if recipe.strides is None else _laid_out(rows, recipe.strides)
        # A stepped slice is a strided view of the rows it spans: computed so, it has torch's strides.
        return rows if every == 1 else rows[(slice(None),) * dim + (slice(None, None, every),)]

    rows = _once_per_graph(table, ("slice", dim, begin, stop, every), compute)
    return _make(table.state, table.steps + (step,), rows=rows, offset=offset, strides=strides)


@_implements(aten.detach.default, aten.alias.default)
def _same(table: RecomputedTable) -> Any:
    return _alias(table, (aten.alias.default, (), {}, None))


@_implements(aten.clone.default)
def _clone(table: RecomputedTable, **kwargs: Any) -> Any:
    """A table of its own (``deepcopy`` calls clone): a write to the copy must not reach this one."""
    if kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
        return NotImplemented
    assert table.recipe is not None
    return _make(_State(table.state.name, table.recipe, table.state.key), (), recipe=table.recipe)


@_implements(aten.slice.Tensor)
def _slice(table: RecomputedTable, dim: int = 0, start: int | None = None, end: int | None = None,
           step: int = 1) -> Any:
    dim %= table.dim()
    size = table.shape[dim]
    # torch.sym_min/sym_max, not slice.indices(): under dynamic shapes the bounds are symbols, and turning
    # them into ints would specialize the graph to one length.
    begin, stop = _bound(start, size, 0), _bound(end, size, size)
    view: Step = (aten.slice.Tensor, (dim, start, end, step), {}, None)
    if dim != table.recipe.pos_dim:  # type: ignore[union-attr]
        return _alias(table, view) if (begin, stop, step) == (0, size, 1) else NotImplemented
    return _rows(table, view, begin, stop, step, begin * table.stride(dim))


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
    size = table.shape[dim]
    torch._check_index(-size <= index < size,
                       lambda: f"select(): index {index} out of range for tensor of size {list(table.shape)} at "
                               f"dimension {dim}")
    if dim != table.recipe.pos_dim:  # type: ignore[union-attr]
        return _alias(table, (aten.select.int, (dim, index), {}, None),
                      tuple(table.shape[:dim]) + tuple(table.shape[dim + 1:]))
    index = index + size if index < 0 else index
    recipe = table.recipe
    assert recipe is not None
    strides = None if recipe.strides is None else tuple(st for d, st in enumerate(table.stride()) if d != dim)

    def compute() -> torch.Tensor:
        row = recipe.rows_in_place(_positions(index, index + 1, table)).squeeze(dim)
        return row if strides is None else _laid_out(row, strides)

    rows = _once_per_graph(table, ("select", dim, index), compute)
    return _make(table.state, table.steps + ((aten.select.int, (dim, index), {}, None),), rows=rows,
                 offset=index * table.stride(dim), strides=strides)


@_implements(aten.index.Tensor)
def _index(table: RecomputedTable, indices: list[torch.Tensor | None]) -> Any:
    recipe = table.recipe
    assert recipe is not None
    dim = recipe.pos_dim
    if len(indices) != dim + 1 or any(i is not None for i in indices[:dim]):
        return NotImplemented
    positions = indices[dim]
    if positions is None or positions.dtype not in (torch.int64, torch.int32):
        return NotImplemented
    positions = check_positions(positions.to(torch.int64), recipe.length, dim, "index", table.state.label)
    return recipe.rows_in_place(torch.where(positions < 0, positions + recipe.length, positions))


@_implements(aten.index_select.default)
def _index_select(table: RecomputedTable, dim: int, index: torch.Tensor) -> Any:
    recipe = table.recipe
    assert recipe is not None
    dim %= table.dim()
    if dim != recipe.pos_dim or index.dim() > 1:
        return NotImplemented
    positions = check_positions(index.to(torch.int64).reshape(-1), recipe.length, dim, "index_select",
                                table.state.label)
    return recipe.rows_in_place(positions)


@_implements(aten.embedding.default)
def _embedding(table: RecomputedTable, indices: torch.Tensor, *args: Any) -> Any:
    recipe = table.recipe
    assert recipe is not None
    if table.dim() != 2 or recipe.pos_dim != 0:
        return NotImplemented
    return recipe.rows(check_positions(indices.to(torch.int64), recipe.length, 0, "embedding", table.state.label))


@_implements(aten.unsqueeze.default)
def _unsqueeze(table: RecomputedTable, dim: int) -> Any:
    dim %= table.dim() + 1
    return _alias(table, (aten.unsqueeze.default, (dim,), {}, None),
                  tuple(table.shape[:dim]) + (1,) + tuple(table.shape[dim:]))


@_implements(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(table: RecomputedTable, dims: Any = None) -> Any:
    step: Step = (aten.squeeze.dims, (list(range(table.dim())) if dims is None else
                                [dims] if isinstance(dims, int) else list(dims),), {}, None)
    dims = {d % table.dim() for d in step[1][0]}
    return _alias(table, step, tuple(s for d, s in enumerate(table.shape) if not (d in dims and s == 1)))


@_implements(aten.view.default, aten._unsafe_view.default)
def _view(table: RecomputedTable, shape: list[int]) -> Any:
    shape = list(shape)
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        shape[shape.index(-1)] = table.numel() // max(known, 1)
    return _alias(table, (aten.view.default, (shape,), {}, None), tuple(shape))


@_implements(aten.expand.default)
def _expand(table: RecomputedTable, size: list[int], implicit: bool = False) -> Any:
    size = [table.shape[d - (len(size) - table.dim())] if s == -1 else s for d, s in enumerate(size)]
    if len(size) != table.dim() or tuple(size) != tuple(table.shape):
        return NotImplemented
    return _alias(table, (aten.expand.default, (size,), {}, None))


@_implements(aten.as_strided.default)
def _as_strided(table: RecomputedTable, size: list[int], stride: list[int], storage_offset: Any = None) -> Any:
    """Rows ``a:b`` asked for by their place in memory (AOTAutograd gives back a graph's output that is a view of
    its table input so): computed as rows; any other view of memory is a plain read."""
    offset = table.storage_offset() if storage_offset is None else storage_offset
    dim = table.recipe.pos_dim  # type: ignore[union-attr]
    row = table.stride(dim)
    if len(size) != table.dim() or list(stride) != list(table.stride()) or \
            any(s != t for d, (s, t) in enumerate(zip(size, table.shape)) if d != dim) or offset % row:
        return NotImplemented
    begin = offset // row
    if begin + size[dim] > table.shape[dim]:
        return NotImplemented
    view: Step = (aten.as_strided.default, (list(size), list(stride), offset), {}, None)
    return _rows(table, view, begin, begin + size[dim], 1, offset)


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
    assert recipe is not None
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
    return RecomputedTable(recipe, _State(table.state.name, recipe, key))


def _same_on(here: Recipe, there: Recipe) -> bool:
    """Whether ``there`` (on another device) computes ``here``'s rows bit for bit, a chunk at a time."""
    device = there.inv_freq.device
    return all(same_values(here.rows(positions).to(device), there.rows(positions.to(device)))
               for _, positions in row_chunks(here, here.inv_freq.device))


NO_TABLE.add(RecomputedTable)
