"""The ``rope-dedup`` command line: profile end to end, audit, and every kind of bad input."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rope_dedup.tools.cli import _modes, main
from rope_dedup.tools.profile import MODES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("rope-dedup")
FAST = ["--inner", "eager", "--layers", "2", "--context", "256", "--head-dim", "16", "--steps", "2",
        "--step-seconds", "0", "--rounds", "0"]


def one_error_line(stderr: str, prog: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# -- profile --------------------------------------------------------------------------------------------

def test_profile_writes_every_figure_and_the_plot(tmp_path, capsys) -> None:
    out, png = tmp_path / "profile.json", tmp_path / "profile.png"
    args = ["profile", "--inner", "eager", "--layers", "2", "--context", "512", "--head-dim", "32", "--steps", "3",
            "--step-seconds", "0", "--modes", "compile,rope_dedup,regional", "--rounds", "5", "--copies", "3",
            "--json", str(out), "--plot", str(png), "--timeout", "300"]
    assert main(args) == 0
    result = json.loads(out.read_text())
    modes = result["modes"]
    assert list(modes) == ["compile", "rope_dedup", "regional"]  # eager: in the out-of-memory test
    ideal = 2 * 512 * 16 * 4  # one cos and one sin table, (512, 16) float32
    for mode, figures in modes.items():
        assert figures["ideal_bytes"] == ideal
        assert figures["rope_bytes"] == (ideal if mode in ("rope_dedup", "regional") else 2 * ideal), mode
        assert figures["max_abs_err_vs_eager"] == 0.0  # inner eager: bitwise equal
        assert figures["peak_rss_process"] > 0 and figures["step_s"] > 0
    assert modes["regional"]["intern_calls_per_step"] == 2 and modes["rope_dedup"]["intern_calls_per_step"] == 1
    assert modes["rope_dedup"]["pass_s"] > 0 and modes["compile"]["pass_s"] is None
    # Under eager all three passes run; the backend's safety copy of the graph is counted beside them.
    by_pass = modes["rope_dedup"]["pass_s_by_pass"]
    assert list(by_pass) == ["dedup_rope", "merge_rope_subgraphs", "fold_rope_constants", "copy_graph"]
    assert modes["rope_dedup"]["pass_s"] == pytest.approx(sum(by_pass.values()))
    assert result["summary"]["rope_dedup_rope_bytes_vs_ideal"] == 1.0
    assert {t["target"] for t in result["targets"]} >= {"RoPE bytes after / ideal", "step time rope_dedup / alone",
                                                         "step time rope_dedup / alone, regional"}
    # Step times come from one process, models in turns, against copies built apart; memory from each mode's own.
    turns = result["turns"]
    assert set(turns["step_s"]) == {"alone 1", "alone 2", "alone 3", "alone, regional 1", "alone, regional 2",
                                    "alone, regional 3", "rope_dedup", "regional"}
    assert turns["rounds"] == 5 and result["summary"]["step_ratio"] == turns["paired"]["rope_dedup"]["ratio"]
    assert result["summary"]["step_noise"] == turns["noise"] > 0
    assert turns["audit"]["mismatches"] == 0 and turns["audit"]["tables"] == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shown = capsys.readouterr().out
    assert "rope_dedup regional" in shown and "ideal, each distinct table stored once: 2 storage(s)" in shown
    # The headline comes first, after the lines describing the model: bytes, step ratios, the audit; then tables.
    text = " ".join(shown.split())
    head = text.index("RoPE tables: 4 as built, 131.1 KB; shared by rope_dedup: 2 storage(s)")
    assert head < text.index("Step time, in turns in one process: rope_dedup / eager alone") < text.index(
        "Audit (static against each layer's theta as built): 4 table(s) in 2 layer(s)") < text.index("RoPE storage")
    assert "issue" not in shown and "target set for" not in shown


def test_out_of_memory_in_one_child_is_one_line_and_the_others_still_print(monkeypatch, capsys) -> None:
    monkeypatch.setenv("ROPE_DEDUP_PROFILE_OOM", "rope_dedup")  # that child asks for 4 EiB after building
    assert main(["profile", *FAST, "--modes", "eager,rope_dedup", "--timeout", "300"]) == 1
    captured = capsys.readouterr()
    line = one_error_line(captured.err, "rope-dedup profile")
    assert line.startswith("rope-dedup profile: error: rope_dedup: out of memory: ")
    assert "can't allocate memory" in line
    assert "  eager " in captured.out  # the eager row of the memory table


def test_a_child_past_its_timeout_is_one_line(capsys) -> None:
    assert main(["profile", *FAST, "--modes", "eager", "--timeout", "0.2"]) == 1
    assert one_error_line(capsys.readouterr().err, "rope-dedup profile") == \
        "rope-dedup profile: error: eager: timed out after 0.2 s"


def test_unknown_preset_is_one_line_with_the_choices() -> None:
    run = subprocess.run([SCRIPT, "profile", "--preset", "titan-1m"], capture_output=True, text=True)
    assert run.returncode == 2
    line = one_error_line(run.stderr, "rope-dedup profile")
    assert "invalid choice: 'titan-1m'" in line and "titan-128k" in line
    assert run.stdout == ""


def test_python_dash_m_runs_the_same_command_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["rope_dedup", "profile", "--help"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("rope_dedup", run_name="__main__")
    assert exit.value.code == 0 and "--preset {default,titan-128k}" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line(capsys) -> None:
    assert main(["profile", "--device", "cuda"]) == 2
    line = one_error_line(capsys.readouterr().err, "rope-dedup profile")
    assert "--device cuda asked for, but CUDA is not available" in line


@pytest.mark.parametrize("args, message", [
    (["--seq", "64", "--context", "32"], "--seq 64 exceeds the table length --context 32"),
    (["--head-dim", "15"], "--head-dim must be even"),
    (["--modes", "eager,jit"], "unknown mode(s) jit"),
    (["--layout", "lazy_cache"], "argument --layout: invalid choice: 'lazy_cache'"),
    (["--layers", "0"], "expected a positive integer, got 0"),
    (["--copies", "2"], "argument --copies: expected 3 to 11, got 2"),
    (["--json", "/nonexistent/folder/out.json"], "folder /nonexistent/folder does not exist"),
])
def test_bad_profile_options_are_one_line(args, message, capsys) -> None:
    try:
        code = main(["profile", *args])
    except SystemExit as exit:  # argparse's own checks
        code = exit.code
    assert code == 2
    assert message in one_error_line(capsys.readouterr().err, "rope-dedup profile")


def test_modes_list() -> None:
    assert _modes("all") == MODES
    assert _modes("rope_dedup, compile") == ("rope_dedup", "compile")


def test_missing_rich_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    assert main(["profile"]) == 2
    assert "needs rich: pip install 'rope-dedup[demo]'" in one_error_line(capsys.readouterr().err, "rope-dedup profile")


def test_missing_matplotlib_fails_before_profiling(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["profile", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in one_error_line(capsys.readouterr().err, "rope-dedup profile")


def test_the_library_imports_without_rich_or_matplotlib() -> None:
    code = ("import sys; sys.modules['rich'] = sys.modules['matplotlib'] = None\n"
            "import rope_dedup, rope_dedup.tools.cli, rope_dedup.tools.profile, rope_dedup.tools.plot\n"
            "print(rope_dedup.explain.__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "explain"


# -- audit ----------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def isolated_imports(monkeypatch, tmp_path_factory):
    """The audit imports user modules and puts their folder on sys.path: undo both after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    user_code = (str(tmp_path_factory.getbasetemp()), str(ROOT / "examples"))
    for name in set(sys.modules) - before:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(user_code):
            del sys.modules[name]


# The legends of the "*" mark under the held and the applied tables: each printed only when its table marks a row.
HELD_CAPTION = "* key differs from most layers; one group letter = identical content"
ODD_CAPTION = "* differs from most layers"
MISMATCH_CAPTION = "* differs from the expectation (mismatches below)"


def assert_no_mark(out: str) -> None:
    assert " * " not in out, out  # no marked row ("layers.5 *" in a cell)
    for caption in (HELD_CAPTION, ODD_CAPTION, MISMATCH_CAPTION):
        assert caption not in out, out


def test_audit_of_a_file_factory_marks_the_odd_layer(capsys) -> None:
    assert main(["audit", str(ROOT / "examples" / "audit.py") + ":build"]) == 0
    out = capsys.readouterr().out
    assert "layers.5 *" in out
    assert "* layers.5 differs from most layers: theta 10000 (most layers: 500000)" in out
    assert HELD_CAPTION in out and ODD_CAPTION in out
    assert MISMATCH_CAPTION not in out  # nothing judged


def test_audit_of_a_clean_model_marks_nothing_and_prints_no_legend(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "clean.py").write_text(
        "import torch\nfrom rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous\n"
        "def build():\n    return ToyDecoder(homogeneous(3, max_len=32)), torch.zeros(1, 4, dtype=torch.long)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "clean.py:build"]) == 0
    out = capsys.readouterr().out
    assert "tables each layer holds" in out and "tables each layer applies" in out  # both tables printed
    assert_no_mark(out)


def test_audit_of_a_dotted_module(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "my_model.py").write_text(
        "import torch\nfrom rope_dedup.testing.toy_decoder import ToyDecoder, local_global\n"
        "def make():\n    return ToyDecoder(local_global(3, max_len=32)), torch.zeros(1, 4, dtype=torch.long)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "my_model:make"]) == 0
    assert "* layers.2 differs from most layers: theta 1e+06" in capsys.readouterr().out


CATCH = str(ROOT / "examples" / "catch_misconfiguration.py")


def test_audit_with_an_expectation_exits_1_and_shows_expected_and_found(capsys) -> None:
    assert main(["audit", f"{CATCH}:theta_ignored", "--expect", "theta=5e5"]) == 1
    out = capsys.readouterr().out
    assert "2 mismatch(es) with the expectation" in out
    assert MISMATCH_CAPTION in out
    assert HELD_CAPTION not in out  # both layers hold the same table: none marked there
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    assert ["layers.1", "theta", "500000", "10000", "13 (|Δ| 1.4)"] in rows  # the mismatch table
    # The applied table, in as many parts as 100 columns need, each repeating the layer: expected beside found.
    applied = [cell for row in rows if row[0] == "layers.1 *" for cell in row[1:]]
    assert (applied[0], applied[2], applied[3], applied[-2:]) == ("cos+sin", "10000", "16",
                                                                  ["theta=500000", "MISMATCH: theta"])


def test_audit_expect_config_exits_0_on_a_correct_model_and_1_on_a_bug(capsys) -> None:
    assert main(["audit", f"{CATCH}:llama3_correct", "--expect", "config"]) == 0
    out = capsys.readouterr().out
    assert "every layer applies the expected RoPE" in out
    assert_no_mark(out)
    assert main(["audit", f"{CATCH}:llama3_dropped", "--expect", "config"]) == 1
    out = capsys.readouterr().out
    assert "│ model.layers.1 │ scaling │ llama3:32:1:4:8192 │ none  │ 15 (|Δ| 0.015) │" in out


def test_audit_of_a_model_without_rope(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "plain.py").write_text(
        "import torch\ndef build():\n    return torch.nn.Linear(4, 4), torch.randn(2, 4)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "plain.py:build"]) == 0
    assert "no RoPE table found" in capsys.readouterr().out
    assert main(["audit", "plain.py:build", "--expect", "theta=1e4"]) == 1
    assert "no RoPE table applied" in capsys.readouterr().out


@pytest.mark.parametrize("expect, message", [
    ("theta=5e5,scaling=rope2:4", "unknown scaling type 'rope2'"),
    ("dim=64", "theta is missing"),
    ("config", "expect='config' needs model.config"),
])
def test_bad_expectations_are_one_line_and_exit_2(expect, message, capsys) -> None:
    assert main(["audit", str(ROOT / "examples" / "audit.py") + ":build", "--expect", expect]) == 2
    assert message in one_error_line(capsys.readouterr().err, "rope-dedup audit")


@pytest.mark.parametrize("spec, source, message, code", [
    ("no_colon", None, "expected MODULE:FACTORY", 2),
    ("surely_not_a_module:build", None, "cannot import surely_not_a_module: ModuleNotFoundError", 2),
    ("missing.py:build", None, "no such file: missing.py", 2),
    ("broken.py:build", "import not_installed_anywhere\n", "cannot import broken.py: ModuleNotFoundError", 2),
    ("plain.py:build", "x = 1\n", "plain.py has no callable 'build'", 2),
    ("raises.py:build", "def build():\n    raise ValueError('no weights here')\n",
     "raises.py:build() raised ValueError: no weights here", 1),
    ("wrong.py:build", "def build():\n    return 42\n", "wrong.py:build() returned int; expected (model, example_inputs)", 2),
])
def test_bad_factories_are_one_line(spec, source, message, code, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    if source is not None:
        (tmp_path / spec.split(":")[0]).write_text(source)
    assert main(["audit", spec]) == code
    assert message in one_error_line(capsys.readouterr().err, "rope-dedup audit")


# -- the presets, for real (minutes) ---------------------------------------------------------------------

@pytest.mark.slow
def test_default_preset_with_inductor(tmp_path) -> None:
    out = tmp_path / "default.json"
    run = subprocess.run([SCRIPT, "profile", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["rope_dedup_rope_bytes_vs_ideal"] == 1.0


def test_static_audit_of_a_factory_that_returns_the_model_alone(capsys) -> None:
    assert main(["audit", f"{CATCH}:rope_unfilled_after_to_empty", "--static"]) == 1  # no expectation needed
    out = capsys.readouterr().out
    assert out.startswith("RoPE audit (static: no forward ran)")
    assert "2 mismatch(es)" in out and "NaN or inf" in out
    assert main(["audit", f"{CATCH}:theta_lost_in_rope_parameters", "--static", "--expect", "config"]) == 1
    out = capsys.readouterr().out
    assert "what each held table encodes" in out and "MISMATCH: theta" in out
    assert main(["audit", f"{CATCH}:theta_ignored", "--static", "--expect", "theta=1e4"]) == 0  # (model, inputs)
    assert "every table holds the expected RoPE" in capsys.readouterr().out


def test_an_audit_with_a_forward_points_a_factory_without_inputs_to_static(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "bare.py").write_text(
        "from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous\n"
        "def build():\n    return ToyDecoder(homogeneous(2))\n"
        "def empty():\n    return ToyDecoder(homogeneous(2)), ()\n"
        "def nothing():\n    return 3\n")
    monkeypatch.chdir(tmp_path)
    for factory in ("build", "empty"):
        assert main(["audit", f"bare.py:{factory}"]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and error.endswith("or add --static to audit its tables without a forward")
    assert main(["audit", "bare.py:build", "--static"]) == 0
    assert main(["audit", "bare.py:nothing", "--static"]) == 2
    assert capsys.readouterr().err.strip().endswith("bare.py:nothing() returned int; expected a model or "
                                                    "(model, example_inputs)")
