"""Recomputed tables against one shared table: RoPE bytes, peaks and step time, side by side in one run.

    python examples/bench_recompute.py                       # titan-128k, then the 1M-position preset
    python examples/bench_recompute.py --preset titan-128k --rounds 10
    python examples/bench_recompute.py --layers 4 --context 8192 --rounds 4   # a quick look

Per preset, one toy decoder (one complex ``freqs_cis`` per layer, or ``--layout cos_sin``, head_dim 128) is built inside
``rope_dedup.sharing()``, so the build holds one table, never one per layer (40 x 512 MiB would not fit at
1M positions). Its deep copy goes through ``share(model, tables="recompute")``. Where the unshared model fits
(``--unshared-max-gb``), a third copy keeps a table per layer: inductor alone as users run it today.

Printed: RoPE bytes of each (unshared as the tables' sizes, shared and recompute as storages held), the peak of the
build and of the conversion (RSS; the CUDA allocator's with ``--device cuda``), and the step-time ratios recompute /
shared and recompute / unshared, each model compiled per block (torchtitan's regional compile; inductor unless
``--backend``), called in turns (A B, then B A) at decode (1 token) and prefill (``--prefill`` tokens); each figure
is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import types
from typing import Any, Callable

if __name__ == "__main__" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a cold cache for each run
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="recompute-inductor-")

import torch  # noqa: E402

import rope_dedup  # noqa: E402
from rope_dedup.recompute import RecomputedTable  # noqa: E402
from rope_dedup.testing import toy_decoder as toy  # noqa: E402

PRESETS = {
    "titan-128k": dict(layers=40, context=131072),  # torchtitan #4111: 67 MB per layer, 2.7 GB unshared
    "1m": dict(layers=40, context=1 << 20),  # one complex64 (1M, 64) table: 512 MiB even when shared
}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> None:
    """Start a new peak window: RSS (Linux: ``/proc/self/clear_refs``) and, with CUDA, the allocator's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak(device: str) -> int:
    """The peak since :func:`reset_peak`: the CUDA allocator's on CUDA, else RSS."""
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else peak_rss()


def build(layers: int, context: int, heads: int, head_dim: int, shared: bool, layout: str,
          device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    specs = toy.homogeneous(layers, layout=layout, max_len=context)
    if shared:
        with rope_dedup.sharing():
            model = toy.ToyDecoder(specs, d_model=heads * head_dim, heads=heads, device=device)
    else:
        model = toy.ToyDecoder(specs, d_model=heads * head_dim, heads=heads, device=device)
    return model.eval()


def rope_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's RoPE state holds: each distinct storage once (a recomputed table: its vector)."""
    seen: dict[int, int] = {}
    for _, table in toy.rope_tensors(model):
        held = table.inv_freq if isinstance(table, RecomputedTable) else table
        storage = held.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def regional(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """Each block compiled, with a code object of this model's own: dynamo keeps its compiled graphs per code
    object and tries them in order, so models sharing one would each pay to check the others' guards first (a
    cost of running several models in one process, not of any of them)."""
    cls = type(model.layers[0])
    forward = cls.forward
    code = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                              forward.__defaults__, forward.__closure__)
    own = type(cls.__name__, (cls,), {"forward": code})
    for i, block in enumerate(model.layers):
        block.__class__ = own
        model.layers[i] = torch.compile(block, backend=backend)
    return model


def paired_ratios(calls: dict[str, Callable[[], Any]], against: str, rounds: int,
                  sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median over rounds of each model's step over ``against``'s step, called in turns (order flipped
    every round), after one warm-up call each; ``sync`` waits for the device before and after each step."""
    names = list(calls)
    for call in calls.values():
        call()
    ratios: dict[str, list[float]] = {n: [] for n in names if n != against}
    for r in range(rounds):
        times = {}
        for name in (names if r % 2 == 0 else names[::-1]):
            sync()
            start = time.perf_counter()
            calls[name]()
            sync()
            times[name] = time.perf_counter() - start
        for name in ratios:
            ratios[name].append(times[name] / times[against])
    return {name: statistics.median(values) for name, values in ratios.items()}


def run(layers: int, context: int, heads: int, head_dim: int, prefill: int, rounds: int,
        unshared_max_gb: float, backend: str, layout: str, control: bool = False, device: str = "cpu"
        ) -> dict[str, Any]:
    table_bytes = context * (head_dim // 2) * 8  # complex64, or a float32 cos and sin of half its width
    result: dict[str, Any] = {"layers": layers, "context": context, "head_dim": head_dim, "layout": layout,
                              "control": control, "device": device, "rope_bytes_unshared": layers * table_bytes}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    reset_peak()
    shared = build(layers, context, heads, head_dim, shared=True, layout=layout, device=device)
    result["build_peak"] = peak(device)
    recompute = copy.deepcopy(shared)
    reset_peak()
    start = time.perf_counter()
    report = rope_dedup.share(recompute, tables="share" if control else "recompute")
    result["convert_s"] = time.perf_counter() - start
    result["convert_peak"] = peak(device)
    result["recomputed"] = len(report.recomputed)
    result["rope_bytes_shared"] = rope_bytes(shared)
    result["rope_bytes_recompute"] = rope_bytes(recompute)
    models = {"shared": shared, "recompute": recompute}
    if layers * table_bytes <= unshared_max_gb * 1e9:
        models["unshared"] = build(layers, context, heads, head_dim, shared=False, layout=layout, device=device)
    compiled = {name: regional(model, backend) for name, model in models.items()}
    for phase, length in (("decode", 1), ("prefill", prefill)):
        tokens = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(1)).to(device)
        with torch.no_grad():
            outputs = {name: model(tokens) for name, model in compiled.items()}
            result[f"{phase}_max_diff_vs_shared"] = (outputs["recompute"] - outputs["shared"]).abs().max().item()
            calls = {name: (lambda m=model: m(tokens)) for name, model in compiled.items()}
            result[f"{phase}_recompute_over_shared"] = paired_ratios(calls, "shared", rounds, sync)["recompute"]
            if "unshared" in calls:
                del calls["shared"]
                result[f"{phase}_recompute_over_unshared"] = paired_ratios(calls, "unshared", rounds, sync)["recompute"]
    return result


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n} B"


def show(name: str, r: dict[str, Any]) -> None:
    control = " (control: the 'recompute' copy stays shared)" if r["control"] else ""
    print(f"{name}: {r['layers']} layers, {r['context']:,} positions, head_dim {r['head_dim']}, {r['layout']} "
          f"tables{control}")
    print(f"  RoPE bytes: unshared {mb(r['rope_bytes_unshared'])}, shared {mb(r['rope_bytes_shared'])}, "
          f"recompute {mb(r['rope_bytes_recompute'])} ({r['recomputed']} tables recomputed)")
    what = "peak RSS" if r["device"] == "cpu" else f"peak allocated on {r['device']}"
    print(f"  {what}: build (inside sharing()) {mb(r['build_peak'])}, conversion {mb(r['convert_peak'])} "
          f"({r['convert_s']:.1f} s)")
    for phase in ("decode", "prefill"):
        line = f"  {phase}: recompute / shared {r[f'{phase}_recompute_over_shared']:.3f}"
        if f"{phase}_recompute_over_unshared" in r:
            line += f", recompute / unshared (inductor alone) {r[f'{phase}_recompute_over_unshared']:.3f}"
        print(line + f"; max |diff| vs shared {r[f'{phase}_max_diff_vs_shared']:.1e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--context", type=int)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--unshared-max-gb", type=float, default=4.0,
                        help="build the unshared model only when its tables fit in this (default 4)")
    parser.add_argument("--backend", default="inductor", help="what each block is compiled with (default inductor)")
    parser.add_argument("--layout", default="complex", choices=("complex", "cos_sin"),
                        help="complex64 freqs_cis (default) or a float32 cos and sin per layer")
    parser.add_argument("--control", action="store_true",
                        help="an A/A check: the copy stays shared instead of recomputed, so its ratios show what "
                             "the arrangement alone (built second, a deep copy) costs")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: models, tokens and peaks there")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    torch.set_num_threads(args.threads)
    presets = PRESETS if args.preset == "all" else {args.preset: PRESETS[args.preset]}
    results = {}
    for name, preset in presets.items():
        layers, context = args.layers or preset["layers"], args.context or preset["context"]
        results[name] = run(layers, context, args.heads, args.head_dim, args.prefill, args.rounds,
                            args.unshared_max_gb, args.backend, args.layout, args.control, args.device)
        show(name, results[name])
        torch._dynamo.reset()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": args.threads, "backend": args.backend,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
