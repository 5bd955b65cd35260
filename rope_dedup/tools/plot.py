"""The profile's figure: RoPE storage and peak RSS by mode, with the ideal marked (needs matplotlib)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from rope_dedup.tools.profile import describe_config, mode_label


_BELOW = dict(loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2, frameon=False)  # clear of the bars


def plot_profile(result: dict[str, Any], path: Path) -> None:
    """Write a two-panel bar chart of ``result`` (what :func:`rope_dedup.tools.profile.run_profile` returns) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    config = result["config"]
    ok = {mode: r for mode, r in result["modes"].items() if "error" not in r}
    labels = [mode_label(mode, config["inner"]).replace(" ", "\n", 1) for mode in ok]
    mb = 1e6
    fig, (rope_ax, rss_ax) = plt.subplots(1, 2, figsize=(12, 5.2))

    rope = [r["rope_bytes"] / mb for r in ok.values()]
    bars = rope_ax.bar(labels, rope, color="#4C72B0")
    rope_ax.bar_label(bars, fmt="%.1f", padding=2)
    if ok:
        ideal = next(iter(ok.values()))["ideal_bytes"] / mb
        rope_ax.axhline(ideal, color="#C44E52", linestyle="--", label=f"ideal: each distinct table once ({ideal:.1f} MB)")
        rope_ax.legend(**_BELOW)
    rope_ax.set_title("RoPE tables (unique storages)")
    rope_ax.set_ylabel("MB")
    rope_ax.margins(y=0.15)

    width = 0.38
    xs = range(len(ok))
    process = [r["peak_rss_process"] / mb for r in ok.values()]
    steps = [(r["peak_rss_steps"] or 0) / mb for r in ok.values()]
    process_bars = rss_ax.bar([x - width / 2 for x in xs], process, width, color="#BBBBBB",
                              label="whole process (build included)")
    rss_ax.bar_label(process_bars, fmt="%.0f", padding=2, color="#777777")
    steps_bars = rss_ax.bar([x + width / 2 for x in xs], steps, width, color="#55A868", label="while running the model")
    rss_ax.bar_label(steps_bars, fmt="%.0f", padding=2)
    rss_ax.set_xticks(list(xs), labels)
    rss_ax.set_title("Peak RSS of the process")
    rss_ax.set_ylabel("MB")
    rss_ax.legend(**_BELOW)
    rss_ax.margins(y=0.15)

    fig.suptitle(textwrap.fill(describe_config(config), 130), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def plot_precision(explanation: Any, path: Path) -> None:
    """Write the angle error against position of ``explanation``'s tables (``explain(..., precision=True)``) to
    ``path``: one line per table and reference, tables of identical curves drawn once and named together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-10  # log scale: a bit-for-bit match is drawn on the floor, and the legend says so
    lines: dict[tuple, list[str]] = {}
    for table in explanation.precision:
        for label, distance, style in (("to reference", table.to_reference, "-"), ("to float64", table.to_float64, ":"),
                                       ("reference to float64", table.reference_to_float64, "--")):
            if distance is not None:
                lines.setdefault((label, style, distance.curve), []).append(table.source)
    fig, ax = plt.subplots(figsize=(10, 6.5))
    for (label, style, curve), sources in lines.items():
        positions = [position for position, _ in curve]
        errors = [max(error, floor) for _, error in curve]
        if label == "reference to float64":
            name = "reference to float64 (its own limit)"
            if any(n.startswith("reference to float64") for n in ax.get_legend_handles_labels()[1]):
                name = "_"  # once is enough: every reference is float32 in the same way
        else:
            shown = ", ".join(sources[:2]) + (f" (+{len(sources) - 2})" if len(sources) > 2 else "")
            name = f"{shown}: {label}" + (" (bit for bit: 0)" if max(e for _, e in curve) == 0 else "")
        ax.plot(positions, errors, style, label=textwrap.shorten(name, 90), color="#888888" if style == "--" else None)
    limit = explanation.max_angle_error
    if limit:
        ax.axhline(limit, color="#C44E52", linewidth=1, label=f"max angle error {limit:g} rad")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("position (largest error in each quarter octave of positions)")
    ax.set_ylabel("angle error (radians)")
    ax.set_title("RoPE angle error against position")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
