"""``rope-dedup profile MODULE:FACTORY``: the user's own model, regional blocks, training steps, bad input."""

from __future__ import annotations

import json
import textwrap

import pytest

from rope_dedup.tools.cli import main

FAST = ["--inner", "eager", "--steps", "2", "--step-seconds", "0", "--rounds", "0", "--timeout", "300"]

FACTORIES = textwrap.dedent("""
    import torch
    from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous

    def build():
        torch.manual_seed(0)
        return ToyDecoder(homogeneous(3, max_len=256), d_model=32, heads=2), torch.randint(0, 64, (1, 8))

    class NoCompile(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = build()[0]

        def forward(self, tokens):
            out = self.model(tokens)
            if torch.compiler.is_compiling():  # fails while dynamo traces: a hard error, not a graph break
                out = out @ torch.ones(3, 3)
            return out

    def no_compile():
        return NoCompile(), (torch.randint(0, 64, (1, 8)),)

    def broken():
        raise RuntimeError("no weights here")

    def no_inputs():
        return build()[0], ()

    def not_a_model():
        return 42
""")


@pytest.fixture
def factories(tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(FACTORIES)
    return path


def profile(*args: str) -> int:
    return main(["profile", *args])


def test_profiles_the_user_model_inference_and_regional(factories, tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert profile(f"{factories}:build", "--regional", "layers", "--modes", "eager,compile,rope_dedup", *FAST,
                   "--rounds", "3", "--copies", "3", "--json", str(out)) == 0
    result = json.loads(out.read_text())
    modes = result["modes"]
    assert list(modes) == ["eager", "compile", "rope_dedup", "regional"]
    # Step time in one process: each timed mode against its own reference, the regional one against regional.
    turns = result["turns"]
    assert {name: ref for name, ref in turns["reference"].items() if ref != "the other copies"} == {
        "rope_dedup": "alone", "regional": "alone, regional"}
    assert len(turns["controls"]) == 2 * 3
    assert set(turns["max_abs_err_vs_alone"].values()) == {0.0}
    assert turns["audit"]["expected"] is None and turns["audit"]["tables"] == 6  # no config: the slot rule alone
    ideal = 2 * 256 * 8 * 4  # cos and sin, (256, head_dim 16 / 2) float32
    for mode, figures in modes.items():
        assert figures["rope_tables"] == 6 and figures["ideal_bytes"] == ideal, mode
        assert figures["rope_bytes"] == (ideal if mode in ("rope_dedup", "regional") else 3 * ideal), mode
        assert figures["max_abs_err_vs_eager"] == 0.0
    assert result["config"]["factory"].endswith("my_models.py:build")
    assert modes["regional"]["intern_calls_per_step"] == 3
    # the console wraps the title line to its width (a tmp path is long): compare words, not line breaks
    assert "my_models.py:build(), regional blocks layers" in " ".join(capsys.readouterr().out.split())


def test_training_steps_include_backward_and_optimizer(factories, tmp_path) -> None:
    out = tmp_path / "p.json"
    assert profile(f"{factories}:build", "--train", "--modes", "compile,rope_dedup", *FAST, "--json", str(out)) == 0
    result = json.loads(out.read_text())
    assert result["config"]["train"] is True
    dedup = result["modes"]["rope_dedup"]
    assert dedup["rope_storages"] == dedup["ideal_storages"] == 2
    assert dedup["max_abs_err_vs_eager"] < 1e-6  # the first step's loss, before any update


@pytest.mark.parametrize("factory, message", [
    ("broken", "my_models.py:broken() raised RuntimeError: no weights here"),
    ("no_inputs", "my_models.py:no_inputs() returned no example inputs"),
    ("not_a_model", "my_models.py:not_a_model() returned int; expected (model, example_inputs)"),
])
def test_a_factory_that_fails_is_one_line_per_mode(factory, message, factories, capsys) -> None:
    assert profile(f"{factories}:{factory}", "--modes", "eager,rope_dedup", *FAST) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rope-dedup profile: error:")]
    assert len(errors) == 2 and all(message in line for line in errors), errors


def test_a_model_that_does_not_compile_still_reports_eager(factories, tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert profile(f"{factories}:no_compile", "--modes", "eager,compile,rope_dedup", *FAST, "--json", str(out)) == 1
    modes = json.loads(out.read_text())["modes"]
    assert "error" not in modes["eager"] and modes["eager"]["rope_tables"] == 6
    # torch 2.10 words it "Dynamo failed to run FX node with fake tensors: ...", later ones "RuntimeError when
    # making fake tensor call": the one line names dynamo's error class either way.
    assert modes["rope_dedup"]["error"].startswith(("TorchRuntimeError: RuntimeError when making fake tensor call",
                                                    "TorchRuntimeError: Dynamo failed to run FX node with fake tensors"))
    captured = capsys.readouterr()
    assert "  eager " in captured.out
    assert "rope-dedup profile: error: rope_dedup: " in captured.err and "Traceback" not in captured.err


def test_regional_path_that_is_not_a_module_list(factories, capsys) -> None:
    assert profile(f"{factories}:build", "--regional", "embed", "--modes", "regional", *FAST) == 1
    assert ("rope-dedup profile: error: rope_dedup regional: ValueError: --regional embed: Embedding is not a "
            "torch.nn.ModuleList of blocks") in capsys.readouterr().err
    assert profile(f"{factories}:build", "--regional", "nowhere", "--modes", "regional", *FAST) == 1
    assert "--regional nowhere: ToyDecoder has no submodule 'nowhere'" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--layers", "4"], "--layers describe the toy decoder, not"),
    (["--preset", "titan-128k"], "--preset describe the toy decoder"),
])
def test_toy_options_with_a_factory_are_bad_input(args, message, factories, capsys) -> None:
    assert profile(f"{factories}:build", *args) == 2
    assert message in capsys.readouterr().err


def test_a_factory_that_cannot_be_imported_is_bad_input(tmp_path, capsys) -> None:
    assert profile(f"{tmp_path}/missing.py:build") == 2
    assert "no such file" in capsys.readouterr().err
