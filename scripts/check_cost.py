"""What the check before each call of a compiled graph costs a per-block compile, measured in one process.

    python scripts/check_cost.py --layers 126 --control no-check   # what removing the check would save
    python scripts/check_cost.py --layers 126 --control same       # an A/A pair: the layout bias alone

Three copies of examples/bench_step_time.py's toy decoder, compiled per block: inductor alone (I),
rope_dedup (R), and a control (C): a second rope_dedup model, either as it is (``same``) or with its compiled
callables made to skip ``InterningCallable.check`` (``no-check``; a diagnostic only: new tables would never
be shared). The three take turns call by call, the order rotated and reversed each round, and the script
prints the median per-round ratios R/I, C/I and C/R. With ``no-check``, C/R is what the check costs; with
``same``, C/R is how far two identical models differ by where they landed in memory.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import bench_step_time as bench  # noqa: E402

from rope_dedup import RopeDedupBackend  # noqa: E402
from rope_dedup.interning import InterningCallable  # noqa: E402


class _Unchecked(InterningCallable):
    """Runs the graph without the check: what a call would cost if nothing were verified."""

    def __call__(self, *args: Any) -> Any:
        return self._compiled(*args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=126)
    parser.add_argument("--control", choices=["no-check", "same"], default="no-check")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--inner", default="inductor")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    case = bench.Case(args.layers, regional=True)
    torch._dynamo.reset()
    reference = bench.build(case, "cpu")
    ours, control = copy.deepcopy(reference), copy.deepcopy(reference)
    ours_backend, control_backend = RopeDedupBackend(args.inner), RopeDedupBackend(args.inner)
    models = {"I": bench.compiled(reference, args.inner, True), "R": bench.compiled(ours, ours_backend, True),
              "C": bench.compiled(control, control_backend, True)}
    tokens = torch.zeros(1, 1, dtype=torch.long, device="cpu")
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        expected = models["I"](tokens)
        for model in models.values():
            torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)
        unchecked = 0
        if args.control == "no-check":  # the callables the control's compiles returned (tables shared by now)
            for found in gc.get_objects():
                if type(found) is InterningCallable and found._store is control_backend.store:
                    found.__class__ = _Unchecked
                    unchecked += 1
        for _ in range(args.warmup):
            for model in models.values():
                model(tokens)
        order = list(models.items())
        for i in range(args.rounds):
            turn = order[i % 3:] + order[:i % 3]
            for name, model in turn if i % 2 == 0 else turn[::-1]:
                began = time.perf_counter()
                model(tokens)
                times[name].append(time.perf_counter() - began)

    def paired(top: str, bottom: str) -> float:
        return statistics.median(a / b for a, b in zip(times[top], times[bottom]))

    storages = [len(backend.report.groups) for backend in (ours_backend, control_backend)]
    print(f"{case.name}, control {args.control}: R/I {paired('R', 'I'):.3f}  C/I {paired('C', 'I'):.3f}  "
          f"C/R {paired('C', 'R'):.3f}  (median ms: I {1e3 * statistics.median(times['I']):.3f}, "
          f"R {1e3 * statistics.median(times['R']):.3f}, C {1e3 * statistics.median(times['C']):.3f}; "
          f"RoPE storages R {storages[0]}, C {storages[1]}; callables unchecked: {unchecked})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
