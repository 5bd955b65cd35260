"""rope_dedup.tools.profile pieces that need no child process: the ideal, error lines, targets."""

from __future__ import annotations

import signal
import sys

import pytest
import torch

from rope_dedup.tools import profile as prof
from rope_dedup.testing import toy_decoder


def test_ideal_is_one_storage_per_distinct_table_from_content() -> None:
    config = prof.ProfileConfig(layers=6, context=32, head_dim=16, pattern="local_global", modes=())
    tables = [t for _, t in toy_decoder.rope_tensors(prof.build_model(config))]
    count, nbytes = prof.ideal_storage(tables)
    assert count == 4  # cos and sin, for theta 1e4 and 1e6
    assert nbytes == 4 * 32 * 8 * 4


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_ideal_handles_half_precision_complex_tables() -> None:
    config = prof.ProfileConfig(layers=3, context=32, head_dim=16, dtype="bfloat16", layout="complex", modes=())
    tables = [t for _, t in toy_decoder.rope_tensors(prof.build_model(config))]
    assert tables[0].dtype == torch.complex32  # torch.equal does not implement it
    assert prof.ideal_storage(tables) == (1, 32 * 8 * 4)


@pytest.mark.parametrize("error, expected, oom", [
    (MemoryError(), "out of memory: MemoryError", True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried"),
     "out of memory: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried", True),
    (ValueError("bad\nsecond line"), "ValueError: bad", False),
])
def test_describe_error_is_one_line(error, expected, oom) -> None:
    assert prof.describe_error(error) == (expected, oom)


def test_real_allocation_failure_reads_as_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as caught:
        torch.empty(1 << 62, dtype=torch.uint8)
    message, oom = prof.describe_error(caught.value)
    assert oom and message.startswith("out of memory: ") and "\n" not in message


def test_exit_reasons() -> None:
    assert "out-of-memory killer" in prof._exit_reason(-signal.SIGKILL, "")
    assert prof._exit_reason(-signal.SIGSEGV, "") == "killed by SIGSEGV"
    assert prof._exit_reason(1, "Traceback...\nImportError: nope\n\n") == "exited with status 1: ImportError: nope"


def test_targets_judged_from_the_summary() -> None:
    summary = {"rope_dedup_rope_bytes_vs_ideal": 1.0, "pass_vs_compile": 0.05, "step_ratio": 0.97}
    rows = {label: met for label, _, _, _, met in prof.check_targets(summary)}
    assert rows == {"RoPE bytes after / ideal": True, "pass time / compile time (target set for 32 layers)": False,
                    "step time rope_dedup / alone": True}


def test_summary_skips_failed_modes() -> None:
    ok = {"rope_bytes": 10, "ideal_bytes": 10, "intern_overhead": 0.001, "pass_s": 0.1, "step_s": 1.0,
          "first_call_s": 10.0, "peak_rss_steps": 100}
    summary = prof.summarize({"compile": {"mode": "compile", "error": "out of memory: x"}, "rope_dedup": ok})
    assert summary == {"rope_dedup_rope_bytes_vs_ideal": 1.0, "rope_dedup_intern_overhead": 0.001}


@pytest.mark.parametrize("layout", prof.profile_layouts())
def test_every_profile_layout_reaches_the_ideal(layout: str) -> None:
    config = prof.ProfileConfig(layers=3, context=64, head_dim=16, layout=layout, inner="eager", steps=1,
                                step_seconds=0, modes=())
    threads = torch.get_num_threads()
    try:
        figures = prof.measure(config, "rope_dedup")  # in this process: it sets the thread count, restored below
    finally:
        torch.set_num_threads(threads)
    assert figures["max_abs_err_vs_eager"] == 0.0
    if layout == "inv_freq":
        # original_inv_freq equals inv_freq but the forward never reads it: the pass cannot see it
        assert figures["rope_storages"] == figures["ideal_storages"] + config.layers
    else:
        assert (figures["rope_storages"], figures["rope_bytes"]) == (figures["ideal_storages"], figures["ideal_bytes"])
    assert figures["intern_calls_per_step"] == 1 and figures["intern_s_per_call"] > 0


def test_lazy_cache_is_not_a_profile_layout() -> None:
    assert "lazy_cache" not in prof.profile_layouts() and "complex" in prof.profile_layouts()


@pytest.mark.parametrize("mode", ["share", "sharing"])
@pytest.mark.parametrize("layout", ["cos_sin", "complex", "gptj"])
def test_the_eager_sharing_modes_reach_the_ideal(mode: str, layout: str) -> None:
    config = prof.ProfileConfig(layers=3, context=64, head_dim=16, layout=layout, pattern="local_global",
                                inner="eager", steps=1, step_seconds=0, modes=())
    threads = torch.get_num_threads()
    try:
        figures = prof.measure(config, mode)
    finally:
        torch.set_num_threads(threads)
    assert figures["max_abs_err_vs_eager"] == 0.0 and figures["graphs"] == 0
    if mode == "sharing" and layout == "gptj":  # a plain attribute: registration hooks never see it
        assert figures["rope_storages"] == figures["rope_storages_before"] == config.layers
    else:
        assert (figures["rope_storages"], figures["rope_bytes"]) == (figures["ideal_storages"], figures["ideal_bytes"])
    assert (figures["share_s"] is not None) == (mode == "share")


def test_eager_sharing_targets() -> None:
    eager = {"peak_rss_build": 1120, "rss_before_build": 100, "param_bytes": 20, "rope_bytes": 1, "ideal_bytes": 1,
             "intern_overhead": None}
    sharing = dict(eager, peak_rss_build=170)
    mib = 1 << 20
    share = dict(eager, rope_bytes_before=1000 * mib, rope_bytes=100 * mib, rss_before_first_call=1000 * mib,
                 rss_after_share=300 * mib, share_s=0.1)
    summary = prof.summarize({"eager": eager, "sharing": sharing, "share": share})
    assert summary["sharing_build_growth_vs_eager"] == pytest.approx(0.05)
    assert summary["share_rss_freed_vs_tables_freed"] == pytest.approx(700 / 900)
    # Tables too small for RSS to tell: no ratio (and no verdict), rather than noise.
    tiny = dict(share, rope_bytes_before=1000, rope_bytes=100, rss_before_first_call=1000, rss_after_share=5000)
    assert "share_rss_freed_vs_tables_freed" not in prof.summarize({"eager": eager, "share": tiny})
    rows = {label: met for label, _, _, _, met in prof.check_targets(summary)}
    assert rows["build peak growth beyond parameters, sharing() / plain"]
    assert rows["RSS freed by share() / table bytes freed"]


def test_every_mode_has_its_own_label_whatever_the_inner_backend() -> None:
    modes = ("eager", "compile", "rope_dedup", "regional", "share", "sharing")
    for inner in ("inductor", "aot_eager", "eager"):
        labels = [prof.mode_label(mode, inner) for mode in modes]
        assert len(set(labels)) == len(labels), labels


def test_allocator_peak_keeps_stderr_free_of_the_profiler_usdt_lines(capfd) -> None:
    """Kineto writes a USDT line at each profiler start and stop, beneath Python; other lines stay."""
    def allocate() -> None:
        torch.ones(1024, device="cpu")
        print("a line of the measured code", file=sys.stderr)

    assert prof.allocator_peak(allocate) == 4096
    err = capfd.readouterr().err
    assert "USDT" not in err and "a line of the measured code" in err
