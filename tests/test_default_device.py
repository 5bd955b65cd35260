"""Results never depend on the default device: every tensor the library makes names its device.

Models and tables are built on CPU, with ``device="cpu"`` named, and then each door runs three ways: plainly,
inside ``with torch.device("meta")`` and after ``torch.set_default_device("meta")``. A factory call of the
library that follows the default device instead of the table's lands on meta and meets the table's CPU
tensors: "Expected all tensors to be on the same device", as on a GPU with a CPU-built inv_freq (the
first H200 run). The answers must be the same all three ways.

A static check beside it (:func:`test_every_factory_call_names_its_device`) reads the library's source and
fails on a torch factory call without ``device=``, so the class is caught before anything runs.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import torch.nn as nn

from rope_dedup import RopeDedupBackend, RopeSpec, dedup_exported, explain, share, sharing
from rope_dedup.tables.keys import infer_key
from rope_dedup.tables.recognize import RopeTable, recognize_rope_table
from rope_dedup.testing.toy_decoder import LAYOUTS, TableRecipe, ToyDecoder, homogeneous, local_global, rope_tensors
from rope_dedup.testing.toy_decoder import unique_storages

ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def default_device(how: str) -> Iterator[None]:
    """``plain``: nothing; ``context``: ``with torch.device("meta")``; ``set``: ``set_default_device("meta")``."""
    if how == "plain":
        yield
    elif how == "context":
        with torch.device("meta"):
            yield
    else:
        torch.set_default_device("meta")
        try:
            yield
        finally:
            torch.set_default_device(None)


WAYS = ["context", "set"]


def on_every_default(run: Callable[[], object]) -> None:
    """``run()`` gives the same answer plainly and under each meta default device."""
    with default_device("plain"):
        expected = run()
    for how in WAYS:
        with default_device(how):
            found = run()
        assert found == expected, f"under {how}: {found!r} != {expected!r}"


def built(specs: list[TableRecipe], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ToyDecoder(specs, device="cpu").eval()


def storages(model: nn.Module) -> int:
    return unique_storages([t for _, t in rope_tensors(model)])[0]


# Every layout recognition knows, including the scaled variants whose keys go through the bent-line fit.
RECIPES = [TableRecipe(layout=layout, theta=5e5, max_len=64) for layout in LAYOUTS if layout != "lazy_cache"]
RECIPES += [TableRecipe(layout="cos_sin", scaling=s, max_len=64) for s in ("linear", "llama3", "yarn")]
RECIPES += [TableRecipe(layout="inv_freq", scaling="llama3"), TableRecipe(layout="cos_sin", dtype=torch.bfloat16)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.layout}-{r.scaling}-{str(r.dtype)[6:]}")
def test_recognition_and_keys(recipe: TableRecipe) -> None:
    tables = [t for _, t in rope_tensors(built([recipe]))]

    def keys() -> list:
        found = [recognize_rope_table(t) for t in tables]
        return [infer_key(f, t) if isinstance(f, RopeTable) else f for f, t in zip(found, tables)]

    on_every_default(keys)


def test_share() -> None:
    def run() -> tuple:
        model = built(local_global(6, layout="inv_freq"))
        report = share(model, backend=RopeDedupBackend("eager"))
        return storages(model), [(str(g.key), len(g.members)) for g in report.groups], len(report.skipped)

    on_every_default(run)


def test_sharing_while_building() -> None:
    def run() -> tuple:
        backend = RopeDedupBackend("eager")
        with sharing(backend=backend):
            model = built(homogeneous(4) + homogeneous(2, layout="inv_freq"))
        with torch.no_grad():
            out = model(TOKENS)
        return storages(model), [(str(g.key), len(g.members)) for g in backend.report.groups], out.tolist()

    on_every_default(run)


def test_static_audit() -> None:
    model = built(local_global(6, layout="inv_freq"))
    on_every_default(lambda: str(explain(model, expect=RopeSpec(1e4))))


def test_dynamic_audit() -> None:
    model = built(local_global(3, every=3) + homogeneous(1, layout="inv_freq"))
    on_every_default(lambda: str(explain(model, TOKENS, expect={"layers.2": RopeSpec(1e6), "*": RopeSpec(1e4)})))


@pytest.mark.parametrize("regional", [False, True], ids=["whole", "regional"])
def test_backend_on_a_toy_decoder(regional: bool) -> None:
    reference = built(homogeneous(4) + local_global(2, layout="inv_freq"))
    with torch.no_grad():
        expected = reference(TOKENS)

    def run() -> tuple:
        torch._dynamo.reset()
        model = copy.deepcopy(reference)
        backend = RopeDedupBackend("eager")
        if regional:
            for i, block in enumerate(model.layers):
                model.layers[i] = torch.compile(block, backend=backend)
            compiled = model
        else:
            compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            out = compiled(TOKENS)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        report = backend.report
        return storages(model), [(str(g.key), len(g.members)) for g in report.groups], report.errors

    on_every_default(run)


def test_dedup_exported() -> None:
    model = built(homogeneous(4, layout="hf_halves") + homogeneous(2, layout="inv_freq"))
    program = torch.export.export(model, (TOKENS,))

    def run() -> tuple:
        ep = dedup_exported(copy.deepcopy(program))
        return len(ep.graph_signature.input_specs), ep.module()(TOKENS).tolist()

    on_every_default(run)


# --- the static check ------------------------------------------------------------------------------

# torch functions that make a tensor from nothing (or from Python data) on the default device unless told
# otherwise. ``*_like`` and methods such as ``new_zeros`` take the device of their input and are fine.
FACTORIES = {"arange", "zeros", "ones", "empty", "full", "tensor", "linspace", "logspace", "eye", "rand", "randn",
             "randint", "randperm", "as_tensor", "asarray", "empty_strided", "scalar_tensor", "tril_indices",
             "triu_indices", "normal", "range", "frombuffer", "sparse_coo_tensor", "hann_window"}
# (path, function) -> why a call there may follow the default device. Empty: every call names its device.
ALLOWED: dict[tuple[str, str], str] = {}


def factory_calls_without_device() -> list[tuple[str, int, str]]:
    found = []
    for folder in ("rope_dedup", "passes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), relative)):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                func = node.func
                if not (isinstance(func.value, ast.Name) and func.value.id == "torch" and func.attr in FACTORIES):
                    continue
                if any(k.arg == "device" for k in node.keywords) or (relative, func.attr) in ALLOWED:
                    continue
                found.append((relative, node.lineno, f"torch.{func.attr}"))
    return found


def test_every_factory_call_names_its_device() -> None:
    assert factory_calls_without_device() == []


def test_the_static_check_sees_a_call_without_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous: a file with an unnamed factory call in the scanned folders is reported."""
    tree = tmp_path / "rope_dedup"
    tree.mkdir()
    (tree / "bad.py").write_text("import torch\nx = torch.arange(4, dtype=torch.float64)\n"
                                 "y = torch.zeros(2, device=x.device)\nz = torch.zeros_like(x)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert factory_calls_without_device() == [("rope_dedup/bad.py", 2, "torch.arange")]
