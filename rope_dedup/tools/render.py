"""How the command line shows a :class:`~rope_dedup.core.text.Table`: with rich, fitted to the terminal, or
as markdown for a PR comment; and the profile's figures as such tables.

A table wider than the terminal is split into parts that each repeat its first column (the mode, the
layer), rather than letting rich squeeze columns until headers and cells end in "…". rich is imported
only when a table is printed with it (it comes with the ``demo`` extra).
"""

from __future__ import annotations

from typing import Any

from rope_dedup.core.text import Row, Table, format_bytes, split_columns
from rope_dedup.tools import profile as prof
from rope_dedup.tools.paired import reading


def print_table(console: Any, table: Table, flag_style: str = "bold yellow", boxed: bool = True) -> None:
    """Print ``table`` on a rich ``console`` within its width: split into parts if it must be, a cell wider
    than the room left folding onto further lines (never cut), the caption under the last part. Flagged rows
    take ``flag_style``; ``boxed=False``: a lighter frame and numbers aligned right, for figures."""
    from rich import box
    from rich.measure import Measurement

    def part(columns: list[int], title: str) -> Any:
        from rich.table import Table as RichTable

        shown = RichTable(title=title, title_justify="left", box=box.HEAVY_HEAD if boxed else box.SIMPLE_HEAD)
        for i in columns:
            shown.add_column(table.columns[i], justify="left" if i == 0 or boxed else "right", overflow="fold")
        for row in table.rows:
            if row.section and boxed and shown.row_count:
                shown.add_section()
            shown.add_row(*(row.cells[i] for i in columns), style=flag_style if row.flagged else None)
        return shown

    unbounded = console.options.update(width=1 << 16)  # measured against the console's width, rich clamps to it

    def fits(columns: list[int]) -> bool:
        return Measurement.get(console, unbounded, part(columns, table.title)).maximum <= console.width

    for n, columns in enumerate(split_columns(len(table.columns), fits)):
        console.print(part(columns, table.title if n == 0 else f"{table.title} (continued)"))
    if table.caption:  # under the last part, as wide as the console rather than that part
        console.print(table.caption, style="italic", markup=False, highlight=False)


def markdown(table: Table) -> list[str]:
    """``table`` as a GitHub-flavoured markdown table, titled, with its caption under it."""
    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") or " " for cell in cells) + " |"

    lines = [f"**{table.title}**", "", line(table.columns), "| " + " | ".join("---" for _ in table.columns) + " |"]
    lines += [line(row.cells) for row in table.rows]
    return lines + ([""] + [table.caption] if table.caption else []) + [""]


# -- the profile's figures as tables -----------------------------------------------------------------------

def profile_tables(result: dict[str, Any]) -> list[Table]:
    """The tables ``rope-dedup profile`` prints for a result (:func:`~rope_dedup.tools.profile.run_profile`'s,
    with ``targets``): RoPE storage, peak memory, time, and the targets when rope_dedup ran beside its inner
    backend. Headers are short; each caption spells them out."""
    ok = {mode: r for mode, r in result["modes"].items() if "error" not in r}
    config = result["config"]
    inner, cuda, train = config["inner"], config["device"] == "cuda", config.get("train", False)
    tables = [_storage_table(ok, inner), _peaks_table(ok, inner, cuda), _time_table(ok, inner, train)] if ok else []
    turns = result.get("turns")
    if turns is not None and "error" not in turns:
        tables.append(_turns_table(turns, inner, train))
    if result["targets"]:
        tables.append(_targets_table(result["targets"], result["summary"], inner))
    return tables


def headline(result: dict[str, Any]) -> list[str]:
    """The few lines the profile opens with: RoPE bytes as built, shared and recomputed; the step-time ratios
    with their noise; the audit's verdict. Each only where the run measured it."""
    ok = {mode: r for mode, r in result["modes"].items() if "error" not in r}
    inner, summary = result["config"]["inner"], result["summary"]
    lines = []
    if ok:
        first = next(iter(ok.values()))
        parts = [f"RoPE tables: {first['rope_tables']} as built, {format_bytes(first['rope_bytes_before'])}"]
        for mode in ("rope_dedup", "regional", "share", "sharing"):
            if mode in ok:
                r = ok[mode]
                ideal = " (the ideal: each distinct table once)" if r["rope_bytes"] == r["ideal_bytes"] else ""
                parts.append(f"shared by {prof.mode_label(mode, inner)}: {r['rope_storages']} storage(s), "
                             f"{format_bytes(r['rope_bytes'])}{ideal}")
                break
        if "recompute" in ok:
            parts.append(f"recompute mode: {format_bytes(ok['recompute']['rope_bytes'])}")
        lines.append("; ".join(parts))
    if "step_noise" in summary:
        # Against 1 (no cost), not each target's limit: the headline says whether a cost shows beyond the noise.
        ratios = [f"{label} {summary[key]:.3f}: {reading(summary[key], summary['step_noise'])}"
                  for key, label in (("step_ratio", f"rope_dedup / {inner} alone"), ("regional_step_ratio", "regional"),
                                     ("recompute_step_ratio", f"recompute / {inner} alone")) if key in summary]
        controls = summary["step_controls"]
        lines.append(f"Step time, in turns in one process: {'; '.join(ratios)} (noise ±{summary['step_noise']:.1%}: "
                     f"{len(controls)} copies of {inner} alone built apart read {min(controls):.3f} to "
                     f"{max(controls):.3f} against each other)")
    audit = (result.get("turns") or {}).get("audit")
    if audit is not None:
        lines.append(_audit_line(audit))
    return lines


def _audit_line(audit: dict[str, Any]) -> str:
    against = f" against {audit['expected']}" if audit.get("expected") else ""
    if "error" in audit:
        return f"Audit (static{against}): could not run: {audit['error']}"
    found = (f"{audit['mismatches']} mismatch(es), first {audit['first_mismatch']}" if audit["mismatches"]
             else "every table holds the expected RoPE" if against else "no unfilled RoPE slot")
    return f"Audit (static{against}): {audit['tables']} table(s) in {audit['layers_with_tables']} layer(s): {found}"


def profile_notes(result: dict[str, Any]) -> list[str]:
    """The lines after the profile's tables: pass errors (each starts with ``WARNING``), then the saving."""
    inner, summary = result["config"]["inner"], result["summary"]
    lines = [f"WARNING {prof.mode_label(mode, inner)}: {error}" for mode, r in result["modes"].items()
             if "error" not in r for error in r["pass_errors"] or ()]
    if "peak_rss_steps_saved" in summary:
        saved = summary["peak_rss_steps_saved"]
        lines.append(f"rope_dedup vs {inner} alone: RoPE storage {format_bytes(summary['rope_bytes_saved'])} less; "
                     f"peak RSS while running {format_bytes(abs(saved))} {'less' if saved >= 0 else 'more'}")
    return lines


def _storage_table(ok: dict[str, dict], inner: str) -> Table:
    first = next(iter(ok.values()))
    rows = tuple(Row((prof.mode_label(mode, inner), f"{r['rope_tables']} → {r['rope_storages']}",
                      format_bytes(r["rope_bytes"]), f"{r['rope_bytes'] / r['ideal_bytes']:.2f}",
                      format_bytes(r["buffer_bytes"]), f"{r['max_abs_err_vs_eager']:.1e}")) for mode, r in ok.items())
    return Table(f"RoPE storage (unique storages; compiled modes use {inner})",
                 ("mode", "tensors → storages", "RoPE", "÷ ideal", "buffers", "max |Δ|"), rows,
                 f"ideal, each distinct table stored once: {first['ideal_storages']} storage(s), "
                 f"{format_bytes(first['ideal_bytes'])}. RoPE: bytes of the RoPE tables' storages; ÷ ideal: "
                 f"over the ideal; buffers: every buffer and tensor attribute; max |Δ|: largest difference from "
                 f"eager's output (training: the first step's loss).")


def _peaks_table(ok: dict[str, dict], inner: str, cuda: bool) -> Table:
    rows = tuple(Row((prof.mode_label(mode, inner), _bytes_or_dash(r["peak_rss_build"]),
                      _bytes_or_dash(prof.first_call_growth(r)), _bytes_or_dash(r["peak_rss_steps"]),
                      format_bytes(r["peak_rss_process"]),
                      *((format_bytes(r["cuda_allocated"]), format_bytes(r["cuda_max_allocated_steps"]))
                        if cuda else ()))) for mode, r in ok.items())
    cuda_legend = ("; CUDA: allocated after the last step; CUDA max: most allocated while running" if cuda else "")
    return Table("Peak memory (RSS" + (", CUDA allocator)" if cuda else ")"),
                 ("mode", "build", "1st call +", "running", "process", *(("CUDA", "CUDA max") if cuda else ())),
                 rows,
                 f"build: while the model is built; 1st call +: how far the first call (compile included) raised "
                 f"RSS above the built model; running: from the end of the first call to the last step; process: "
                 f"the whole child{cuda_legend}.")


def _time_table(ok: dict[str, dict], inner: str, train: bool) -> Table:
    rows = []
    for mode, r in ok.items():
        intern = r["intern_s_per_call"] is not None
        rows.append(Row((prof.mode_label(mode, inner), "-" if mode in prof.EAGER_MODES else f"{r['first_call_s']:.2f}",
                         "-" if r["pass_s"] is None else f"{r['pass_s']:.3f}",
                         f"{r['intern_s_per_call'] * 1e6:.2f}" if intern else "-",
                         str(r["intern_calls_per_step"]) if intern else "-",
                         f"{r['intern_overhead']:.2%}" if intern else "-")))
    step = "forward, backward and AdamW step" if train else "forward"
    return Table("Compile and interning (each mode in its own process)",
                 ("mode", "1st call s", "pass s", "intern µs", "calls", "÷ step"), tuple(rows),
                 f"1st call: compiling included; pass: rope_dedup's passes and graph copy (share mode: the share() "
                 f"call); intern: what rope_dedup's wrapper of a compiled graph adds to a call (its looks at the "
                 f"RoPE inputs, on their schedule), per call; calls: graph calls per {step}; ÷ step: interning's "
                 f"share of that process's median step.")


def _turns_table(turns: dict[str, Any], inner: str, train: bool) -> Table:
    step = "forward, backward and AdamW step" if train else "forward under no_grad"
    rows = []
    for name, seconds in turns["step_s"].items():
        paired = turns["paired"].get(name)
        rows.append(Row((prof.turns_label(name, inner), f"{seconds * 1e3:.3f}",
                         f"{paired['ratio']:.3f}" if paired else "-",
                         f"{paired['low']:.3f} to {paired['high']:.3f}" if paired else "-",
                         prof.turns_label(turns["reference"][name], inner) if paired else "-")))
    return Table(f"Step time, models in turns in one process ({turns['rounds']} rounds)",
                 ("model", "step ms", "÷ ref", "95% range", "ref"), tuple(rows),
                 f"step: one {step}, median over rounds, every model called once per round (A B, then B A); "
                 f"÷ ref: the median of per-round ratios over the reference (ref) of the same round; 95% range: "
                 f"that median's confidence interval. The reference is {turns['copies']} copies of the {inner} "
                 f"model, each built apart, the reference step of each round their mean; each copy against the "
                 f"others' mean is an A/A control. From the controls, ±{turns['noise']:.1%} here holds 99% of the "
                 f"ratios a model no different from {inner} alone would read: the noise a step-time target is "
                 f"judged against.")


def _targets_table(targets: list[dict], summary: dict[str, Any], inner: str) -> Table:
    rows = []
    for t in targets:
        percent, nbytes = t["limit"] < 1, t["key"].endswith("_bytes")
        shown = (f"{t['measured']:.2%}" if percent else format_bytes(t["measured"]) if nbytes
                 else f"{t['measured']:.3f}" if t["key"] in prof.STEP_TARGETS else f"{t['measured']:.2f}")
        limit = (f"{t['comparison']} {t['limit']:.0%}" if percent else f"{t['comparison']} {format_bytes(t['limit'])}"
                 if nbytes else f"{t['comparison']} {t['limit']:.2f}")
        shown_verdict = t["verdict"] + (f" ±{summary['step_noise']:.1%}" if t["key"] in prof.STEP_TARGETS else "")
        rows.append(Row((t["target"], shown, limit, shown_verdict), flagged=t["verdict"] == "not met"))
    if "first_call_ratio" in summary:
        rows.append(Row(("first call rope_dedup / alone", f"{summary['first_call_ratio']:.2f}", "", "")))
    return Table(f"Ratios (rope_dedup over {inner} alone) and targets", ("ratio", "measured", "target", ""),
                 tuple(rows), "A step-time target (± its A/A noise) is met unless its ratio exceeds the limit by more "
                              "than the noise: within it, a run on another minute of the machine could read either "
                              "side of the limit.")


def _bytes_or_dash(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)
