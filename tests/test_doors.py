"""Every way in: the backend by name with no import, mode/options from torch.compile, the config object,
freezing, and the report a user reads first. Each test here failed before the door was opened."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import NamedTuple

import pytest
import torch
import torch._inductor.compile_fx
import torch._inductor.cudagraph_trees
from torch._dynamo.testing import normalize_gm
from torch._dynamo.utils import counters

from rope_dedup import RopeDedupBackend, RopeDedupConfig
from rope_dedup.testing.toy_decoder import (
    COMPUTED_LAYOUTS, ToyDecoder, homogeneous, local_global, rope_tensors, unique_storages,
)

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))

# A model written inline so the child process imports nothing of rope_dedup's.
TWO_ROPES = textwrap.dedent("""
    import sys, torch

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            inv = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
            angles = torch.outer(torch.arange(64, dtype=torch.float32), inv)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

        def forward(self, x):
            return x * self.cos[: x.shape[0]] + self.sin[: x.shape[0]]

    model = torch.nn.Sequential(Rope(), Rope())
""")


def run_child(code: str) -> str:
    child = subprocess.run([sys.executable, "-c", TWO_ROPES + textwrap.dedent(code)], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    return child.stdout


def rope_storages(model: torch.nn.Module) -> int:
    return unique_storages([t for _, t in rope_tensors(model)])[0]


def test_backend_name_works_in_a_process_that_never_imported_rope_dedup() -> None:
    out = run_child("""
        x = torch.ones(8, 8)
        out = torch.compile(model, backend="rope_dedup", options={"inner": "eager"})(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
        print(model[0].cos.data_ptr() == model[1].cos.data_ptr(), "rope_dedup.backend" in sys.modules)
    """)
    assert out.split() == ["True", "True"]  # shared; the entry point imported the backend on lookup


def test_backend_name_works_after_import_and_without_the_entry_point() -> None:
    """Both registration paths: an installed entry point (import first, then the name: no duplicate
    assertion) and a source tree without installed metadata (registered at import)."""
    for hide_entry_point in (False, True):
        out = run_child(f"""
            import importlib.metadata as metadata
            if {hide_entry_point}:
                everything = metadata.entry_points
                metadata.entry_points = lambda **kw: (
                    metadata.EntryPoints(()) if kw.get("group") == "torch_dynamo_backends" else everything(**kw))
            import rope_dedup
            torch.compile(model, backend="rope_dedup", options={{"inner": "eager"}})(torch.ones(8, 8))
            print(model[0].cos.data_ptr() == model[1].cos.data_ptr(), len(rope_dedup.rope_dedup_backend.report.groups))
        """)
        assert out.split() == ["True", "2"], hide_entry_point


class InductorCall(NamedTuple):
    patches: dict  # the config patches the compile got
    graph: str  # the graph it was handed, printed without comments (no source paths)


@pytest.fixture
def inductor_calls(monkeypatch) -> list[InductorCall]:
    """What each inductor compile gets; the graph then runs as it is (no real compile)."""
    seen: list[InductorCall] = []

    def record(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(InductorCall(dict(config_patches or {}), normalize_gm(gm.print_readable(print_output=False))))
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", record)
    return seen


def patches(calls: list[InductorCall]) -> list[dict]:
    return [call.patches for call in calls]


@pytest.mark.parametrize("how", [
    {"mode": "max-autotune-no-cudagraphs"}, {"mode": "reduce-overhead"}, {"mode": "max-autotune"},
    {"options": {"epilogue_fusion": False, "max_autotune": True}}, {}])
def test_mode_and_options_reach_inductor_as_torch_compile_passes_them(how, inductor_calls) -> None:
    torch.compile(ToyDecoder(homogeneous(2)), **how)(TOKENS)
    alone = patches(inductor_calls)
    inductor_calls.clear()
    torch._dynamo.reset()
    model = ToyDecoder(homogeneous(2))
    backend = RopeDedupBackend()
    options = dict(how.get("options") or {})  # torch.compile may consume its options dict
    torch.compile(model, backend=backend, mode=how.get("mode"), options=options or None)(TOKENS)
    assert patches(inductor_calls) == alone and len(alone) == 1
    assert rope_storages(model) == 2


def test_rope_dedup_options_through_torch_compile_options(inductor_calls) -> None:
    torch.compile(ToyDecoder(homogeneous(3)), options={"epilogue_fusion": False})(TOKENS)
    [alone] = inductor_calls
    inductor_calls.clear()
    torch._dynamo.reset()
    model = ToyDecoder(homogeneous(3))
    backend = RopeDedupBackend()
    torch.compile(model, backend=backend,
                  options={"dry_run": True, "inner": "inductor", "epilogue_fusion": False})(TOKENS)
    assert patches(inductor_calls) == [{"epilogue_fusion": False}]
    assert inductor_calls[0].graph == alone.graph  # dry run: inductor gets the graph it gets alone
    assert rope_storages(model) == 6  # dry run: nothing aliased
    assert [len(g.members) for g in backend.report.groups] == [3, 3]  # but reported
    assert backend.store.snapshot() == []  # the backend's own (sharing) store is untouched

    torch._dynamo.reset()
    model = ToyDecoder(homogeneous(3))
    torch.compile(model, backend="rope_dedup", options={"inner": "eager", "share_persistent": True})(TOKENS)
    assert patches(inductor_calls) == [{"epilogue_fusion": False}]  # eager inner: inductor not called again
    assert rope_storages(model) == 2


@pytest.mark.parametrize("layout", COMPUTED_LAYOUTS)
def test_dry_run_hands_inductor_the_graph_it_gets_alone(layout, inductor_calls) -> None:
    """Under inductor, shared tables keep their graph inputs, so only folding or merging tables computed in
    forward (both opted in here) rewrites the graph: the real run shows the comparison sees a rewrite."""
    computed = {"inner": "inductor", "fold_constants": True, "merge_computed": True}
    torch.compile(ToyDecoder(homogeneous(3, layout=layout)))(TOKENS)
    for options in ({**computed, "dry_run": True}, computed):
        torch._dynamo.reset()
        torch.compile(ToyDecoder(homogeneous(3, layout=layout)), backend="rope_dedup", options=options)(TOKENS)
    alone, dry_run, rewritten = (call.graph for call in inductor_calls)
    assert dry_run == alone
    assert rewritten != alone


def test_mode_and_options_together_get_torch_s_own_error() -> None:
    with pytest.raises(RuntimeError, match="Either mode or options can be specified"):
        torch.compile(ToyDecoder(homogeneous(1)), backend=RopeDedupBackend(), mode="max-autotune",
                      options={"dry_run": True})


@pytest.mark.parametrize("kwargs, error, message", [
    ({"inner": "no_such_backend"}, ValueError, r"unknown inner backend 'no_such_backend': choose one of .*aot_eager"),
    ({"inner": 42}, TypeError, "inner must be a backend name or a backend callable, got int"),
    ({"inner": "rope_dedup"}, ValueError, "unknown inner backend 'rope_dedup'"),
    ({"dry_run": "yes"}, TypeError, "dry_run must be True or False"),
    ({"fold_constants": 1}, TypeError, "fold_constants must be True, False or None"),
    ({"inner_options": {"no_such_option": 1}}, ValueError,
     r"unknown option\(s\) 'no_such_option': rope_dedup's options are inner, mode, inner_options, share_persistent"),
    ({"inner": "eager", "mode": "max-autotune"}, ValueError, "'eager', which takes no mode or options"),
    ({"mode": "fastest"}, RuntimeError, "Unrecognized mode=fastest"),
])
def test_bad_settings_fail_at_construction(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        RopeDedupConfig(**kwargs)
    with pytest.raises(error, match=message):
        RopeDedupBackend(**kwargs)


def test_unknown_keyword_lists_the_options() -> None:
    with pytest.raises(TypeError, match="unknown option.s. share_persistant: RopeDedupBackend takes inner, mode"):
        RopeDedupBackend(share_persistant=True)


def test_unknown_option_through_torch_compile_names_it_at_the_first_compile() -> None:
    with pytest.raises(Exception, match="unknown option.s. 'share_persistant'"):
        torch.compile(ToyDecoder(homogeneous(1)), backend=RopeDedupBackend(),
                      options={"share_persistant": True})(TOKENS)


def test_config_object_and_defaults_per_inner() -> None:
    config = RopeDedupConfig(inner="aot_eager", dry_run=True)
    backend = RopeDedupBackend(config=config)
    assert backend.config is config and backend.inner == "aot_eager" and backend.store.dry_run
    assert config.computed_table_transforms() == (False, False)  # a dry run rewrites nothing
    assert not config.redirects_inputs()
    assert RopeDedupConfig(inner="aot_eager").computed_table_transforms() == (True, True)
    assert RopeDedupConfig().computed_table_transforms() == (False, False)
    with pytest.raises(TypeError, match="either config= or the options"):
        RopeDedupBackend(config=config, strict=True)
    with pytest.raises(Exception):  # frozen
        config.dry_run = False


@pytest.mark.parametrize("setting", ["freezing", "install_free_tensors"])
def test_freezing_reaches_the_ideal_with_equal_outputs(setting: str) -> None:
    """Under freezing, state reaches the backend as get_attr nodes that dynamo registered as persistent
    buffers; the source dynamo recorded says they are the model's non-persistent tables."""
    patch = ({"freezing": True}, {}) if setting == "freezing" else ({}, {"install_free_tensors": True})
    specs = local_global(4, every=2)
    outputs = []
    for backend in ("inductor", RopeDedupBackend("inductor")):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ToyDecoder(specs).eval()
        with torch._inductor.config.patch(patch[0]), torch._dynamo.config.patch(patch[1]), torch.no_grad():
            compiled = torch.compile(model, backend=backend)
            outputs.append([compiled(TOKENS), compiled(TOKENS + 1)])
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert rope_storages(model) == 4  # two thetas x cos/sin
    report = backend.report
    assert sorted(len(g.members) for g in report.groups) == [2, 2, 2, 2]
    assert not [s for s in report.skipped if "rope" in s.path]
    assert counters["rope_dedup"]["graphs"] == 1


def test_report_counts_trainable_parameters_in_one_line() -> None:
    model = ToyDecoder(homogeneous(3))
    backend = RopeDedupBackend("eager")
    torch.compile(model, backend=backend)(TOKENS)
    text = str(backend.report)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert f"  {trainable} trainable parameter(s) (requires grad): never shared, not listed" in text
    assert "embed.weight" not in text and "qkv.weight" not in text
    assert len(backend.report.skipped) == trainable  # the object still has every skip


def test_dynamo_reset_resets_the_inner_backend_as_for_inductor_alone(inductor_calls, monkeypatch) -> None:
    """torch._dynamo.reset() resets each backend it cached; inductor's wrapper then drops its CUDA graph
    trees. Wrapped in rope_dedup, the inner wrapper must get that call too."""
    resets = []
    monkeypatch.setattr(torch._inductor.cudagraph_trees, "reset_cudagraph_trees", lambda: resets.append(1))
    torch.compile(ToyDecoder(homogeneous(1)), mode="reduce-overhead")(TOKENS)
    torch._dynamo.reset()
    alone = len(resets)
    torch.compile(ToyDecoder(homogeneous(1)), backend=RopeDedupBackend(), mode="reduce-overhead")(TOKENS)
    torch._dynamo.reset()
    assert alone >= 1 and len(resets) == 2 * alone


def test_an_unsupported_torch_fails_at_import_with_one_line() -> None:
    child = subprocess.run([sys.executable, "-c", "import torch; torch.__version__ = '2.9.1+cu128'; import rope_dedup"],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode != 0
    assert child.stderr.strip().splitlines()[-1] == \
        "ImportError: rope_dedup supports torch>=2.10,<2.16; installed torch is 2.9.1+cu128"


def test_the_declared_torch_range_is_the_one_checked_at_import() -> None:
    import tomllib
    from pathlib import Path

    from rope_dedup import SUPPORTED_TORCH
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (low, high) = (".".join(map(str, v)) for v in SUPPORTED_TORCH)
    assert f"torch>={low},<{high}" in pyproject["project"]["dependencies"]


def test_ci_runs_the_readme_test_command() -> None:
    from pathlib import Path

    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("python3 -m venv .venv-nox"))
    assert command in (root / ".ci" / "run").read_text()


def test_the_readme_fits_a_newcomers_patience() -> None:
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text().splitlines()
    assert len(readme) <= 200, len(readme)
    assert readme[readme.index("## Install and see it work") + 3].endswith("rope-dedup profile")  # the first command


def test_words_a_user_reads_carry_no_issue_numbers_or_round_notes() -> None:
    """README, docs and every string in the package (CLI output, docstrings, errors) speak to users."""
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    team_words = re.compile(r"\bissue \d|\bissue #\d|target set for|this round|round's|the issue's", re.IGNORECASE)
    files = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "rope_dedup").rglob("*.py"),
             *(root / "passes").glob("*.py")]
    hits = [f"{path.relative_to(root)}:{n}: {line.strip()}" for path in files
            for n, line in enumerate(path.read_text().splitlines(), 1) if team_words.search(line)]
    assert not hits, "\n".join(hits)
