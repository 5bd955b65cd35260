#!/usr/bin/env python
"""CUDA graphs under rope_dedup: same outputs, ideal RoPE storage, same recordings, same step time.

For each compile style (``whole``: ``torch.compile(model)``; ``regional``: each block compiled on its
own, ``model.layers[i] = torch.compile(block)`` as torchtitan does) the toy decoder is built twice with
the same weights and compiled

- with the inner backend alone: ``torch.compile(model, backend=INNER, mode=MODE)``, and
- with rope_dedup: ``torch.compile(model, backend=RopeDedupBackend(INNER), mode=MODE)``, which
  ``torch.compile`` calls as ``backend(gm, example_inputs, mode=MODE)`` and which must hand ``mode`` on
  to inductor as ``torch.compile(..., mode=MODE)`` would (``--mode default`` passes no mode at all).

Each model runs ``--warmup-steps`` forward steps under ``torch.no_grad`` (the inner backend alone first,
then rope_dedup, so counters can be attributed to one of them; CUDA graph trees warm up on the first
call and record on the second, hence at least 3), and the script checks:

- outputs: rope_dedup's equal the inner backend's alone at every step (``torch.equal``; max |diff| too);
- RoPE storage of the rope_dedup model: unique storages and bytes equal the ideal (each distinct
  table once: exact-equality groups of the model's tables; 1 storage for a homogeneous complex model,
  2 for cos/sin), and the model compiled without the pass keeps one storage per table;
- ``counters["inductor"]["cudagraph_skips"]`` equal for both, on CPU too (there inductor skips CUDA
  graphs once per graph when the mode asks for them: a sign the mode reached inductor through rope_dedup);
- CUDA graph recordings (on CUDA only): equal for both, and at least one when ``MODE`` uses CUDA graphs
  (else the comparison proves nothing). Counted by wrapping
  ``torch._inductor.cudagraph_trees.CUDAGraphTreeManager.record_function``: in torch 2.13 it is the only
  place a ``CUDAGraphNode`` (one ``torch.cuda.graph`` capture of a compiled function) is created, first
  recordings and re-recordings alike (its one caller is ``CUDAGraphTreeManager._run``, through ``self``);
  the script checks both facts in the installed torch's source and fails on CUDA if they no longer
  hold (``environment.recording_counter_gap`` in the JSON). There is no
  inductor counter of recordings (``counters["inductor"]`` has ``cudagraph_skips`` and
  ``cudagraph_recorded_non_static_inputs``, a sum of inputs; both are reported per backend too). As a
  cross-check, the ``CUDAGRAPH_RECORDING`` start callbacks of ``torch._dynamo.callback_handler`` are
  counted as well (they fire around each recording unless a compile is already in progress);

and measures, interleaved in this process (the two models alternate step by step, ABBA order, after a few
untimed steps of each), the step time rope_dedup / alone (``step_ratio``: the median of the ratios of
steps run back to back; ``step_ratio_of_medians`` too), and the backend's ``pass_seconds`` (all passes)
plus ``copy_seconds`` over its first call (compile).

inductor's FX graph and AOT autograd caches are turned off so that both first calls compile; kernels
(Triton, C++) compiled for the first model may still be reused by the second, so first-call times are
indicative only. Exit status: 0 all checks passed, 1 a check failed or a style raised, 2 bad usage
(``--device cuda`` without CUDA).

    python scripts/cuda_graphs_check.py --json out/cuda/cuda_graphs.json         # on a CUDA machine
    python scripts/cuda_graphs_check.py --device cpu --mode default --layers 2 --context 256
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import torch._functorch.config
import torch._inductor.config
from torch._dynamo.utils import counters

from rope_dedup import RopeDedupBackend
from rope_dedup.recompute import RecomputedTable
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, rope_tensors, unique_storages
from rope_dedup.tools.profile import ideal_storage, storage_figures

STYLES = ("whole", "regional")
LABELS = ("inductor", "rope_dedup")  # the inner backend alone, and with the pass; "inductor" names the
# baseline even under --inner aot_eager/eager (the JSON's config says which backend it was)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
INNERS = ("inductor", "aot_eager", "eager")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYOUTS = ("cos_sin", "hf_halves", "titan_cos_sin", "complex", "stacked", "gptj")
VOCAB = 64


# -- counting CUDA graph recordings ------------------------------------------------------------------

class RecordingCounter:
    """Counts CUDA graph recordings per label (whoever is running: set ``label`` before each call).

    Wraps ``CUDAGraphTreeManager.record_function`` on the class (every recording of a cudagraph tree goes
    through it) and registers a start callback on ``torch._dynamo.callback_handler`` for the
    ``CUDAGRAPH_RECORDING`` trigger as a cross-check. Enter it after ``torch._dynamo.reset()``, which
    clears the callbacks.
    """

    def __init__(self) -> None:
        self.label: str | None = None
        self.recordings: Counter = Counter()
        self.callbacks: Counter = Counter()

    def __enter__(self) -> "RecordingCounter":
        from torch._dynamo.callback import CallbackTrigger
        from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

        self._manager_class = CUDAGraphTreeManager
        self._original = original = CUDAGraphTreeManager.record_function

        @functools.wraps(original)
        def record_function(manager, *args, **kwargs):
            self.recordings[self.label] += 1
            return original(manager, *args, **kwargs)

        recording = getattr(CallbackTrigger, "CUDAGRAPH_RECORDING", None)

        def on_start(args) -> None:
            if args.callback_trigger == recording:
                self.callbacks[self.label] += 1

        self._on_start = on_start
        CUDAGraphTreeManager.record_function = record_function
        if recording is not None:
            torch._dynamo.callback_handler.register_start_callback(on_start)
        else:  # an older torch without the trigger: no cross-check
            self.callbacks = None
        return self

    def __exit__(self, *exc) -> None:
        self._manager_class.record_function = self._original
        try:
            torch._dynamo.callback_handler.remove_start_callback(self._on_start)
        except ValueError:  # cleared meanwhile (torch._dynamo.reset())
            pass


def counter_covers_all_recordings() -> str | None:
    """Why wrapping ``record_function`` might miss recordings in this torch (None: it cannot).

    Checked in the source of the installed torch: ``CUDAGraphNode`` (one recording) is created in
    ``CUDAGraphTreeManager.record_function`` only, and ``record_function`` is reached through the instance
    (``self.record_function``), so the wrapper on the class sees every call.
    """
    import inspect

    from torch._inductor import cudagraph_trees

    try:
        module = inspect.getsource(cudagraph_trees)
        record = inspect.getsource(cudagraph_trees.CUDAGraphTreeManager.record_function)
    except (OSError, TypeError) as error:
        return f"cannot read torch._inductor.cudagraph_trees' source: {error}"
    if module.count("CUDAGraphNode(") != record.count("CUDAGraphNode(") or "CUDAGraphNode(" not in record:
        return "this torch creates CUDAGraphNode outside CUDAGraphTreeManager.record_function"
    if "self.record_function(" not in module:
        return "this torch does not call CUDAGraphTreeManager.record_function through the instance"
    return None


def inductor_counters() -> dict[str, int]:
    """The cudagraph-related inductor counters now (deltas around a phase attribute them)."""
    return {key: counters["inductor"][key] for key in ("cudagraph_skips", "cudagraph_recorded_non_static_inputs")}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


# -- the model -----------------------------------------------------------------------------------------

def build(args: argparse.Namespace) -> ToyDecoder:
    specs = homogeneous(args.layers, layout=args.layout, max_len=args.context, dtype=DTYPES[args.dtype])
    torch.manual_seed(0)
    with torch.device(args.device):  # tables built where they live, as model code would
        model = ToyDecoder(specs, d_model=args.heads * args.head_dim, heads=args.heads, vocab=VOCAB)
    return model.eval()


def compile_style(model: ToyDecoder, style: str, backend: Any, mode: str) -> Callable:
    """``whole``: torch.compile(model); ``regional``: each block on its own (torchtitan)."""
    kwargs = {} if mode == "default" else {"mode": mode}
    if style == "regional":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend, **kwargs)
        return model
    return torch.compile(model, backend=backend, **kwargs)


def table_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [tensor for _, tensor in rope_tensors(model)]


# -- one style -----------------------------------------------------------------------------------------

def run_style(style: str, args: argparse.Namespace) -> dict[str, Any]:
    """Compile, warm up, compare and time both models of one compile style; every figure as a dict."""
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch._dynamo.reset()
    counters.clear()
    gc.collect()

    models = {label: build(args) for label in LABELS}
    eager = build(args) if args.tables == "recompute" else None  # what "within inductor's own difference" is from
    tables = table_tensors(models["rope_dedup"])
    ideal = ideal_storage(tables)
    stored_before = unique_storages(tables)
    backend = RopeDedupBackend(args.inner, tables=args.tables)
    compiled = {"inductor": compile_style(models["inductor"], style, args.inner, args.mode),
                "rope_dedup": compile_style(models["rope_dedup"], style, backend, args.mode)}
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (args.batch, args.seq), generator=generator).to(args.device)
              for _ in range(args.warmup_steps)]

    def call(label: str, x: torch.Tensor) -> torch.Tensor:
        counter.label = label
        if cuda:  # a new inference step: earlier outputs may be overwritten by the next replay
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return compiled[label](x)

    outputs: dict[str, list[torch.Tensor]] = {label: [] for label in LABELS}
    first_call: dict[str, float] = {}
    phase_counters: dict[str, dict[str, int]] = {}
    with RecordingCounter() as counter:
        for label in LABELS:  # one after the other, so each counter delta belongs to one of them
            before = inductor_counters()
            for i, x in enumerate(tokens):
                started = time.perf_counter()
                out = call(label, x).clone()  # a copy: the next replay reuses the graph's output memory
                sync()
                if i == 0:
                    first_call[label] = time.perf_counter() - started
                outputs[label].append(out)
            phase_counters[label] = delta(inductor_counters(), before)
        warmup_recordings = {label: counter.recordings[label] for label in LABELS}

        times: dict[str, list[float]] = {label: [] for label in LABELS}
        x = tokens[-1]
        for _ in range(3):  # untimed: both settled in their steady state before the clock starts
            for label in LABELS:
                call(label, x)
        sync()
        for i in range(args.timed_steps):
            for label in (LABELS if i % 2 == 0 else LABELS[::-1]):  # ABBA: neither always goes first
                sync()
                started = time.perf_counter()
                call(label, x)
                sync()
                times[label].append(time.perf_counter() - started)
        recordings = {label: counter.recordings[label] for label in LABELS}
        callbacks = {label: counter.callbacks[label] for label in LABELS} if counter.callbacks is not None else None

    pairs = list(zip(outputs["inductor"], outputs["rope_dedup"]))
    equal = [torch.equal(a, b) for a, b in pairs]
    max_diff = max(float((a.double() - b.double()).abs().max()) for a, b in pairs)
    from_eager = None
    if eager is not None:
        with torch.no_grad():
            reference = [eager(x) for x in tokens]
        from_eager = {label: max(float((a.double() - b.double()).abs().max()) for a, b in zip(outputs[label], reference))
                      for label in LABELS}
    if args.tables == "recompute":
        held = table_tensors(models["rope_dedup"])
        storage = {"rope_tables": len(tables), "rope_storages_before": stored_before[0],
                   "rope_bytes_before": stored_before[1],
                   "recomputed_tables": sum(isinstance(t, RecomputedTable) for t in held),
                   "rope_bytes": backend.report.recomputed_bytes}
    else:
        storage = storage_figures(tables, stored_before, unique_storages(table_tensors(models["rope_dedup"])), ideal)
    plain_count, plain_bytes = unique_storages(table_tensors(models["inductor"]))
    step = {label: statistics.median(times[label]) for label in LABELS} if args.timed_steps else None
    # Per ABBA pair the two steps ran back to back, under the same load: the median of the per-pair ratios
    # cancels slow phases (another process, a compile pool starting) that medians of all steps would not.
    pair_ratio = (statistics.median(d / a for a, d in zip(times["inductor"], times["rope_dedup"]))
                  if args.timed_steps else None)
    return {
        "style": style,
        "outputs_equal": all(equal),
        "outputs_equal_per_step": equal,
        "max_abs_diff": max_diff,
        "max_abs_diff_from_eager": from_eager,
        **storage,
        "rope_storages_without_pass": plain_count,
        "rope_bytes_without_pass": plain_bytes,
        "cudagraph_recordings": recordings if cuda else None,
        "cudagraph_recordings_warmup": warmup_recordings if cuda else None,
        "cudagraph_recording_callbacks": callbacks if cuda else None,
        "inductor_counters": phase_counters,
        "first_call_s": first_call,
        "pass_s": sum(backend.pass_seconds.values()) + backend.copy_seconds,
        "pass_vs_first_call": (sum(backend.pass_seconds.values()) + backend.copy_seconds) / first_call["rope_dedup"],
        "graphs_compiled": backend.graphs_compiled,
        "pass_errors": list(backend.errors),
        "report": str(backend.report).splitlines()[0] if str(backend.report) else "",
        "timed_steps": args.timed_steps,
        "step_s": step,
        "step_ratio": pair_ratio,
        "step_ratio_of_medians": step["rope_dedup"] / step["inductor"] if step else None,
    }


def failures_of(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Why this style's result fails the check (empty: it passes)."""
    style = result["style"]
    if "error" in result:
        return [f"{style}: {result['error']}"]
    found = []
    if args.tables == "recompute":  # rows computed by the inner backend's kernels: within its own difference
        from_eager = result["max_abs_diff_from_eager"]
        if from_eager["rope_dedup"] > from_eager["inductor"]:
            found.append(f"{style}: recomputed tables move the outputs {from_eager['rope_dedup']:.3g} from eager, "
                         f"{args.inner} alone {from_eager['inductor']:.3g}")
        if result["recomputed_tables"] != result["rope_tables"] or result["rope_bytes"] > 1024:
            found.append(f"{style}: {result['recomputed_tables']} of {result['rope_tables']} tables recomputed, "
                         f"{fmt_bytes(result['rope_bytes'])} of frequency vectors (1 KB at most)")
    elif not result["outputs_equal"]:
        found.append(f"{style}: outputs differ from {args.inner} alone (max |diff| {result['max_abs_diff']:.3g})")
    if args.tables == "share" and \
            (result["rope_storages"], result["rope_bytes"]) != (result["ideal_storages"], result["ideal_bytes"]):
        found.append(f"{style}: RoPE storage {result['rope_storages']} storage(s), {fmt_bytes(result['rope_bytes'])}; "
                     f"ideal {result['ideal_storages']}, {fmt_bytes(result['ideal_bytes'])}")
    if result["rope_storages_without_pass"] != result["rope_storages_before"]:
        found.append(f"{style}: the model compiled without the pass shares tables "
                     f"({result['rope_storages_before']} -> {result['rope_storages_without_pass']} storages)")
    if result["pass_errors"]:
        found.append(f"{style}: the pass failed: {result['pass_errors'][0]}")
    skips = {label: result["inductor_counters"][label]["cudagraph_skips"] for label in LABELS}
    if skips["inductor"] != skips["rope_dedup"]:  # on CPU too: reduce-overhead skips CUDA graphs, once per graph
        found.append(f"{style}: inductor skipped CUDA graphs {skips['inductor']} time(s) alone, {skips['rope_dedup']} "
                     "with rope_dedup: the mode did not reach inductor alike")
    recordings = result["cudagraph_recordings"]
    if recordings is not None:
        if recordings["inductor"] != recordings["rope_dedup"]:
            found.append(f"{style}: CUDA graph recordings differ: {recordings['inductor']} alone, "
                         f"{recordings['rope_dedup']} with rope_dedup")
        if args.mode in CUDAGRAPH_MODES and recordings["inductor"] == 0:
            found.append(f"{style}: mode {args.mode} recorded no CUDA graph without the pass "
                         f"(cudagraph_skips {result['inductor_counters']['inductor']['cudagraph_skips']}): "
                         "the comparison proves nothing")
    return found


# -- output --------------------------------------------------------------------------------------------

def fmt_bytes(n: int | float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def print_table(results: list[dict[str, Any]]) -> None:
    header = ("style", "outputs equal", "max |diff|", "RoPE storages (ideal)", "RoPE bytes (ideal)",
              "CUDA graphs alone/rd", "step rd/alone", "pass/first call", "first call s alone/rd")
    rows = []
    for r in results:
        if "error" in r:
            rows.append((r["style"], "error", "-", "-", "-", "-", "-", "-", "-"))
            continue
        rec = r["cudagraph_recordings"]
        rows.append((
            r["style"], "yes" if r["outputs_equal"] else "NO", f"{r['max_abs_diff']:.1e}",
            f"{r['rope_tables']} -> {r['rope_storages']} ({r['ideal_storages']})" if "rope_storages" in r else
            f"{r['rope_tables']} -> {r['recomputed_tables']} recomputed",
            f"{fmt_bytes(r['rope_bytes'])} ({fmt_bytes(r['ideal_bytes'])})" if "ideal_bytes" in r else
            f"{fmt_bytes(r['rope_bytes'])} of vectors",
            "n/a (cpu)" if rec is None else f"{rec['inductor']}/{rec['rope_dedup']}",
            "-" if r["step_ratio"] is None else f"{r['step_ratio']:.3f}",
            f"{r['pass_vs_first_call']:.2%}",
            f"{r['first_call_s']['inductor']:.1f}/{r['first_call_s']['rope_dedup']:.1f}"))
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def environment(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name() if cuda and args.device == "cuda" else None,
        "cudagraph_trees": torch._inductor.config.triton.cudagraph_trees,
        "python": sys.version.split()[0],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--mode", choices=MODES, default="reduce-overhead",
                        help="torch.compile mode for both compiles (default: %(default)s; 'default' passes none)")
    parser.add_argument("--inner", choices=INNERS, default="inductor",
                        help="backend compiled alone and under rope_dedup (default: %(default)s); a mode other "
                             "than 'default' needs inductor")
    parser.add_argument("--styles", default=",".join(STYLES), help="comma-separated, from whole,regional")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=32768, help="RoPE table length (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layout", choices=LAYOUTS, default="cos_sin")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--seq", type=int, default=64, help="tokens per step")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=4,
                        help="compared steps per model, the first compiles (default %(default)s, at least 3)")
    parser.add_argument("--timed-steps", type=int, default=50, help="interleaved steps per model for the time ratio")
    parser.add_argument("--tables", choices=("share", "recompute"), default="share",
                        help="rope_dedup's tables= (recompute: outputs within the inner backend's own difference "
                             "from eager, every table recomputed)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON")
    args = parser.parse_args(argv)
    args.styles = tuple(s.strip() for s in args.styles.split(",") if s.strip())
    if not args.styles or set(args.styles) - set(STYLES):
        parser.error(f"--styles: choose from {','.join(STYLES)}")
    if args.warmup_steps < 3:
        parser.error("--warmup-steps must be at least 3 (CUDA graph trees warm up, then record, then replay)")
    if args.mode != "default" and args.inner != "inductor":
        parser.error(f"--mode {args.mode} is an inductor mode; use --mode default with --inner {args.inner}")
    if args.seq > args.context:
        parser.error(f"--seq {args.seq} exceeds the table length --context {args.context}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: --device cuda, but no CUDA device is visible to torch "
                       f"{torch.__version__}\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch._inductor.config.fx_graph_cache = False  # both first calls compile (see the module docstring)
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        torch._functorch.config.enable_autograd_cache = False
    env = environment(args)
    print(f"toy decoder: {args.layers} layers, context {args.context}, head_dim {args.head_dim}, {args.heads} heads, "
          f"{args.dtype} {args.layout} tables (homogeneous), {args.device}; inner {args.inner}, mode {args.mode}; "
          f"torch {env['torch']}"
          + (f", CUDA {env['torch_cuda']} on {env['device_name']}" if env["device_name"] else ""))
    results, failures = [], []
    if args.device == "cuda" and args.mode in CUDAGRAPH_MODES and not env["cudagraph_trees"]:
        failures.append("torch._inductor.config.triton.cudagraph_trees is off: recordings are counted in "
                        "CUDA graph trees only")
    env["recording_counter_gap"] = counter_covers_all_recordings()
    if args.device == "cuda" and env["recording_counter_gap"]:
        failures.append(f"CUDA graph recordings may be miscounted: {env['recording_counter_gap']}")
    for style in args.styles:
        try:
            result = run_style(style, args)
        except Exception as error:  # report it and go on with the other style
            text = str(error).strip().splitlines()
            result = {"style": style, "error": f"{type(error).__name__}: {text[0] if text else ''}",
                      "traceback": traceback.format_exc()}
            print(result["traceback"], file=sys.stderr)
        results.append(result)
        failures += failures_of(result, args)
    print_table(results)
    print("CUDA graph recordings counted by wrapping torch._inductor.cudagraph_trees."
          "CUDAGraphTreeManager.record_function" if args.device == "cuda" else
          "CUDA graphs: none on cpu (recordings not counted)")
    for failure in failures:
        print(f"FAILED {failure}")
    what = "outputs equal, RoPE storage ideal" if args.tables == "share" else \
        "outputs within the inner backend's own difference from eager, every table recomputed"
    print(f"OK: {what}" + (", CUDA graph recordings equal" if args.device == "cuda" else "")
          if not failures else f"{len(failures)} check(s) failed")
    if args.json is not None:
        config = {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                  for k, v in vars(args).items()}
        payload = {"config": config, "environment": env,
                   "recording_counter": "torch._inductor.cudagraph_trees.CUDAGraphTreeManager.record_function "
                                        "calls (wrapped), per backend",
                   "styles": {r["style"]: r for r in results}, "failures": failures, "ok": not failures}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
