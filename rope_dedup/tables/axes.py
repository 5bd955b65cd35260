"""Tables over several position axes: 2-D axial vision RoPE (height, width) and M-RoPE (time, height, width).

Each column of such a table rotates by the position on one axis: a token's row is, for Qwen-VL's vision
tower, ``cat(f * pos_h, f * pos_w)``, and each model picks its own column order (Pixtral alternates the
frequencies, SAM pairs them, M-RoPE cuts ``mrope_section`` blocks). Given the tokens' positions on each
axis, :func:`split_axes` finds the axis of each column (the one whose position its values are a
function of) and rebuilds the table a 1-D sequence would get: row ``p`` holds every column at position
``p`` of its own axis. That table is recognized, keyed and judged like any other; the axes go in its key.
"""

from __future__ import annotations

import itertools

import torch

# Axis names by number of axes: M-RoPE's time/height/width, a vision tower's height/width.
_NAMES = {2: "hw", 3: "thw"}


def axis_positions(ids: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``ids`` as int64 (axes, rows) when it holds 2 to 4 positions per row, on its first dim (M-RoPE's
    (3, batch, seq)) or its last (a vision tower's (patches, 2)); None otherwise."""
    for axes in (2, 3, 4):
        if ids.numel() != axes * rows:
            continue
        if ids.shape[0] == axes and ids.dim() >= 2:
            return ids.reshape(axes, rows).to(torch.int64)
        if ids.shape[-1] == axes and ids.dim() >= 2:
            return ids.reshape(rows, axes).t().to(torch.int64)
    return None


def split_axes(rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple[int | None, ...], int] | None:
    """(the table a 1-D sequence gets at positions p..p+K-1, the axis of each column: None where the positions
    cannot tell, p) for (tokens, width) ``rows`` whose tokens sit at (axes, tokens) ``positions``; p is 0 unless
    an axis starts later (Muse's vision tower counts from 1). None when the positions do not explain the rows (a
    column that depends on no axis alone), tell the axes apart nowhere (text-only M-RoPE: a 1-D table), or
    cover fewer than 2 positions on every axis used."""
    if rows.dim() != 2 or positions.shape[1] != rows.shape[0]:
        return None
    positions = positions.to(rows.device)
    firsts, fits = [], []
    for axis in positions:
        values, inverse = torch.unique(axis, return_inverse=True)
        first = torch.full((values.numel(),), axis.numel(), dtype=torch.int64, device=axis.device)
        first.scatter_reduce_(0, inverse, torch.arange(axis.numel(), device=axis.device), reduce="amin")
        firsts.append(dict(zip(values.tolist(), first.tolist())))
        fits.append((rows[first[inverse]] == rows).all(dim=0))  # columns that are a function of this axis
    fit = torch.stack(fits)  # (axes, width)
    if bool(fit.all()) or not bool(fit.any(dim=0).all()):
        return None  # positions that tell the axes apart nowhere, or a column no axis explains alone
    # An axis with more distinct positions fits whatever a coarser one fits (HunYuan's first axis is the
    # token index itself): each column belongs to the coarsest axis that fits it, unknown (None) on a tie.
    # A constant column (an unrotated pair) fits every axis and belongs to none.
    distinct = [len(f) for f in firsts]
    constant = (rows == rows[:1]).all(dim=0)
    of_column: list[int | None] = []
    source = []
    for c in range(rows.shape[1]):
        fitting = fit[:, c].nonzero().flatten().tolist()
        coarsest = [a for a in fitting if distinct[a] == min(distinct[b] for b in fitting)]
        of_column.append(coarsest[0] if len(coarsest) == 1 and not bool(constant[c]) else None)
        source.append(coarsest[0])  # any axis that fits rebuilds the column's values alike
    used = sorted(set(source))
    start = max(min(firsts[a]) for a in used)
    end = next(p for p in itertools.count(start) if any(p not in firsts[a] for a in used))
    if end - start < 2:
        return None
    index = torch.tensor([[firsts[a][p] for a in source] for p in range(start, end)], dtype=torch.int64,
                         device=rows.device)
    return rows.gather(0, index), tuple(of_column), start


def axes_label(of_column: tuple[int | None, ...], count: int) -> str:
    """The axes of a table's columns, in order, as a key shows them: ``h8,w8`` (Qwen-VL's vision tower),
    ``t16,h24,w24`` (M-RoPE's sections), ``h,w alternating`` (Pixtral, SAM pairs, interleaved M-RoPE); more
    axes are numbered (``0:32,1:30``), and ``*`` marks columns whose axis the positions could not tell."""
    names = _NAMES.get(count) or [f"{i}:" for i in range(count)]
    runs: list[tuple[str, int]] = []
    for axis in of_column:
        name = "*" if axis is None else names[axis]
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + 1)
        else:
            runs.append((name, 1))
    if len(runs) <= 2 * count:
        return ",".join(f"{name}{n}" for name, n in runs)
    return ",".join(dict.fromkeys(name for name, _ in runs)) + " alternating"
