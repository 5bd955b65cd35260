"""rope_dedup.tools.paired: models taken in turns, the paired ratio and its interval, the verdict, own code."""

from __future__ import annotations

import statistics

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from rope_dedup.testing import toy_decoder as toy
from rope_dedup.tools.paired import Paired, own_code, take_turns, verdict


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
    assert Paired(1.0, 0.99, 1.02, 10).spread == pytest.approx(0.02)
    assert Paired(0.98, 0.97, 0.995, 10).spread == pytest.approx(0.03)


@pytest.mark.parametrize("ratio, expected", [(1.00, "within noise"), (1.019, "within noise"), (0.981, "within noise"),
                                             (1.03, "not met"), (0.97, "met")])
def test_verdict_against_the_control_spread(ratio: float, expected: str) -> None:
    assert verdict(ratio, 1.0, 0.02) == expected


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
