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

