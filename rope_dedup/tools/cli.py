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

from rope_dedup.audit.precision import DEFAULT_MAX_ANGLE_ERROR
from rope_dedup.core.text import TEXT_WIDTH, Table
from rope_dedup.tools import profile as prof
from rope_dedup.tools.factories import FactoryError, NoInputs, load_factory, model_and_inputs, model_of
from rope_dedup.tools.paired import MAX_COPIES, MIN_COPIES, check_copies
from rope_dedup.tools.render import headline, markdown, print_table, profile_notes, profile_tables

USAGE_ERROR, RUN_ERROR = 2, 1
FORMATS = ("text", "json", "markdown")


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
        return _audit(args, console, error_console)
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
        "profile", help="memory by mode (each in a fresh process) and step time (models in turns in one process)",
        description="Profile MODULE:FACTORY's model (FACTORY() returns (model, example_inputs), as for audit), "
                    "or by default a toy decoder whose attention layers each own a RoPE table: torch.compile "
                    "with the inner backend alone, with rope_dedup, and in recompute mode (also eager, regional "
                    "compile, share(), sharing() with --modes), each mode's memory in a fresh process; then the "
                    "step time of every compiled mode against copies of the inner backend alone built apart (A/A "
                    "controls), called in turns in one process, and the static audit of the model. Toy options "
                    "override the preset.")
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
    p.add_argument("--steps", type=_positive_int, help="steps each memory process runs after its first call, at least")
    p.add_argument("--step-seconds", type=float, help="and stepping lasts at least this long (default 1)")
    p.add_argument("--rounds", type=_count,
                   help="rounds of the step-time comparison, every model called once per round (default 200; 0: "
                        "memory only, no step-time comparison)")
    p.add_argument("--copies", type=_copies,
                   help=f"copies of the inner backend alone, built apart, that step times read against; their "
                        f"spread is the noise ({MIN_COPIES} to {MAX_COPIES}, default 6)")
    p.add_argument("--seq", type=_positive_int, help="tokens per step")
    p.add_argument("--batch", type=_positive_int, help="sequences per step")
    p.add_argument("--threads", type=_positive_int, help="intra-op threads per child (default 1)")
    p.add_argument("--timeout", type=float, help="seconds allowed per mode")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON")
    _format_option(p)
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
    a.add_argument("--precision", action="store_true",
                   help="also judge how exactly each table is computed: its angle and value distance from the "
                        "reference implementation (transformers' float32 construction) and from float64 math; exit 1 "
                        "if a table diverges from its reference (with inputs: or inductor rotates unlike eager)")
    a.add_argument("--max-angle-error", type=_radians, metavar="RAD",
                   help=f"with --precision: an angle difference from the reference that is never a finding "
                        f"(default {DEFAULT_MAX_ANGLE_ERROR:g}: below a cos/sin table rounded to fp16, 2.4e-4, far "
                        f"above two correct float32 builds, 2e-7; docs/audit.md says why)")
    a.add_argument("--plot", type=Path, metavar="PATH.png",
                   help="with --precision: write the angle error against position, one line per table and reference")
    _format_option(a)
    return parser


def _format_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--format", choices=FORMATS, default="text",
                         help="text: tables for the terminal (default); json: every figure on stdout, for CI; "
                              "markdown: tables for a PR comment")


def _radians(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of radians, got {text}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of radians >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive integer, got {text}")
    return value


def _copies(text: str) -> int:
    try:
        return check_copies(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {MIN_COPIES} to {MAX_COPIES}, got {text}") from None


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
    # Piped or redirected output (a CI log) gets rich's 80 columns unless told otherwise; tables split to fit.
    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else TEXT_WIDTH
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
    described = prof.describe_config(asdict(config))
    if args.format == "text":
        console.print(described, style="dim")
    result = _run_with_progress(config, args.timeout, error_console)
    result["targets"] = [dict(zip(("key", "target", "measured", "limit", "comparison", "verdict"), row))
                         for row in prof.check_targets(result["summary"])]
    if args.format == "json":  # stdout is the JSON alone; what else is said goes to stderr
        print(json.dumps(result, indent=2))
        console = error_console
    elif args.format == "markdown":
        _print_markdown([described, "", *(f"**{line}**  " for line in headline(result)), ""], profile_tables(result),
                        profile_notes(result))
    else:
        _print_profile(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        from rope_dedup.tools.plot import plot_profile

        plot_profile(result, args.plot)
        console.print(f"wrote {args.plot}")
    failed = [(_progress_label(mode, config.inner), r["error"]) for mode, r in
              [*result["modes"].items(), (prof.TURNS, result.get("turns") or {})] if "error" in r]
    for label, error in failed:
        print(f"rope-dedup profile: error: {label}: {error}", file=sys.stderr)
    return RUN_ERROR if failed else 0


_TOY_OPTIONS = ("preset", "layers", "context", "head_dim", "heads", "dtype", "layout", "pattern", "seq", "batch")


def _profile_config(args: argparse.Namespace) -> prof.ProfileConfig:
    common = dict(device=args.device, inner=args.inner, modes=args.modes, steps=args.steps,
                  step_seconds=args.step_seconds, rounds=args.rounds, copies=args.copies, threads=args.threads,
                  regional=args.regional, train=args.train or None)
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
        shown = [*config.modes, *([prof.TURNS] if prof.timed_modes(config) else [])]
        tasks = {mode: progress.add_task(f"{_progress_label(mode, config.inner)}: waiting", total=1, start=False)
                 for mode in shown}

        def on_start(mode: str) -> None:
            progress.start_task(tasks[mode])
            progress.update(tasks[mode], description=f"{_progress_label(mode, config.inner)}: running")

        def on_done(mode: str, result: dict) -> None:
            status = "[red]✗ failed[/] (reason below)" if "error" in result else "[green]✓[/] done"
            progress.update(tasks[mode], completed=1, description=f"{_progress_label(mode, config.inner)}: {status}")
            progress.stop_task(tasks[mode])

        return prof.run_profile(config, on_start, on_done, timeout)


def _progress_label(mode: str, inner: str) -> str:
    return "step time, in turns" if mode == prof.TURNS else prof.mode_label(mode, inner)


def _print_profile(result: dict[str, Any], console) -> None:
    for line in headline(result):
        console.print(line, style="bold", markup=False, highlight=False)
    console.print()
    for table in profile_tables(result):
        print_table(console, table, flag_style="red", boxed=False)
    for line in profile_notes(result):
        console.print(line, style="red" if line.startswith("WARNING") else None, markup=False, highlight=False)


def _print_markdown(head: list[str], tables: list[Table], notes: list[str]) -> None:
    """Tables as markdown, then the notes in a fenced block (their indents carry meaning)."""
    lines = list(head)
    for table in tables:
        lines += markdown(table)
    if notes:
        lines += ["```text", *notes, "```"]
    print("\n".join(lines).rstrip("\n"))


# -- audit --------------------------------------------------------------------------------------------

def _audit(args: argparse.Namespace, console, error_console) -> int:
    from rope_dedup.audit.explain import explain
    from rope_dedup.audit.spec import SpecError, parse_spec

    try:
        expect = None if args.expect is None else "config" if args.expect == "config" else parse_spec(args.expect)
    except SpecError as error:
        raise BadInput(str(error)) from None
    for option, given in (("--max-angle-error", args.max_angle_error is not None), ("--plot", args.plot is not None)):
        if given and not args.precision:
            raise BadInput(f"{option} goes with --precision")
    if args.plot is not None:
        _check_writable(args.plot, "--plot")
        try:
            import matplotlib  # noqa: F401  (checked before the audit runs, used after)
        except ImportError:
            raise BadInput("--plot needs matplotlib: pip install 'rope-dedup[demo]'") from None
    limit = DEFAULT_MAX_ANGLE_ERROR if args.max_angle_error is None else args.max_angle_error
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
        explanation = explain(model, *inputs, expect=expect, precision=args.precision, max_angle_error=limit)
    except SpecError as error:  # --expect config on a model whose config lacks a field
        raise BadInput(str(error)) from None
    except Exception as error:
        print(f"rope-dedup audit: error: the dry run failed: {prof.describe_error(error)[0]}", file=sys.stderr)
        return RUN_ERROR
    if args.format == "json":
        print(json.dumps(explanation.to_dict(), indent=2))
    elif args.format == "markdown":
        tables = [*explanation.tables(), *filter(None, [explanation.mismatch_table()])]
        notes = explanation.notes() + ([_all_expected(explanation)] if explanation.judged and not explanation.mismatches
                                       else [])
        _print_markdown([explanation.headline(), ""], tables, notes)
    else:
        _print_explanation(explanation, console)
    if args.plot is not None:
        from rope_dedup.tools.plot import plot_precision

        plot_precision(explanation, args.plot)
        (console if args.format == "text" else error_console).print(f"wrote {args.plot}")
    return RUN_ERROR if explanation.mismatches else 0


@contextlib.contextmanager
def _bad_factory():
    """A factory that cannot be found, or gives no model and inputs, is bad input (exit 2)."""
    try:
        yield
    except FactoryError as error:
        raise BadInput(str(error)) from None


def _print_explanation(explanation, console) -> None:
    console.print(explanation.headline(), highlight=False)
    for table in explanation.tables():
        print_table(console, table)
    for line in explanation.notes():
        console.print(line, style="bold yellow" if line.startswith("* ") else None, markup=False, highlight=False)
    mismatches = explanation.mismatch_table()
    if mismatches is not None:
        print_table(console, mismatches, flag_style="red")
    elif explanation.judged:
        console.print(_all_expected(explanation), style="green", highlight=False)


def _all_expected(explanation) -> str:
    return "every table holds the expected RoPE" if explanation.static else "every layer applies the expected RoPE"
