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

# The releases the suite was run on (README, "Supported torch"); pyproject.toml declares the same range.
SUPPORTED_TORCH = (2, 10), (2, 16)


def _torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.11.0+cu130`` or ``2.16.0a0+git1234``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


if not SUPPORTED_TORCH[0] <= _torch_release(torch.__version__) < SUPPORTED_TORCH[1]:
    raise ImportError(f"rope_dedup supports torch>={'.'.join(map(str, SUPPORTED_TORCH[0]))},"
                      f"<{'.'.join(map(str, SUPPORTED_TORCH[1]))}; installed torch is {torch.__version__}")

from rope_dedup.backend import RopeDedupBackend, rope_dedup_backend
from rope_dedup.check import RopeMismatch
from rope_dedup.config import RopeDedupConfig
from rope_dedup.explain import Explanation, explain
from rope_dedup.passes.dedup_exported import dedup_exported
from rope_dedup.passes.dedup_rope import dedup_rope
from rope_dedup.passes.pass_base import RopePassResult
from rope_dedup.keys import RopeKey
from rope_dedup.report import DedupReport, Departed, Group, Skip
from rope_dedup.share import share, sharing
from rope_dedup.spec import RopeSpec
from rope_dedup.tracing import symbolic_trace
from rope_dedup.unshare import unshare

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
    "dedup_exported",
    "dedup_rope",
    "explain",
    "rope_dedup_backend",
    "share",
    "sharing",
    "symbolic_trace",
    "unshare",
]
