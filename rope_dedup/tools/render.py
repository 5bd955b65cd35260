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
    if not ok:
        return []
    config = result["config"]
    inner, cuda = config["inner"], config["device"] == "cuda"
    tables = [_storage_table(ok, inner), _peaks_table(ok, inner, cuda), _time_table(ok, inner, config.get("train", False))]
    if result["targets"]:
        tables.append(_targets_table(result["targets"], result["summary"], inner))
    return tables


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
    step = "forward, backward and AdamW step" if train else "one forward under no_grad"
    rows = []
    for mode, r in ok.items():
        intern = r["intern_s_per_call"] is not None
        rows.append(Row((prof.mode_label(mode, inner), "-" if mode in prof.EAGER_MODES else f"{r['first_call_s']:.2f}",
                         f"{r['step_s'] * 1e3:.2f}", f"{r['step_s_min'] * 1e3:.2f}",
                         "-" if r["pass_s"] is None else f"{r['pass_s']:.3f}",
                         f"{r['intern_s_per_call'] * 1e6:.2f}" if intern else "-",
                         str(r["intern_calls_per_step"]) if intern else "-",
                         f"{r['intern_overhead']:.2%}" if intern else "-")))
    return Table("Time", ("mode", "1st call s", "step ms", "min ms", "pass s", "intern µs", "calls", "÷ step"),
                 tuple(rows),
                 f"1st call: compiling included; step: {step}, median; min: the fastest step; pass: rope_dedup's "
                 f"passes and graph copy (share mode: the share() call); intern: what rope_dedup's wrapper of a "
                 f"compiled graph adds to a call (its looks at the RoPE inputs, on their schedule), per call; "
                 f"calls: graph calls per step; ÷ step: interning's share of the step.")


def _targets_table(targets: list[dict], summary: dict[str, Any], inner: str) -> Table:
    rows = []
    for t in targets:
        percent = t["limit"] < 1
        shown = f"{t['measured']:.2%}" if percent else f"{t['measured']:.2f}"
        limit = f"{t['comparison']} {t['limit']:.0%}" if percent else f"{t['comparison']} {t['limit']:.2f}"
        rows.append(Row((t["target"], shown, limit, "met" if t["met"] else "not met"), flagged=not t["met"]))
    if "step_ratio_min" in summary:
        rows.append(Row(("step time rope_dedup / alone, fastest steps", f"{summary['step_ratio_min']:.2f}", "", "")))
        rows.append(Row(("first call (compile) rope_dedup / alone", f"{summary['first_call_ratio']:.2f}", "", "")))
    return Table(f"Ratios (rope_dedup over {inner} alone) and targets", ("ratio", "measured", "target", ""),
                 tuple(rows))


def _bytes_or_dash(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)
