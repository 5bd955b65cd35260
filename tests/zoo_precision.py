"""The precision survey: every RoPE model type of the installed transformers, built tiny as the zoo builds it,
through the static precision audit against its config (``explain(model, expect="config", precision=True)``).

    python tests/zoo_precision.py                      # every type; a line each, then the summary
    python tests/zoo_precision.py llama gemma3         # some types
    python tests/zoo_precision.py --json out.json      # and every table's figures as JSON
    python tests/zoo_precision.py --markdown out.json  # that survey as docs/audit.md's table
    python tests/zoo_precision.py --dtype bfloat16     # each model cast with model.to(torch.bfloat16) first

Per type: the dtypes of the tables it holds (``inv_freq`` and cos/sin caches), the worst angle difference
from the reference implementation and from float64 math over the positions each is judged at (a cache: its
length; a frequency vector: up to ``max_position_embeddings``), and the class: ``matches`` (every table matches
its reference), ``diverges`` (one does: the cause follows), ``not judged`` (why), or ``no table`` (RoPE
computed from nothing held). docs/audit.md records the three releases' results. Exit 1 when the audit raised.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
import zoo

from rope_dedup import explain


@dataclass
class Surveyed:
    """What the static precision audit found in one type's tables."""

    model_type: str
    verdict: str  # matches, diverges, not judged, no table, skipped, error
    dtypes: list[str] = field(default_factory=list)
    context: int = 0  # the most positions a table was judged at
    to_reference: float | None = None  # the worst angle difference, radians
    to_float64: float | None = None
    reference_to_float64: float | None = None
    notes: list[str] = field(default_factory=list)  # causes of divergences, why not judged, why skipped
    tables: list[dict] = field(default_factory=list)


def survey(model_type: str, dtype: torch.dtype | None = None) -> Surveyed:
    """One type's tables judged; ``dtype``: the model cast first (``model.to(dtype)``), as a deployment does."""
    tiny = zoo.build(model_type)
    if isinstance(tiny, zoo.Skipped):
        return Surveyed(model_type, "skipped", notes=[tiny.reason])
    if dtype is not None:
        tiny.model.to(dtype)
    try:
        explanation = explain(tiny.model, expect="config", precision=True)
    except Exception as error:  # a survey lists what raised, and goes on
        return Surveyed(model_type, "error", notes=[f"{type(error).__name__}: {error}"])
    tables = list(explanation.precision)
    if not tables:
        return Surveyed(model_type, "no table", notes=[line for line in explanation.notes() if "not measure" in line])
    judged = [t for t in tables if t.verdict != "not judged"]
    found = Surveyed(model_type, "matches", tables=[_values(t) for t in tables])
    found.dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tables})
    found.notes = sorted({f"{t.source}: {t.reference}" for t in tables if t.verdict == "not judged"})
    if not judged:
        found.verdict = "not judged"
        return found
    found.context = max(t.length for t in judged)
    found.to_reference = max(t.to_reference.angle for t in judged if t.to_reference)
    exact = [t.to_float64.angle for t in judged if t.to_float64]
    own = [t.reference_to_float64.angle for t in judged if t.reference_to_float64]
    found.to_float64 = max(exact) if exact else None
    found.reference_to_float64 = max(own) if own else None
    diverging = [t for t in judged if t.diverges]
    if diverging:
        found.verdict = "diverges"
        found.notes = sorted({f"{t.source}: {t.cause}" for t in diverging}) + found.notes
    elif len(judged) < len(tables):
        found.verdict = f"matches, {len(tables) - len(judged)} not judged"
    return found


def _values(table) -> dict:
    values = asdict(table)
    values["dtype"] = str(table.dtype).removeprefix("torch.")
    for name in ("to_reference", "to_float64", "reference_to_float64"):
        if values[name] is not None:
            values[name].pop("curve")
    return values


def _angle(value: float | None) -> str:
    return "-" if value is None else "0" if value == 0 else f"{value:.2g}"


def markdown(survey: dict) -> list[str]:
    """A survey's JSON as docs/audit.md's table: the judged types grouped by class, dtype and positions judged,
    with their worst angle to the reference and the range of their worst to float64; then the rest by class."""
    groups: dict[tuple, list[dict]] = {}
    others: dict[str, list[str]] = {}
    for result in survey["types"]:
        if result["to_reference"] is None:
            others.setdefault(result["verdict"], []).append(result["model_type"])
            continue
        cause = next((n.split(": ", 1)[1].split(":")[0] for n in result["notes"] if result["verdict"] == "diverges"), "")
        key = (result["verdict"] + (f" ({cause})" if cause else ""), ",".join(result["dtypes"]), result["context"])
        groups.setdefault(key, []).append(result)
    lines = ["| class | dtype | positions judged | to reference | to float64 | types |", "|---|---|---|---|---|---|"]
    for (verdict, dtypes, context), results in sorted(groups.items(), key=lambda g: (g[0][0], g[0][2])):
        reference = _angle(max(r["to_reference"] for r in results))
        exact = sorted(r["to_float64"] for r in results if r["to_float64"] is not None)
        spread = "-" if not exact else _angle(exact[0]) if _angle(exact[0]) == _angle(exact[-1]) else \
            f"{_angle(exact[0])} to {_angle(exact[-1])}"
        names = ", ".join(sorted(r["model_type"] for r in results))
        lines.append(f"| {verdict} | {dtypes} | {context} | {reference} | {spread} | {names} |")
    lines += [f"| {verdict} | | | | | {', '.join(sorted(types))} |" for verdict, types in sorted(others.items())
              if verdict != "skipped"]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every RoPE type)")
    parser.add_argument("--json", help="write every type's tables and figures here")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), help="cast each model first (model.to(dtype))")
    parser.add_argument("--markdown", metavar="JSON", help="print the table of a survey written with --json, and stop")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as written:
            print("\n".join(markdown(json.load(written))))
        return 0

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("rope_dedup").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    types = args.types or zoo.rope_model_types()
    start, results = time.perf_counter(), []
    for model_type in types:
        began = time.perf_counter()
        result = survey(model_type, getattr(torch, args.dtype) if args.dtype else None)
        results.append(result)
        print(f"{model_type:40} {result.verdict:22} {','.join(result.dtypes):18} {result.context:>8} "
              f"{_angle(result.to_reference):>8} {_angle(result.to_float64):>8} {time.perf_counter() - began:5.1f} s"
              + (f"  {result.notes[0][:200]}" if result.notes and result.verdict != "matches" else ""), flush=True)
    counts = {v: sum(r.verdict == v for r in results) for v in dict.fromkeys(r.verdict for r in results)}
    print(f"transformers {transformers.__version__}: {len(results)} types in {time.perf_counter() - start:.0f} s: "
          + ", ".join(f"{n} {v}" for v, n in counts.items()))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
                       "types": [asdict(r) for r in results]}, out, indent=1)
    return 1 if counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
