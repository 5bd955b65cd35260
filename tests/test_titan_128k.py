"""The torchtitan #4111 case: 40 layers, 128K context, head_dim 128, fp32 complex freqs_cis per layer."""

from __future__ import annotations

import pytest
import torch
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, rope_tensors, unique_storages

from rope_dedup import RopeDedupBackend

TABLE_BYTES = 131072 * 64 * 8  # (positions, head_dim / 2) complex64: 67,108,864 bytes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["whole", "regional"])
def test_forty_layers_128k_end_with_one_table(mode: str) -> None:
    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(40, layout="complex", max_len=131072), d_model=256, heads=2)
    tables = [t for _, t in rope_tensors(model)]
    assert unique_storages(tables) == (40, 40 * TABLE_BYTES)
    tokens = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        expected = model(tokens)
        backend = RopeDedupBackend("eager")
        if mode == "regional":
            for i, block in enumerate(model.layers):
                model.layers[i] = torch.compile(block, backend=backend)
            out = model(tokens)
        else:
            out = torch.compile(model, backend=backend)(tokens)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert unique_storages(tables) == (1, TABLE_BYTES)
    report = backend.report
    assert (report.bytes_before, report.bytes_after) == (40 * TABLE_BYTES, TABLE_BYTES)
