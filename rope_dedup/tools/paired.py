"""Step times of several models taken in turns in one process, and ratios that load cannot flip.

Two models timed in separate processes, one after the other, differ by whatever else the machine did
meanwhile and by each process's memory layout: on a shared 2-core machine one model's step moved by about
20% between processes. Here every model is called once per round, in turns (A B, then B A in the next
round), so a burst of load hits all of them alike, and a ratio is the median over rounds of one model's step
over the reference's step in the same round. A second copy of the reference (an A/A control) reads the
noise floor: how far a ratio strays from 1 when nothing differs.
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

    @property
    def spread(self) -> float:
        """How far from 1 this ratio may be read while nothing differs: for an A/A control, the noise floor."""
        return max(self.high - 1.0, 1.0 - self.low)  # the interval holds the median: its offset from 1 too


def verdict(ratio: float, limit: float, noise: float) -> str:
    """A ratio against an upper ``limit`` given the A/A ``noise``: ``met`` below ``limit - noise``, ``not met``
    above ``limit + noise``, else ``within noise``: a run on another minute of the machine could read either."""
    if ratio > limit + noise:
        return "not met"
    return "met" if ratio < limit - noise else "within noise"
