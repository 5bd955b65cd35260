"""Recognition does not depend on how a table was computed, nor on which kernel rounded it.

Model code computes a RoPE table in float32 by several routes: ``outer``, HF's ``inv_freq @ positions``
matmul, ``einsum``, a broadcast multiply, with frequencies from float32 ``pow`` or computed in float64 and
cast; then ``cos``/``sin`` in float32, or the whole table in float64 and cast. Each route rounds
differently, and so do the kernels under it: torch's vectorized CPU ``cos`` has been seen to return, in
a fresh process, values off by up to 1.5e-4 at angles near 500 rad (an error that grows with the angle,
as from a coarse range reduction) where another call of the same op was off by 3.6e-8. Recognition must
accept every such table (the same decision every run), and still refuse what is not RoPE.

:func:`sloppy_cos` stands in for that kernel, deterministically: the exact cos of the float32 angle moved
by up to ``SLOPPY`` float32 ulps-per-radian of itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_dedup.tables.keys import infer_key
from rope_dedup.tables.recognize import NotRope, RopeTable, recognize_rope_table

PATHS = ("outer", "matmul", "einsum", "broadcast", "pow32", "float64_cast", "sloppy_cos")
# Five float32 ulps of the angle: the 1.5e-4 seen at 511 rad is 2.5 of them; twice that is the margin.
SLOPPY = 5 * 2.0**-24


def frequencies(theta: float, dim: int, path: str, device: torch.device) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device)
    if path == "pow32":  # all in float32, as most model code writes it
        return 1.0 / (theta ** (exponents.float() / dim))
    return (1.0 / theta ** (exponents.double() / dim)).float()  # float64, cast


def sloppy_cos(angles: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of float32 ``angles`` with an error that grows with the angle, as a coarse kernel's."""
    wobble = torch.rand(angles.shape, generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu")
    exact = angles.double() * (1 + SLOPPY * (2 * wobble.to(angles.device, torch.float64) - 1))
    return exact.cos().float(), exact.sin().float()


def table(path: str, theta: float, dim: int, length: int, seed: int = 0,
          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 tables of shape (length, dim / 2), computed by ``path``."""
    device = torch.device(device)
    freqs = frequencies(theta, dim, path, device)
    positions = torch.arange(length, dtype=torch.float32, device=device)
    if path == "float64_cast":
        angles64 = torch.outer(positions.double(), freqs.double())
        return angles64.cos().float(), angles64.sin().float()
    if path == "matmul":  # HF: inv_freq[None, :, None] @ position_ids[:, None, :], then transposed
        angles = (freqs[None, :, None] @ positions[None, None, :]).transpose(1, 2)[0]
    elif path == "einsum":
        angles = torch.einsum("i,j->ij", positions, freqs)
    elif path == "broadcast":
        angles = positions[:, None] * freqs[None, :]
    else:
        angles = torch.outer(positions, freqs)
    if path == "sloppy_cos":
        return sloppy_cos(angles, seed)
    return angles.cos(), angles.sin()


LAYOUTS = ("cos", "sin", "cos_sin_halves", "complex")


def arrange(cos: torch.Tensor, sin: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    if layout == "cos":
        return cos.to(dtype)
    if layout == "sin":
        return sin.to(dtype)
    if layout == "complex":
        return torch.complex(cos, sin).to(torch.complex64)
    return torch.cat([torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)], -1).to(dtype)


def assert_recognized(tensor: torch.Tensor, theta: float, dim: int) -> None:
    found = recognize_rope_table(tensor)
    assert isinstance(found, RopeTable), f"refused: {found.reason}"
    key = infer_key(found, tensor)
    assert key.dim == dim
    if not found.rough and tensor.dtype in (torch.float32, torch.complex64):
        assert abs(key.theta / theta - 1) < 2e-3, key


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    path=st.sampled_from(PATHS),
    theta=st.sampled_from([1e4, 5e5, 1e6, 12345.0, 500.0]),
    dim=st.sampled_from([8, 16, 32, 64, 128]),
    length=st.sampled_from([2, 3, 17, 256, 512, 4096, 32768]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_every_route_to_a_table_is_recognized(path: str, theta: float, dim: int, length: int, dtype: torch.dtype,
                                             layout: str, seed: int) -> None:
    cos, sin = table(path, theta, dim, length, seed)
    tensor = arrange(cos, sin, layout, dtype)
    found = recognize_rope_table(tensor)
    if length < 3 and dtype != torch.float32:
        return  # two positions of a half-precision table pin nothing: either answer is honest
    assert isinstance(found, RopeTable), f"refused: {found.reason}"
    assert_recognized(tensor, theta, dim)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_long_tables_are_recognized(path: str, layout: str) -> None:
    cos, sin = table(path, 5e5, 64, 1 << 17)
    assert_recognized(arrange(cos, sin, layout, torch.float32), 5e5, 64)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", PATHS)
def test_a_million_rows_are_recognized(path: str, dtype: torch.dtype) -> None:
    cos, sin = table(path, 1e6, 128, 1 << 20)
    assert_recognized(arrange(cos, sin, "cos_sin_halves", dtype), 1e6, 128)


@pytest.mark.parametrize("path", PATHS)
def test_what_is_not_rope_is_still_refused(path: str) -> None:
    cos, sin = table(path, 1e4, 64, 512)
    generator = torch.Generator().manual_seed(0)
    swapped = cos.clone()
    swapped[100:] = torch.roll(cos[100:], 1, dims=1)  # columns shuffled past position 100
    noisy = cos + 1e-2 * torch.randn(cos.shape, generator=generator)
    bent = torch.outer(torch.arange(512, dtype=torch.float32) ** 1.01, frequencies(1e4, 64, path, cos.device)).cos()
    for impostor in (swapped, noisy, bent, torch.rand(512, 32, generator=generator)):
        assert isinstance(recognize_rope_table(impostor), NotRope)


@pytest.mark.parametrize("path", PATHS)
def test_tables_computed_on_the_test_device_are_recognized(path: str, device: torch.device) -> None:
    """On CUDA each route runs CUDA's kernels (matmul, cos, sin round differently there)."""
    for length in (512, 1 << 16):
        cos, sin = table(path, 5e5, 128, length, device=device)
        for layout in LAYOUTS:
            assert_recognized(arrange(cos, sin, layout, torch.float32), 5e5, 128)


DECISIONS = textwrap.dedent("""
    import torch
    from rope_dedup import RopeDedupBackend, share
    from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, local_global, rope_tensors
    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(6, max_len=512) + local_global(6, layout="hf_halves", max_len=512))
    report = share(model, backend=RopeDedupBackend("eager"))
    storages = len({t.untyped_storage().data_ptr() for _, t in rope_tensors(model)})
    print(storages, len(report.groups), sorted(s.path for s in report.skipped if "rope" in s.path))
""")


def test_the_same_model_gets_the_same_decision_in_every_process() -> None:
    """Fresh processes, where the first kernels run cold: every one shares the same way."""
    runs = [subprocess.run([sys.executable, "-c", DECISIONS], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            for threads in (1, 2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    outputs = {run.stdout for run in runs}
    assert len(outputs) == 1, outputs
    assert outputs.pop().startswith("6 6 []")  # theta 1e4 cos, sin; two thetas x cos, sin: nothing skipped
