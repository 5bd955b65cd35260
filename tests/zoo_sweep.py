"""The sweep: every RoPE model type of the installed transformers, built tiny, audited and shared.

    python tests/zoo_sweep.py                 # all types; fails on any failure or unexplained finding
    python tests/zoo_sweep.py llama gemma3    # some types
    python tests/zoo_sweep.py --write         # and rewrite this transformers' table in docs/zoo.md
    python tests/zoo_sweep.py --check         # and fail if docs/zoo.md says otherwise (nox -s zoo)

Each type runs :func:`zoo.sweep_one` (static audit, dynamic audit, ``share()``) in this one process, in
order, as a user auditing many models in one script would. It fails (exit 1) when rope_dedup raised, the
two audits disagree, ``share()`` changed an output, a finding is not explained in :func:`zoo.explained`,
an explanation found nothing to explain, or ``--budget`` seconds went by.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

import torch
import zoo

DOCS = Path(__file__).resolve().parents[1] / "docs" / "zoo.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every RoPE type)")
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds; stop and fail past it")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="rewrite this transformers' table in docs/zoo.md")
    group.add_argument("--check", action="store_true", help="fail if docs/zoo.md's table differs")
    args = parser.parse_args(argv)
    if args.types and (args.write or args.check):
        parser.error("--write and --check compare the whole registry's table: give no types")

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("rope_dedup").setLevel(logging.WARNING)
    torch._logging.set_logs(dynamo=logging.ERROR)  # graph breaks and recompiles of the models themselves
    warnings.filterwarnings("ignore")
    types = args.types or zoo.rope_model_types()
    start, results, broken = time.perf_counter(), [], []
    for model_type in types:
        if time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent after {len(results)} of {len(types)} types", file=sys.stderr)
            return 1
        result = zoo.sweep_one(model_type)
        results.append(result)
        problems = zoo.problems_of(result)
        broken += [f"{model_type}: {p}" for p in problems]
        status = "FAILED" if problems else zoo.status_of(result)
        print(f"{model_type:42} {status:8} {getattr(result, 'seconds', 0.0):6.1f} s", flush=True)
    elapsed = time.perf_counter() - start
    counts = {s: sum(1 for r in results if zoo.status_of(r) == s) for s in ("clean", "finding", "skipped")}
    print(f"transformers {transformers.__version__}: {len(results)} types in {elapsed:.0f} s: "
          + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if not args.types:
        broken += [f"{t}: explained in zoo.explained() but not swept" for t in zoo.stale_explanations(types)]
    for line in broken:
        print(line, file=sys.stderr)
    table = zoo.table(results)
    if args.write:
        zoo.write_table(DOCS, transformers.__version__, table)
    elif args.check and zoo.read_table(DOCS, transformers.__version__) != table:
        print(f"{DOCS} differs from this sweep's table for transformers {transformers.__version__}: rerun with "
              f"--write and review the diff", file=sys.stderr)
        return 1
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
