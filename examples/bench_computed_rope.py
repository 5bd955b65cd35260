"""RoPE tables computed in ``forward``: what folding and merging buy under each inner backend, in one run.

    python examples/bench_computed_rope.py --json docs/computed-rope.json   # recorded in docs/benchmarks.md
    python examples/bench_computed_rope.py --layers 4 --rounds 5 --inners eager   # a quick look

For each case (a toy decoder whose RoPE module computes its table in ``forward``: ``computed`` from
scratch, ``from_inv_freq`` HF style from a buffer) and each inner backend, every variant of
``RopeDedupBackend(inner, fold_constants=..., merge_computed=...)`` is compiled on its own copy of the
same model; then the variants take turns step by step (the order rotates every round), so that load
from elsewhere on the machine hits all of them alike. Ratios are each variant over ``off`` (both
transforms off: the dedup pass alone), same process, same inputs.

Memory: the peak of tensor memory allocated during one step above what was allocated when it began:
``max_memory_allocated`` on CUDA; on CPU the same figure from the profiler's allocator events
(``profile_memory=True``: every allocation and free of PyTorch's CPU allocator, inductor's included, each
with its time), which, unlike peak RSS, does not depend on whether glibc hands freed blocks back. A
folded table is held for good: ``held`` counts those bytes (from the report), apart from the transient peak.
The profiler logs each start and stop on stderr; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

if __name__ == "__main__" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a cold cache: honest compile times
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="computed-rope-inductor-")

import torch  # noqa: E402

from rope_dedup import RopeDedupBackend  # noqa: E402
from rope_dedup.testing import toy_decoder as toy  # noqa: E402

VARIANTS = {  # name -> (fold_constants, merge_computed)
    "off": (False, False),
    "merge": (False, True),
    "fold": (True, False),
    "fold+merge": (True, True),
}
CASES = {  # layout -> variants that can differ (nothing is constant-only in from_inv_freq: fold has nothing to do)
    "computed": ("off", "merge", "fold", "fold+merge"),
    "from_inv_freq": ("off", "merge"),
}
VOCAB = 64


def build(args: argparse.Namespace, layout: str, training: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(args.device):
        model = toy.ToyDecoder(toy.homogeneous(args.layers, layout=layout, max_len=args.context),
                               d_model=args.heads * args.head_dim, heads=args.heads, vocab=VOCAB)
    return model.train(training)


def step_peak_bytes(step: Callable[[], Any], device: str) -> int:
    """Peak tensor bytes allocated during one call of ``step``, above those allocated when it started."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        return torch.cuda.max_memory_allocated() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # Every allocation and free of the CPU allocator, with its own time stamp (what torch.profiler's memory
    # timeline reads); op-level memory figures would date a free to the start of the op that encloses it.
    changes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack += event.children
        if event.tag == torch._C._profiler._EventType.Allocation:
            changes.append((event.start_time_ns, event.extra_fields.alloc_size))
    live = peak = 0
    for _, delta in sorted(changes):
        live += delta
        peak = max(peak, live)
    return peak


def folded_bytes(backend: RopeDedupBackend) -> int:
    """Bytes of the constants the fold pass created (report members named ``module:node``)."""
    return sum(g.bytes_after for g in backend.report.groups if any(":" in m for m in g.members))


def run_case(args: argparse.Namespace, layout: str, inner: str, training: bool) -> dict[str, Any]:
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(args.device)
    steps: dict[str, Callable[[], torch.Tensor]] = {}
    backends: dict[str, RopeDedupBackend] = {}
    first_call: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name in CASES[layout]:
        fold, merge = VARIANTS[name]
        model = build(args, layout, training)
        backends[name] = RopeDedupBackend(inner, fold_constants=fold, merge_computed=merge)
        compiled = torch.compile(model, backend=backends[name])

        def step(compiled=compiled, model=model) -> torch.Tensor:
            if training:
                model.zero_grad(set_to_none=True)
                out = compiled(tokens)
                out.float().logsumexp(-1).mean().backward()
            else:
                with torch.no_grad():
                    out = compiled(tokens)
            sync()
            return out

        started = time.perf_counter()
        outputs[name] = step().detach()
        first_call[name] = time.perf_counter() - started
        steps[name] = step
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.warmup):
        for name in names:
            steps[name]()
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            started = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - started)
    transient = {name: step_peak_bytes(steps[name], args.device) for name in names}
    base = statistics.median(times["off"])
    result = {}
    for name in names:
        median = statistics.median(times[name])
        result[name] = {
            "step_s": median,
            "step_s_min": min(times[name]),
            "step_ratio": median / base,
            "step_ratio_min": min(times[name]) / min(times["off"]),
            "first_call_s": first_call[name],
            "transient_peak_bytes": transient[name],
            "transient_ratio": transient[name] / transient["off"] if transient["off"] else None,
            "held_bytes": folded_bytes(backends[name]),
            "max_abs_diff_vs_off": float((outputs[name].float() - outputs["off"].float()).abs().max()),
            "bitwise_equal_off": bool(torch.equal(outputs[name], outputs["off"])),
        }
    del steps, backends, outputs
    torch._dynamo.reset()
    gc.collect()
    return result


def mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--context", type=int, default=8192, help="max_len of the computed table")
    parser.add_argument("--seq", type=int, default=512, help="tokens per step (from_inv_freq: table length)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--inners", default="eager,aot_eager,inductor")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--modes", default="forward,train", help="forward and/or train (forward+backward)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.perf_counter()
    env = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
           "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
           "threads": torch.get_num_threads(), "loadavg_before": os.getloadavg()[0]}
    print(f"# {args.layers} layers, head_dim {args.head_dim}, {args.heads} heads, context {args.context}, "
          f"seq {args.seq}, batch {args.batch}; {args.rounds} interleaved rounds; {args.device}, "
          f"{env['threads']} thread(s); torch {env['torch']}")
    results: dict[str, Any] = {}
    header = (f"{'case':<14} {'mode':<8} {'inner':<10} {'variant':<11} {'step ms':>8} {'ratio':>6} {'min r':>6} "
              f"{'peak MB':>8} {'ratio':>6} {'held MB':>8} {'compile s':>9} {'= off':>6}")
    print(header)
    for layout in args.cases.split(","):
        for mode in args.modes.split(","):
            for inner in args.inners.split(","):
                result = run_case(args, layout, inner, training=mode == "train")
                results[f"{layout}/{mode}/{inner}"] = result
                for name, r in result.items():
                    ratio = f"{r['transient_ratio']:.2f}" if r["transient_ratio"] is not None else "-"
                    same = "yes" if r["bitwise_equal_off"] else f"{r['max_abs_diff_vs_off']:.0e}"
                    print(f"{layout:<14} {mode:<8} {inner:<10} {name:<11} {r['step_s'] * 1e3:8.2f} "
                          f"{r['step_ratio']:6.3f} {r['step_ratio_min']:6.3f} {mb(r['transient_peak_bytes']):>8} "
                          f"{ratio:>6} {mb(r['held_bytes']):>8} {r['first_call_s']:9.1f} {same:>6}", flush=True)
    env["loadavg_after"] = os.getloadavg()[0]
    env["wall_s"] = time.perf_counter() - started
    print(f"# wall {env['wall_s']:.0f} s; load average {env['loadavg_before']:.1f} -> {env['loadavg_after']:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "environment": env,
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
