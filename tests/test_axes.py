"""Tables over several position axes (rope_dedup/tables/axes.py): each column's axis read from the positions
the tokens sit at, and the table a 1-D sequence gets rebuilt from them; then the audit of transformers' vision
towers and multimodal models built tiny (tests/zoo.py): keys with axes, theta and axes findings, a tower judged
by its own config, and RoPE applied at positions the audit cannot read said so."""

from __future__ import annotations

import pytest
import torch

import rope_dedup
from rope_dedup.tables.axes import axes_label, axis_positions, split_axes
from rope_dedup.tables.recognize import RopeTable, recognize_rope_table

F = 8
FREQS = 1.0 / (100.0 ** (torch.arange(0, 2 * F, 2, dtype=torch.float64) / (2 * F)))


def _grid(height: int, width: int) -> torch.Tensor:
    """(2, h*w) positions of a patch grid, in a shuffled token order: the order must not matter."""
    h, w = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    order = torch.randperm(height * width, generator=torch.Generator().manual_seed(0))
    return torch.stack([h.flatten(), w.flatten()])[:, order]


def _columns(positions: torch.Tensor, axes: list[int], freqs: torch.Tensor) -> torch.Tensor:
    """cos of each token's angle per column: column j rotates by axis ``axes[j]`` at frequency ``freqs[j]``."""
    return torch.cos(positions[axes].t().to(torch.float64) * freqs)


def test_a_2d_axial_table_is_read_axis_by_axis() -> None:
    positions = _grid(5, 6)
    axes, freqs = [0] * F + [1] * F, torch.cat([FREQS, FREQS])
    half = _columns(positions, axes, freqs)
    rows, of_column, start = split_axes(torch.cat([half, half], dim=-1), positions)  # Qwen-VL: cat(h, w) twice
    assert of_column == tuple(axes + axes) and start == 0
    assert axes_label(of_column, 2) == "h8,w8,h8,w8"
    # Row p is every column at position p of its own axis: 5 rows, as far as both axes reach.
    expected = torch.cos(torch.arange(5, dtype=torch.float64)[:, None] * freqs)
    assert torch.equal(rows, torch.cat([expected, expected], dim=-1))
    assert isinstance(recognize_rope_table(rows), RopeTable)


def test_alternating_axes_are_named_so() -> None:
    positions = _grid(4, 4)
    axes = [j % 2 for j in range(2 * F)]  # Pixtral / SAM: the axes take turns
    _, of_column, _ = split_axes(_columns(positions, axes, torch.cat([FREQS, FREQS])), positions)
    assert of_column == tuple(axes)
    assert axes_label(of_column, 2) == "h,w alternating"


def test_mrope_sections_with_an_image_in_the_text() -> None:
    # Text at 0..5, a 2x3 image at t=6 (h 6..7, w 6..8), text again from 9: M-RoPE's 3-D position_ids.
    t = list(range(6)) + [6] * 6 + list(range(9, 13))
    h = list(range(6)) + [6, 6, 6, 7, 7, 7] + list(range(9, 13))
    w = list(range(6)) + [6, 7, 8, 6, 7, 8] + list(range(9, 13))
    positions = torch.tensor([t, h, w])
    axes = [0] * 4 + [1] * 2 + [2] * 2  # mrope_section [4, 2, 2]
    rows, of_column, _ = split_axes(_columns(positions, axes, FREQS), positions)
    assert axes_label(of_column, 3) == "t4,h2,w2"
    assert torch.equal(rows, torch.cos(torch.arange(7, dtype=torch.float64)[:, None] * FREQS))  # t has 0..6, not 7


def test_an_axis_that_numbers_the_tokens_does_not_take_every_column() -> None:
    # HunYuan-VL: the first of 4 axes is the token index, which every column is trivially a function of.
    positions = torch.stack([torch.arange(16), *_grid(4, 4), torch.zeros(16, dtype=torch.int64)])
    positions[3, 8:] = 1
    axes = [0] * 2 + [1] * 2 + [2] * 2 + [3] * 2
    _, of_column, _ = split_axes(_columns(positions, axes, FREQS), positions)
    assert of_column == tuple(axes)
    assert axes_label(of_column, 4) == "0:2,1:2,2:2,3:2"


def test_a_grid_counted_from_1_starts_there() -> None:
    positions = _grid(4, 4) + 1  # Muse's vision tower
    rows, _, start = split_axes(_columns(positions, [0] * F + [1] * F, torch.cat([FREQS, FREQS])), positions)
    assert start == 1 and rows.shape[0] == 4  # positions 1..4


def test_positions_that_do_not_explain_the_rows_give_nothing() -> None:
    positions = _grid(4, 4)
    assert split_axes(torch.rand(16, 2 * F, generator=torch.Generator().manual_seed(1)), positions) is None
    text = torch.arange(16).expand(3, 16)  # text-only M-RoPE: every axis the same, a 1-D table
    assert split_axes(_columns(text, [0] * F, FREQS), text) is None


def test_axis_positions_take_axes_first_or_last() -> None:
    assert torch.equal(axis_positions(torch.arange(6).reshape(3, 2), 3), torch.tensor([[0, 2, 4], [1, 3, 5]]))
    assert torch.equal(axis_positions(torch.arange(6).reshape(3, 1, 2), 2), torch.arange(6).reshape(3, 2))
    assert axis_positions(torch.arange(5), 5) is None


# -- judged against a transformers config: the vision tower and the multimodal text of GLM-4.1V ---------------

def _glm4v_vision():
    pytest.importorskip("transformers")
    import zoo

    tiny = zoo.build("glm4v_vision")
    assert isinstance(tiny, zoo.Tiny), tiny.reason
    return tiny, tiny.model.rotary_pos_emb


def _findings(tiny) -> list[str]:
    import zoo

    return zoo.lines(rope_dedup.explain(tiny.model, expect="config", **tiny.inputs))


def test_a_2d_axial_tower_is_keyed_by_its_axes_and_judged_clean() -> None:
    tiny, _ = _glm4v_vision()
    audit = rope_dedup.explain(tiny.model, expect="config", **tiny.inputs)
    assert audit.mismatches == ()
    keys = {str(table.key) for table in audit.applied if table.layer.startswith("blocks.")}
    assert keys == {"theta=10000 dim=128 len=4 float32 cpu cos-halves|sin-halves axes=h32,w32"}


def test_a_vision_tower_with_another_theta_is_a_theta_finding() -> None:
    tiny, rotary = _glm4v_vision()
    count = rotary.inv_freq.numel()
    rotary.inv_freq.copy_(1.0 / 1e5 ** (torch.arange(count, dtype=torch.float32, device="cpu") / count))
    found = _findings(tiny)
    # 4 positions per axis pin theta roughly (the key's 1e5 reads 11550): the field and the expected value are sure.
    assert [line.split(", found")[0] for line in found] == [f"blocks.{i}: theta: expected 10000" for i in (0, 1)]


def test_columns_on_other_axes_than_the_recomposition_puts_there_are_an_axes_finding() -> None:
    tiny, rotary = _glm4v_vision()
    forward = rotary.forward

    def swapped(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # A forward that bypasses its class's layout: (w, h, w, h) blocks where recomposition_frequencies says (h, w, h, w).
        return tuple(torch.cat([t[..., 32:64], t[..., :32], t[..., 96:], t[..., 64:96]], dim=-1)
                     for t in forward(x, position_ids))

    rotary.forward = swapped
    # The values at equal positions are right: only the axes tell the bug.
    assert _findings(tiny) == [f"blocks.{i}: axes: expected h32,w32, found w32,h32" for i in (0, 1)]


class _CoordinateRope(torch.nn.Module):
    """Attention whose angles run over patch-centre coordinates in [-1, 1] (DINOv3), not whole positions."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
        self.register_buffer("inv_freq", 1.0 / 100.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        coords = torch.linspace(-1.0, 1.0, x.shape[1], dtype=torch.float32, device=x.device)
        angles = torch.cat([coords[:, None] * self.inv_freq] * 2, dim=-1) * 6.283185307179586
        q = self.q(x)
        rotated = torch.cat([-q[..., 8:], q[..., :8]], dim=-1)
        return q * angles.cos() + rotated * angles.sin()


def test_rope_applied_at_positions_the_audit_cannot_read_is_said_so() -> None:
    model = torch.nn.Sequential(_CoordinateRope(), _CoordinateRope())
    audit = rope_dedup.explain(model, torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(0)),
                               expect=rope_dedup.RopeSpec(100.0))
    (finding,) = audit.mismatches
    assert (finding.layer, finding.field) == ("(model)", "rope")
    assert finding.found.startswith("RoPE applied that the audit cannot measure (0: computed in 0")
    assert [layer for layer, _ in audit.unmeasured] == ["0: computed in 0", "1: computed in 1"]
    assert "applied but in a layout the audit does not measure (2):" in str(audit)


def test_a_tower_inside_a_multimodal_model_is_judged_by_its_own_config() -> None:
    pytest.importorskip("transformers")
    import zoo

    tiny = zoo.build("glm4v")  # M-RoPE text with an image span, and the 2-D axial vision tower that reads it
    assert isinstance(tiny, zoo.Tiny), tiny.reason
    rotary = tiny.model.visual.rotary_pos_emb
    count = rotary.inv_freq.numel()
    rotary.inv_freq.copy_(1.0 / 1e5 ** (torch.arange(count, dtype=torch.float32, device="cpu") / count))
    found = _findings(tiny)
    assert [line.split(", found")[0] for line in found] == [f"visual.blocks.{i}: theta: expected 10000" for i in (0, 1)]


def test_an_image_towers_plain_theta_is_read_as_1d_or_per_axis_of_its_grid() -> None:
    pytest.importorskip("transformers")
    import zoo

    tiny = zoo.build("dinov3_vit")  # rope_theta 100, head_dim 64: head_dim/4 frequencies per axis of the grid
    assert isinstance(tiny, zoo.Tiny), tiny.reason
    rotary = tiny.model.rope_embeddings

    def static(theta: float, frequencies: int) -> list[str]:
        exponents = torch.arange(frequencies, dtype=torch.float32, device="cpu") / frequencies
        rotary.inv_freq = 1.0 / theta ** exponents
        return zoo.lines(rope_dedup.explain(tiny.model, expect="config"))

    assert static(100.0, 16) == []  # DINOv3's own: 2-D, half the head per axis
    assert static(100.0, 32) == []  # 1-D over the patches, the whole head
    assert [line.split(", found")[0] for line in static(1e4, 16)] == ["rope_embeddings: theta: expected 100"]
    assert [line.split(", found")[0] for line in static(100.0, 8)] == ["rope_embeddings: rotary_dim: expected 64"]
