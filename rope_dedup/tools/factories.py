"""``MODULE:FACTORY``: how the command line reaches a user's model (``audit`` and ``profile``).

A factory is a callable taking no arguments and returning ``(model, example_inputs)``; MODULE is a dotted
name (found from the current folder, as with ``python -m``) or a path to a ``.py`` file (its folder goes
first on ``sys.path``, as with ``python path.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch


class FactoryError(ValueError):
    """The factory cannot be found or did not give a model and inputs; the message says which."""


def load_factory(factory_path: str) -> Callable[[], Any]:
    """``MODULE:FACTORY`` -> the callable."""
    module_name, colon, attribute = factory_path.rpartition(":")
    if not colon or not module_name or not attribute:
        raise FactoryError(f"expected MODULE:FACTORY (e.g. examples/audit.py:build), got {factory_path!r}")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            module = _import_file(Path(module_name))
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except FactoryError:
        raise
    except (Exception, SystemExit) as error:  # a script's argparse exiting at import counts too
        raise FactoryError(f"cannot import {module_name}: {one_line(error)}") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise FactoryError(f"{module_name} has no callable {attribute!r}")
    return factory


def build(factory_path: str) -> tuple[torch.nn.Module, tuple]:
    """Call the factory named by ``factory_path``; (model, example inputs as a tuple)."""
    factory = load_factory(factory_path)
    try:
        built = factory()
    except Exception as error:
        raise FactoryError(f"{factory_path}() raised {one_line(error)}") from None
    return model_and_inputs(built, factory_path)


class NoInputs(FactoryError):
    """The factory returned a model and no example inputs: enough for an audit without a forward only."""


def model_and_inputs(built: Any, factory_path: str) -> tuple[torch.nn.Module, tuple]:
    """Check what a factory returned: a module and at least one example input."""
    if isinstance(built, torch.nn.Module):
        raise NoInputs(f"{factory_path}() returned a model and no example inputs; expected (model, example_inputs)")
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module)):
        raise FactoryError(f"{factory_path}() returned {type(built).__name__}; expected (model, example_inputs)")
    model, inputs = built
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not inputs:
        raise NoInputs(f"{factory_path}() returned no example inputs; expected (model, example_inputs)")
    return model, inputs


def model_of(built: Any, factory_path: str) -> torch.nn.Module:
    """The model a factory returned, alone or as (model, example_inputs): all an audit without a forward needs."""
    model = built[0] if isinstance(built, tuple) and len(built) == 2 else built
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"{factory_path}() returned {type(built).__name__}; "
                           "expected a model or (model, example_inputs)")
    return model


def one_line(error: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _import_file(path: Path):
    if not path.is_file():
        raise FactoryError(f"no such file: {path}")
    sys.path.insert(0, str(path.resolve().parent))
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    if module_spec is None or module_spec.loader is None:
        raise FactoryError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
    return module
