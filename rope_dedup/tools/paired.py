"""Step times of several models taken in turns in one process, and ratios that load cannot flip.

Two models timed in separate processes, one after the other, differ by whatever else the machine did
meanwhile and by each process's memory layout: on a shared 2-core machine one model's step moved by about
20% between processes. Here every model is called once per round, in turns (A B, then B A in the next
round), so a burst of load hits all of them alike, and a ratio is the median over rounds of one model's step
over the reference's step in the same round.

Turns do not cancel where a model landed in memory: two copies of one model, built apart, differ by 1% to 3%
in one process. So the reference is several copies built apart, the reference step of each round their mean,
and each copy read against the others (A/A controls) tells how far a model no different from the reference
may read from it (:func:`noise`).
"""

from __future__ import annotations

import math
import statistics
import time
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch


def own_code(*modules: torch.nn.Module) -> None:
    """Give ``modules`` (instances of one class) a class of their own whose ``forward`` has its own code object.

    Dynamo keeps compiled graphs per code object and tries them in order, so models sharing one would each
    check the others' guards first on every call: a cost of running several models in one process, not of
    any of them. A user's process runs one model."""
    cls = type(modules[0])
    if any(type(m) is not cls for m in modules):
        raise TypeError(f"own_code takes modules of one class; got {sorted({type(m).__name__ for m in modules})}")
    forward = cls.forward
    copy = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                              forward.__defaults__, forward.__closure__)
    own = type(cls.__name__, (cls,), {"forward": copy, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    for module in modules:
        module.__class__ = own


def cpu_timer(call: Callable[[], Any]) -> float:
    """Seconds one call takes, by ``perf_counter``."""
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def cuda_timer(call: Callable[[], Any]) -> float:
    """Seconds one call takes by CUDA events, synchronized before and after: a launch-bound call counts its
    host time too."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def take_turns(calls: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1,
               timer: Callable[[Callable[[], Any]], float] = cpu_timer) -> dict[str, list[float]]:
    """Each call's seconds per round: ``warmup`` untimed rounds, then ``rounds`` timed ones, every call once
    per round, in the given order in even rounds and reversed in odd ones."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(timer(calls[name]))
    return times


@dataclass(frozen=True)
class Paired:
    """One model's step over the reference's, from rounds in turns: the median of the per-round ratios and
    the 95% confidence interval of that median (distribution-free, from the order statistics)."""

    ratio: float
    low: float
    high: float
    rounds: int

    @classmethod
    def of(cls, times: list[float], reference: list[float]) -> Paired:
        ratios = sorted(t / r for t, r in zip(times, reference))
        n = len(ratios)
        half = 0.98 * math.sqrt(n)  # 1.96 standard deviations of a binomial(n, 1/2) rank, halved
        low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
        return cls(statistics.median(ratios), ratios[low], ratios[high], n)


def mean_per_round(series: list[list[float]]) -> list[float]:
    """The mean of several models' seconds in each round: the step of a reference made of copies."""
    return [statistics.fmean(round_) for round_ in zip(*series, strict=True)]


def leave_one_out(copies: dict[str, list[float]]) -> dict[str, Paired]:
    """Each copy of one model against the mean of the others, round by round: the A/A controls."""
    if len(copies) < 2:
        raise ValueError(f"A/A controls need at least 2 copies, got {len(copies)}")
    return {name: Paired.of(times, mean_per_round([t for other, t in copies.items() if other != name]))
            for name, times in copies.items()}


# Student's t, two-sided 99%, by degrees of freedom: the few copies a run builds. 99%, not 95%: a profile judges
# two or three ratios per run, and a verdict that flips in one run of ten would be read as a finding.
_T_995 = {2: 9.925, 3: 5.841, 4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355, 9: 3.250, 10: 3.169}
MIN_COPIES, MAX_COPIES = min(_T_995) + 1, max(_T_995) + 1


def check_copies(copies: int) -> int:
    """``copies`` if the noise can be read from that many copies of a reference, else a ValueError."""
    if not MIN_COPIES <= copies <= MAX_COPIES:
        raise ValueError(f"copies must be {MIN_COPIES} to {MAX_COPIES}, got {copies}")
    return copies


def noise(controls: list[float], copies: int) -> float:
    """Half-width around 1 of the 99% prediction interval of a ratio over the mean of ``copies`` copies, for one
    more model no different from them, from the A/A ``controls`` (each copy's ratio over the others' mean).

    A copy's placement moves its step by p (sd s, taken as normal). A control reads p_i less the others' mean:
    sd s * k / (k - 1), with k copies. A new model over all k copies' mean reads sd s * sqrt(1 + 1 / k)."""
    k = check_copies(copies)
    df = len(controls) - 1
    if df < 2:
        raise ValueError(f"the noise needs at least 3 A/A controls, got {len(controls)}")
    placement = statistics.stdev(controls) * (k - 1) / k
    # Past the table (regional and whole copies pooled), its last value: a slightly wider interval.
    return _T_995[min(df, max(_T_995))] * placement * math.sqrt(1 + 1 / k)


def verdict(ratio: float, limit: float, noise: float) -> str:
    """A ratio against an upper ``limit`` given the A/A ``noise``: ``not met`` only above ``limit + noise``, else
    ``met``. Within the noise of the limit a run on another minute of the machine could read either side of it, so
    a three-way verdict there would flip between identical runs."""
    return "not met" if ratio > limit + noise else "met"


def reading(ratio: float, noise: float) -> str:
    """A ratio against 1 (no cost) given the A/A ``noise``: ``within noise``, or slower or faster beyond it."""
    if abs(ratio - 1) <= noise:
        return "within noise"
    return "slower beyond the noise" if ratio > 1 else "faster beyond the noise"
