"""Memory and time of a toy decoder under eager, ``torch.compile`` and rope_dedup.

Memory is measured per mode, each in its own interpreter (``python -m rope_dedup.tools.profile MODE CONFIG
RESULT``), so that its peak RSS and its inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``) belong to it
alone, with a fixed glibc mmap threshold so that freed tables leave RSS in every mode (see :func:`run_mode`).
The child builds the model, computes the ideal RoPE storage on its own (exact-equality groups of the model's
tables, not the pass's groups), then measures three phases: build, first call (compile) and steps. Peak RSS
is read per phase (``getrusage``, with the high-water mark reset between phases through
``/proc/self/clear_refs``), because every mode builds the same copies first: what sharing changes is the
memory the compiled model runs in.

Step time is measured otherwise: one more child (:data:`TURNS`) builds the model once per compiled mode, plus
several copies of the inner backend alone built apart, and calls them in turns, round after round
(:mod:`rope_dedup.tools.paired`). Each ratio is the median of per-round ratios over the copies' mean, judged
against the noise the copies read against each other (A/A controls); the same child runs the static audit of
the model.

Setting ``ROPE_DEDUP_PROFILE_OOM=MODE[,MODE]`` makes those modes' children request an impossible
allocation after building the model: the real allocator failure path, for tests and for checking
how a failure is shown.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from rope_dedup.core.memory import TRIM_THRESHOLD_BYTES
from rope_dedup.testing import toy_decoder as toy
from rope_dedup.tools.factories import build as build_from_factory, one_line
from rope_dedup.tools.paired import (Paired, check_copies, cpu_timer, cuda_timer, leave_one_out, mean_per_round, noise,
                                     own_code, take_turns, verdict)
from rope_dedup.tensors import same_values

MODES = ("eager", "compile", "rope_dedup", "regional", "share", "sharing", "recompute")
# Modes that never compile: eager, then rope_dedup.share(model); eager, built inside rope_dedup.sharing().
EAGER_MODES = ("eager", "share", "sharing")
# Modes whose step is timed against the inner backend alone, in turns in one process, and the child that does it.
TIMED_MODES = ("rope_dedup", "regional", "recompute")
TURNS = "turns"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATTERNS = ("homogeneous", "local_global")
INNERS = ("inductor", "aot_eager", "eager")
_VOCAB = 64


@dataclass(frozen=True)
class ProfileConfig:
    """The model every mode builds, and how it is run. ``context`` is the RoPE table length."""

    layers: int = 8
    context: int = 131072
    head_dim: int = 128
    heads: int = 4
    dtype: str = "float32"
    layout: str = "cos_sin"
    pattern: str = "homogeneous"
    device: str = "cpu"
    inner: str = "inductor"
    modes: tuple[str, ...] = ("compile", "rope_dedup", "recompute")
    batch: int = 1
    seq: int = 16
    steps: int = 20  # steps of each memory child, after its first call: the memory it runs in
    step_seconds: float = 1.0  # and stepping lasts at least this long: sub-ms steps need a window wider than a load burst
    rounds: int = 200  # rounds of the step-time child, every timed model called once per round; 0: no step-time child
    copies: int = 6  # copies of the inner backend alone, built apart, that the step-time child's ratios read against
    threads: int = 1  # one intra-op thread: step times on a shared 2-core machine stay comparable
    factory: str | None = None  # MODULE:FACTORY returning (model, example_inputs); None: the toy decoder above
    regional: str = "layers"  # the ModuleList whose blocks the regional mode compiles one by one
    train: bool = False  # a step is forward, backward and an AdamW step instead of a no-grad forward

    def __post_init__(self) -> None:
        check_copies(self.copies)


PRESETS = {
    "default": ProfileConfig(),
    # torchtitan's llama3 shape: 40 layers each holding a 128K x 64 complex64 freqs_cis (67 MB), ~2.7 GB of copies.
    # torchtitan compiles block by block, so the regional mode is part of this case.
    # Three copies per reference: each copy of 40 layers compiles on its own, and the whole and regional copies'
    # controls pool into one noise.
    "titan-128k": ProfileConfig(layers=40, context=131072, head_dim=128, heads=2, layout="complex",
                                modes=("eager", "compile", "rope_dedup", "regional"), copies=3),
}


def profile_layouts() -> tuple[str, ...]:
    """Toy layouts the profile accepts: ``lazy_cache`` is written during forward, so it is state, not a
    table, and an "ideal" storage for it would be meaningless."""
    return tuple(layout for layout in toy.LAYOUTS if layout != "lazy_cache")


def build_model(config: ProfileConfig) -> torch.nn.Module:
    """The toy decoder ``config`` describes, in eval mode on its device."""
    spec: dict[str, Any] = dict(layout=config.layout, max_len=config.context, dtype=DTYPES[config.dtype])
    if config.pattern == "local_global":
        specs = toy.local_global(config.layers, **spec)
    else:
        specs = toy.homogeneous(config.layers, **spec)
    with torch.device(config.device):  # tables built where they live, as model code would
        model = toy.ToyDecoder(specs, d_model=config.heads * config.head_dim, heads=config.heads, vocab=_VOCAB)
    return model.eval()


def ideal_storage(tables: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(count, bytes) of storages if every distinct table were stored once: exact-equality groups."""
    distinct: list[torch.Tensor] = []
    for table in tables:
        if not any(d.dtype == table.dtype and d.shape == table.shape and same_values(d, table) for d in distinct):
            distinct.append(table)
    return toy.unique_storages(distinct)


def storage_figures(tables: Sequence[torch.Tensor], before: tuple[int, int], after: tuple[int, int],
                    ideal: tuple[int, int]) -> dict[str, int]:
    """The RoPE storage figures every profile record carries, each a (count, bytes) of unique storages:
    before and after rope_dedup ran, and the ideal of :func:`ideal_storage`."""
    return {"rope_tables": len(tables), "rope_storages_before": before[0], "rope_bytes_before": before[1],
            "rope_storages": after[0], "rope_bytes": after[1], "ideal_storages": ideal[0], "ideal_bytes": ideal[1]}


# -- the child: one mode, one process ---------------------------------------------------------------

class _Capture:
    """Backend wrapper that keeps each compiled callable with its example inputs, to time interning on
    real arguments afterwards. It only acts at compile time: the step path is not wrapped."""

    def __init__(self, backend: Callable) -> None:
        self.backend = backend
        self.compiled: list[tuple[Callable, list]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence, **compile_kwargs: Any) -> Callable:
        compiled = self.backend(gm, example_inputs, **compile_kwargs)
        self.compiled.append((compiled, list(example_inputs)))
        return compiled


@dataclass
class _Peaks:
    """High-water marks per phase: process RSS, and on CUDA ``max_memory_allocated``.

    Without a resettable RSS peak (not Linux) the phases stay None and only the process peak is known.
    """

    cuda: bool
    resettable: bool = os.access("/proc/self/clear_refs", os.W_OK)
    rss: dict[str, int | None] = field(default_factory=dict)
    cuda_max: dict[str, int] = field(default_factory=dict)

    def end_phase(self, phase: str) -> None:
        self.rss[phase] = _max_rss() if self.resettable else None
        if self.resettable:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # Linux >= 4.0: reset the peak RSS that getrusage reports
        if self.cuda:
            self.cuda_max[phase] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def process_peak(self) -> int:
        return max(v for v in self.rss.values() if v is not None) if self.resettable else _max_rss()


def allocator_peak(fn: Callable[[], Any]) -> int:
    """The most bytes that ``fn``'s own allocations held at once, from the allocator events torch's profiler
    records (every allocation and free, on CPU as on CUDA): a transient that RSS would hide in the heap."""
    from torch.profiler import ProfilerActivity, profile

    with _without_usdt_lines(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        recorded.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    sizes = [e["args"]["Bytes"] for e in sorted(events, key=lambda e: e["ts"]) if e.get("name") == "[memory]"]
    return max(itertools.accumulate(sizes, initial=0))


@contextlib.contextmanager
def _without_usdt_lines() -> Iterator[None]:
    """Kineto writes a ``USDT:`` line to the process's stderr (file descriptor 2, beneath Python) as the
    profiler starts and stops, whatever ``KINETO_LOG_LEVEL`` says: catch fd 2 meanwhile and write back every
    other line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not line.startswith("USDT:")))


def _max_rss() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _current_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Buffers and plain tensor attributes (GPT-J keeps its table as one), not parameters."""
    return list(_named_state_tensors(model).values())


def _named_state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`_state_tensors` by qualified name."""
    named = dict(model.named_buffers(remove_duplicate=False))
    for prefix, module in model.named_modules(remove_duplicate=False):
        named.update({f"{prefix}.{key}" if prefix else key: value for key, value in vars(module).items()
                      if isinstance(value, torch.Tensor)})
    return named


def _prepare(mode: str, model: torch.nn.Module, config: ProfileConfig,
             backend: Any) -> tuple[Callable, Any, _Capture | None]:
    """(what to call, the rope_dedup backend or None, the capturing wrapper or None) for ``mode``;
    ``backend``: the one to share through (``share`` mode) or the model was built under (``sharing``)."""
    from rope_dedup.backend import RopeDedupBackend
    from rope_dedup.share import share

    if mode == "eager":
        return model, None, None
    if mode == "sharing":
        return model, backend, None
    if mode == "share":
        share(model, backend=backend)
        return model, backend, None
    if mode == "compile":
        return torch.compile(model, backend=config.inner), None, None
    if mode == "recompute":  # no table left where a recipe is exact, then compiled with the inner backend alone
        share(model, tables="recompute")
        return torch.compile(model, backend=config.inner), None, None
    backend = RopeDedupBackend(inner=config.inner)
    capture = _Capture(backend)
    if mode == "rope_dedup":
        return torch.compile(model, backend=capture), backend, capture
    blocks = regional_blocks(model, config.regional)
    for i, block in enumerate(blocks):  # regional compile, as torchtitan does it
        blocks[i] = torch.compile(block, backend=capture)  # type: ignore[assignment]
    return model, backend, capture


def regional_blocks(model: torch.nn.Module, path: str) -> torch.nn.ModuleList:
    """The ModuleList at ``path`` (``layers``, ``model.layers``) whose blocks regional mode compiles."""
    try:
        blocks = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"--regional {path}: {type(model).__name__} has no submodule {path!r}") from None
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(f"--regional {path}: {type(blocks).__name__} is not a torch.nn.ModuleList of blocks")
    return blocks


def build_inputs(config: ProfileConfig) -> tuple[torch.nn.Module, tuple, list[torch.Tensor]]:
    """(model in eval mode on its device, example inputs, its RoPE tables) for ``config``.

    Training steps also run in eval mode: dropout would make the modes' outputs differ for no reason.
    """
    torch.manual_seed(0)
    if config.factory is None:
        model = build_model(config)
        tokens = torch.randint(0, _VOCAB, (config.batch, config.seq), device=config.device)
        return model, (tokens,), [t for _, t in toy.rope_tensors(model)]
    model, inputs = build_from_factory(config.factory)
    model = model.to(config.device).eval()
    inputs = tuple(x.to(config.device) if isinstance(x, torch.Tensor) else x for x in inputs)
    return model, inputs, rope_tables(model)


def rope_tables(model: torch.nn.Module) -> list[torch.Tensor]:
    """A user model's RoPE tables, recognized from content (names are not used) among its buffers and
    plain tensor attributes. The ideal is then exact-equality groups of these, as for the toy decoder."""
    from rope_dedup.tables.recognize import is_rope_table

    unique = {id(t): t for t in _state_tensors(model)}.values()
    return [t for t in unique if (t.is_floating_point() or t.is_complex()) and is_rope_table(t)]


def first_tensor(output: Any) -> torch.Tensor:
    """The tensor a model's output leads with (HF ``ModelOutput``s and tuples included)."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise TypeError(f"the model returned {type(output).__name__} with no floating-point tensor to compare or train on")


def training_loss(output: Any) -> torch.Tensor:
    """The model's own loss when it returns one (HF with labels), else the mean square of its first output."""
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else first_tensor(output).float().square().mean()


def _interning_cost(capture: _Capture, step: Callable[[], Any]) -> tuple[float, int] | None:
    """(seconds rope_dedup's wrapper adds to a call at steady state, graph calls per step), or None if
    nothing interns. The wrapper's own time, with the graph made a no-op, over enough calls that the looks
    of its schedule count in proportion (a graph that only reads looks at one call in 64 once settled),
    less the time of calling that no-op graph directly, as dynamo would without the wrapper."""
    from rope_dedup.interning import InterningCallable

    interning = [(fn, args) for fn, args in capture.compiled if isinstance(fn, InterningCallable)]
    if not interning:
        return None
    calls = {id(fn): 0 for fn, _ in interning}
    graphs = {id(fn): fn._compiled for fn, _ in interning}
    for fn, _ in interning:  # count the graph calls of one step, then put each graph back
        def counted(*args: Any, fn: InterningCallable = fn) -> Any:
            calls[id(fn)] += 1
            return graphs[id(fn)](*args)
        fn._compiled = counted
    try:
        step()
    finally:
        for fn, _ in interning:
            fn._compiled = graphs[id(fn)]
    number = 12800  # 200 periods of the widest schedule (64 calls)
    seconds = 0.0
    for fn, args in interning:
        fn._compiled = _no_graph
        try:
            runs = timeit.repeat(lambda: fn(*args), number=number, repeat=5)
        finally:
            fn._compiled = graphs[id(fn)]
        # Less the call the graph gets without the wrapper: what remains is the wrapper's own.
        bare = timeit.repeat(lambda: _no_graph(*args), number=number, repeat=5)
        seconds += max(0.0, statistics.median(runs) - statistics.median(bare)) / number * calls[id(fn)]
    total_calls = sum(calls.values())
    return (seconds / total_calls if total_calls else 0.0), total_calls


def _no_graph(*args: Any) -> None:
    """Stands for a compiled graph while the wrapper around it is timed."""


def _simulated_oom(mode: str, device: str) -> None:
    if mode in os.environ.get("ROPE_DEDUP_PROFILE_OOM", "").split(","):
        torch.empty(1 << 62, dtype=torch.uint8, device=device)


def make_step(run: Callable, model: torch.nn.Module, inputs: tuple, config: ProfileConfig) -> Callable[[], torch.Tensor]:
    """One step of ``run`` on ``inputs``: a no-grad forward, or with ``config.train`` forward, backward and an
    AdamW step of ``model``'s parameters; on CUDA it waits for the device. Returns the output (or the loss)."""
    sync = torch.cuda.synchronize if config.device == "cuda" else (lambda: None)
    if config.train:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def train_step() -> torch.Tensor:
            loss = training_loss(run(*inputs))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            return loss.detach()
        return train_step

    def step() -> torch.Tensor:
        with torch.no_grad():
            out = first_tensor(run(*inputs))
        sync()
        return out
    return step


def measure(config: ProfileConfig, mode: str) -> dict[str, Any]:
    """Build, compile and run ``config``'s model in ``mode`` in this process; every figure as a dict."""
    from rope_dedup.backend import RopeDedupBackend
    from rope_dedup.share import sharing

    torch.set_num_threads(config.threads)
    cuda = config.device == "cuda"
    # Made before the build is measured: the first backend imports dynamo's backends (tens of MB of modules).
    built_under = RopeDedupBackend(inner=config.inner) if mode == "sharing" else None
    rss_before_build = _current_rss()
    if built_under is not None:
        with sharing(backend=built_under):
            model, inputs, tables = build_inputs(config)
    else:
        model, inputs, tables = build_inputs(config)
    ideal = ideal_storage(tables)
    before = toy.unique_storages(tables)
    with torch.no_grad():
        reference = model(*inputs)
        reference = training_loss(reference) if config.train else first_tensor(reference)
    _simulated_oom(mode, config.device)
    peaks = _Peaks(cuda)
    peaks.end_phase("build")
    rss_before_first_call = _current_rss()

    if mode == "share":  # made before the clock starts: the first backend imports dynamo's backends
        built_under = RopeDedupBackend(inner=config.inner)
    if mode == "recompute":
        del tables  # the tables are replaced: this list must not keep them alive
    started = time.perf_counter()
    run, backend, capture = _prepare(mode, model, config, built_under)
    prepare_s = time.perf_counter() - started
    if mode == "recompute":
        tables = recomputed_and_plain_tables(model)
    rss_after_prepare = _current_rss()
    step = make_step(run, model, inputs, config)
    started = time.perf_counter()
    out = step()
    first_call = time.perf_counter() - started
    peaks.end_phase("compile")
    times: list[float] = []
    while len(times) < config.steps or sum(times) < config.step_seconds:
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    peaks.end_phase("steps")
    q1, step_median, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
    interning = _interning_cost(capture, step) if capture is not None else None
    return {
        "mode": mode,
        **storage_figures(tables, before, toy.unique_storages([_held(t) for t in tables]), ideal),
        "buffer_bytes": toy.unique_storages([_held(t) for t in _state_tensors(model)])[1],
        "param_bytes": toy.unique_storages(list(model.parameters()))[1],
        "peak_rss_build": peaks.rss["build"],
        "rss_before_build": rss_before_build,
        "rss_after_share": rss_after_prepare if mode == "share" else None,
        "share_s": prepare_s if mode == "share" else None,
        "peak_rss_compile": peaks.rss["compile"],
        "rss_before_first_call": rss_before_first_call,
        "peak_rss_steps": peaks.rss["steps"],
        "peak_rss_process": peaks.process_peak(),
        "rss_end": _current_rss(),
        "cuda_allocated": torch.cuda.memory_allocated() if cuda else None,
        "cuda_max_allocated_steps": peaks.cuda_max.get("steps"),
        "cuda_max_allocated_process": max(peaks.cuda_max.values()) if cuda else None,
        "first_call_s": first_call,
        "steps": len(times),
        "step_s": step_median,
        "step_s_min": min(times),
        "step_s_quartiles": [q1, q3],
        # Training: the first step's loss (parameters not yet updated) against eager's.
        "max_abs_err_vs_eager": float((out.float() - reference.float()).abs().max()),
        "graphs": backend.graphs_compiled if backend is not None else None,
        # rope_dedup's compile-time cost: its passes and its safety copy of each graph.
        # share mode: the share() call; sharing mode: no separate pass (it runs while the model is built).
        "pass_s": prepare_s if mode == "share" else None if backend is None or mode == "sharing"
        else sum(backend.pass_seconds.values()) + backend.copy_seconds,
        "pass_s_by_pass": dict(backend.pass_seconds, copy_graph=backend.copy_seconds) if backend is not None else None,
        "pass_errors": backend.errors if backend is not None else None,
        "intern_s_per_call": interning[0] if interning else None,
        "intern_calls_per_step": interning[1] if interning else None,
        "intern_overhead": interning[0] * interning[1] / step_median if interning else None,
    }


# The step-time child's references: copies of the inner backend alone, built apart and compiled the same way, whole
# or block by block; a candidate reads against the mean of its reference's copies in each round.
ALONE, ALONE_REGIONAL = "alone", "alone, regional"
REFERENCE = {"rope_dedup": ALONE, "recompute": ALONE, "regional": ALONE_REGIONAL}
OTHERS = "the other copies"  # each copy's reference: the mean of its group's other copies


def copy_name(group: str, i: int) -> str:
    """The step-time child's name of copy ``i`` (from 1) of the reference ``group``."""
    return f"{group} {i}"


def measure_turns(config: ProfileConfig) -> dict[str, Any]:
    """Step time of every timed mode of ``config`` against the inner backend alone, in turns in this process,
    with A/A controls; and the static audit of the model as built. Every figure as a dict.

    Each reference is ``config.copies`` copies built apart: their own weights and code objects, where each
    landed in memory, so the controls carry the noise a candidate's placement does. Copies point their RoPE
    tables at the first copy's: still one table per layer, as the inner backend alone runs it, without another
    copy of every table in memory."""
    torch.set_num_threads(config.threads)
    modes = timed_modes(config)
    first, inputs, tables = build_inputs(config)
    audit = audit_model(first, config)
    groups = {ALONE: [copy_name(ALONE, i + 1) for i in range(config.copies)]}
    if "regional" in modes:
        groups[ALONE_REGIONAL] = [copy_name(ALONE_REGIONAL, i + 1) for i in range(config.copies)]
    steps: dict[str, Callable[[], torch.Tensor]] = {}
    outputs: dict[str, torch.Tensor] = {}
    first_call: dict[str, float] = {}
    references = {name: group for group, names in groups.items() for name in names}
    for name in [*references, *modes]:
        model = first if name == copy_name(ALONE, 1) else build_inputs(config)[0]
        if name in references and model is not first:
            _adopt_tables(model, first, tables)
        regional = name == "regional" or references.get(name) == ALONE_REGIONAL
        if regional:
            own_code(*_blocks_by_class(regional_blocks(model, config.regional)))
        else:
            own_code(model)
        if name in references:
            run: Callable = _compiled_alone(model, config, regional)
        else:
            run = _prepare(name, model, config, None)[0]
        steps[name] = make_step(run, model, inputs, config)
        started = time.perf_counter()  # the first call compiles; a candidate built unshared shares here
        outputs[name] = steps[name]()
        first_call[name] = time.perf_counter() - started
    del first, tables
    rounds = take_turns(steps, config.rounds, timer=cuda_timer if config.device == "cuda" else cpu_timer)
    paired: dict[str, Paired] = {}
    for names in groups.values():
        paired.update(leave_one_out({name: rounds[name] for name in names}))
    controls = {name: paired[name].ratio for name in references}
    for mode in modes:
        paired[mode] = Paired.of(rounds[mode], mean_per_round([rounds[name] for name in groups[REFERENCE[mode]]]))
    return {
        "mode": TURNS,
        "step_s": {name: statistics.median(times) for name, times in rounds.items()},
        "paired": {name: asdict(p) for name, p in paired.items()},
        "reference": {name: REFERENCE.get(name, OTHERS) for name in paired},
        "copies": config.copies,
        "controls": controls,
        "noise": noise(list(controls.values()), config.copies),
        "rounds": config.rounds,
        "first_call_s": first_call,
        "max_abs_err_vs_alone": {name: float((out.float() - outputs[copy_name(ALONE, 1)].float()).abs().max())
                                 for name, out in outputs.items()},
        "audit": audit,
    }


def _adopt_tables(model: torch.nn.Module, first: torch.nn.Module, tables: list[torch.Tensor]) -> None:
    """Point ``model``'s RoPE tables (a copy built apart) at ``first``'s ``tables``, found by name: its own are
    freed."""
    wanted = {id(t) for t in tables}
    theirs = {name: t for name, t in _named_state_tensors(first).items() if id(t) in wanted}
    mine = _named_state_tensors(model)
    with torch.no_grad():
        for name, table in theirs.items():
            mine[name].set_(table.untyped_storage(), table.storage_offset(), table.size(), table.stride())


def _compiled_alone(model: torch.nn.Module, config: ProfileConfig, regional: bool) -> Callable:
    """``model`` compiled with the inner backend alone, whole or block by block."""
    if not regional:
        return torch.compile(model, backend=config.inner)
    blocks = regional_blocks(model, config.regional)
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, backend=config.inner)  # type: ignore[assignment]
    return model


def _blocks_by_class(blocks: torch.nn.ModuleList) -> list[torch.nn.Module]:
    """The blocks of the most common class (a stack of one block class, in the models profiled so far)."""
    classes = [type(block) for block in blocks]
    common = max(set(classes), key=classes.count)
    return [block for block in blocks if type(block) is common]


def audit_model(model: torch.nn.Module, config: ProfileConfig) -> dict[str, Any]:
    """The static audit of ``model`` as built: against each toy layer's own theta, or a factory model's
    transformers config where it has one (else the slot rule alone). One line and the mismatch count."""
    from rope_dedup.audit.explain import explain
    from rope_dedup.audit.spec import RopeSpec

    if config.factory is None:
        # Each layer (a block: layers.0) against the theta its Rope module (layers.0.attention.rope) was built with.
        expect: Any = {name.removesuffix(".attention.rope"): RopeSpec(module.spec.theta)
                       for name, module in model.named_modules() if isinstance(module, toy.Rope)}
        expected = "each layer's theta as built"
    elif getattr(model, "config", None) is not None:
        expect, expected = "config", "the model's config"
    else:
        expect, expected = None, None
    try:
        explanation = explain(model, expect=expect)
    except Exception as error:  # the audit's failure is reported; the figures still print
        return {"error": one_line(error), "expected": expected}
    layers = [row for row in explanation.layers if row.tables]
    return {"layers": len(explanation.layers), "layers_with_tables": len(layers),
            "tables": sum(len(row.tables) for row in explanation.layers), "mismatches": len(explanation.mismatches),
            "first_mismatch": next((f"{m.layer}: {m.field} expected {m.expected}, found {m.found}"
                                    for m in explanation.mismatches), None),
            "expected": expected, "headline": explanation.headline()}


def recomputed_and_plain_tables(model: torch.nn.Module) -> list[torch.Tensor]:
    """After ``share(model, tables="recompute")``: the recomputed tables and the RoPE tables left plain."""
    from rope_dedup.recompute import RecomputedTable

    unique = {id(t): t for t in _state_tensors(model)}.values()
    return [t for t in unique if isinstance(t, RecomputedTable)] + rope_tables(model)


def _held(tensor: torch.Tensor) -> torch.Tensor:
    """What holds a tensor's memory: a recomputed table's frequency vector, else the tensor itself."""
    from rope_dedup.recompute import RecomputedTable

    return tensor.inv_freq if isinstance(tensor, RecomputedTable) and tensor.is_recomputed else tensor


def describe_error(error: BaseException) -> tuple[str, bool]:
    """(one-line description, whether it is an out-of-memory failure)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    oom = (isinstance(error, (MemoryError, torch.OutOfMemoryError))
           or "can't allocate memory" in text or "out of memory" in text.lower())
    if oom:
        return f"out of memory: {text or type(error).__name__}", True
    return one_line(error), False


def _child_main(argv: list[str]) -> int:
    mode, config_json, result_path = argv
    config = ProfileConfig(**json.loads(config_json))
    try:
        result, code = (measure_turns(config) if mode == TURNS else measure(config, mode)), 0
    except Exception as error:  # the parent shows one line per failed mode; the rest still print
        message, oom = describe_error(error)
        result = {"mode": mode, "error": message, "traceback": traceback.format_exc()}
        code = 3 if oom else 1
    Path(result_path).write_text(json.dumps(result))
    return code


# -- the parent ---------------------------------------------------------------------------------------

# Children that compile with one inductor cache, in this order: the inner backend alone compiles cold (its first
# call is what rope_dedup's pass time and first call are held against, and those compile cold in a cache of their
# own), recompute mode reuses its kernels, and the step-time child finds every graph it compiles already built.
SHARED_CACHE = ("compile", "recompute", TURNS)


def run_mode(config: ProfileConfig, mode: str, workdir: str, timeout: float | None = None) -> dict[str, Any]:
    """Run one mode in a fresh interpreter; its figures, or ``{"mode", "error"}`` with one line."""
    result_path = Path(workdir) / f"{mode}.json"
    cache = Path(workdir) / f"{'alone' if mode in SHARED_CACHE else mode}-inductor-cache"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
           "OMP_NUM_THREADS": str(config.threads),
           # glibc moves its mmap threshold up as blocks are freed, so identical runs may keep freed tables in
           # the heap or not: peak RSS then varies by up to all tables' size. A fixed 4 MiB threshold gives
           # tables their own mappings, returned to the OS when freed, in every mode alike.
           "MALLOC_MMAP_THRESHOLD_": str(4 << 20)}
    command = [sys.executable, "-m", "rope_dedup.tools.profile", mode, json.dumps(asdict(config)), str(result_path)]
    try:
        child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {timeout:g} s"}
    if result_path.is_file():
        return json.loads(result_path.read_text())
    return {"mode": mode, "error": _exit_reason(child.returncode, child.stderr)}


def _exit_reason(returncode: int, stderr: str) -> str:
    if returncode == -signal.SIGKILL:
        return "killed by SIGKILL (most likely the kernel's out-of-memory killer)"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "no output")
    return f"exited with status {returncode}: {last.strip()}"


def environment() -> dict[str, Any]:
    """What the figures depend on besides the config."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def run_profile(
    config: ProfileConfig,
    on_start: Callable[[str], None] = lambda mode: None,
    on_done: Callable[[str, dict], None] = lambda mode, result: None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Run every mode of ``config`` one after the other (never concurrently: they would share the CPUs), then,
    if a timed mode is among them, the step-time child (``on_start``/``on_done`` see it as :data:`TURNS`)."""
    before = environment()
    results = {}
    turns = None
    with tempfile.TemporaryDirectory(prefix="rope-dedup-profile-") as workdir:
        for mode in config.modes:
            on_start(mode)
            results[mode] = run_mode(config, mode, workdir, timeout)
            on_done(mode, results[mode])
        if timed_modes(config):
            on_start(TURNS)
            turns = run_mode(config, TURNS, workdir, timeout)
            on_done(TURNS, turns)
    env = {**before, "loadavg_1min_after": environment()["loadavg_1min"]}
    return {"config": asdict(config), "environment": env, "modes": results, "turns": turns,
            "summary": summarize(results, turns)}


def timed_modes(config: ProfileConfig) -> list[str]:
    """The modes of ``config`` whose step the step-time child times against the inner backend alone (none when
    ``config.rounds`` is 0)."""
    return [mode for mode in config.modes if mode in TIMED_MODES] if config.rounds else []


def summarize(results: dict[str, dict], turns: dict[str, Any] | None = None) -> dict[str, Any]:
    """Figures held against the targets: memory of each mode from its own process, against ``compile`` (the
    inner backend alone); step-time ratios and their A/A noise from the step-time child ``turns``."""
    ok = {mode: r for mode, r in results.items() if "error" not in r}
    base, dedup = ok.get("compile"), ok.get("rope_dedup")
    summary: dict[str, Any] = {}
    for mode in ("rope_dedup", "regional"):
        if mode in ok and ok[mode]["ideal_bytes"]:
            summary[f"{mode}_rope_bytes_vs_ideal"] = ok[mode]["rope_bytes"] / ok[mode]["ideal_bytes"]
        if mode in ok and ok[mode]["intern_overhead"] is not None:
            summary[f"{mode}_intern_overhead"] = ok[mode]["intern_overhead"]
    if base and dedup:
        summary["pass_vs_compile"] = dedup["pass_s"] / base["first_call_s"]
        summary["first_call_ratio"] = dedup["first_call_s"] / base["first_call_s"]
        if base["peak_rss_steps"] is not None and dedup["peak_rss_steps"] is not None:
            summary["peak_rss_steps_saved"] = base["peak_rss_steps"] - dedup["peak_rss_steps"]
        summary["peak_rss_process_ratio"] = dedup["peak_rss_process"] / base["peak_rss_process"]
        growth = {mode: first_call_growth(r) for mode, r in (("compile", base), ("rope_dedup", dedup))}
        if None not in growth.values():
            summary["first_call_growth_vs_allowed"] = growth["rope_dedup"] / (  # type: ignore[operator]
                FIRST_CALL_GROWTH_FACTOR * growth["compile"] + FIRST_CALL_GROWTH_SLACK)  # type: ignore[operator]
        summary["rope_bytes_saved"] = base["rope_bytes"] - dedup["rope_bytes"]
    recomputed = ok.get("recompute")
    if recomputed:
        summary["recompute_rope_bytes"] = recomputed["rope_bytes"]
    if turns is not None and "error" not in turns:
        summary["step_noise"] = turns["noise"]
        summary["step_controls"] = list(turns["controls"].values())
        for mode, key in (("rope_dedup", "step_ratio"), ("regional", "regional_step_ratio"),
                          ("recompute", "recompute_step_ratio")):
            if mode in turns["paired"]:
                summary[key] = turns["paired"][mode]["ratio"]
    eager, built, shared = ok.get("eager"), ok.get("sharing"), ok.get("share")
    if eager and built and build_growth(eager) and build_growth(built) is not None:
        summary["sharing_build_growth_vs_eager"] = build_growth(built) / build_growth(eager)  # type: ignore[operator]
    if shared and shared["rss_after_share"] is not None and shared["rope_bytes_before"] > shared["rope_bytes"]:
        freed = shared["rope_bytes_before"] - shared["rope_bytes"]
        if freed >= RSS_READABLE_BYTES:
            rss_freed = shared["rss_before_first_call"] - shared["rss_after_share"]
            summary["share_rss_freed_vs_tables_freed"] = rss_freed / freed
        summary["share_seconds_per_gb"] = shared["share_s"] / (shared["rope_bytes_before"] / 1e9)
    return summary


# Table bytes share() must free before RSS can tell: below this, pages and the heap (a freed block below
# glibc's mmap threshold stays in it until a trim, which share() makes only past this much) move RSS by
# more than the tables do, and the ratio is left out rather than printed as noise.
RSS_READABLE_BYTES = TRIM_THRESHOLD_BYTES

# The pass may raise the first call's peak by at most this much more than the compile alone does: its own
# copies (recognition, the graph copy) must stay small beside the tables it shares.
FIRST_CALL_GROWTH_FACTOR, FIRST_CALL_GROWTH_SLACK = 1.25, 16 << 20


def build_growth(result: dict[str, Any]) -> int | None:
    """How far building the model raised RSS above the process before it, beyond its parameters (the same
    in every mode, and what a small toy decoder's build is mostly made of once its tables are shared)."""
    if result.get("peak_rss_build") is None or result.get("rss_before_build") is None:
        return None
    return max(0, result["peak_rss_build"] - result["rss_before_build"] - result.get("param_bytes", 0))


def first_call_growth(result: dict[str, Any]) -> int | None:
    """How far the first call (compile included) raised RSS above where the built model stood."""
    if result.get("peak_rss_compile") is None or result.get("rss_before_first_call") is None:
        return None
    return max(0, result["peak_rss_compile"] - result["rss_before_first_call"])


TARGETS = (  # (summary key, label, limit, how it is judged)
    ("rope_dedup_rope_bytes_vs_ideal", "RoPE bytes after / ideal", 1.0, "=="),
    ("regional_rope_bytes_vs_ideal", "RoPE bytes after / ideal (regional)", 1.0, "=="),
    ("pass_vs_compile", "pass time / compile time", 0.02, "<="),
    ("rope_dedup_intern_overhead", "interning / step time", 0.02, "<="),
    ("regional_intern_overhead", "interning / step time, regional", 0.02, "<="),
    ("step_ratio", "step time rope_dedup / alone", 1.0, "<="),
    ("regional_step_ratio", "step time rope_dedup / alone, regional", 1.0, "<="),
    ("peak_rss_process_ratio", "peak RSS process rope_dedup / alone", 1.0, "<="),
    ("first_call_growth_vs_allowed", "first-call peak growth / (1.25 x alone + 16 MiB)", 1.0, "<="),
    ("sharing_build_growth_vs_eager", "build peak growth beyond parameters, sharing() / plain", 0.10, "<="),
    ("share_rss_freed_vs_tables_freed", "RSS freed by share() / table bytes freed", 0.70, ">="),
    ("share_seconds_per_gb", "share() seconds per GB of tables", 1.0, "<="),
    ("recompute_rope_bytes", "RoPE bytes left, recompute mode", 1024, "<="),
    ("recompute_step_ratio", "step time recompute / alone", 1.02, "<="),
)
# Ratios of step times: judged against the A/A controls' noise (summary["step_noise"]), never alone.
STEP_TARGETS = ("step_ratio", "regional_step_ratio", "recompute_step_ratio")


def check_targets(summary: dict[str, Any]) -> list[tuple[str, str, float, float, str, str]]:
    """(summary key, label, measured, limit, comparison, verdict) for every target this run measured. The verdict
    is ``met`` or ``not met``; a step-time ratio is ``not met`` only beyond its limit plus the A/A controls'
    noise."""
    rows = []
    for key, label, limit, how in TARGETS:
        if key not in summary:
            continue
        value = summary[key]
        if key in STEP_TARGETS:
            if "step_noise" in summary:  # without A/A controls (a result from separate processes): not judged
                rows.append((key, label, value, limit, how, verdict(value, limit, summary["step_noise"])))
            continue
        met = abs(value - limit) < 1e-9 if how == "==" else value >= limit if how == ">=" else value <= limit
        rows.append((key, label, value, limit, how, "met" if met else "not met"))
    return rows


def mode_label(mode: str, inner: str) -> str:
    """How a mode is shown: ``compile`` is named after its backend (rope_dedup modes compile with it too),
    and told from the ``eager`` mode when that backend is ``eager``."""
    return {"eager": "eager", "compile": "compiled, eager" if inner == "eager" else inner, "rope_dedup": "rope_dedup", "regional": "rope_dedup regional",
            "share": "eager + share()", "sharing": "eager, sharing() build",
            "recompute": f"recompute + {'compiled, eager' if inner == 'eager' else inner}"}[mode]


def turns_label(name: str, inner: str) -> str:
    """How a model of the step-time child is shown: a mode's label, or the inner backend alone's."""
    alone = mode_label("compile", inner)
    groups = {ALONE: f"{alone} alone", ALONE_REGIONAL: f"{alone} alone, regional"}
    if name in groups:
        return f"{groups[name]} (its copies' mean)"
    if name == OTHERS:
        return name
    group, _, i = name.rpartition(" ")
    return f"{groups[group]}, copy {i}" if group in groups else mode_label(name, inner)


def describe_config(config: dict[str, Any]) -> str:
    """One line naming the profiled model and how it ran (``config`` as in the result: a dict)."""
    timed = f"step time over {config['rounds']} rounds in turns" if config.get("rounds") else "no step-time rounds"
    steps = (f"{'training (forward, backward, AdamW) ' if config.get('train') else ''}memory over >= "
             f"{config['steps']} steps and >= {config['step_seconds']:g} s, {timed}")
    if config.get("factory"):
        regional = f", regional blocks {config['regional']}" if "regional" in config["modes"] else ""
        return (f"{config['factory']}(){regional}, {config['device']}, {config['threads']} thread(s); "
                f"step = the factory's inputs, {steps}")
    return (f"toy decoder: {config['layers']} layers, context {config['context']}, head_dim {config['head_dim']}, "
            f"{config['heads']} heads, {config['dtype']} {config['layout']} tables ({config['pattern']}), "
            f"{config['device']}, {config['threads']} thread(s); step = batch {config['batch']} x {config['seq']} "
            f"tokens, {steps}")


def describe_preset(config: ProfileConfig) -> str:
    """A preset in a few words, for ``--help``."""
    return (f"{config.layers} layers, context {config.context}, head_dim {config.head_dim}, {config.dtype} "
            f"{config.layout}, modes {','.join(config.modes)}")


def apply_overrides(config: ProfileConfig, **overrides: Any) -> ProfileConfig:
    """``config`` with every override that is not None."""
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})


if __name__ == "__main__":
    status = _child_main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the result is written: skip teardown (inductor's compile workers take ~2 s to stop)
