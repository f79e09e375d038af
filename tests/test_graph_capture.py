"""Piecewise compilation (``inductor_rocm_attn.compilation``): the split, shared compiled code, fusions inside the
pieces and outputs equal to the eager model; on a GPU, graph replay over a mixed schedule.

CPU compiles are slow (tens of seconds): one 3-layer model is compiled once per module and
shared; the deeper model reuses its pieces through Inductor's FX-graph cache.
"""

from __future__ import annotations

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import forward_context
from inductor_rocm_attn.decode_check import run_mixed_decode
from inductor_rocm_attn.compilation import RerunGraphBackend, compile_piecewise
from inductor_rocm_attn.compilation.split import SPLITTING_OPS, op_name
from inductor_rocm_attn.models import TinyDecoder, qwen3_config
from decoder_pairs import decoder_pair

pytestmark = pytest.mark.compile

LAYERS = 3
SIZES = [1, 2, 4, 8, 16, 32]


@pytest.fixture(scope="module")
def compiled():
    model, ref = decoder_pair(qwen3_config(num_layers=LAYERS), num_blocks=160)
    ira.fusion_report().clear()
    with torch._inductor.config.patch(force_disable_caches=True):  # cold: the passes run
        runner = compile_piecewise(model, capture_sizes=SIZES, max_num_seqs=16, max_num_tokens=64,
                                   max_model_len=256)
    records = list(ira.fusion_report().records)
    return runner, model, ref, records


def _calls(gm, name):
    return sum(op_name(n) == name for n in gm.graph.nodes)


def test_split_has_one_piece_per_attention_boundary(compiled):
    runner, model, _, _ = compiled
    st = runner.stats
    assert st.num_attention_pieces == LAYERS
    assert st.num_compiled_pieces == LAYERS + 1
    order = [n.target for n in runner.split_gm.graph.nodes if n.op == "call_module"]
    # compiled and attention pieces alternate, starting and ending with a compiled piece
    assert order[0::2] == [p.name for p in runner.pieces]
    assert order[1::2] == runner.attention_pieces
    for name in runner.attention_pieces:
        sub = runner.split_gm._modules[name]
        ops = [n for n in sub.graph.nodes if n.op == "call_function"]
        assert [op_name(n) for n in ops] == list(SPLITTING_OPS)
    # each layer's cache update stays in the piece before its attention (where fusions fire)
    caches = {"rocm_attn.unified_kv_cache_update", "rocm_attn.unified_qk_norm_rope_and_kv_cache_update",
              "rocm_attn.unified_rope_and_kv_cache_update"}
    attn_layers = [runner.split_gm._modules[a].graph for a in runner.attention_pieces]
    names = [next(n for n in g.nodes if op_name(n) in SPLITTING_OPS).args[4] for g in attn_layers]
    assert names == [layer.layer_name for layer in ira.attention_layers(model)]
    for i, piece in enumerate(runner.pieces):
        sub = runner.split_gm._modules[piece.name]
        n_cache = sum(op_name(n) in caches for n in sub.graph.nodes)
        assert n_cache == (1 if i < LAYERS else 0), piece.name
        assert [layer.layer_name for layer in piece.slots] == ([names[i]] if i < LAYERS else [])


def test_identical_layers_share_compiled_code(compiled):
    runner = compiled[0]
    st = runner.stats
    assert st.num_unique_compiles == 3  # first (embedding), middle layers, last (lm head)
    middle = runner.pieces[1:-1]
    assert [p.name for p in middle] in st.piece_groups
    assert len({id(p.fn) for p in middle}) == 1
    assert len({id(p.fn) for p in runner.pieces}) == 3


def test_compile_count_does_not_grow_with_depth(compiled):
    model, _ = decoder_pair(qwen3_config(num_layers=LAYERS + 2), num_blocks=8)
    runner = compile_piecewise(model, capture_sizes=SIZES, max_num_seqs=16, max_model_len=128)
    assert runner.stats.num_compiled_pieces == LAYERS + 3
    assert runner.stats.num_unique_compiles == 3


def test_fusions_fire_inside_pieces(compiled):
    runner, model, _, records = compiled
    if not runner.stats.plugin_active:
        pytest.skip("the plugin is off for this runner")
    fused = [r for r in records if r.fused and r.pass_name == "qk_norm_rope_kv_cache_fusion"]
    # one fusion per compiled piece that holds a cache update (the first and the shared middle)
    assert len(fused) == 2, ira.fusion_report()
    assert all(r.layer_name.startswith("__rocm_attn_slot") for r in fused)
    # every layer, also those sharing the middle piece's code, follows the fused writer
    assert all(layer.interleaved_v for layer in ira.attention_layers(model))


def test_pieces_match_eager_model_over_mixed_steps(compiled):
    runner, model, ref, _ = compiled
    calls = []
    for layer in ira.attention_layers(model):
        orig = layer.impl.forward

        def counting(*a, _orig=orig, **k):
            calls.append(1)
            return _orig(*a, **k)

        layer.impl.forward = counting
    try:
        res = run_mixed_decode(runner, ref, steps=10, max_seqs=8, max_len=100, seed=1)
    finally:
        for layer in ira.attention_layers(model):
            del layer.impl.forward
    assert res.finite
    assert res.max_rel_err < 1e-5, res
    assert res.argmax_agreement == 1.0
    assert res.padded_steps > 0 and res.mixed_steps > 0
    assert len(calls) == LAYERS * res.steps  # attention ran once per layer: stand-ins are gone


def test_single_token_and_oversized_steps(compiled):
    runner, model, ref, _ = compiled
    alloc = ira.BlockAllocator(160, 16, shuffle_seed=5)
    # A 40-token prefill (above the largest captured size: runs unpadded) then a 1-token decode.
    for qlens, clens in (([40], [0]), ([1], [40])):
        tables = [list(alloc.allocate(0, qlens[0]))]
        ids = torch.randint(0, model.cfg.vocab_size, (sum(qlens),))
        md = runner.prepare(qlens, clens, tables)
        assert md.slot_mapping.shape[0] == runner.padded_size(sum(qlens))
        out = runner(ids, md).clone()
        ref_md = ira.build_attention_metadata(qlens, clens, tables, 16)
        with torch.no_grad(), ira.set_forward_context(ref_md):
            expect = ref(ids, ref_md.positions)
        assert out.shape == expect.shape
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_prepare_rejects_foreign_metadata(compiled):
    runner = compiled[0]
    md = ira.build_attention_metadata([1], [0], [[0]], 16)
    with pytest.raises(ValueError, match="runner.prepare"):
        runner(torch.zeros(1, dtype=torch.long), md)


def test_step_inputs_are_checked_before_running(compiled):
    """Token ids: integers, inside the vocabulary (CPU: always; a GPU with
    ROCM_ATTN_CHECK_INDICES=1), one per token; metadata: the latest prepare()'s (the buffers
    hold its step); a step larger than the buffers names the limit."""
    runner = compiled[0]
    vocab = runner.vocab_size
    assert vocab == runner.model.cfg.vocab_size
    old = runner.prepare([2], [0], [[0]])
    md = runner.prepare([2], [0], [[1]])
    with pytest.raises(ValueError, match=r"not the latest runner.prepare\(...\)'s"):
        runner(torch.tensor([3, 4]), old)
    with pytest.raises(TypeError, match=r"input_ids must be int64 or int32 token ids, got torch.float32"):
        runner(torch.tensor([3.0, 4.0]), md)
    with pytest.raises(ValueError, match=rf"input_ids\[1\] = {vocab} is outside the vocabulary \[0, {vocab}\)"):
        runner(torch.tensor([3, vocab]), md)
    with pytest.raises(ValueError, match=r"input_ids \(3,\) for a step of 2 tokens: expected \[2\]"):
        runner(torch.tensor([3, 4, 5]), md)
    # a list of ids failed as an AttributeError ('list' object has no attribute 'dim'); a
    # query_len that is not an int as a TypeError of sum(), naming neither the call nor the entry
    with pytest.raises(TypeError, match=r"PiecewiseRunner: input_ids must be a 1-D tensor of token ids, got list"):
        runner([3, 4], md)
    with pytest.raises(ValueError, match=r"sequence 1 has query_len None, context_len 0; both must be ints >= 0"):
        runner.prepare([1, None], [0, 0], [[0], [1]])
    with pytest.raises(TypeError, match=r"PiecewiseRunner.prepare: query_lens must be a sequence of ints"):
        runner.prepare((q for q in [1, 1]), [0, 0], [[0], [1]])
    assert runner(torch.tensor([3, 4]), md).isfinite().all()  # the refused calls left the step
    with pytest.raises(ValueError, match=rf"{runner.max_num_seqs + 1} sequences > max_num_seqs {runner.max_num_seqs}"):
        runner.prepare([1] * (runner.max_num_seqs + 1), [1] * (runner.max_num_seqs + 1),
                       [[i] for i in range(runner.max_num_seqs + 1)])


def _capture_with(runner, **flags):
    """Capture the shared runner's graphs with the rerun backend and the given kinds."""
    runner._graph_backend = RerunGraphBackend()
    runner.use_cuda_graphs = True
    for name, value in flags.items():
        setattr(runner, name, value)
    runner.capture()


def _release(runner):
    """Back to the fixture's state: compiled, no graphs (the runner is shared)."""
    runner.use_cuda_graphs = False
    runner._captured = runner._piece_sizes = frozenset()
    runner._step_graphs.clear()
    runner._mixed_graphs.clear()
    runner._shapes.clear()
    runner._step_md = runner._step_shape = None
    for p in runner.pieces:
        p.graphs.clear()


def test_prepare_rejects_block_ids_outside_the_caches(compiled):
    # A whole-step graph replay runs no layer code: the plan itself checks block ids against
    # the caches (160 blocks here), for decode-only and mixed steps.
    runner = compiled[0]
    for qlens in ([1, 1], [1, 3]):
        with pytest.raises(IndexError, match=r"block_tables\[1\]\[0\] = 160 is outside the cache \(num_blocks 160"):
            runner.prepare(qlens, [3, 0], [[0], [160]])


def test_replay_discipline_with_rerun_graphs(compiled):
    """Graph control flow on CPU: RerunGraphBackend replays each piece on its captured input
    tensors under the capture-time context, so anything the runner failed to route through
    the persistent buffers or earlier pieces' outputs would come out stale."""
    runner, model, ref, _ = compiled
    try:
        # the piecewise graphs alone (whole steps: the next test, test_mixed_step_graphs.py)
        _capture_with(runner, decode_graphs=False, mixed_graphs=False, piecewise_graphs=True)
        n = runner.stats.num_captures
        assert n == len(runner.pieces) * len(SIZES)
        res = run_mixed_decode(runner, ref, steps=8, max_seqs=8, max_len=100, seed=2)
        assert res.graph_steps == res.steps and res.padded_steps > 0
        assert res.whole_step_steps == 0
        assert res.graphs_bitwise_equal_pieces
        assert res.max_rel_err < 1e-5 and res.argmax_agreement == 1.0, res
        assert res.captures_after == res.captures_before == n
    finally:
        _release(runner)


def test_whole_decode_step_graphs_with_rerun_graphs(compiled):
    """decode_graphs: a decode-only step replays one graph of the whole step (pieces and
    attention) captured on fixed-shape metadata views; other steps use the piecewise graphs.
    On CPU the rerun backend stands in for graphs, so stale inputs would show as errors."""
    runner, model, ref, _ = compiled
    try:
        before = runner.stats.num_captures  # the runner is shared: count this test's captures
        _capture_with(runner, decode_graphs=True, mixed_graphs=False, piecewise_graphs=True)
        sizes_with_step_graph = [s for s in SIZES if s <= runner.buffers.max_num_seqs]
        assert sorted(runner._step_graphs) == sizes_with_step_graph and not runner._mixed_graphs
        assert runner.stats.num_captures - before == (
            len(runner.pieces) * len(SIZES) + len(sizes_with_step_graph))
        res = run_mixed_decode(runner, ref, steps=12, max_seqs=8, max_len=100, seed=3)
        assert res.whole_step_steps > 0 and res.mixed_steps > 0  # both kinds of step ran
        assert res.graphs_bitwise_equal_pieces
        assert res.max_rel_err < 1e-5 and res.argmax_agreement == 1.0, res
        assert res.captures_after == res.captures_before
        # A decode step can still be planned for the piecewise graphs.
        alloc = ira.BlockAllocator(160, 16, shuffle_seed=9)
        tables = [list(alloc.allocate(i, 5)) for i in range(3)]
        md = runner.prepare([1, 1, 1], [4, 4, 4], tables, whole_step=False)
        assert not runner.replays_whole_step(md)
        md = runner.prepare([1, 1, 1], [4, 4, 4], tables)  # padded to 4: one empty sequence
        assert runner.replays_whole_step(md)
        assert md.seq_lens.tolist() == [5, 5, 5, 0] and md.query_start_loc.tolist() == [0, 1, 2, 3, 3]
        assert md.max_seq_len == runner.max_model_len and md.num_actual_tokens == 3
        assert tuple(md.block_table.shape) == (4, runner.buffers.max_blocks_per_seq)
        assert md.slot_mapping[3].item() == -1
        md = runner.prepare([1, 2], [4, 4], tables[:2])  # no mixed graphs: the piecewise ones
        assert not runner.replays_whole_step(md) and md.seq_lens.tolist() == [5, 6]
    finally:
        _release(runner)


@pytest.mark.gpu
@pytest.mark.parametrize("decode_graphs", [False, True], ids=["piecewise", "decode_graphs"])
def test_graph_replay_matches_eager_200_mixed_steps(decode_graphs):
    """Graphs replayed with changing lengths, block tables and (padded) sizes: bitwise equal
    to the compiled pieces without graphs, equal to eager up to bf16 rounding; no
    re-capture in steady state. With decode_graphs, decode-only steps replay one graph of
    the whole step (attention inside). (Whole mixed steps: test_mixed_step_graphs.py.)"""
    cfg = qwen3_config(num_layers=3, hidden_size=512, intermediate_size=1024, num_heads=8,
                       num_kv_heads=4, head_size=64)
    model, ref = decoder_pair(cfg, num_blocks=1024, dtype=torch.bfloat16, device="cuda")
    runner = compile_piecewise(model, capture_sizes=[1, 2, 4, 8, 16, 32, 64], max_num_seqs=32,
                               max_model_len=512, decode_graphs=decode_graphs, mixed_graphs=False,
                               piecewise_graphs=True)
    assert runner.stats.num_captures == len(runner.pieces) * 7 + (6 if decode_graphs else 0)
    res = run_mixed_decode(runner, ref, steps=200, max_seqs=24, max_len=400, seed=0)
    assert res.finite
    assert res.graph_steps == res.steps
    assert (res.whole_step_steps > 0) == decode_graphs
    assert res.padded_steps > 0 and res.mixed_steps > 0
    assert res.graphs_bitwise_equal_pieces
    assert res.captures_after == res.captures_before
    assert res.max_rel_err < 2e-2, res
    # Graph replay is bitwise the pieces without graphs (above); compiled vs eager differs by
    # bf16 rounding, bounded by max_rel_err. Random bf16 weights leave near-tied logits, so a
    # flip whose gap is within that error is expected: the H200 measured 0.969-0.97 agreement,
    # every flip within the logits' own error. The floor catches a wrong model, not rounding.
    assert res.argmax_agreement > 0.95, res


@pytest.mark.gpu
def test_capture_compiles_every_triton_kernel_before_the_first_launch(monkeypatch):
    """With ``compile_threads`` > 1 the capture first compiles, in parallel, every Triton
    kernel its steps launch (``precompile``): no kernel compiles at a real launch during the
    warm-ups and captures, and the graphs then replay correct steps. A geometry no other
    test uses (6 query heads over 2 KV heads): its kernels are not compiled in the process yet."""
    import triton

    cfg = qwen3_config(num_layers=2, hidden_size=384, intermediate_size=512, num_heads=6,
                       num_kv_heads=2, head_size=64)
    model, ref = decoder_pair(cfg, num_blocks=256, dtype=torch.bfloat16, device="cuda")
    at_launch, compile_only = [], []

    def before_compile(*, fn, is_manual_warmup, **_):
        (compile_only if is_manual_warmup else at_launch).append(fn.name)

    runner = compile_piecewise(model, capture_sizes=[1, 2, 4, 8], max_num_seqs=8, max_model_len=512,
                               capture=False)
    # Only around the capture: building the pieces runs some kernels for real.
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", before_compile)
    runner.capture(compile_threads=4)
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    assert runner.stats.precompiled_kernels > 0 and compile_only
    assert at_launch == [], f"compiled at a launch after the precompile: {sorted(set(at_launch))}"
    res = run_mixed_decode(runner, ref, steps=40, max_seqs=8, max_len=400, seed=1)
    assert res.finite and res.graph_steps == res.steps and res.mixed_steps > 0
    assert res.max_rel_err < 2e-2, res


# --- compile time: piece inputs from Dynamo's fake values, the trace cache ------------------------


def _same_fake(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and tuple(map(str, a.shape)) == tuple(map(str, b.shape))
                and tuple(map(str, a.stride())) == tuple(map(str, b.stride())) and a.dtype == b.dtype
                and a.device == b.device and a.requires_grad == b.requires_grad)
    return str(a) == str(b)


def test_piece_inputs_read_from_placeholder_meta():
    """split_module copies Dynamo's fake values onto the pieces' placeholders: read there,
    they equal the inputs a fake run of the split graph sees (the fallback when meta is
    missing, with identical pieces run once)."""
    from inductor_rocm_attn.compilation.dedup import canonicalize_names, normalize_layer_names, structure_key
    from inductor_rocm_attn.compilation.split import split_at_attention, submodule_inputs

    model, _ = decoder_pair(qwen3_config(num_layers=3), num_blocks=8)
    names = {layer.layer_name for layer in ira.attention_layers(model)}
    seen = {}

    def backend(gm, example_inputs):
        split, compiled, _ = split_at_attention(gm)
        for n in compiled:
            normalize_layer_names(split._modules[n], names)
            canonicalize_names(split._modules[n])
        from_meta = submodule_inputs(split, example_inputs, compiled)
        for n in compiled:  # drop the meta: the fallback runs the split graph
            for node in split._modules[n].graph.nodes:
                node.meta.pop("example_value", None)
        interpreted = submodule_inputs(split, example_inputs, compiled,
                                       memo_key=lambda n, a: structure_key(split._modules[n], a)
                                       if n in compiled else None)
        ran = [n for n in compiled  # the run records each node's value (AOTAutograd's cache needs it)
               if all("example_value" in x.meta for x in split._modules[n].graph.nodes if x.op != "output")]
        seen.update(meta=from_meta, run=interpreted, compiled=compiled, ran=ran)
        return gm.forward

    md = ira.build_attention_metadata([3, 5], [0, 0], [[0], [1]], 16)
    ids, pos = torch.randint(0, model.cfg.vocab_size, (8,)), md.positions.clone()
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    with torch.no_grad(), ira.set_forward_context(md):
        torch.compile(model, backend=backend, fullgraph=True)(ids, pos)
    assert list(seen["meta"]) == list(seen["run"]) == seen["compiled"]
    for n in seen["compiled"]:
        a, b = seen["meta"][n], seen["run"][n]
        assert len(a) == len(b) and all(_same_fake(x, y) for x, y in zip(a, b)), n
    assert any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and not str(x.shape[0]).isdigit())
               for x in seen["meta"][seen["compiled"][0]])  # the token dimension stayed symbolic
    # identical layers ran once: the first piece, one middle piece, the last
    assert seen["ran"] == [seen["compiled"][0], seen["compiled"][1], seen["compiled"][-1]]


def test_trace_cache_warm_start_skips_dynamo(tmp_path):
    """trace_cache: the first runner traces and stores the graph, a second runner of an
    identical model loads it (no Dynamo) and computes the same logits; a changed model or
    a changed traced source file is not served the stored graph."""
    from inductor_rocm_attn.compilation import trace_cache as tc

    cfg = qwen3_config(num_layers=3)

    def named(cfg, num_blocks, name="trace_cache_model"):  # the same layer names in every start
        torch.manual_seed(0)
        m = TinyDecoder(cfg, name=name).eval()
        ira.bind_kv_caches(m, num_blocks, torch.float32, "cpu", poison=True)
        return m

    def start():  # a start of a server: the model built anew, under the same layer names
        return compile_piecewise(named(cfg, 64), capture_sizes=[1, 2, 4, 8], max_num_seqs=8,
                                 max_model_len=256, trace_cache=str(tmp_path))

    def release(runner):  # as a process exit would: the names are free again (Dynamo keeps
        for name in runner.layers:  # the runner alive through its backend)
            forward_context._LAYERS.pop(name, None)

    cold = start()
    assert not cold.stats.trace_loaded
    release(cold)
    warm = start()
    assert warm.stats.trace_loaded
    _, ref = decoder_pair(cfg, num_blocks=64)
    assert len(list(tmp_path.glob("*.trace"))) == 1
    assert warm.stats.num_unique_compiles == 3 and warm.stats.num_compiled_pieces == LAYERS + 1
    res = run_mixed_decode(warm, ref, steps=6, max_seqs=4, max_len=60, seed=4, compare_no_graphs=False)
    assert res.steps == 6
    assert res.max_rel_err < 1e-5 and res.argmax_agreement == 1.0, res
    # the stored graph, node for node
    entry = tc.TraceCache(str(tmp_path)).load(next(tmp_path.glob("*.trace")).stem)
    gm = tc.deserialize_graph(entry.graph)
    again = tc.deserialize_graph(tc.serialize_graph(gm))
    assert [n.format_node() for n in again.graph.nodes] == [n.format_node() for n in gm.graph.nodes]
    assert sum(op_name(n) in SPLITTING_OPS for n in gm.graph.nodes) == LAYERS
    assert any(f.endswith("models.py") for f in entry.files)  # the traced model source
    # a different model (eps, layer names, cache size) keys differently; a traced file that
    # changed invalidates the entry
    def key(*args, **kw):
        m = named(*args, **kw)
        k = tc.trace_key(m, ira.attention_layers(m), None, {})[0]
        for layer in ira.attention_layers(m):
            forward_context._LAYERS.pop(layer.layer_name, None)
        return k

    release(warm)
    k = key(cfg, 8)
    assert k == key(cfg, 8)
    assert k != key(qwen3_config(num_layers=3, rms_eps=1e-5), 8)
    assert k != key(cfg, 8, name="other_model") and k != key(cfg, 16)
    src = tmp_path / "traced_source.py"
    src.write_text("x = 1\n")
    name = next(tmp_path.glob("*.trace")).stem
    tc.TraceCache(str(tmp_path)).store(name, tc.TraceEntry(entry.graph, entry.plan,
                                                            {**entry.files, str(src): tc.file_digest(str(src))}))
    assert tc.TraceCache(str(tmp_path)).load(name) is not None
    src.write_text("x = 2\n")
    assert tc.TraceCache(str(tmp_path)).load(name) is None


def test_a_fake_run_that_specializes_the_token_dimension_is_refused():
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from inductor_rocm_attn.compilation.split import _check_not_specialized

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ids = mode.from_tensor(torch.zeros(8, dtype=torch.int64), source=LocalSource("input_ids"),
                           symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC]))
    _check_not_specialized(mode, [ids, ids.shape[0]])  # symbolic: fine
    assert int(ids.shape[0]) == 8  # what torch 2.11's C++ matmul did under the fake mode
    with pytest.raises(RuntimeError, match=r"specialized the token dimension \(s\d+ = 8\)"):
        _check_not_specialized(mode, [ids])


def test_capture_sizes_above_max_model_len():
    """A capture size larger than ``max_model_len`` (a serving budget of many short
    sequences): the warm-up and capture steps spread their tokens over ``max_num_seqs``
    sequences instead of one sequence longer than the block table allows, and a real
    step of that size replays the graphs and matches the eager model."""
    model, ref = decoder_pair(qwen3_config(num_layers=1), num_blocks=32)
    runner = compile_piecewise(model, capture_sizes=[4, 48], max_num_seqs=4, max_num_tokens=48, max_model_len=32)
    _capture_with(runner, decode_graphs=False, mixed_graphs=False, piecewise_graphs=True)
    assert runner.stats.num_captures == 2 * len(runner.pieces)
    alloc = ira.BlockAllocator(32, 16, shuffle_seed=1)
    qlens = [20, 20, 5]  # 45 tokens: padded to the captured 48
    tables = [list(alloc.allocate(i, q)) for i, q in enumerate(qlens)]
    ids = torch.randint(0, model.cfg.vocab_size, (sum(qlens),))
    md = runner.prepare(qlens, [0, 0, 0], tables)
    out = runner(ids, md).clone()
    ref_md = ira.build_attention_metadata(qlens, [0, 0, 0], tables, 16)
    with torch.no_grad(), ira.set_forward_context(ref_md):
        expect = ref(ids, ref_md.positions)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_trace_key_covers_plain_object_attributes():
    """A module attribute that is neither a dataclass nor a transformers config (a
    ``SimpleNamespace`` of options, an options class): Dynamo bakes the values its forward
    reads into the trace, so a changed value must key differently; a stored trace of
    ``scale=1`` served to a model of ``scale=100`` computed with 1, silently."""
    import types

    from inductor_rocm_attn.compilation import trace_cache as tc

    class Options:  # a plain class, e.g. a model's hand-written config
        def __init__(self, scale):
            self.scale = scale

    def key(opts):
        m = torch.nn.Linear(4, 4)
        m.opts = opts
        return tc.trace_key(m, [], None, {})[0]

    ns = types.SimpleNamespace
    assert key(ns(scale=1.0)) == key(ns(scale=1.0))
    assert key(ns(scale=1.0)) != key(ns(scale=100.0))
    assert key(Options(1.0)) == key(Options(1.0))
    assert key(Options(1.0)) != key(Options(100.0))
    assert key(Options(1.0)) != key(ns(scale=1.0))  # the class is part of the description


def test_a_parameter_replaced_or_moved_after_the_compile_is_refused():
    """The pieces (and graphs) take the compile's parameters at their addresses: a parameter
    replaced afterwards (load_state_dict(assign=True), a new Parameter) was silently not
    read, and model.to(dtype) had the compiled code read the new memory as the old dtype.
    A step checks the first and last parameter; check_parameters() and generate() all."""
    from inductor_rocm_attn.integrations.batching import generate

    model, _ = decoder_pair(qwen3_config(num_layers=1), num_blocks=8)
    runner = compile_piecewise(model, capture_sizes=[1, 2], max_model_len=64)

    def step():
        md = runner.prepare([2], [0], [[0]])
        return runner(torch.tensor([3, 4]), md).clone()

    before = step()
    head = model.lm_head.weight
    model.load_state_dict({"lm_head.weight": torch.zeros_like(head)}, strict=False, assign=True)
    with pytest.raises(ValueError, match=r"model's lm_head.weight is not the tensor the runner was compiled "
                                         r"with \(replaced: load_state_dict\(..., assign=True\)"):
        step()
    model.lm_head.weight = head
    torch.testing.assert_close(step(), before, rtol=0, atol=0)
    qkv = model.layers[0].qkv_proj.weight  # not one a step checks: check_parameters and generate do
    model.layers[0].qkv_proj.weight = torch.nn.Parameter(qkv.detach().clone())
    with pytest.raises(ValueError, match=r"model's layers.0.qkv_proj.weight is not the tensor"):
        runner.check_parameters()
    with pytest.raises(ValueError, match=r"model's layers.0.qkv_proj.weight is not the tensor"):
        generate(runner, [[1, 2, 3]], max_new_tokens=2)
    model.layers[0].qkv_proj.weight = qkv
    runner.check_parameters()
    model.to(torch.float64)
    with pytest.raises(ValueError, match=r"model's embed.weight moved to new memory since the compile \(now "
                                         r"torch.float64 on cpu, compiled for torch.float32 on cpu"):
        step()


def test_a_model_that_cannot_take_ids_and_positions_is_refused_before_tracing():
    """README's "Using it" model (forward(x)) given to compile_piecewise failed deep in Dynamo
    ("Too many positional arguments"), naming neither the expected signature nor forward=."""
    import inductor_rocm_attn as ira

    class HiddenStates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(256, 256)
            self.attn = ira.Attention(4, 64, num_kv_heads=4, layer_name="sig.0", register=False)

        def forward(self, x):
            q = self.proj(x)
            return self.attn(q, q, q)

    with pytest.raises(TypeError, match=r"compile_piecewise: HiddenStates.forward is called as \(input_ids \[T\], "
                                        r"positions \[T\]\) -> logits, but its signature \(x\)"):
        compile_piecewise(HiddenStates(), capture_sizes=[1, 2])
    with pytest.raises(TypeError, match=r"compile_piecewise: forward= is called as"):
        compile_piecewise(HiddenStates(), capture_sizes=[1, 2], forward=lambda ids: ids)


def test_a_trace_cache_that_cannot_be_written_warns_and_builds_from_the_trace(tmp_path, monkeypatch):
    """A read-only (or full) cache directory failed the compile after the trace with a bare OS
    error; a pre-filled read-only cache is a valid setup, so a miss there now builds from the
    trace with a warning, and leaves no temporary file."""
    from inductor_rocm_attn.compilation import trace_cache as tc

    import builtins

    def refuse(path, mode="r", *a, **k):  # the cache module's writes into tmp_path
        if "w" in mode and str(path).startswith(str(tmp_path)):
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, mode, *a, **k)

    monkeypatch.setattr(tc, "open", refuse, raising=False)
    torch.manual_seed(0)
    model = TinyDecoder(qwen3_config(num_layers=2), name="trace_cache_readonly").eval()
    ira.bind_kv_caches(model, 16, torch.float32, "cpu")
    with pytest.warns(UserWarning, match=r"trace cache: could not store the trace .*Permission denied.*building "
                                         r"from the trace"):
        runner = compile_piecewise(model, capture_sizes=[1, 2], max_num_seqs=2, max_model_len=64,
                                   trace_cache=str(tmp_path))
    assert not runner.stats.trace_loaded and runner.stats.num_unique_compiles > 0
    assert list(tmp_path.iterdir()) == []


def test_steps_the_compiled_pieces_cannot_run_as_traced_are_refused(compiled):
    """A model switched to training mode after an eval-mode compile was served without its
    dropouts; input_ids on a device the runner cannot copy from failed inside the copy; a step
    over max_num_tokens was named after the buffers, not the call. Each refused before the
    step, and the next step runs."""
    runner, model, _, _ = compiled
    md = runner.prepare([2], [0], [[0]])
    model.train()
    try:
        with pytest.raises(ValueError, match=r"PiecewiseRunner: the model is in training mode now, but it was "
                                             r"compiled in eval mode .*call model\.eval\(\)"):
            runner(torch.tensor([3, 4]), md)
        with pytest.raises(ValueError, match=r"PiecewiseRunner: the model is in training mode now"):
            runner.check_parameters()
    finally:
        model.eval()
    with pytest.raises(ValueError, match=r"PiecewiseRunner: input_ids are on meta; pass them on the CPU"):
        runner(torch.tensor([3, 4], device="meta"), md)
    with pytest.raises(ValueError, match=rf"PiecewiseRunner\.prepare: the step has {runner.max_num_tokens + 1} "
                                         rf"tokens, more than max_num_tokens={runner.max_num_tokens}"):
        runner.prepare([runner.max_num_tokens + 1], [0], [list(range(8))])
    md = runner.prepare([2], [0], [[0]])
    assert torch.isfinite(runner(torch.tensor([3, 4]), md)).all()


def test_max_model_len_past_the_models_positions_is_refused():
    """TinyDecoder's RoPE table holds max_position rows: a max_model_len past them compiled and
    planned steps whose positions read outside the table (on a GPU graph replay, unchecked)."""
    cfg = qwen3_config(num_layers=1)
    cfg.max_position = 32
    model, _ = decoder_pair(cfg, num_blocks=8)
    with pytest.raises(ValueError, match=r"compile_piecewise: max_model_len 64 is more than the 32 positions "
                                         r"TinyDecoder embeds \(its max_positions"):
        compile_piecewise(model, capture_sizes=[1, 2], max_model_len=64)
