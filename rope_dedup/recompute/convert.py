"""Put recomputed tables in a model's place: every recognized table whose recipe is exact.

Each table a module holds (buffer or plain attribute) is recognized, keyed, and searched for a recipe that
reproduces it bit for bit; one that has one is replaced by a :class:`RecomputedTable`, and tables with equal
recipes use one frequency vector. What cannot be converted keeps its values and says why, so the caller can
share it instead. A persistent table stays in the ``state_dict`` under its key, with its values.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from rope_dedup.core.eligibility import Refusal, SkipReason, why_not_shareable
from rope_dedup.core.report import Recomputed
from rope_dedup.recompute.recipe import CHUNK_ROWS, Recipe, find_recipe
from rope_dedup.recompute.table import RecomputedTable, _context, _State, written_arguments
from rope_dedup.tables.keys import RopeKey, infer_key
from rope_dedup.tables.recognize import RopeTable, recognize_rope_table
from rope_dedup.tensors import Origin, is_dtensor, is_plain, local, module_state, same_values, storage_nbytes


@dataclass
class Conversion:
    """What one :func:`recompute_tables` call did: tables converted, and tables left as they were, with why."""

    recomputed: list[Recomputed]
    kept: list[tuple[str, Refusal]]
    vector_bytes: int  # what the recomputed tables hold between them: their distinct frequency vectors
    replaced: dict[int, RecomputedTable] = field(default_factory=dict)  # id(table before) -> its replacement


class Converter:
    """Turns tables into :class:`RecomputedTable` s: the recipes found so far, by where a table's values live
    (held here, so that no other table's storage takes their address while this lives), and one frequency
    vector per distinct set of bits."""

    def __init__(self) -> None:
        self._vectors: dict[tuple, torch.Tensor] = {}
        self._by_storage: dict[tuple, tuple[Recipe, torch.Tensor, RopeKey]] = {}
        self._states: dict[tuple, _State] = {}  # where a converted table's values lived -> its memory (see below)
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> its replacement
        self._by_module: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> [(length, vector)]

    def convert(self, tensor: torch.Tensor, path: str, origin: Origin = Origin.BUFFER,
                module: torch.nn.Module | None = None) -> tuple[RecomputedTable | None, Recomputed | None, Refusal | None]:
        """(its replacement, what was recomputed, why not): all None when ``tensor`` is not a RoPE table, and only
        the replacement when ``tensor`` was converted before.

        One tensor gets one replacement however often it is offered (held by two modules), and tensors that are
        one view of one memory (tables shared before) get replacements that are one memory too: a write to one
        shows in the others, as it did. A table of ``module`` is first tried with the frequencies of the tables
        of the same length converted there already (a bf16 sin measures its theta less well than its cos)."""
        made = self._made.get(tensor)
        if made is not None:  # offered again (registered in a second module): counted once, where first seen
            return made, None, None
        refusal = _refusal(tensor, origin)
        where = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                 tuple(tensor.stride()), tensor.dtype) if refusal is None else None
        known = self._by_storage.get(where) if where is not None else None
        if known is None:  # not the memory of a table converted already (shared tables: one look for all)
            # A DTensor is recognized by its local shard, so that it is kept with its reason, not passed over.
            found = recognize_rope_table(local(tensor)) if origin is not Origin.PARAMETER or not tensor.requires_grad \
                else None
            if not isinstance(found, RopeTable) or found.length is None:
                return None, None, None
            if refusal is not None or where is None:
                return None, None, refusal
            key = infer_key(found, tensor)
            known = self._equal_to_known(tensor)
            if known is None:
                siblings = [v for length, v in self._by_module.get(module, ()) if length == found.length] \
                    if module is not None else []
                searched = find_recipe(tensor, found, key.theta, key.dim, siblings)
                if isinstance(searched, str):
                    return None, None, Refusal(SkipReason.NOT_EXACT, searched)
                # Kept by its address only while held here: a freed table's address may come back for another.
                known = self._by_storage[where] = (self._one_vector(searched), tensor, key)
        recipe, _, key = known
        if module is not None:
            self._by_module.setdefault(module, []).append((recipe.length, recipe.inv_freq))
        state = self._states.get(where) if where in self._by_storage else None
        if state is None:
            state = _State(path, recipe, key)
            if where in self._by_storage:
                self._states[where] = state
        replacement = self._made[tensor] = RecomputedTable(recipe, state)
        return replacement, Recomputed(path, key, storage_nbytes(tensor)), None

    def siblings(self, module: torch.nn.Module) -> int:
        """How many tables of ``module`` were converted by this converter."""
        return len(self._by_module.get(module, ()))

    def forget_tables(self) -> None:
        """Let go of the tables kept for comparison (a backend keeps its converter, and its vectors, across
        compiles: not the tables it replaced)."""
        self._by_storage.clear()
        self._states.clear()

    @property
    def vector_bytes(self) -> int:
        """Bytes of the distinct frequency vectors handed out so far."""
        return sum(v.untyped_storage().nbytes() for v in self._vectors.values())

    def _equal_to_known(self, tensor: torch.Tensor) -> tuple[Recipe, torch.Tensor, RopeKey] | None:
        """A recipe found for a table of the very same bits (layer after layer while a model is built): a
        comparison, instead of a search and a check that compute the table again."""
        for known in self._by_storage.values():
            seen = known[1]
            if seen.shape == tensor.shape and seen.dtype == tensor.dtype and seen.device == tensor.device and \
                    all(same_values(a, b) for a, b in zip(seen.split(CHUNK_ROWS), tensor.split(CHUNK_ROWS))):
                return known
        return None

    def _one_vector(self, recipe: Recipe) -> Recipe:
        """The recipe with an earlier recipe's frequency vector of the same bits, if any: one vector per key (a
        key's cos and sin tables, and its tables in other layouts, use one)."""
        ident = (recipe.inv_freq.device, tuple(recipe.inv_freq.view(torch.int32).cpu().tolist()))
        known = self._vectors.get(ident)
        if known is not None and same_values(known, recipe.inv_freq):
            return recipe.with_inv_freq(known)
        self._vectors[ident] = recipe.inv_freq
        return recipe


class BuilderWrites(TorchDispatchMode):
    """While ``sharing(tables="recompute")`` builds a model: the tensors replaced as they registered are still
    the builder's (``c = ...; self.register_buffer("cos", c); c.mul_(s)``), and torch would have written the
    buffer itself. A write to one (or to a view of its memory) makes it the recomputed table's storage, with its
    values. A dispatch mode of the building thread: it passes every op through and looks at in-place ones."""

    def __init__(self) -> None:
        super().__init__()
        self._watched: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}  # memory -> (tensor, its replacement)
        self._lock = threading.Lock()

    def watch(self, tensor: torch.Tensor, replacement: RecomputedTable) -> None:
        with self._lock:
            self._watched[_memory(tensor)] = (weakref.ref(tensor), weakref.ref(replacement))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._watched and func._schema.is_mutable:
            for arg in written_arguments(func, args, kwargs):
                if type(arg) is torch.Tensor and arg.layout == torch.strided and not arg.is_meta:
                    memory = _memory(arg)
                    if memory in self._watched:
                        self._adopt(memory)
        return out

    def _adopt(self, memory: tuple) -> None:
        with self._lock:
            tensor, replacement = (ref() for ref in self._watched.pop(memory))
        if tensor is not None and replacement is not None and _memory(tensor) == memory:
            replacement.state.adopt(tensor, "its builder's own reference")


def _memory(tensor: torch.Tensor) -> tuple:
    return tensor.device, tensor.untyped_storage().data_ptr()


def recompute_tables(*models: torch.nn.Module, dry_run: bool = False, converter: Converter | None = None,
                     keep: Callable[[torch.nn.Module, str, torch.Tensor], Refusal | None] | None = None
                     ) -> Conversion:
    """Replace every recognized RoPE table of ``models`` by a :class:`RecomputedTable` where a recipe gives
    its bits exactly; tables of equal recipes share one frequency vector. Already converted tables count again
    in the result and change nothing. ``keep(module, name, table)`` may refuse a table the converter would take
    (why, or None)."""
    done: list[Recomputed] = []
    kept: list[tuple[str, Refusal]] = []
    replaced: dict[int, RecomputedTable] = {}
    originals: list[torch.Tensor] = []
    converter = converter if converter is not None else Converter()
    overlapping = _other_views(*models)
    offered = []
    for model in models:
        for path, tensor, origin, _, module in module_state(model):
            if not isinstance(tensor, RecomputedTable):
                offered.append((path, tensor, origin, module))
            elif not tensor.is_recomputed:
                kept.append((path, Refusal(SkipReason.NOT_EXACT, f"written in place by {tensor.state.written_by} "
                                                                 f"after it was recomputed")))
            elif tensor.state.key is not None:
                done.append(Recomputed(path, tensor.state.key, tensor.nbytes))
    # Twice for a table no recipe reproduced: a sibling of its module converted after it gives its frequencies.
    for again in (False, True):
        retry = []
        for path, tensor, origin, module in offered:
            replacement, recomputed, refusal = converter.convert(tensor, path, origin, module)
            if not again and replacement is None and refusal is not None and refusal.reason is SkipReason.NOT_EXACT \
                    and converter.siblings(module) == 0:
                retry.append((path, tensor, origin, module, refusal))
                continue
            if replacement is not None and id(tensor) in overlapping:
                refusal = Refusal(SkipReason.NOT_EXACT, f"another view of the memory of {overlapping[id(tensor)]}: "
                                                        f"recomputed apart, a write to one would miss the other")
            if replacement is not None and refusal is None and keep is not None:
                refusal = keep(module, path.rpartition(".")[2], tensor)
            if refusal is not None:
                kept.append((path, refusal))
            elif replacement is not None and recomputed is not None:
                done.append(recomputed)
                if not dry_run:
                    replaced[id(tensor)] = replacement
                    originals.append(tensor)  # alive until every holder is replaced: its id stays its own
        offered = [(path, tensor, origin, module) for path, tensor, origin, module, _ in retry
                   if converter.siblings(module)]
        kept += [(path, refusal) for path, _, _, module, refusal in retry if not converter.siblings(module)]
    # All at once (a search that fails changes nothing), and in every place that holds the table: holders of one
    # tensor keep holding one tensor.
    for module, name, tensor, persistent in holders(*models):
        if id(tensor) in replaced:
            put_table(module, name, replaced[id(tensor)], persistent)
    return Conversion(done, kept, vector_bytes(*models), replaced)


def _other_views(*models: torch.nn.Module) -> dict[int, str]:
    """id(tensor) -> the path of another tensor of ``models`` that views the same memory in another way (a cache
    and a slice of it, held apart): tables that alias so cannot be recomputed apart."""
    views: dict[tuple, dict[tuple, str]] = {}
    tensors = []
    for model in models:
        for path, tensor, _, _, _ in module_state(model):
            if is_plain(tensor) and not tensor.is_meta and tensor.untyped_storage().data_ptr():
                memory = _memory(tensor)
                view = (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
                views.setdefault(memory, {}).setdefault(view, path)
                tensors.append((tensor, memory, view))
    return {id(tensor): next(p for v, p in views[memory].items() if v != view)
            for tensor, memory, view in tensors if len(views[memory]) > 1}


def put_table(module: torch.nn.Module, name: str, table: RecomputedTable, persistent: bool) -> None:
    """Put ``table`` in ``name``'s place; a persistent one's ``state_dict`` entry holds its values."""
    _put(module, name, table)
    table.state.owner = (weakref.ref(module), name)
    if persistent:
        keep_values_in_state_dict(module)


_HOOKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # modules whose state_dict hook is in place


def keep_values_in_state_dict(module: torch.nn.Module) -> None:
    """Make ``module``'s ``state_dict`` hold the values of its recomputed buffers (once per module)."""
    if module not in _HOOKED:
        module._register_state_dict_hook(_values_in_state_dict)
        _HOOKED.add(module)


def vector_bytes(*models: torch.nn.Module) -> int:
    """What the recomputed tables of ``models`` hold between them: their distinct frequency vectors."""
    held = {(t.inv_freq.device, t.inv_freq.untyped_storage().data_ptr()): t.inv_freq.untyped_storage().nbytes()
            for model in models for _, t, _, _, _ in module_state(model) if isinstance(t, RecomputedTable) and t.is_recomputed}
    return sum(held.values())


def _refusal(tensor: torch.Tensor, origin: Origin) -> Refusal | None:
    """Why a table keeps its values: the sharing rules (trainable, sharded, meta, freed ...), and parameters.
    A persistent table is converted: its state_dict entry holds its values (:func:`_values_in_state_dict`)."""
    if origin is Origin.PARAMETER:
        return Refusal(SkipReason.NOT_EXACT, "a parameter: only buffers and plain attributes are recomputed")
    if is_dtensor(tensor):
        return Refusal(SkipReason.NOT_EXACT, "a DTensor: recomputing on each rank is not supported yet")
    return why_not_shareable(tensor, None)


def _values_in_state_dict(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A checkpoint holds a recomputed table's values, not the recipe: it loads anywhere, as before. The entry is
    the table's memory, as torch's is (:meth:`RecomputedTable.state_dict_entry`); ``keep_vars=True`` keeps the
    table itself."""
    for name, buffer in module._buffers.items():
        key = prefix + name
        if isinstance(buffer, RecomputedTable) and key in state_dict and state_dict[key] is not buffer:
            state_dict[key] = buffer.state_dict_entry()


def restore_values(model: torch.nn.Module) -> list[str]:
    """Put back a plain tensor holding its values in place of each recomputed table of ``model`` (one tensor
    for every holder of one table); the paths."""
    paths = [path for path, t, _, _, _ in module_state(model) if isinstance(t, RecomputedTable)]
    plain: dict[int, torch.Tensor] = {}
    for module, name, tensor, _ in holders(model):
        if isinstance(tensor, RecomputedTable):
            _put(module, name, plain.setdefault(id(tensor), tensor.values()))
    return paths


def holders(*models: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, torch.Tensor, bool]]:
    """(module, name, tensor, persistent) for every buffer and plain tensor attribute of ``models``, in every place
    that holds it (a tensor two modules hold comes twice)."""
    for model in models:
        for module in model.modules():
            for name, tensor in list(module._buffers.items()):
                if tensor is not None:
                    yield module, name, tensor, name not in module._non_persistent_buffers_set
            for name, tensor in list(vars(module).items()):
                if isinstance(tensor, torch.Tensor):
                    yield module, name, tensor, False


@contextlib.contextmanager
def values_in_place(*models: torch.nn.Module) -> Iterator[list[str]]:
    """While the block runs, each recomputed table of ``models`` is a plain tensor of its values (the audit
    judges a recomputed table as its values), one tensor for the tables of one recipe, as one storage would
    hold them if they were shared. Yields their paths; the tables are put back however the block ends."""
    swapped: list[tuple[torch.nn.Module, str, RecomputedTable]] = []
    made: dict[tuple, torch.Tensor] = {}
    paths: list[str] = []
    try:
        for model in models:
            paths += [path for path, t, _, _, _ in module_state(model) if isinstance(t, RecomputedTable)]
            for module, name, tensor, _ in holders(model):
                if not isinstance(tensor, RecomputedTable):
                    continue
                ident = (tensor.inv_freq.device, tensor.inv_freq.untyped_storage().data_ptr(),
                         _context(tensor.recipe)) if tensor.is_recomputed and tensor.recipe is not None \
                    else (id(tensor),)
                if ident not in made:
                    made[ident] = tensor.values()
                swapped.append((module, name, tensor))
                _put(module, name, made[ident].detach())  # its own tensor, one storage
        yield paths
    finally:
        for module, name, table in reversed(swapped):
            _put(module, name, table)


def _put(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Set a buffer (keeping whether it is persistent) or a plain tensor attribute."""
    if name in module._buffers:
        module._buffers[name] = value
    else:
        setattr(module, name, value)
