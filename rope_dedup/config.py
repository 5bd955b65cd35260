"""Every setting of the rope_dedup backend in one frozen, validated object.

A backend gets its settings through three doors: ``RopeDedupBackend(...)`` keywords, and the ``mode`` /
``options`` that ``torch.compile`` forwards to a backend (the only door a string-only configuration such
as ``torch.compile(model, backend="rope_dedup", options={...})`` or torchtitan's ``--compile.backend``
has). All three end in a :class:`RopeDedupConfig`, so what an option means and what it defaults to is
written once, here, and a bad value fails when the config is made, not deep inside dynamo at the first
call.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple

import torch

# Tables computed in forward: (fold_constants, merge_computed) per inner backend when left at None, as
# measured in docs/benchmarks.md ("Tables computed in forward", figures there). eager, aot_eager: both
# make forward steps faster and outputs stay bitwise equal. inductor: merging measured nothing, and folding
# makes the table eager's cos/sin, which differ from inductor's fused ones in the last bits: outputs would
# no longer equal the compile without the pass, so it is opt-in. A callable inner gets neither.
COMPUTED_TABLE_DEFAULTS: dict[str, tuple[bool, bool]] = {
    "eager": (True, True),
    "aot_eager": (True, True),
    "inductor": (False, False),
}

_SELF_NAMES = ("rope_dedup",)

TABLES = ("share", "recompute")  # one storage per key, or no table at all where a recipe is exact


class ComputedTables(NamedTuple):
    """What happens to RoPE tables computed in ``forward``: folded into constants, merged when identical."""

    fold: bool
    merge: bool  # an inner backend that is rope_dedup again would recurse


@dataclass(frozen=True)
class RopeDedupConfig:
    """What a :class:`~rope_dedup.backend.RopeDedupBackend` does, and what it hands the graph to.

    Attributes:
        inner: backend the rewritten graph is compiled with: a name from ``torch._dynamo.list_backends()``
            (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...) or a backend callable.
        mode: ``torch.compile`` mode for the inner backend (``"max-autotune"``, ``"reduce-overhead"``,
            ...). With ``inner="inductor"`` the graph is compiled exactly as ``torch.compile(model,
            mode=mode)`` would compile it; a callable inner receives it as a keyword, as ``torch.compile``
            passes it; other named backends take none.
        inner_options: the inner backend's own options (inductor's config, as in ``torch.compile(...,
            options=...)``), forwarded under the same rules as ``mode``.
        share_persistent: also share tensors saved in a ``state_dict`` (persistent buffers, frozen
            parameters). Off by default: safetensors' ``save_file`` refuses tensors that share memory and
            ``load_state_dict`` would write one table into every sharer (see docs/sharing.md, "Checkpoints").
        fold_constants: evaluate a subgraph that reads no input and ends in a RoPE table once, at compile
            time, into one shared constant. None: :data:`COMPUTED_TABLE_DEFAULTS` for the inner backend.
        merge_computed: merge identical table computations that read buffers or positions. None: as above.
        strict: raise an unexpected error inside the pass; otherwise the graph compiles without sharing
            and the error is logged and kept in ``report.errors``.
        dry_run: decide and report, but alias and rewrite nothing (what :func:`rope_dedup.audit.explain` uses).
        tables: ``"share"`` (one storage per key) or ``"recompute"``: every table a recipe reproduces bit for
            bit holds only its frequency vector and computes the rows a read reads (docs/recompute.md). The
            backend converts the whole model while it compiles the first graph, before dynamo guards on it.
        release_memory: after a compile that freed CPU tables (and from run-time interning once 64 MB
            more are freed), return freed heap memory to the OS with glibc's ``malloc_trim``: otherwise
            glibc keeps tables of a few MB in the process and RSS hardly drops. Never on the per-call path;
            a no-op without glibc and on CUDA.
    """

    inner: str | Callable = "inductor"
    mode: str | None = None
    inner_options: Mapping[str, Any] = field(default_factory=dict)
    share_persistent: bool = False
    fold_constants: bool | None = None
    merge_computed: bool | None = None
    strict: bool = False
    dry_run: bool = False
    tables: str = "share"
    release_memory: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.inner, str):
            if self.inner not in COMPUTED_TABLE_DEFAULTS:  # listing imports every backend: only when needed
                known = torch._dynamo.list_backends(exclude_tags=())
                if self.inner in _SELF_NAMES or self.inner not in known:
                    raise ValueError(f"unknown inner backend {self.inner!r}: choose one of "
                                     f"{', '.join(n for n in known if n not in _SELF_NAMES)}, "
                                     f"or pass a backend callable")
        elif not callable(self.inner) or isinstance(self.inner, (RopeDedupConfig, bool)):
            raise TypeError(f"inner must be a backend name or a backend callable, got {type(self.inner).__name__}: "
                            f"{self.inner!r}")
        for name in ("share_persistent", "strict", "dry_run", "release_memory"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("fold_constants", "merge_computed"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True, False or None (the inner backend's default), "
                                f"got {getattr(self, name)!r}")
        if self.tables not in TABLES:
            raise ValueError(f"tables must be one of {', '.join(map(repr, TABLES))}, got {self.tables!r}")
        if self.mode is not None and not isinstance(self.mode, str):
            raise TypeError(f"mode must be a string such as 'max-autotune', got {self.mode!r}")
        if not isinstance(self.inner_options, Mapping):
            raise TypeError(f"inner_options must be a mapping, got {type(self.inner_options).__name__}")
        object.__setattr__(self, "inner_options", MappingProxyType(dict(self.inner_options)))
        if self.mode == "default":  # torch.compile's own spelling of "no mode"
            object.__setattr__(self, "mode", None)
        if self.inner == "inductor":
            known = torch._inductor.config.get_config_copy()  # type: ignore[assignment]
            unknown = [k for k in self.inner_options if k.replace("-", "_") not in known]
            if unknown:
                raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))}: rope_dedup's options are "
                                 f"{', '.join(self.option_names())}; inductor's are listed by "
                                 f"torch._inductor.list_options()")
        elif isinstance(self.inner, str) and (self.mode or self.inner_options):
            raise ValueError(f"unknown option(s) for inner backend {self.inner!r}, which takes no mode or options: "
                             f"mode={self.mode!r}, {', '.join(map(repr, self.inner_options)) or 'no options'}; "
                             f"rope_dedup's options are {', '.join(self.option_names())}")
        self.inner_backend()  # inductor checks its mode and options here, not at the first call

    def _fields(self) -> dict[str, Any]:
        """The constructor's keywords that rebuild this config (options as a plain dict)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["inner_options"] = dict(self.inner_options)
        return values

    def __copy__(self) -> RopeDedupConfig:
        return self  # frozen: a shallow copy could not differ

    def __deepcopy__(self, memo: dict) -> RopeDedupConfig:
        # Frameworks deep-copy torch.compile's keywords (Lightning Fabric): copy field by field, so a field
        # that cannot be copied is named, and rebuild through the constructor, which validates again.
        copied = {}
        for name, value in self._fields().items():
            try:
                copied[name] = copy.deepcopy(value, memo)
            except Exception as error:
                raise TypeError(f"cannot deep-copy RopeDedupConfig: field {name!r} holds {value!r}, which "
                                f"cannot be deep-copied ({error})") from error
        return RopeDedupConfig(**copied)

    def __reduce_ex__(self, protocol: int) -> tuple:  # type: ignore[override]  # pickle passes an int
        # The read-only options view cannot be pickled: pickle the keywords and rebuild through the
        # constructor. Each field is tried first, so an unpicklable one (a lambda inner) is named.
        values = self._fields()
        for name, value in values.items():
            try:
                pickle.dumps(value, protocol)
            except Exception as error:
                raise pickle.PicklingError(
                    f"cannot pickle RopeDedupConfig: field {name!r} holds {value!r}, which cannot be pickled "
                    f"({error}); name the inner backend by string or use a module-level function") from error
        return _rebuild_config, (values,)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, *, base: RopeDedupConfig | None = None,
                     mode: str | None = None) -> RopeDedupConfig:
        """A config from ``torch.compile``'s ``options``: rope_dedup's own names set fields, every other
        name is an option of the inner backend (inductor's config). ``base`` supplies what is not given."""
        base = base if base is not None else cls()
        own = {f.name for f in dataclasses.fields(cls)} - {"inner_options", "mode"}
        options = dict(options or {})
        mine = {k: options.pop(k) for k in list(options) if k in own}
        inner_options = {**base.inner_options, **options}
        return dataclasses.replace(base, **mine, inner_options=inner_options,
                                   mode=mode if mode is not None else base.mode)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def inner_backend(self) -> Callable:
        """The inner backend as ``torch.compile`` would build it for the same backend, mode and options."""
        if self.inner == "inductor":
            # torch.compile wraps inductor the same way with no mode at all: config patches from the
            # compiler bisector included, so "inductor alone" and "rope_dedup with inductor" compile alike.
            return torch._TorchCompileInductorWrapper(self.mode, dict(self.inner_options) or None, None)
        if self.mode or self.inner_options:
            return torch._TorchCompileWrapper(self.inner, self.mode, dict(self.inner_options) or None, None)
        return torch._dynamo.backends.registry.lookup_backend(self.inner) if isinstance(self.inner, str) \
            else self.inner

    def redirects_inputs(self) -> bool:
        """Whether duplicate table placeholders are rewritten to read one node (their memory is shared either way).

        Not under inductor unless merging needs it: one node per table changes inductor's fusion in the
        backward (a Persimmon model's gradients moved by 2e-7, bitwise equal with placeholders left apart,
        same table memory); other backends run the graph as written, and merging needs one node per table.
        """
        return not self.dry_run and (self.inner != "inductor" or self.computed_table_transforms().merge)

    def computed_table_transforms(self) -> ComputedTables:
        """Whether the backend folds constant RoPE subgraphs and merges identical ones: never in a dry run,
        which rewrites nothing."""
        if self.dry_run:
            return ComputedTables(fold=False, merge=False)
        default = COMPUTED_TABLE_DEFAULTS.get(self.inner, (False, False)) if isinstance(self.inner, str) \
            else (False, False)
        fold = default[0] if self.fold_constants is None else self.fold_constants
        merge = default[1] if self.merge_computed is None else self.merge_computed
        return ComputedTables(fold, merge)


def _rebuild_config(values: dict[str, Any]) -> RopeDedupConfig:
    return RopeDedupConfig(**values)
