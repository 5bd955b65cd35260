"""What a user's type checker sees: a typed script over the public API, checked by ``nox -s typecheck``
(mypy, calls to unannotated functions refused here) and run by tests/test_typing_user.py.

``_misuses`` holds calls the real signatures reject, each silenced by its error code: were a signature to
lose its types (``Any``), the ignore would go unused, which the check reports as an error.
"""

from __future__ import annotations

import torch

import rope_dedup
from rope_dedup import DedupReport, Explanation, RopeDedupBackend, RopeDedupConfig, RopeKey, RopeSpec, SkipReason
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous


def shared_bytes(model: torch.nn.Module) -> tuple[int, list[RopeKey], list[SkipReason]]:
    report: DedupReport = rope_dedup.share(model, backend=RopeDedupBackend("eager"))
    keys = [group.key for group in report.groups]
    return report.bytes_saved, keys, [skip.kind for skip in report.skipped]


def audit(model: torch.nn.Module) -> Explanation:
    explanation = rope_dedup.explain(model, expect=RopeSpec(1e4, rotary_dim=16))
    for mismatch in explanation.mismatches:
        print(mismatch.layer, mismatch.field)
    return explanation


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    config = RopeDedupConfig(inner="eager", share_persistent=False)
    result = torch.compile(model, backend=RopeDedupBackend(config=config))
    assert isinstance(result, torch.nn.Module)
    return result


def _misuses(model: torch.nn.Module) -> None:
    rope_dedup.share(model, backend="inductor")  # type: ignore[arg-type]
    RopeSpec("1e4")  # type: ignore[arg-type]
    saved: str = rope_dedup.share(model).bytes_saved  # type: ignore[assignment]
    print(saved)


def main() -> str:
    model = ToyDecoder(homogeneous(3, max_len=64))
    saved, keys, kinds = shared_bytes(model)
    assert saved > 0 and keys[0].theta == 1e4 and SkipReason.TRAINABLE in kinds
    assert not audit(model).mismatches
    return rope_dedup.__version__


if __name__ == "__main__":
    print(main())
