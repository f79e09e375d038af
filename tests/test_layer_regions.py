"""Per-layer compile regions (``layer_regions``, ``compilation.regions``): compile_piecewise
traces each region of ``models.DecoderLayer`` once, reuses it for the other layers and
inlines the calls, so the pieces are those of a trace without regions."""

from __future__ import annotations

import itertools

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import layer_regions
from inductor_rocm_attn.compilation import compile_piecewise
from inductor_rocm_attn.compilation.regions import inline_regions
from inductor_rocm_attn.models import TinyDecoder, qwen3_config

LAYERS = 3
_names = itertools.count()

needs_regions = pytest.mark.skipif(not layer_regions.available(), reason="this torch has no layer regions")
needs_nested = pytest.mark.skipif(layer_regions._NESTED is None,
                                  reason="torch.compiler.nested_compile_region is missing (torch < 2.8)")
# The ways to reuse a region's trace this torch can run: ours (stamp) everywhere, Dynamo's own
# (nested) where it reuses region traces (torch 2.13; torch 2.11 traces each call again).
MODES = ["stamp"] + (["nested"] if layer_regions._dynamo_reuses_regions() else [])


def _model(prefix: str) -> TinyDecoder:
    torch.manual_seed(0)
    model = TinyDecoder(qwen3_config(num_layers=LAYERS), name=f"{prefix}{next(_names)}").eval()
    ira.bind_kv_caches(model, 32, torch.float32, "cpu")
    return model


def _compile(model: TinyDecoder):
    return compile_piecewise(model, capture_sizes=[1, 2, 4], max_num_seqs=4, max_model_len=64, trace_cache=False)


def _piece_graphs(runner, model_name: str) -> list[str]:
    """Each submodule's graph, the model's name (in the layer names) replaced."""
    return [str(m.graph).replace(model_name, "<model>") for _, m in sorted(runner.split_gm.named_children())]


def _compile_in_mode(model: TinyDecoder, mode: str | None):
    saved = layer_regions.MODE
    layer_regions.MODE = mode  # None: tracing() leaves the region path off (the flat trace)
    try:
        return _compile(model)
    finally:
        layer_regions.MODE = saved


@pytest.fixture(scope="module")
def flat_runner():
    flat = _model("flat")
    return _compile_in_mode(flat, None), flat


@pytest.fixture(scope="module", params=MODES)
def runners(request, flat_runner):
    with_regions = _model(f"regions_{request.param}")
    return (_compile_in_mode(with_regions, request.param), with_regions), flat_runner


@needs_regions
def test_each_region_is_traced_once_and_reused(runners):
    (runner, _), (flat_runner, _) = runners
    assert (runner.stats.region_calls, runner.stats.region_subgraphs) == (2 * LAYERS, 2)
    assert (flat_runner.stats.region_calls, flat_runner.stats.region_subgraphs) == (0, 0)


@needs_regions
def test_pieces_equal_those_of_a_trace_without_regions(runners):
    (runner, model), (flat_runner, flat) = runners
    assert _piece_graphs(runner, model.layers[0].attn.layer_name.split(".")[0]) == \
        _piece_graphs(flat_runner, flat.layers[0].attn.layer_name.split(".")[0])
    assert [len(g) for g in runner.stats.piece_groups] == [1, LAYERS - 1, 1]
    assert not any(n.op == "get_attr" for n in runner.split_gm.graph.nodes)


@needs_regions
def test_outputs_equal_those_of_a_trace_without_regions(runners):
    """A prefill step, then a decode step over what it cached (the caches start poisoned)."""
    (runner, model), (flat_runner, flat) = runners
    ids = torch.randint(0, 512, (4,))
    for m in (model, flat):
        ira.bind_kv_caches(m, 32, torch.float32, "cpu", poison=True)
    for step, (query_lens, context_lens) in enumerate((([2, 2], [0, 0]), ([1, 1], [2, 2]))):
        out = []
        for r in (runner, flat_runner):
            md = r.prepare(query_lens, context_lens, [[0, 1], [2, 3]])
            out.append(r(ids[:sum(query_lens)], md).clone())
        assert torch.isfinite(out[0]).all(), f"step {step}"
        torch.testing.assert_close(out[0], out[1], rtol=0, atol=0, msg=f"step {step}")


@needs_regions
def test_a_plain_torch_compile_takes_no_region_path():
    """Outside compile_piecewise's trace a layer runs its code inline (the fusion passes of a
    whole-model compile must see a layer's RoPE next to its cache update)."""
    model = _model("plain")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, 512, (4,))
    md = ira.build_attention_metadata([4], [0], [[0]], model.layers[0].attn.block_size)
    torch._dynamo.reset()
    with torch.no_grad(), ira.set_forward_context(md):
        torch.compile(model, backend=backend, fullgraph=True)(ids, md.positions)
    assert not layer_regions.active()
    assert inline_regions(graphs[0]) == (0, 0)


@needs_regions
def test_a_region_trace_that_fails_warns_and_traces_without_regions(monkeypatch):
    """A torch whose nested_compile_region cannot trace a layer's region: the model is traced
    again without its regions (the flat trace's cost), with a warning naming the failure."""
    from inductor_rocm_attn import models

    def failing_region(layer, positions, hidden):
        raise RuntimeError("this region cannot be traced")

    monkeypatch.setattr(models, "_qkv_region", failing_region)
    model = _model("fallback")
    with pytest.warns(UserWarning, match="per-layer compile regions failed.*tracing again without them"):
        runner = _compile(model)
    assert runner.stats.region_calls == 0
    assert [len(g) for g in runner.stats.piece_groups] == [1, LAYERS - 1, 1]
    md = runner.prepare([2], [0], [[0]])
    assert torch.isfinite(runner(torch.tensor([1, 2]), md)).all()


def test_a_failure_of_the_model_itself_is_raised_once_traced_flat(monkeypatch):
    """A model that cannot be traced at all fails with its own error (after the flat retry)."""
    from inductor_rocm_attn import models

    def broken(layer, positions, hidden):
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(models.DecoderLayer, "qkv", broken)
    monkeypatch.setattr(models, "_qkv_region", broken)
    with pytest.raises(Exception, match="the model is broken"):
        _compile(_model("broken"))


def test_a_model_without_regions_is_traced_once(monkeypatch):
    """A model none of whose modules takes a region path (``compile_regions``) is traced flat
    once: its own trace failure comes with no retry and no warning blaming the regions."""
    import contextlib
    import warnings

    from inductor_rocm_attn import models

    def broken(layer, positions, hidden):
        raise RuntimeError("the model is broken")

    model = _model("unmarked")
    for m in model.modules():
        if hasattr(m, "compile_regions"):
            m.compile_regions = False
    entered = []
    monkeypatch.setattr(layer_regions, "tracing", lambda *a: (entered.append(1), contextlib.nullcontext())[1])
    monkeypatch.setattr(models.DecoderLayer, "qkv", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning here would blame the regions
        with pytest.raises(Exception, match="the model is broken"):
            _compile(model)
    assert not entered  # traced flat from the start


@needs_nested
def test_inlining_keeps_a_regions_in_place_ops():
    """An in-place op on a region's intermediate has no users in the graph (a MoE block's
    ``add_`` of the expert biases): inlining keeps it, and drops only unused size reads."""
    @torch.compiler.nested_compile_region
    def biased(x, bias):
        n = x.size(0)
        y = x * 2
        y.add_(bias)
        y[0].mul_(3)
        return y[:n]

    graphs = []

    def backend(gm, example_inputs):
        inline_regions(gm)
        graphs.append(gm)
        return gm.forward

    x, bias = torch.randn(4, 3), torch.randn(3)
    torch._dynamo.reset()
    out = torch.compile(lambda a, b: biased(biased(a, b), b), backend=backend, fullgraph=True)(x, bias)
    torch.testing.assert_close(out, biased(biased(x, bias), bias), rtol=0, atol=0)
    assert sum(n.target in ("add_", "mul_") for n in graphs[0].graph.nodes) == 4
