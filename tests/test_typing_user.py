"""The typed user script that ``nox -s typecheck`` checks also runs: its calls are real ones."""

from __future__ import annotations

import importlib.metadata

import typing_user


def test_the_typed_user_script_runs() -> None:
    assert typing_user.main() == importlib.metadata.version("rope-dedup")
