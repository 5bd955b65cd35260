"""What the precision audit costs: the static audit of a model with and without ``precision=True``, side by side.

    python examples/bench_precision.py                       # titan-128k: 40 layers, 128K positions, complex64
    python examples/bench_precision.py --layers 4 --context 32768 --rounds 5

The model is built once (the profile's toy decoder, ``rope-dedup profile --preset``); each round times
``explain(model)`` and ``explain(model, precision=True)`` one after the other, after one untimed call of the
second, so both see the same machine. The
allocator's peak is measured once per mode, around the audit alone (torch's profiler counts every allocation).
Run it in three fresh processes for a figure you quote (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict

import torch

from rope_dedup import explain
from rope_dedup.audit.precision import DEFAULT_MAX_ANGLE_ERROR, precision_of
from rope_dedup.tools import profile as prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(prof.PRESETS), default="titan-128k")
    parser.add_argument("--layers", type=int, help="override the preset's layers")
    parser.add_argument("--context", type=int, help="override the preset's table length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = prof.apply_overrides(prof.PRESETS[args.preset], layers=args.layers, context=args.context)
    start = time.perf_counter()
    model = prof.build_model(config)
    print(f"{prof.describe_config(asdict(config))}; built in {time.perf_counter() - start:.1f} s, "
          f"{args.threads} thread(s)")
    explain(model, precision=True)  # first-call work (imports, kernels) is neither mode's
    plain, precise = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        explain(model)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        explanation = explain(model, precision=True)
        precise.append(time.perf_counter() - start)
    without, with_ = statistics.median(plain), statistics.median(precise)
    print(f"static audit: {without:.2f} s; with precision: {with_:.2f} s (median of {args.rounds}); the precision "
          f"audit adds {with_ - without:.2f} s (x{with_ / without:.2f})")
    # The precision pass alone, on the tables the static audit found: the figure the difference above blurs.
    static = explain(model)
    groups = {path: letter for letter, members in static.groups.items() for path in members}
    start = time.perf_counter()
    precision_of(model, static.applied, static=True, judge=None, groups=groups, unmeasured=[],
                 max_angle_error=DEFAULT_MAX_ANGLE_ERROR)
    print(f"the precision pass alone: {time.perf_counter() - start:.2f} s")
    peak_plain = prof.allocator_peak(lambda: explain(model))
    peak_precise = prof.allocator_peak(lambda: explain(model, precision=True))
    print(f"allocator peak during the audit: {peak_plain / 1e6:.1f} MB without precision, {peak_precise / 1e6:.1f} MB "
          f"with it ({(peak_precise - peak_plain) / 1e6:+.1f} MB)")
    judged = [t for t in explanation.precision if t.verdict != "not judged"]
    print(f"tables judged: {len(judged)} ({len(explanation.groups)} distinct content), "
          f"{sum(t.diverges for t in judged)} diverge; worst to float64: "
          f"{max(t.to_float64.angle for t in judged if t.to_float64):.3g} rad")


if __name__ == "__main__":
    main()
