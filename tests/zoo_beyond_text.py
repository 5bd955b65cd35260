"""The zoo types the sweep skips for their input ("no text input", "fails on text alone"), run on the inputs of
``zoo_inputs.py``: static and dynamic audit, their agreement, ``share()`` and a bitwise compare of the output.

    python tests/zoo_beyond_text.py                # every such type of docs/zoo.md's table for this transformers
    python tests/zoo_beyond_text.py glm4v pixtral  # some types

Each type is built as ``zoo._build`` builds one (default config shrunk at ``zoo.LEVELS``, loaded back with
``from_dict``, the parameter cap, seeded init, eval), with the config fixes of ``zoo_inputs.CONFIG_FIXES``. A
survey, not a check: it prints what each type gives (docs/zoo.md, "Beyond text", has the 5.23.0 run) and fails
on nothing; the sweep takes these types over once the audit judges their RoPE (issue 42).
"""
from __future__ import annotations

import gc
import inspect
import logging
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import zoo
import zoo_inputs as I

DOCS = Path(__file__).resolve().parents[1] / "docs" / "zoo.md"


@dataclass
class Built:
    model_type: str
    model: torch.nn.Module
    inputs: dict
    level: str
    output: torch.Tensor | None


def skipped_types() -> list[str]:
    """The types docs/zoo.md's table for the installed transformers skips for their input."""
    import transformers

    rows = zoo.read_table(DOCS, transformers.__version__) or []
    found = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) >= 3 and cells[1] == "skipped" and cells[2].startswith(
                ("no text input", "the tiny model's own forward fails on text alone")):
            found.append(cells[0])
    return found


def model_class_of(model_type: str):
    import transformers
    from transformers.models.auto import modeling_auto
    mappings = [getattr(modeling_auto, name, {}) for name in zoo._MODEL_MAPPINGS]
    class_name = next((m[model_type] for m in mappings if model_type in m), None)
    if isinstance(class_name, (list, tuple)):
        class_name = class_name[0]
    return getattr(transformers, class_name)


def config_at(model_type: str, level: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config_class = CONFIG_MAPPING[model_type]
    values = zoo.shrink(config_class().to_dict(), level)
    fix = I.CONFIG_FIXES.get(model_type)
    if fix is not None:
        fix(values, level)
    return config_class.from_dict(values)


def build_at(model_type, model_class, params, level, seed=0, verbose=False):
    try:
        config = config_at(model_type, level)
    except Exception as error:
        return f"the shrunk config is refused: {zoo._first_line(error)}"
    model = zoo.instantiate(model_class, config, level, seed)
    if isinstance(model, str):
        return model
    try:
        made = I.non_text_inputs(model_type, model, config, params)
    except Exception as error:
        if verbose:
            print("".join(traceback.format_exc().splitlines(True)[-8:]))
        return f"the input builder raised: {zoo._first_line(error)}"
    if isinstance(made, str):
        return f"no inputs: {made}"
    with torch.no_grad():
        try:
            output = zoo.first_tensor(model(**made))
        except Exception as error:
            if verbose:
                print("".join(traceback.format_exc().splitlines(True)[-8:]))
            return f"forward fails on the built inputs: {zoo._first_line(error)}"
    return Built(model_type, model, made, level, output)


def build(model_type: str, verbose=False) -> Built | str:
    model_class = model_class_of(model_type)
    params = inspect.signature(model_class.forward).parameters
    reasons = []
    for level in zoo.LEVELS:
        built = build_at(model_type, model_class, params, level, verbose=verbose)
        if isinstance(built, Built):
            return built
        reasons.append(f"[{level}] {built}")
    return "; ".join(dict.fromkeys(reasons))


def describe(inputs: dict) -> str:
    parts = []
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{key}{tuple(value.shape)}" if value.numel() > 6 else f"{key}={value.tolist()}")
        else:
            parts.append(f"{key}={value!r:.40}")
    return ", ".join(parts)


def audit(model_type: str) -> None:
    import rope_dedup
    start = time.perf_counter()
    built = build(model_type)
    if isinstance(built, str):
        print(f"## {model_type}: CANNOT RUN ({time.perf_counter() - start:.1f}s): {built}", flush=True)
        return
    shape = tuple(built.output.shape) if built.output is not None else None
    print(f"## {model_type}: forward ok, level {built.level}, {describe(built.inputs)} -> {shape}", flush=True)
    problems, static_lines, dynamic_lines = [], [], []
    try:
        static = rope_dedup.explain(built.model, expect="config")
        static_lines = zoo.lines(static)
    except Exception:
        problems.append("static explain raised:\n" + "".join(traceback.format_exc().splitlines(True)[-6:]))
        static = None
    try:
        dynamic = rope_dedup.explain(built.model, expect="config", **built.inputs)
        dynamic_lines = zoo.lines(dynamic)
    except Exception:
        problems.append("dynamic explain raised:\n" + "".join(traceback.format_exc().splitlines(True)[-6:]))
        dynamic = None
    if static is not None and dynamic is not None:
        try:
            problems += [f"disagreement: {d}" for d in zoo.disagreements(static, dynamic)]
        except Exception:
            problems.append("disagreements raised:\n" + "".join(traceback.format_exc().splitlines(True)[-6:]))
    try:
        report = rope_dedup.share(built.model)
        with torch.no_grad():
            after = zoo.first_tensor(built.model(**built.inputs))
        if built.output is not None and not torch.equal(after, built.output):
            problems.append("share() changed the output")
        shared = len(getattr(report, "newly_shared", []) or [])
    except Exception:
        problems.append("share raised:\n" + "".join(traceback.format_exc().splitlines(True)[-6:]))
        shared = "?"
    applied = len(dynamic.applied) if dynamic is not None and hasattr(dynamic, "applied") else "?"
    held = len(static.applied) if static is not None and hasattr(static, "applied") else "?"
    status = "PROBLEM" if problems else ("findings" if static_lines or dynamic_lines else "clean")
    print(f"   {status}; static tables {held}, dynamic applied {applied}, newly shared {shared}; "
          f"{time.perf_counter() - start:.1f}s", flush=True)
    both = [line for line in static_lines if line in dynamic_lines]
    for line in both:
        print(f"   [static+dynamic] {line}")
    for line in static_lines:
        if line not in both:
            print(f"   [static] {line}")
    for line in dynamic_lines:
        if line not in both:
            print(f"   [dynamic] {line}")
    for name, expl in (("static", static), ("dynamic", dynamic)):
        if expl is None:
            continue
        seen = sorted({f"{t.layer}: {t.source}" for t in expl.applied})
        if seen:
            print(f"   {name} applied ({len(seen)}): " + " | ".join(seen[:3]) + (" | ..." if len(seen) > 3 else ""))
        if getattr(expl, "unmeasured", ()):
            print(f"   {name} unmeasured: " + " | ".join(f"{a}: {b}" for a, b in expl.unmeasured[:3]))
    for p in problems:
        print("   !! " + p.rstrip().replace("\n", "\n      "))
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("rope_dedup").setLevel(logging.WARNING)
    torch._logging.set_logs(dynamo=logging.ERROR)  # graph breaks of the models themselves, as in the sweep
    types = argv or skipped_types()
    total = time.perf_counter()
    for model_type in types:
        try:
            audit(model_type)
        except Exception:
            print(f"## {model_type}: HARNESS ERROR\n" + "".join(traceback.format_exc().splitlines(True)[-6:]))
        gc.collect()
    print(f"total {time.perf_counter() - total:.1f}s for {len(types)} types")


if __name__ == "__main__":
    main(sys.argv[1:])
