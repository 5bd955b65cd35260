"""rope_dedup: share identical RoPE tables across attention layers, at compile time.

``torch.compile(model, backend=rope_dedup_backend)`` finds every RoPE cos/sin/freqs_cis table the
compiled graphs read, keys it by (theta, dim, length, dtype, device, layout, scaling), verifies equal
content, and leaves one storage per distinct table; :func:`dedup_rope` does the same for a plain
``torch.fx.GraphModule`` and :func:`dedup_exported` for a ``torch.export`` program. Every tensor
examined ends up shared or skipped with a reason in the report. Without compiling, :func:`share` does the
same to a built model in place and :class:`sharing` while one is built. :func:`explain` audits which RoPE each
attention layer applies, and with ``expect=RopeSpec(...)`` or ``expect="config"`` checks it.
"""

import torch

# The releases the suite was run on (docs/testing.md, "Other torch releases"); pyproject.toml declares the same range.
SUPPORTED_TORCH = (2, 10), (2, 16)


def _torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.11.0+cu130`` or ``2.16.0a0+git1234``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


if not SUPPORTED_TORCH[0] <= _torch_release(torch.__version__) < SUPPORTED_TORCH[1]:
    raise ImportError(f"rope_dedup supports torch>={'.'.join(map(str, SUPPORTED_TORCH[0]))},"
                      f"<{'.'.join(map(str, SUPPORTED_TORCH[1]))}; installed torch is {torch.__version__}")

import importlib
import importlib.metadata
import sys
import types
import warnings
from typing import Any

from rope_dedup.audit.check import RopeMismatch
from rope_dedup.audit.explain import Explanation, explain
from rope_dedup.audit.spec import RopeSpec
from rope_dedup.backend import RopeDedupBackend, rope_dedup_backend
from rope_dedup.config import RopeDedupConfig
from rope_dedup.core import moves
from rope_dedup.core.eligibility import SkipReason
from rope_dedup.core.report import DedupReport, Departed, Group, Skip
from rope_dedup.export import dedup_exported
from rope_dedup.passes.dedup_rope import dedup_rope
from rope_dedup.passes.pass_base import RopePassResult
from rope_dedup.share import share, sharing
from rope_dedup.tables.keys import RopeKey
from rope_dedup.tracing import symbolic_trace
from rope_dedup.unshare import unshare

try:
    __version__ = importlib.metadata.version("rope-dedup")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

# The release that drops the deprecated names below; CHANGELOG.md lists each under "Deprecated".
REMOVED_IN = "0.3.0"

# Shared tables stay shared through .to(), .half(), to_empty(): see rope_dedup/core/moves.py.
moves.install()

# Modules that moved into product folders (0.2): importable from the old path until REMOVED_IN.
MOVED_MODULES = {
    "store": "core.store", "eligibility": "core.eligibility", "report": "core.report", "memory": "core.memory",
    "reload": "core.reload", "sources": "core.sources", "recognize": "tables.recognize", "keys": "tables.keys",
    "explain": "audit.explain", "applied": "audit.applied", "check": "audit.check", "spec": "audit.spec",
    "cli": "tools.cli", "profile": "tools.profile", "plot": "tools.plot", "factories": "tools.factories",
    "toy_decoder": "testing.toy_decoder", "passes.dedup_exported": "export",
}


class _MovedModule(types.ModuleType):
    """The old path of a moved module: each name read from it warns once per place and comes from the new one.

    It sits in ``sys.modules`` only, never as an attribute of the package: ``rope_dedup.explain`` stays
    the function while ``from rope_dedup.explain import Explanation`` still works."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old)
        self._new = new

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(f"{self.__name__} moved to {self._new}: import {name} from there ({self.__name__} goes "
                      f"in {REMOVED_IN})", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(self._new), name)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self._new))


for _old, _new in MOVED_MODULES.items():
    sys.modules.setdefault(f"rope_dedup.{_old}", _MovedModule(f"rope_dedup.{_old}", f"rope_dedup.{_new}"))


def __getattr__(name: str) -> Any:
    if name == "RopeDedupResult":  # renamed in 0.1 without a warning: kept until REMOVED_IN with one
        warnings.warn(f"rope_dedup.RopeDedupResult is now rope_dedup.RopePassResult (RopeDedupResult goes in "
                      f"{REMOVED_IN})", DeprecationWarning, stacklevel=2)
        return RopePassResult
    raise AttributeError(f"module 'rope_dedup' has no attribute {name!r}")


# What users call and read. Internals (the store, recognition, keying) stay importable from their modules.
__all__ = [
    "DedupReport",
    "Departed",
    "Explanation",
    "Group",
    "RopeDedupBackend",
    "RopeDedupConfig",
    "RopeKey",
    "RopeMismatch",
    "RopePassResult",
    "RopeSpec",
    "Skip",
    "SkipReason",
    "dedup_exported",
    "dedup_rope",
    "explain",
    "rope_dedup_backend",
    "share",
    "sharing",
    "symbolic_trace",
    "unshare",
]
