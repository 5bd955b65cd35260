"""``rope-dedup`` command line: ``profile`` (memory and time by mode) and ``audit MODULE:FACTORY``.

rich (and matplotlib for ``--plot``) come with the ``demo`` extra and are imported only here, when a
command runs. Bad input ends in one line on stderr and a non-zero exit: 2 for what the user asked
(unknown preset, no CUDA, a factory that does not import), 1 for what failed while running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn, Sequence

import torch

from rope_dedup.tools import profile as prof
from rope_dedup.tools.factories import FactoryError, NoInputs, load_factory, model_and_inputs, model_of
from rope_dedup.core.text import format_bytes

USAGE_ERROR, RUN_ERROR = 2, 1


class BadInput(Exception):
    """What the user asked for cannot be done; the message is the whole story."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + error
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rope-dedup`` and ``python -m rope_dedup``; returns the exit status."""
    args = _parser().parse_args(argv)
    prog = f"rope-dedup {args.command}"
    try:
        console, error_console = _consoles()
        if args.command == "profile":
            return _profile(args, console, error_console)
        return _audit(args, console)
    except BadInput as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rope-dedup", description="Share identical RoPE tables across attention layers.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser(
        "profile", help="compare memory and time: eager, torch.compile, rope_dedup (each in a fresh process)",
        description="Profile MODULE:FACTORY's model (FACTORY() returns (model, example_inputs), as for audit), "
                    "or by default a toy decoder whose attention layers each own a RoPE table: eager, "
                    "torch.compile with the inner backend alone, with rope_dedup, and regional compile (each "
                    "block of a ModuleList compiled on its own), each in a fresh process. Toy options override "
                    "the preset.")
    p.add_argument("factory", metavar="MODULE:FACTORY", nargs="?",
                   help="your model, e.g. my_pkg.models:build or path/to/model.py:build (default: the toy decoder)")
    p.add_argument("--regional", metavar="PATH",
                   help="the ModuleList whose blocks regional mode compiles (e.g. model.layers); adds the "
                        "regional mode (toy decoder: layers)")
    p.add_argument("--train", action="store_true",
                   help="a step is forward, backward and an AdamW step (peak memory includes grads and "
                        "optimizer state); the default step is a no-grad forward")
    p.add_argument("--preset", choices=sorted(prof.PRESETS), default="default",
                   help="starting configuration (default: %(default)s): " + "; ".join(
                       f"{name}: {prof.describe_preset(config)}" for name, config in prof.PRESETS.items()))
    p.add_argument("--layers", type=_positive_int, help="attention layers, each with its own table")
    p.add_argument("--context", type=_positive_int, help="table length (positions)")
    p.add_argument("--head-dim", type=_positive_int, help="head dimension (the rotary dim)")
    p.add_argument("--heads", type=_positive_int, help="attention heads")
    p.add_argument("--dtype", choices=sorted(prof.DTYPES), help="table dtype")
    p.add_argument("--layout", choices=prof.profile_layouts(), help="how each layer stores its table")
    p.add_argument("--pattern", choices=prof.PATTERNS, help="same table everywhere, or Gemma-style local/global")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where the model runs")
    p.add_argument("--inner", choices=prof.INNERS, help="backend compared with, and used under rope_dedup")
    p.add_argument("--modes", type=_modes, help=f"comma-separated, from {','.join(prof.MODES)} (or 'all'); "
                                                "'regional' compiles block by block; 'share' runs eager after "
                                                "rope_dedup.share(model), 'sharing' builds inside rope_dedup.sharing()")
    p.add_argument("--steps", type=_positive_int, help="timed forward steps after the first call, at least")
    p.add_argument("--step-seconds", type=float, help="and stepping lasts at least this long (default 1)")
    p.add_argument("--seq", type=_positive_int, help="tokens per step")
    p.add_argument("--batch", type=_positive_int, help="sequences per step")
    p.add_argument("--threads", type=_positive_int, help="intra-op threads per child (default 1)")
    p.add_argument("--timeout", type=float, help="seconds allowed per mode")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH.png", help="write a bar chart of memory by mode")
    a = commands.add_parser(
        "audit", help="dry run: the RoPE tables each layer holds, which would share, what is skipped and why",
        description="Import MODULE (a dotted name, or a path to a .py file), call FACTORY() for "
                    "(model, example_inputs), run one forward through a dry-run rope_dedup backend and print "
                    "per layer the tables found, their inferred keys, the share groups and every skip. With "
                    "--static, no forward: the tables the model holds are measured, and RoPE slots left "
                    "unfilled (zeros, NaN) are mismatches; FACTORY() may then return the model alone.")
    a.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. examples/audit.py:build or my_pkg.models:build")
    a.add_argument("--static", action="store_true",
                   help="audit the tables the model holds without running it (right after init); exit 1 if a "
                        "table differs from --expect or a RoPE slot holds no table")
    a.add_argument("--expect", metavar="SPEC",
                   help="what every layer should apply: 'config' (the model's transformers config) or "
                        "theta=5e5[,dim=64][,scaling=TYPE:PARAMS][,attention_factor=1.2], scaling one of "
                        "linear:FACTOR, dynamic:FACTOR:ORIGINAL_MAX, llama3:FACTOR:LOW:HIGH:ORIGINAL_MAX, "
                        "yarn:FACTOR:ORIGINAL_MAX[:BETA_FAST:BETA_SLOW]; exit 1 if any layer differs")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _modes(text: str) -> tuple[str, ...]:
    modes = prof.MODES if text == "all" else tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in prof.MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; "
                                         f"choose from {', '.join(prof.MODES)}")
    return modes


def _consoles():
    try:
        from rich.console import Console
    except ImportError:
        raise BadInput("the command line needs rich: pip install 'rope-dedup[demo]'") from None
    # Piped or redirected output gets rich's 80 columns unless told otherwise: too narrow for the tables.
    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 140
    return Console(width=width), Console(stderr=True)


# -- profile ------------------------------------------------------------------------------------------

def _profile(args: argparse.Namespace, console, error_console) -> int:
    config = _profile_config(args)
    if args.plot is not None:
        _check_writable(args.plot, "--plot")
        try:
            import matplotlib  # noqa: F401  (checked before minutes of profiling, used after)
        except ImportError:
            raise BadInput("--plot needs matplotlib: pip install 'rope-dedup[demo]'") from None
    if args.json is not None:
        _check_writable(args.json, "--json")
    console.print(prof.describe_config(asdict(config)), style="dim")
    result = _run_with_progress(config, args.timeout, error_console)
    result["targets"] = [dict(zip(("target", "measured", "limit", "comparison", "met"), row))
                         for row in prof.check_targets(result["summary"])]
    _print_profile(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        from rope_dedup.tools.plot import plot_profile

        plot_profile(result, args.plot)
        console.print(f"wrote {args.plot}")
    failed = [(mode, r["error"]) for mode, r in result["modes"].items() if "error" in r]
    for mode, error in failed:
        print(f"rope-dedup profile: error: {prof.mode_label(mode, config.inner)}: {error}", file=sys.stderr)
    return RUN_ERROR if failed else 0


_TOY_OPTIONS = ("preset", "layers", "context", "head_dim", "heads", "dtype", "layout", "pattern", "seq", "batch")


def _profile_config(args: argparse.Namespace) -> prof.ProfileConfig:
    common = dict(device=args.device, inner=args.inner, modes=args.modes, steps=args.steps,
                  step_seconds=args.step_seconds, threads=args.threads, regional=args.regional,
                  train=args.train or None)
    if args.factory is not None:
        toy_only = [f"--{name.replace('_', '-')}" for name in _TOY_OPTIONS
                    if getattr(args, name) is not None and not (name == "preset" and args.preset == "default")]
        if toy_only:
            raise BadInput(f"{', '.join(toy_only)} describe the toy decoder, not {args.factory}")
        with _bad_factory():
            load_factory(args.factory)  # importable here; each mode's process calls it
        config = prof.apply_overrides(prof.ProfileConfig(factory=args.factory), **common)
    else:
        config = prof.apply_overrides(
            prof.PRESETS[args.preset], layers=args.layers, context=args.context, head_dim=args.head_dim,
            heads=args.heads, dtype=args.dtype, layout=args.layout, pattern=args.pattern, seq=args.seq,
            batch=args.batch, **common)
        layouts = prof.profile_layouts()
        if config.layout not in layouts:
            raise BadInput(f"unknown layout {config.layout!r}; choose from {', '.join(layouts)}")
        if config.head_dim % 2:
            raise BadInput(f"--head-dim must be even (rotary pairs), got {config.head_dim}")
        if config.seq > config.context:
            raise BadInput(f"--seq {config.seq} exceeds the table length --context {config.context}")
    if args.regional is not None and "regional" not in config.modes:
        config = prof.apply_overrides(config, modes=(*config.modes, "regional"))
    if config.device == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"--device cuda asked for, but CUDA is not available to this torch ({torch.__version__})")
    return config


def _check_writable(path: Path, option: str) -> None:
    folder = path.resolve().parent
    if not folder.is_dir():
        raise BadInput(f"{option} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise BadInput(f"{option} {path}: folder {folder} is not writable")


def _run_with_progress(config: prof.ProfileConfig, timeout: float | None, console) -> dict[str, Any]:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(finished_text=" "), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        tasks = {mode: progress.add_task(f"{prof.mode_label(mode, config.inner)}: waiting", total=1, start=False)
                 for mode in config.modes}

        def on_start(mode: str) -> None:
            progress.start_task(tasks[mode])
            progress.update(tasks[mode], description=f"{prof.mode_label(mode, config.inner)}: running")

        def on_done(mode: str, result: dict) -> None:
            status = "[red]✗ failed[/] (reason below)" if "error" in result else "[green]✓[/] done"
            progress.update(tasks[mode], completed=1, description=f"{prof.mode_label(mode, config.inner)}: {status}")
            progress.stop_task(tasks[mode])

        return prof.run_profile(config, on_start, on_done, timeout)


def _print_profile(result: dict[str, Any], console) -> None:
    ok = {mode: r for mode, r in result["modes"].items() if "error" not in r}
    if not ok:
        return
    inner = result["config"]["inner"]
    console.print(_memory_table(ok, inner, cuda=result["config"]["device"] == "cuda"))
    console.print(_time_table(ok, inner, train=result["config"].get("train", False)))
    summary = result["summary"]
    if result["targets"]:
        console.print(_targets_table(result["targets"], summary, inner))
    for mode, r in ok.items():
        for error in r["pass_errors"] or ():
            console.print(f"WARNING {prof.mode_label(mode, inner)}: {error}", style="red", markup=False, highlight=False)
    if "peak_rss_steps_saved" in summary:
        saved = summary["peak_rss_steps_saved"]
        console.print(f"rope_dedup vs {inner} alone: RoPE storage {format_bytes(summary['rope_bytes_saved'])} less; "
                      f"peak RSS while running {format_bytes(abs(saved))} {'less' if saved >= 0 else 'more'}",
                      highlight=False)


def _table(title: str, columns: Sequence[str], caption: str | None = None):
    from rich import box
    from rich.table import Table

    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD)
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
    return table


def _memory_table(ok: dict[str, dict], inner: str, cuda: bool):
    ideal = next(iter(ok.values()))
    table = _table(f"Memory (unique storages; compiled modes use {inner})",
                   ("mode", "RoPE tensors→storages", "RoPE bytes", "÷ ideal", "buffers", "build peak",
                    "1st call +", "running peak", "process peak",
                    *(("CUDA alloc", "CUDA max running") if cuda else ()), "max |Δ| vs eager"),
                   caption=f"ideal, each distinct table stored once: {ideal['ideal_storages']} storage(s), "
                           f"{format_bytes(ideal['ideal_bytes'])}. Peaks are RSS. Build: while the model is built; "
                           f"1st call +: how far the first call (compile included) raised RSS above the built model; "
                           f"running: from the end of the first call to the last step; process: the whole child.")
    for mode, r in ok.items():
        table.add_row(prof.mode_label(mode, inner), f"{r['rope_tables']} → {r['rope_storages']}",
                      format_bytes(r["rope_bytes"]), f"{r['rope_bytes'] / r['ideal_bytes']:.2f}",
                      format_bytes(r["buffer_bytes"]), _bytes_or_dash(r["peak_rss_build"]),
                      _bytes_or_dash(prof.first_call_growth(r)), _bytes_or_dash(r["peak_rss_steps"]),
                      format_bytes(r["peak_rss_process"]),
                      *((format_bytes(r["cuda_allocated"]), format_bytes(r["cuda_max_allocated_steps"])) if cuda else ()),
                      f"{r['max_abs_err_vs_eager']:.1e}")
    return table


def _time_table(ok: dict[str, dict], inner: str, train: bool):
    step = "forward, backward and AdamW step" if train else "one forward under no_grad"
    table = _table("Time", ("mode", "first call s", "step ms", "fastest step ms", "pass s", "intern µs/call",
                            "calls/step", "intern ÷ step"),
                   caption=f"first call includes compiling; step: {step}, median; intern: the per-call storage "
                           f"check of the compiled callable (InterningCallable.intern_inputs)")
    for mode, r in ok.items():
        intern = r["intern_s_per_call"] is not None
        table.add_row(prof.mode_label(mode, inner), "-" if mode in prof.EAGER_MODES else f"{r['first_call_s']:.2f}",
                      f"{r['step_s'] * 1e3:.2f}", f"{r['step_s_min'] * 1e3:.2f}",
                      "-" if r["pass_s"] is None else f"{r['pass_s']:.3f}",
                      f"{r['intern_s_per_call'] * 1e6:.2f}" if intern else "-",
                      str(r["intern_calls_per_step"]) if intern else "-",
                      f"{r['intern_overhead']:.2%}" if intern else "-")
    return table


def _targets_table(targets: list[dict], summary: dict[str, Any], inner: str):
    table = _table(f"Ratios (rope_dedup over {inner} alone) and targets", ("", "measured", "target", ""))
    for t in targets:
        percent = t["limit"] < 1
        shown = f"{t['measured']:.2%}" if percent else f"{t['measured']:.2f}"
        limit = f"{t['comparison']} {t['limit']:.0%}" if percent else f"{t['comparison']} {t['limit']:.2f}"
        table.add_row(t["target"], shown, limit, "[green]met" if t["met"] else "[red]not met")
    if "step_ratio_min" in summary:
        table.add_row("step time rope_dedup / alone, fastest steps", f"{summary['step_ratio_min']:.2f}", "", "")
        table.add_row("first call (compile) rope_dedup / alone", f"{summary['first_call_ratio']:.2f}", "", "")
    return table


def _bytes_or_dash(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


# -- audit --------------------------------------------------------------------------------------------

def _audit(args: argparse.Namespace, console) -> int:
    from rope_dedup.audit.explain import explain
    from rope_dedup.audit.spec import SpecError, parse_spec

    try:
        expect = None if args.expect is None else "config" if args.expect == "config" else parse_spec(args.expect)
    except SpecError as error:
        raise BadInput(str(error)) from None
    with _bad_factory():
        factory = load_factory(args.factory)
    try:
        built = factory()
    except Exception as error:
        print(f"rope-dedup audit: error: {args.factory}() raised {prof.describe_error(error)[0]}", file=sys.stderr)
        return RUN_ERROR
    with _bad_factory():
        if args.static:
            model, inputs = model_of(built, args.factory), ()
        else:
            try:
                model, inputs = model_and_inputs(built, args.factory)
            except NoInputs as error:
                raise BadInput(f"{error}, or add --static to audit its tables without a forward") from None
    try:
        explanation = explain(model, *inputs, expect=expect)
    except SpecError as error:  # --expect config on a model whose config lacks a field
        raise BadInput(str(error)) from None
    except Exception as error:
        print(f"rope-dedup audit: error: the dry run failed: {prof.describe_error(error)[0]}", file=sys.stderr)
        return RUN_ERROR
    _print_explanation(explanation, console)
    return RUN_ERROR if explanation.mismatches else 0


@contextlib.contextmanager
def _bad_factory():
    """A factory that cannot be found, or gives no model and inputs, is bad input (exit 2)."""
    try:
        yield
    except FactoryError as error:
        raise BadInput(str(error)) from None


def _print_explanation(explanation, console) -> None:
    from rich.table import Table

    from rope_dedup.audit.check import MISMATCH_COLUMNS
    from rope_dedup.audit.explain import COLUMNS

    console.print(explanation.headline(), highlight=False)
    # A caption is the legend of the "*" mark: shown only under a table that marks a row. (The groups are
    # spelled out in the notes below either way.)
    owned = explanation.rows()
    if owned:
        table = Table(*COLUMNS, title="tables each layer holds", title_justify="left",
                      caption="* key differs from most layers; one group letter = identical content"
                      if _marks_a_row(owned) else None)
        _add_rows(table, owned)
        console.print(table)
    applied = explanation.applied_rows()
    if applied:
        caption = None
        if _marks_a_row(applied):
            caption = ("* differs from the expectation (mismatches below)" if explanation.judged
                       else "* differs from most layers")
        title = "what each held table encodes" if explanation.static else "tables each layer applies"
        table = Table(title=title, title_justify="left", caption=caption)
        for column in explanation.applied_columns():  # long sources and specs fold rather than end in "…"
            table.add_column(column, overflow="fold")
        _add_rows(table, applied)
        console.print(table)
    for line in explanation.notes():
        console.print(line, style="bold yellow" if line.startswith("* ") else None, markup=False, highlight=False)
    if explanation.mismatches:
        title = f"{len(explanation.mismatches)} mismatch(es)" + (" with the expectation" if explanation.judged else "")
        table = Table(*MISMATCH_COLUMNS, title=title, title_justify="left", title_style="bold red")
        for mismatch in explanation.mismatches:
            table.add_row(*mismatch.cells(), style="red")
        console.print(table)
    elif explanation.judged:
        console.print("every table holds the expected RoPE" if explanation.static
                      else "every layer applies the expected RoPE", style="green", highlight=False)


def _marks_a_row(rows: list[tuple[bool, tuple[str, ...]]]) -> bool:
    return any(flagged for flagged, _ in rows)


def _add_rows(table, rows: list[tuple[bool, tuple[str, ...]]]) -> None:
    for flagged, cells in rows:
        if cells[0] and table.row_count:  # a rule between layers
            table.add_section()
        table.add_row(*cells, style="bold yellow" if flagged else None)
