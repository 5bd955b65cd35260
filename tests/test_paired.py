"""rope_dedup.tools.paired: models taken in turns, the paired ratio and its interval, A/A controls and their noise,
the verdict, own code."""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from rope_dedup.testing import toy_decoder as toy
from rope_dedup.tools.paired import (MAX_COPIES, MIN_COPIES, Paired, leave_one_out, mean_per_round, noise, own_code,
                                     reading, take_turns, verdict)


def test_models_take_turns_and_swap_order_every_round() -> None:
    order: list[str] = []
    calls = {name: (lambda name=name: order.append(name)) for name in "ABC"}
    times = take_turns(calls, rounds=3, warmup=1, timer=lambda call: call() or 1.0)
    assert order == list("ABC" "ABC" "CBA" "ABC")  # the warm-up round, then rounds 0, 1, 2
    assert times == {name: [1.0, 1.0, 1.0] for name in "ABC"}
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        take_turns(calls, rounds=0)


def test_the_ratio_is_the_median_of_per_round_ratios_with_its_interval() -> None:
    reference = [1.0] * 101
    slowed = [1.0 + k / 1000 for k in range(101)]  # per-round ratios 1.000 ... 1.100
    got = Paired.of(slowed, reference)
    assert got.ratio == pytest.approx(statistics.median(slowed)) and got.rounds == 101
    # The 95% interval of a median of 101 from its order statistics: ranks 40 to 60 (0-based).
    assert (got.low, got.high) == (pytest.approx(1.040), pytest.approx(1.060))
    # A load burst that slows one round of both models leaves the ratio alone.
    burst = Paired.of([t * (5 if i == 7 else 1) for i, t in enumerate(slowed)],
                      [t * (5 if i == 7 else 1) for i, t in enumerate(reference)])
    assert burst == got


def test_each_copy_reads_against_the_mean_of_the_others() -> None:
    assert mean_per_round([[1.0, 2.0], [3.0, 4.0]]) == [2.0, 3.0]
    with pytest.raises(ValueError):
        mean_per_round([[1.0, 2.0], [3.0]])  # a round missing for one model is a bug, not a shorter mean
    rounds = 9
    copies = {"a": [1.0] * rounds, "b": [1.0] * rounds, "c": [1.06] * rounds}
    controls = leave_one_out(copies)
    assert controls["c"].ratio == pytest.approx(1.06)
    assert controls["a"].ratio == pytest.approx(1 / 1.03)
    with pytest.raises(ValueError, match="at least 2 copies"):
        leave_one_out({"a": [1.0]})


def test_the_noise_holds_99_percent_of_ratios_of_a_model_no_different() -> None:
    """Copies and a candidate whose placement moves their step (sd 2%, plus round jitter): a candidate no different
    from the copies reads beyond the noise in about 1% of runs, whatever the copies' number."""
    rng = random.Random(0)
    for copies in (MIN_COPIES, 5, MAX_COPIES):
        beyond, runs = 0, 3000
        for _ in range(runs):
            def model() -> list[float]:
                placement = rng.gauss(1.0, 0.02)
                return [placement * rng.gauss(1.0, 0.002) for _ in range(5)]
            times = {str(i): model() for i in range(copies)}
            controls = [p.ratio for p in leave_one_out(times).values()]
            ratio = Paired.of(model(), mean_per_round(list(times.values()))).ratio
            beyond += abs(ratio - 1) > noise(controls, copies)
        assert 0.003 < beyond / runs < 0.025, (copies, beyond / runs)


def test_the_noise_needs_enough_copies() -> None:
    with pytest.raises(ValueError, match=f"copies must be {MIN_COPIES} to {MAX_COPIES}"):
        noise([1.0, 1.01, 0.99], MIN_COPIES - 1)
    with pytest.raises(ValueError, match="at least 3 A/A controls"):
        noise([1.0, 1.01], MIN_COPIES)


@pytest.mark.parametrize("ratio, expected", [(1.00, "met"), (1.019, "met"), (0.97, "met"), (1.021, "not met")])
def test_a_target_fails_only_beyond_its_limit_plus_the_noise(ratio: float, expected: str) -> None:
    assert verdict(ratio, 1.0, 0.02) == expected


@pytest.mark.parametrize("ratio, expected", [(1.00, "within noise"), (1.019, "within noise"), (0.981, "within noise"),
                                             (1.021, "slower beyond the noise"), (0.979, "faster beyond the noise")])
def test_a_ratio_reads_against_one_and_the_noise(ratio: float, expected: str) -> None:
    assert reading(ratio, 0.02) == expected


def test_own_code_gives_each_model_its_own_compiled_entries() -> None:
    torch._dynamo.reset()
    first, second = (toy.ToyDecoder(toy.homogeneous(1, max_len=16), d_model=8, heads=1).eval() for _ in range(2))
    shared_forward = type(first).forward
    own_code(first)
    own_code(second)
    assert type(first).forward.__code__ is not type(second).forward.__code__
    assert isinstance(first, toy.ToyDecoder) and type(first).__name__ == "ToyDecoder"
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad():
        for model in (first, second):
            torch.compile(model, backend="eager")(tokens)
    for model in (first, second):
        assert len(_debug_get_cache_entry_list(type(model).forward.__code__)) == 1
    assert not _debug_get_cache_entry_list(shared_forward.__code__)
    with pytest.raises(TypeError, match="modules of one class"):
        own_code(first, first.layers[0])
