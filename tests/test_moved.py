"""Modules that moved into product folders stay importable from their old path for one release, with a
DeprecationWarning, and give the very same objects; rope_dedup.RopeDedupResult likewise."""

from __future__ import annotations

import importlib

import pytest

import rope_dedup

# One public name per moved module.
NAMES = {
    "store": "CanonicalStore", "eligibility": "SkipReason", "report": "DedupReport", "memory": "release_if_freed",
    "reload": "guard_reload", "sources": "attribute_origin", "recognize": "recognize_rope_table",
    "keys": "RopeKey", "explain": "Explanation", "applied": "TableCapture", "check": "check_table",
    "spec": "RopeSpec", "cli": "main", "profile": "ProfileConfig", "plot": "plot_profile",
    "factories": "load_factory", "toy_decoder": "ToyDecoder", "passes.dedup_exported": "dedup_exported",
}


def test_every_moved_module_is_listed_once() -> None:
    assert set(NAMES) == set(rope_dedup.MOVED_MODULES)


@pytest.mark.parametrize("old", sorted(NAMES))
def test_the_old_path_warns_and_gives_the_same_object(old: str) -> None:
    name = NAMES[old]
    new = importlib.import_module(f"rope_dedup.{rope_dedup.MOVED_MODULES[old]}")
    with pytest.warns(DeprecationWarning, match=rf"rope_dedup\.{old} moved to rope_dedup\.{rope_dedup.MOVED_MODULES[old]}"):
        got = getattr(importlib.import_module(f"rope_dedup.{old}"), name)
    assert got is getattr(new, name)


def test_importing_the_old_explain_module_leaves_the_function_in_place() -> None:
    with pytest.warns(DeprecationWarning):
        from rope_dedup.explain import Explanation  # noqa: F401
    import rope_dedup.explain  # noqa: F401
    assert callable(rope_dedup.explain) and rope_dedup.explain.__module__ == "rope_dedup.audit.explain"


def test_the_result_renamed_without_a_warning_now_has_one() -> None:
    with pytest.warns(DeprecationWarning, match="RopePassResult"):
        assert rope_dedup.RopeDedupResult is rope_dedup.RopePassResult
    with pytest.raises(AttributeError, match="no attribute 'RopeDedupResults'"):
        rope_dedup.RopeDedupResults
