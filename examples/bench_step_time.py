"""Step time of a compiled model, rope_dedup against inductor alone, measured side by side in one process.

    python examples/bench_step_time.py                            # 40 and 126 layers, tiny inputs, CPU
    python examples/bench_step_time.py --device cuda --realistic  # CUDA events, plus one realistic shape
    python examples/bench_step_time.py --layers 4 --rounds 20     # a quick look

For each case three copies of one toy decoder (same weights, one RoPE cos/sin table per layer) are compiled:
one with ``inductor``, a second with ``inductor`` (the A/A control) and one with ``RopeDedupBackend()``
(inductor inside), whole or per block (regional, torchtitan's way). Each model gets code objects of its own
(``rope_dedup.tools.paired.own_code``), as a process that runs one model has: models sharing a code object
would each check the others' compiled guards first on every call. After a warm-up, the models take turns call
by call, A B C then C B A in the next round (``rope_dedup.tools.paired.take_turns``), so that whatever else
the machine does hits all alike. On CUDA each call is timed with CUDA events and synchronized before the next,
so a launch-bound step counts its host time too. Tiny inputs (one token, batch 1) make fixed per-call costs
show: dynamo's guards, the wrapper rope_dedup returns, the pointer check of run-time interning.

Each case runs in ``--processes`` fresh processes, one after another (4 by default): one process's memory
layout (where each model's tensors and compiled code landed) biases its times by a percent or two either way
for the whole run, which interleaving cannot cancel. The A/A control reads that bias and the noise in the
same process: a rope_dedup figure as far from 1 as the control's is no measured cost. The model built first
(the others are its deep copies), compiled and called first, runs faster, so every other process builds
rope_dedup's model first, and an even number of processes cancels it.

Printed per case: the median step of each, and per process the paired ratios (each the median of per-round
ratios over the inductor call of the same round) of rope_dedup and of the A/A control; then the median of
each over the processes: the figures to hold against a target, side by side.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

if __name__ == "__main__" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a cold cache for each run
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="step-time-inductor-")

import torch  # noqa: E402

from rope_dedup import RopeDedupBackend  # noqa: E402
from rope_dedup.testing import toy_decoder as toy  # noqa: E402
from rope_dedup.tools.paired import Paired, cpu_timer, cuda_timer, own_code, take_turns, verdict  # noqa: E402


@dataclass(frozen=True)
class Case:
    layers: int
    regional: bool
    d_model: int = 32
    heads: int = 2
    seq: int = 1
    batch: int = 1
    context: int = 4096

    @property
    def name(self) -> str:
        shape = f"d{self.d_model} seq {self.seq} x{self.batch}"
        return f"{self.layers} layers, {'regional' if self.regional else 'whole'}, {shape}, context {self.context}"


def build(case: Case, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = toy.ToyDecoder(toy.homogeneous(case.layers, max_len=case.context), d_model=case.d_model,
                           heads=case.heads, vocab=256, device=device)
    return model.eval()


def compiled(model: torch.nn.Module, backend: Any, regional: bool) -> Callable:
    """``model`` compiled whole or block by block, with code objects of its own (see the docstring)."""
    if not regional:
        own_code(model)
        return torch.compile(model, backend=backend)
    own_code(*model.layers)
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=backend)
    return model


MODELS = ("inductor", "inductor again", "rope_dedup")  # "inductor": the inner backend alone; "again": the A/A control


def measure(case: Case, device: str, rounds: int, warmup: int, inner: str = "inductor",
            rope_dedup_first: bool = False) -> dict[str, Any]:
    """One process's figures. The model built first (the others are its deep copies) and compiled and called
    first runs a little faster for the whole process (two inductor models: 1.007 to 1.023 at 126 layers,
    whole): ``rope_dedup_first`` gives that place to rope_dedup, and the bench alternates it."""
    torch._dynamo.reset()
    first = build(case, device)
    models = [first, copy.deepcopy(first), copy.deepcopy(first)]
    order = MODELS[::-1] if rope_dedup_first else MODELS  # the A/A control stays in the middle
    backend = RopeDedupBackend(inner)
    made = {name: compiled(model, backend if name == "rope_dedup" else inner, case.regional)
            for name, model in zip(order, models)}
    tokens = torch.randint(0, 256, (case.batch, case.seq), generator=torch.Generator().manual_seed(0)).to(device)
    firsts: dict[str, float] = {}
    outputs: dict[str, Any] = {}
    with torch.no_grad():
        for name in made:
            began = time.perf_counter()
            outputs[name] = made[name](tokens)
            firsts[name] = time.perf_counter() - began
        for name in made:
            torch.testing.assert_close(outputs[name], outputs["inductor"], rtol=0, atol=0)
        calls = {name: (lambda fn=made[name]: fn(tokens)) for name in made}
        times = take_turns(calls, rounds, warmup, cuda_timer if device == "cuda" else cpu_timer)
    paired = {name: Paired.of(times[name], times["inductor"]) for name in ("rope_dedup", "inductor again")}
    report = backend.report
    return {
        "case": asdict(case),
        "name": case.name,
        "median_ms": {name: 1e3 * statistics.median(times[name]) for name in MODELS},
        "fastest_ms": {name: 1e3 * min(times[name]) for name in MODELS},
        "median_paired_ratio": paired["rope_dedup"].ratio,
        "control_paired_ratio": paired["inductor again"].ratio,
        "paired": {name: asdict(p) for name, p in paired.items()},
        "first_call_s": firsts,
        "rope_dedup_first": rope_dedup_first,
        "rope_storages": {"groups": len(report.groups), "tensors": sum(len(g.members) for g in report.groups)},
        "rounds": rounds,
    }


def measure_in_child(case: Case, args: argparse.Namespace, rope_dedup_first: bool) -> dict[str, Any]:
    """:func:`measure` in a fresh process: its own memory layout, its own dynamo and inductor state."""
    command = [sys.executable, __file__, "--case", json.dumps(asdict(case)), "--device", args.device,
               "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--inner", args.inner]
    if rope_dedup_first:
        command.append("--rope-dedup-first")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {case.name} in a child process failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def combined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's figures over its processes: the median of each, the fastest step of all, each paired ratio."""
    result = dict(runs[0])
    result["median_ms"] = {name: statistics.median(run["median_ms"][name] for run in runs) for name in MODELS}
    result["fastest_ms"] = {name: min(run["fastest_ms"][name] for run in runs) for name in MODELS}
    for field in ("median_paired_ratio", "control_paired_ratio"):
        result[field] = statistics.median(run[field] for run in runs)
    result["paired_ratio_per_process"] = [run["median_paired_ratio"] for run in runs]
    result["control_ratio_per_process"] = [run["control_paired_ratio"] for run in runs]
    result["first_call_s"] = [run["first_call_s"] for run in runs]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[40, 126])
    parser.add_argument("--modes", nargs="+", choices=["whole", "regional"], default=["whole", "regional"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--realistic", action="store_true",
                        help="also one realistic shape: 8 layers, d_model 1024, 16 heads, 256 tokens")
    parser.add_argument("--target", type=float, default=1.01, help="median paired ratio to hold (default 1.01)")
    parser.add_argument("--inner", default="inductor", help="the inner backend, alone and inside rope_dedup")
    parser.add_argument("--processes", type=int, default=4,
                        help="fresh processes per case, whose paired ratios' median is the figure, every other one "
                             "with rope_dedup's model built and compiled first (default 4; 1 measures in this "
                             "process)")
    parser.add_argument("--rope-dedup-first", action="store_true", help=argparse.SUPPRESS)  # measure_in_child
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # set by measure_in_child
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.case is not None:  # a child of measure_in_child: one process's figures, as JSON on stdout
        print(json.dumps(measure(Case(**json.loads(args.case)), args.device, args.rounds, args.warmup, args.inner,
                                 args.rope_dedup_first)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda asked for, but CUDA is not available", file=sys.stderr)
        return 2
    cases = [Case(n, mode == "regional") for n in args.layers for mode in args.modes]
    if args.realistic:
        cases.append(Case(8, False, d_model=1024, heads=16, seq=256))
    results = []
    print(f"{'case':<58} {args.inner + ' ms':>11} {'rope_dedup ms':>13} {'paired':>7} {'A/A':>6}  per process "
          "(rope_dedup, A/A)")
    for case in cases:
        runs = [measure(case, args.device, args.rounds, args.warmup, args.inner)] if args.processes == 1 else [
            measure_in_child(case, args, rope_dedup_first=k % 2 == 1) for k in range(args.processes)]
        result = combined(runs)
        results.append(result)
        pairs = " ".join(f"{r:.3f}/{c:.3f}" for r, c in zip(result["paired_ratio_per_process"],
                                                              result["control_ratio_per_process"]))
        print(f"{result['name']:<58} {result['median_ms']['inductor']:>11.3f} {result['median_ms']['rope_dedup']:>13.3f} "
              f"{result['median_paired_ratio']:>7.3f} {result['control_paired_ratio']:>6.3f}  {pairs}", flush=True)
    worst = max(r["median_paired_ratio"] for r in results)
    noise = max(abs(r["control_paired_ratio"] - 1) for r in results)
    print(f"worst median paired ratio {worst:.3f}, A/A control within ±{noise:.1%}: target <= {args.target} "
          f"{verdict(worst, args.target, noise)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
                       or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "inner": args.inner, "results": results, "target": args.target, "worst": worst,
                       "control_noise": noise}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
