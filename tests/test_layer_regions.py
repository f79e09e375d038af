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


# --- stamp mode: our own reuse where Dynamo traces every region call (torch 2.11) ----------


def test_stamp_mode_traces_each_later_layer_as_one_call(monkeypatch):
    """Stamp mode: Dynamo traces the first layer's regions and sees each later layer's
    region as one opaque call (``region_copy``), stamped out after the trace: no region call
    is left for Dynamo to trace (nor to dedup) and no marker is left in the pieces."""
    from inductor_rocm_attn.compilation import build as build_module

    seen = []
    real = build_module.stamp_regions

    def counting(gm, example_inputs):
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        seen.append((targets.count(layer_regions.region_copy), targets.count(layer_regions.region_input),
                     sum(getattr(t, "__name__", "") == "invoke_subgraph" for t in targets)))
        return real(gm, example_inputs)

    monkeypatch.setattr(build_module, "stamp_regions", counting)
    runner = _compile_in_mode(_model("stamp_count"), "stamp")
    # 2 regions x (LAYERS - 1) copies; the representative's qkv has 2 inputs, its MLP 2.
    assert seen == [(2 * (LAYERS - 1), 4, 0)]
    assert (runner.stats.region_calls, runner.stats.region_subgraphs) == (2 * LAYERS, 2)
    marker_fns = (layer_regions.region_copy, layer_regions.region_input, layer_regions.region_output)
    for _, piece in runner.split_gm.named_children():
        assert not any(n.target in marker_fns for n in piece.graph.nodes)
    assert not any(hasattr(m, "_region_stamp") or hasattr(m, "_region_tensors") for m in runner.model.modules())


def test_signature_tells_layers_that_trace_alike():
    """Identical layers share a signature whatever their attention's layer name; a plain
    attribute, a tensor's dtype or a hook makes a layer differ."""
    model = _model("signature")
    a, b, c = model.layers
    assert a.attn.layer_name != b.attn.layer_name
    assert layer_regions.signature(a) == layer_regions.signature(b) is not None
    b.input_layernorm.eps = 1e-2
    assert layer_regions.signature(a) != layer_regions.signature(b)
    b.input_layernorm.eps = a.input_layernorm.eps
    assert layer_regions.signature(a) == layer_regions.signature(b)
    b.gate_up_proj.weight.data = b.gate_up_proj.weight.data.double()
    assert layer_regions.signature(a) != layer_regions.signature(b)
    c.qkv_proj.register_forward_hook(lambda m, i, o: o * 2)
    assert layer_regions.signature(c) is None


def _stamp_vs_flat(prefix: str, change) -> tuple:
    """A model changed by ``change`` compiled in stamp mode and flat; their outputs over a
    prefill and a decode step (caches poisoned first)."""
    models = [_model(f"{prefix}_stamp"), _model(f"{prefix}_flat")]
    for m in models:
        change(m)
    runners = [_compile_in_mode(models[0], "stamp"), _compile_in_mode(models[1], None)]
    ids = torch.randint(0, 512, (4,))
    for m in models:
        ira.bind_kv_caches(m, 32, torch.float32, "cpu", poison=True)
    outs = []
    for query_lens, context_lens in (([2, 2], [0, 0]), ([1, 1], [2, 2])):
        step = [r(ids[:sum(query_lens)], r.prepare(query_lens, context_lens, [[0, 1], [2, 3]])).clone()
                for r in runners]
        assert torch.isfinite(step[0]).all()
        outs.append(step)
    return runners[0], outs


def test_stamp_mode_traces_a_layer_that_differs_on_its_own():
    """A layer whose norm has another eps is its own group (traced, not stamped from the
    first layer's trace): the outputs equal the flat trace's bit for bit."""
    def change(m):
        m.layers[1].input_layernorm.eps = 0.5

    runner, outs = _stamp_vs_flat("differs", change)
    assert (runner.stats.region_calls, runner.stats.region_subgraphs) == (2 * LAYERS, 4)
    for stamped, flat in outs:
        torch.testing.assert_close(stamped, flat, rtol=0, atol=0)


def test_stamp_mode_traces_a_hooked_layer_inline():
    """A layer with a forward hook on a submodule is never stamped (the hook is code the
    first layer's trace does not hold): traced inline, outputs equal the flat trace's."""
    def change(m):
        m.layers[2].qkv_proj.register_forward_hook(lambda mod, i, o: o * 2)

    runner, outs = _stamp_vs_flat("hooked", change)
    assert (runner.stats.region_calls, runner.stats.region_subgraphs) == (2 * (LAYERS - 1), 2)
    for stamped, flat in outs:
        torch.testing.assert_close(stamped, flat, rtol=0, atol=0)


class _Block(torch.nn.Module):
    compile_regions = True

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, bias=False)


def _block_body(block, x):
    return torch.relu(block.lin(x)) + x


_block_region = layer_regions.region(_block_body)


def _trace_blocks(model, fn, *inputs):
    from inductor_rocm_attn.compilation.regions import stamp_regions

    stats = []

    def backend(gm, example_inputs):
        stats.append(stamp_regions(gm, example_inputs))
        return gm.forward

    saved = layer_regions.MODE
    layer_regions.MODE = "stamp"
    torch._dynamo.reset()
    try:
        with torch.no_grad(), layer_regions.tracing(model):
            return torch.compile(fn, backend=backend, fullgraph=True)(*inputs), stats
    finally:
        layer_regions.MODE = saved


def test_stamped_blocks_compute_what_eager_does():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(4)])

    def run(x):
        for block in model:
            x = _block_region(block, x)
        return x

    x = torch.randn(5, 8)
    out, stats = _trace_blocks(model, run, x)
    assert stats == [(4, 1)]
    with torch.no_grad():
        torch.testing.assert_close(out, run(x), rtol=0, atol=0)


def test_a_copy_called_on_other_shapes_is_refused():
    """The representative's trace holds for a copy only on arguments of the same metadata:
    a later block called on a 3-d input fails the trace (compile_piecewise then traces flat)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())

    def run(x):
        return _block_region(model[1], _block_region(model[0], x)[:, None, :])

    with pytest.raises(Exception, match="argument 0 of a copy differs from the representative"):
        _trace_blocks(model, run, torch.randn(5, 8))


def test_stamp_mode_refuses_a_region_holding_attention(monkeypatch):
    """A region that runs an attention op breaks the contract: the op names the first
    layer, which a stamped copy would then name too. The stamp refuses it and the model
    is traced again flat, with a warning."""
    from inductor_rocm_attn import models

    def qkv_with_attention(layer, positions, hidden):
        q, k, v = layer.qkv(positions, hidden)
        layer.attn(q, k, v)
        return q, k, v

    monkeypatch.setattr(models, "_qkv_region", layer_regions.region(qkv_with_attention))
    with pytest.warns(UserWarning, match="op naming its layer"):
        runner = _compile_in_mode(_model("attention_inside"), "stamp")
    assert runner.stats.region_calls == 0
    assert [len(g) for g in runner.stats.piece_groups] == [1, LAYERS - 1, 1]


def test_a_module_called_twice_is_not_stamped():
    """A representative module called twice in the trace (a module shared between calls)
    leaves two marked segments of one key: refused, never stamped from the wrong one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())

    def run(x):
        return _block_region(model[1], _block_region(model[0], _block_region(model[0], x)))

    with pytest.raises(Exception, match="called more than once"):
        _trace_blocks(model, run, torch.randn(5, 8))


def _blocks(n: int, setup) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(n)])
    for i, block in enumerate(model):
        setup(i, block)
    return model


def _stamped_vs_eager(model, body) -> tuple:
    """``body`` as a region over ``model``'s blocks: the stamped trace's output, eager's and
    the stamp's (region calls, representatives)."""
    region = layer_regions.region(body)

    def run(x):
        for block in model:
            x = region(block, x)
        return x

    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = run(x)
    out, stats = _trace_blocks(model, run, x)
    return out, expected, stats


def test_a_region_reading_its_attention_layers_attributes_is_stamped_per_their_values():
    """A region may read its layer's attention attributes (a head size, the softmax scale);
    the attention layer is otherwise left out of the signature (its name differs per layer),
    so layers whose attention computes alike share a trace and the others get their own."""
    from inductor_rocm_attn.layer import Attention

    def setup(i, block):
        block.attn = Attention(2, 32, num_kv_heads=2, scale=0.5 if i == 1 else 0.25,
                               layer_name=f"stamp_attn_attr{next(_names)}", register=False)

    out, expected, stats = _stamped_vs_eager(_blocks(3, setup), lambda b, x: b.lin(x) * b.attn.impl.scale)
    assert stats == [(3, 2)]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_plain_attribute_holding_the_representatives_tensor_is_not_substituted():
    """Every block holds the first block's buffer as a plain attribute: in the first block
    that is its own tensor, in the others another layer's, so the first block's trace (which
    reads both as one graph input) cannot be stamped for them; each computes with its own."""
    def setup(i, block):
        block.register_buffer("anchor", torch.randn(8))

    model = _blocks(3, setup)
    for block in model:
        block.first_anchor = model[0].anchor
    out, expected, stats = _stamped_vs_eager(model, lambda b, x: b.lin(x) + b.anchor + 2 * b.first_anchor)
    assert stats == [(3, 2)]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # Holding one's own tensor so is stamped like reading it (the sinks of an attention layer).
    for block in model:
        block.first_anchor = block.anchor
    out, expected, stats = _stamped_vs_eager(model, lambda b, x: b.lin(x) + b.anchor + 2 * b.first_anchor)
    assert stats == [(3, 1)]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["grad", "autocast"])
def test_a_copy_under_another_grad_or_autocast_mode_is_refused(mode):
    """A region's code may read the grad / autocast mode, which a model may change around
    one layer: a copy called under other modes than its representative is refused (traced
    flat by compile_piecewise), never stamped from the representative's trace."""
    model = _blocks(3, lambda i, block: None)
    region = layer_regions.region(
        lambda b, x: b.lin(x).float() * (2.0 if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") else 1.0))

    def run(x):
        x = region(model[0], x)
        with torch.enable_grad() if mode == "grad" else torch.autocast("cpu", dtype=torch.bfloat16):
            x = region(model[1], x)
        return region(model[2], x)

    with pytest.raises(Exception, match="a copy runs under another grad / inference / autocast mode"):
        _trace_blocks(model, run, torch.randn(5, 8))


def test_signature_tells_a_negative_zero():
    """0.0 == -0.0 in Python, but not to every op (atan2, a division)."""
    a, b = _Block(), _Block()
    a.scale, b.scale = 0.0, -0.0
    b.lin.weight = a.lin.weight
    assert layer_regions.signature(a) != layer_regions.signature(b)
    b.scale = 0.0
    assert layer_regions.signature(a) == layer_regions.signature(b)
    # atan2(+-0, -1) = +-pi: the second block computes with its own -0.0
    out, expected, stats = _stamped_vs_eager(
        _blocks(3, lambda i, block: setattr(block, "scale", -0.0 if i == 1 else 0.0)),
        lambda blk, x: blk.lin(x) + torch.atan2(torch.full_like(x, blk.scale), -torch.ones_like(x)))
    assert stats == [(3, 2)]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_compile_piecewise_names_a_stamp_refusal_and_traces_flat(monkeypatch):
    """A model running one layer with grad enabled: the stamp refuses the copy, and
    compile_piecewise's warning names that refusal (not Dynamo's wrapper around it)."""
    model = _model("grad_layer")

    def forward(input_ids, positions):
        hidden = model.embed(input_ids)
        for i, layer in enumerate(model.layers):
            with torch.set_grad_enabled(i == 1):
                hidden = layer(positions, hidden)
        return model.lm_head(model.norm(hidden))

    monkeypatch.setattr(layer_regions, "MODE", "stamp")
    with pytest.warns(UserWarning, match="failed on torch .*layer region DecoderLayer.qkv: a copy runs under another "
                                         "grad / inference / autocast mode"):
        runner = compile_piecewise(model, capture_sizes=[1, 2, 4], max_num_seqs=4, max_model_len=64,
                                   trace_cache=False, forward=forward)
    assert runner.stats.region_calls == 0
    md = runner.prepare([2], [0], [[0]])
    assert torch.isfinite(runner(torch.tensor([1, 2]), md)).all()
