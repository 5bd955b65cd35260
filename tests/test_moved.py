"""Modules that moved into product folders stay importable from their old path until rope_dedup.REMOVED_IN,
with a DeprecationWarning, and give the very same objects; rope_dedup.RopeDedupResult likewise. CHANGELOG.md
names each, and the release of rope_dedup.__version__."""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

import pytest

import rope_dedup

ROOT = Path(__file__).resolve().parents[1]
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


def deprecated_section() -> str:
    """The "Deprecated" part of CHANGELOG.md's Unreleased section."""
    text = (ROOT / "CHANGELOG.md").read_text()
    unreleased = text[text.index("## [Unreleased]"):text.index("\n## [", text.index("## [Unreleased]") + 1)]
    return unreleased[unreleased.index("### Deprecated"):]


@pytest.mark.parametrize("old", sorted(NAMES))
def test_the_changelog_names_each_moved_module_and_its_new_place(old: str) -> None:
    section = deprecated_section()
    assert f"Removed in {rope_dedup.REMOVED_IN}" in section
    assert f"- `rope_dedup.{old}`" in section and f"`rope_dedup.{rope_dedup.MOVED_MODULES[old]}`" in section


def test_the_changelog_names_the_renamed_result_and_the_warning_names_the_release() -> None:
    assert "- `rope_dedup.RopeDedupResult`: use `rope_dedup.RopePassResult`" in deprecated_section()
    with pytest.warns(DeprecationWarning, match=rf"goes in {rope_dedup.REMOVED_IN}"):
        rope_dedup.RopeDedupResult
    with pytest.warns(DeprecationWarning, match=rf"goes in {rope_dedup.REMOVED_IN}"):
        importlib.import_module("rope_dedup.keys").RopeKey


def test_version_is_the_installed_metadata_and_the_changelog_knows_it() -> None:
    assert rope_dedup.__version__ == importlib.metadata.version("rope-dedup")
    assert f"## [{rope_dedup.__version__}] - " in (ROOT / "CHANGELOG.md").read_text()
