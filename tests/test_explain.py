"""rope_dedup.audit.explain: per-layer keys, the odd layer marked, skips with reasons, and nothing shared."""

from __future__ import annotations

import torch
from rope_dedup.testing.toy_decoder import TableRecipe, ToyDecoder, homogeneous, local_global, rope_tensors, unique_storages

from rope_dedup import RopeDedupBackend, RopeSpec, explain
from rope_dedup.audit.explain import split_layer

TOKENS = torch.randint(0, 64, (1, 8))


def test_local_global_is_described_as_a_pattern_not_as_odd_layers() -> None:
    model = ToyDecoder(local_global(6, every=3, max_len=64))
    result = explain(model, TOKENS)
    assert result.odd_layers == []
    assert result.pattern == ("layers follow a pattern that repeats every 3 layers (not marked as odd):\n"
                              "  layers.2, layers.5: theta 1e+06 (layers.0, layers.1, layers.3, layers.4: 10000)")
    thetas = {row.layer: {t.key.theta for t in row.tables} for row in result.layers}
    assert thetas["layers.0"] == {1e4} and thetas["layers.5"] == {1e6}
    assert {row.layer: {t.key.theta for t in row.applied} for row in result.layers} == thetas
    # cos and sin of the local layers, cos and sin of the global ones
    assert sorted(len(members) for members in result.groups.values()) == [2, 2, 4, 4]
    text = str(result)
    assert result.pattern in text and " *" not in text


def test_a_broken_pattern_marks_the_layer_that_breaks_it() -> None:
    specs = local_global(6, every=3, max_len=64)
    specs[4] = specs[5]  # a local layer given the global theta: no period any more, 3 local vs 3 global
    result = explain(ToyDecoder(specs + [specs[0]] * 2), TOKENS)  # 5 local, 3 global: a majority
    assert result.pattern is None
    assert [row.layer for row in result.odd_layers] == ["layers.2", "layers.4", "layers.5"]
    assert result.odd_layers[0].differs == ("theta 1e+06 (most layers: 10000)",)


def test_no_majority_is_said_and_nobody_is_marked() -> None:
    result = explain(ToyDecoder(homogeneous(1, max_len=64) + homogeneous(1, theta=1e6, max_len=64)), TOKENS)
    assert result.odd_layers == []
    assert result.pattern == ("no majority among the layers (not marked as odd):\n"
                              "  layers.1: theta 1e+06 (layers.0: 10000)")


def test_a_theta_that_never_reached_one_layer_is_flagged() -> None:
    model = ToyDecoder(homogeneous(5, theta=5e5, max_len=64) + [TableRecipe(max_len=64)])
    odd = explain(model, TOKENS).odd_layers
    assert [(row.layer, row.differs) for row in odd] == [("layers.5", ("theta 10000 (most layers: 500000)",))]


def test_shares_nothing_and_lists_every_skip_with_its_reason() -> None:
    specs = homogeneous(2, layout="inv_freq", max_len=64) + [TableRecipe(layout="lazy_cache", max_len=64)]
    model = ToyDecoder(specs)
    tables = [t for _, t in rope_tensors(model)]
    before = unique_storages(tables)
    result = explain(model, tokens=TOKENS)
    assert unique_storages(tables) == before
    assert [(s.path, s.reason.split(" (")[0]) for s in result.skipped] == [
        ("layers.2.attention.rope.cached_freqs", "written in the graph")]
    assert result.parameters_skipped == len(list(model.parameters()))
    # the forward never reads original_inv_freq: not examined, and said so
    assert result.unread == ("layers.0.attention.rope.original_inv_freq", "layers.1.attention.rope.original_inv_freq")
    assert result.report.bytes_before > result.report.bytes_after  # what sharing *would* save


def test_audits_do_not_use_up_the_models_recompile_slots() -> None:
    # Dynamo stops compiling a code object after 8 entries; audits must not leave theirs on forward.
    for _ in range(9):
        assert explain(ToyDecoder(homogeneous(2, max_len=64)), TOKENS).layers
    backend = RopeDedupBackend("eager")
    with torch.no_grad():
        torch.compile(ToyDecoder(homogeneous(2, max_len=64)), backend=backend)(TOKENS)
    assert backend.graphs_compiled == 1


def test_split_layer() -> None:
    assert split_layer("layers.12.attention.rope.cos") == ("layers.12", "attention.rope.cos")
    assert split_layer("rope.freqs_cis") == ("rope", "freqs_cis")
    assert split_layer("freqs_cis") == ("(model)", "freqs_cis")


def test_the_audit_caller_has_findable_source() -> None:
    """torch 2.12 and older wrap (and trace through) any callable whose source file inspect cannot find,
    which hid the model's sources from the audit (persistence unreadable: 7 audit tests failed there).
    The generated caller's source is registered, so every torch compiles it as a plain function."""
    import inspect

    from rope_dedup.audit.explain import _fresh_caller

    caller = _fresh_caller(ToyDecoder(homogeneous(1)), 1, [])
    assert inspect.getsourcefile(caller) == "<rope_dedup.explain>"
    assert "return model(input0)" in inspect.getsource(caller)


def call_layer(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One function every model below calls its layers through, as transformers' models all call theirs
    through ``GradientCheckpointingLayer.__call__``: one code object for all of them."""
    return layer(x)


def _breaking_model(kind: int) -> torch.nn.Module:
    """A toy decoder of a class of its own whose blocks break the graph and are called through
    :func:`call_layer`: dynamo compiles that shared frame once per class audited."""
    block = type(f"Block{kind}", (torch.nn.Module,), {
        "__init__": lambda self, inner: (torch.nn.Module.__init__(self), setattr(self, "inner", inner))[0],
        "forward": lambda self, x: (torch._dynamo.graph_break(), self.inner(x))[1],
    })
    model = ToyDecoder(homogeneous(2, max_len=64))
    for i, inner in enumerate(model.layers):
        model.layers[i] = block(inner)

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        x = model.embed(tokens)
        for layer in model.layers:
            x = call_layer(layer, x)
        return model.head(model.norm(x))

    model.forward = forward
    return model


def test_an_audit_does_not_depend_on_how_many_were_compiled_before() -> None:
    """The ninth architecture through a shared frame hit dynamo's recompile_limit, which made that frame
    and all it calls run eagerly for the rest of the process: the audit then traced nothing (issue 31:
    higgs_audio_v2 then jetmoe). Each audit now has a recompile budget of its own, and leaves the
    user's compiles theirs."""
    limit = torch._dynamo.config.recompile_limit
    for kind in range(limit + 2):
        found = explain(_breaking_model(kind), TOKENS, expect=RopeSpec(1e4))
        assert found.mismatches == () and [t.layer for t in found.applied] == ["layers.0", "layers.1"], kind
    backend = RopeDedupBackend("eager")
    with torch.no_grad():
        torch.compile(_breaking_model(limit + 2), backend=backend)(TOKENS)
    assert backend.graphs_compiled > 0


class _ApplyRope(torch.nn.Module):
    """What transformers 5.25's ``kernels`` hub makes of a model file's ``apply_rotary_pos_emb``: one module at
    module level, called from every layer."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated = torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)
        return x * cos + rotated * sin


APPLY_ROPE = _ApplyRope()


class _HubLayer(torch.nn.Module):
    def __init__(self, theta: float) -> None:
        super().__init__()
        angles = torch.outer(torch.arange(64.0), 1.0 / theta ** (torch.arange(0, 16, 2).float() / 16))
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        return self.proj(APPLY_ROPE(x, self.cos[:seq], self.sin[:seq]))


class _HubModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList(_HubLayer(theta) for theta in (1e4, 1e4, 1e6))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_module_level_rope_function_module_does_not_take_the_layers_tables() -> None:
    """The dynamic audit names the layer that applies a table, not the module-level module it calls (on 5.25
    every layer's RoPE was credited to ``apply_rotary_pos_emb``, and findings on layers went unseen)."""
    result = explain(_HubModel(), TOKENS)
    assert sorted({t.layer for t in result.applied}) == ["layers.0", "layers.1", "layers.2"]
    assert [row.layer for row in result.odd_layers] == ["layers.2"]
