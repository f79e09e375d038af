"""A rejected call changes nothing, and nothing wrong is accepted silently.

Each test makes a bad call to a function that writes state (a cache, the allocator's free
lists, a layer's attributes, the forward context, the builder's buffers) and asserts a clear
error naming the function, the bad value and what is supported, with the state as before.
"""

import copy
import dataclasses
import threading
import warnings

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn.forward_context import get_forward_context, registered_layers
from inductor_rocm_attn.layout import dense_kv

from reliability_steps import BS, D, H, HKV, _names, qkv, snapshot, stepped_layer, unchanged


def _allocator_state(alloc):
    return list(alloc._free), {k: list(v) for k, v in alloc._tables.items()}, dict(alloc._lengths)


# --- flags given as strings: a truthy "False" must not turn a feature on ----------------------------


def test_profiling_flag_must_be_a_bool():
    before = get_forward_context()
    with pytest.raises(TypeError, match=r"set_forward_context: profiling must be True or False, got 'False'"):
        with ira.set_forward_context(None, profiling="False"):
            pass
    assert get_forward_context() is before


def test_forward_context_is_per_thread():
    """Two threads, each stepping its own layer: thread A enters its step's context, thread B
    then enters another's while A's layer runs. With one process-wide context A's layer ran
    under B's step, silently: it wrote its keys into B's block of A's cache (and a context
    left out of order was restored for the other thread). A thread outside any context is
    told so, whatever another thread runs."""
    a, b = stepped_layer("state_thread_a"), stepped_layer("state_thread_b")
    block_a, block_b = a.alloc._free[:2]  # free blocks of A's cache: poisoned, never written
    md_a = ira.build_attention_metadata([2], [0], [[block_a]], BS)
    md_b = ira.build_attention_metadata([2], [0], [[block_b]], BS)
    a_in, b_in, b_done = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def thread_a():
        with ira.set_forward_context(md_a):
            a_in.set()
            b_in.wait(10)
            seen["a"] = get_forward_context().attn_metadata
            a.layer(*qkv(2, a.g))

    def thread_b():
        a_in.wait(10)
        with ira.set_forward_context(md_b):
            b_in.set()
            b_done.wait(10)
        try:  # outside any context of its own while A is inside one
            b.layer(*qkv(2, b.g))
        except RuntimeError as e:
            errors.append(str(e))

    before_b = snapshot(a.layer.kv_cache[block_b])
    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    threads[0].join(10)
    b_done.set()
    threads[1].join(10)
    k, _ = dense_kv(a.layer.kv_cache, HKV, False)  # [blocks, block_size, HKV, D]
    assert unchanged(before_b, a.layer.kv_cache[block_b]), "thread A's layer wrote at thread B's slots"
    assert k[block_a, :2].isfinite().all(), "thread A's step did not write its own slots"
    assert seen["a"] is md_a
    assert len(errors) == 1 and "called outside a forward context" in errors[0]
    assert get_forward_context().attn_metadata is None

def test_register_flag_must_be_a_bool():
    with pytest.raises(TypeError, match=r"Attention: register must be True or False, got 'no'"):
        ira.Attention(H, D, num_kv_heads=HKV, layer_name="state.register", register="no")
    assert "state.register" not in registered_layers()


def test_interleaved_v_switch_must_be_a_bool():
    s = stepped_layer("state_switch")
    before = snapshot(s.layer.kv_cache)
    with pytest.raises(TypeError, match=r"set_interleaved_v_cache: enabled must be True or False, got 'False'"):
        s.layer.set_interleaved_v_cache("False")
    assert not s.layer.interleaved_v and unchanged(before, s.layer.kv_cache), "a rejected switch converted the cache"


def test_layer_name_of_a_slot_alias_is_refused():
    # such a layer registers, but its name resolves only to a piecewise runner's slot: every
    # call of it failed in the forward context's lookup
    with pytest.raises(ValueError, match=r"Attention: layer_name '__rocm_attn_slot0__' starts with "
                                         r"'__rocm_attn_slot', reserved for the slot aliases"):
        ira.Attention(H, D, num_kv_heads=HKV, layer_name="__rocm_attn_slot0__")
    assert "__rocm_attn_slot0__" not in registered_layers()


# --- an fp8 query the attention refuses: refused before the cache update writes ---------------------


@pytest.mark.parametrize("q_scale, match", [
    (0.5, r"unified_attention_with_output: a q_scale of 0\.5 with an fp8 query"),
    (1.0, r"rocm_attn\.paged_attention: no provider supports this call.*reference supports dtypes .*not "
          r"torch\.float8_e4m3fn"),
])
def test_fp8_query_refused_before_the_cache_update_writes(q_scale, match):
    s = stepped_layer("state_fp8q", q_scale=q_scale)
    before = snapshot(s.layer.kv_cache)
    q, k, v = qkv(s.num_tokens, s.g)
    with pytest.raises(NotImplementedError, match=match), ira.set_forward_context(s.md):
        s.layer(q.to(torch.float8_e4m3fn), k, v)
    assert unchanged(before, s.layer.kv_cache), "the cache update wrote before the attention refused the query"


def test_q_scale_with_a_query_that_is_not_fp8_warns_that_it_is_ignored():
    """The seed ignores ``q_scale`` for a 16/32-bit query (it would scale an fp8 one): the
    layer's first such step says so, later steps do not repeat it, and the result is the
    unscaled one."""
    plain = stepped_layer("state_q1")
    with pytest.warns(UserWarning, match=r"q_scale 2\.0 is ignored for a torch\.float32 query"):
        scaled = stepped_layer("state_q2", q_scale=2.0)  # its first step
    q, k, v = qkv(scaled.num_tokens, scaled.g)
    outs = []
    for s in (plain, scaled):
        with ira.set_forward_context(s.md), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outs.append(s.layer(q, k, v))
        assert not any("q_scale" in str(w.message) for w in seen), "warned again after the first step"
    assert torch.equal(outs[0], outs[1])


# --- a compiled graph with the fp8 output quant fused into the attention (output_scale) -------------


_WRITER_OPS = {
    "kv_cache_update": "unified_kv_cache_update",
    "rope": "unified_rope_and_kv_cache_update",
    "rope_cos_sin": "unified_rope_cos_sin_and_kv_cache_update",
    "qk_norm_qkv": "unified_qk_norm_rope_and_kv_cache_update",
    "qk_norm_rope_cos_sin": "unified_qk_norm_rope_cos_sin_and_kv_cache_update",
}


@pytest.mark.compile
@pytest.mark.parametrize("writer", list(_WRITER_OPS))
def test_fused_output_quant_scale_refused_before_the_cache_update_writes(writer):
    # the attention refused the value, after the layer's cache update had written the step's keys
    import re

    from blocks import WriterQuantBlock

    block = WriterQuantBlock(writer, f"state.output_scale.{writer}")
    layer = block.attn
    ira.bind_kv_caches(block, 4, torch.float32, poison=True)
    md = ira.build_attention_metadata([5], [0], [[2]], BS)
    g = torch.Generator().manual_seed(0)
    positions, x = torch.arange(5), torch.randn(5, (block.h + 2 * block.hkv) * block.d, generator=g)
    before = snapshot(layer.kv_cache, x)
    torch._dynamo.reset()
    with torch.no_grad(), ira.set_forward_context(md), ira.plugin():
        compiled = torch.compile(block, backend="inductor")
        for bad in (0.0, -1.0, float("nan"), float("inf")):  # the first call compiles
            block.scale.fill_(bad)
            with pytest.raises(ValueError, match=re.escape(f"rocm_attn.{_WRITER_OPS[writer]}: output_scale must be a "
                                                           f"positive finite number, got {bad!r}")):
                compiled(positions, x)
            assert unchanged(before, layer.kv_cache, x), "the cache update wrote before the scale was refused"
            assert not layer.interleaved_v, "a refused call switched the layer to interleaved V"
        block.scale.fill_(0.5)
        out = compiled(positions, x)
    assert out.dtype == torch.float8_e4m3fn and torch.isfinite(out.float()).all()
    assert not unchanged(before, layer.kv_cache), "the fused graph with a good scale wrote no cache"


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([0.5], dtype=torch.bfloat16), r"output_scale must be a float32 tensor \(a per-tensor scale\), got "
                                                r"torch\.bfloat16"),
    (torch.tensor([[0.5]]), r"output_scale must be a per-tensor scale \(1 element, shape \(\) or \(1,\)\), got "
                            r"shape \(1, 1\)"),
    # a meta scale dispatches to the fake kernel
    (torch.tensor([0.5], device="meta"), r"all tensors must be on one device, got .*(key|qkv) on cpu.*, output_scale "
                                         r"on meta"),
    (torch.tensor(float("nan")), r"output_scale must be a positive finite number, got nan"),
])
@pytest.mark.parametrize("writer", list(_WRITER_OPS))
def test_cache_update_ops_check_output_scale_before_writing(writer, bad, match):
    # the layer ops' eager path, called as the fused graph calls them
    from blocks import WriterQuantBlock

    block = WriterQuantBlock(writer, f"state.update_scale.{writer}.{next(_names)}")
    ira.bind_kv_caches(block, 4, torch.float32, poison=True)
    md = ira.build_attention_metadata([5], [0], [[2]], BS)
    x = torch.randn(5, (block.h + 2 * block.hkv) * block.d)
    before = snapshot(block.attn.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.{_WRITER_OPS[writer]}: {match}"), ira.set_forward_context(md):
        block.write(torch.arange(5), x, bad)
    assert unchanged(before, block.attn.kv_cache) and not block.attn.interleaved_v
    with ira.set_forward_context(md):
        block.write(torch.arange(5), x, torch.tensor([0.5]))
    assert not unchanged(before, block.attn.kv_cache), "a good output_scale: the update wrote nothing"


# --- the builder -----------------------------------------------------------------------------------


def test_builder_device_must_be_the_buffers():
    buffers = ira.MetadataBuffers(4, 16, 4, "cpu")
    first = ira.build_attention_metadata([2], [0], [[1]], BS, buffers=buffers)
    before = snapshot(buffers.query_start_loc, buffers.seq_lens, buffers.block_table, buffers.slot_mapping,
                      buffers.positions)
    # the device was ignored: the metadata landed on the buffers' device
    with pytest.raises(ValueError, match=r"build_attention_metadata: device meta but the buffers are on cpu"):
        ira.build_attention_metadata([3], [0], [[2]], BS, "meta", buffers=buffers)
    assert unchanged(before, buffers.query_start_loc, buffers.seq_lens, buffers.block_table, buffers.slot_mapping,
                     buffers.positions), "a refused step overwrote the previous step's buffers"
    assert first.seq_lens.tolist() == [2]
    md = ira.build_attention_metadata([3], [0], [[2]], BS, "cpu", buffers=buffers)  # the buffers' device: fine
    assert md.seq_lens.tolist() == [3]


def test_builder_device_string_names_the_builder():
    with pytest.raises(ValueError, match=r"build_attention_metadata: device 'bogus' is not a torch device"):
        ira.build_attention_metadata([2], [0], [[0]], BS, "bogus")


@pytest.mark.parametrize("same_shape", [False, True])
def test_metadata_of_refilled_buffers_is_refused(same_shape):
    """Metadata built into MetadataBuffers holds views of them: a later build into the same
    buffers overwrites its tensors with another step. Run again after that (a step used twice,
    or one kept past the next build), it is refused before anything is written, although its
    earlier check is memoized on it (CPU) and its builder's plan vouches for its tensors (GPU):
    it would write the other step's slots (another sequence's block)."""
    s = stepped_layer("state_refill")
    buffers = ira.MetadataBuffers(4, 16, 4, "cpu")
    g = s.g
    old = ira.build_attention_metadata(s.query_lens, s.context_lens, s.tables, BS, buffers=buffers)
    with ira.set_forward_context(old):
        s.layer(*qkv(s.num_tokens, g))  # checked and memoized on the metadata
    # another step into the same buffers: a new sequence in a free block (of the same shape,
    # or of another)
    free = s.alloc._free[0]
    lens = [1, 1, 1] if same_shape else [3]
    newer = ira.build_attention_metadata(lens, [0] * len(lens), [[free]] * len(lens) if not same_shape
                                         else [[free], [s.alloc._free[1]], [s.alloc._free[2]]], BS,
                                         buffers=buffers, num_padded_tokens=s.num_tokens if same_shape else None)
    before = snapshot(s.layer.kv_cache)
    for ops in ("forward", "attention alone"):
        with pytest.raises(ValueError, match=r"rocm_attn\.unified_\w+: the step's metadata was built into "
                                             r"MetadataBuffers that a later build_attention_metadata\(\.\.\., "
                                             r"buffers=\.\.\.\) refilled"), ira.set_forward_context(old):
            q, k, v = qkv(s.num_tokens, g)
            if ops == "forward":
                s.layer(q, k, v)
            else:
                out = torch.full((s.num_tokens, H, D), float("nan"))
                torch.ops.rocm_attn.unified_attention_with_output(q.view(-1, H, D), k.view(-1, HKV, D),
                                                                  v.view(-1, HKV, D), out, s.layer.layer_name)
        assert unchanged(before, s.layer.kv_cache), "a step of refilled buffers wrote the cache"
    with ira.set_forward_context(newer):  # the buffers' latest step runs
        s.layer(*qkv(newer.slot_mapping.shape[0], g))



@pytest.mark.parametrize("derive", ["dataclasses.replace", "copy.copy, then a field set"])
def test_copy_of_metadata_of_refilled_buffers_is_refused(derive):
    """A copy of metadata built into MetadataBuffers (``dataclasses.replace``, or ``copy.copy``
    with a field set anew: a memo of its own) reads the same buffers. Checked and memoized on
    the copy, then run again after a later build refilled the buffers, it ran on the new step's
    values without a check: it wrote the cache at the new step's slots."""
    s = stepped_layer("state_refill_copy")
    buffers = ira.MetadataBuffers(4, 16, 4, "cpu")
    old = ira.build_attention_metadata(s.query_lens, s.context_lens, s.tables, BS, buffers=buffers)
    if derive == "dataclasses.replace":
        derived = dataclasses.replace(old, causal=True)
    else:
        derived = copy.copy(old)
        derived.causal = True
    with ira.set_forward_context(derived):
        s.layer(*qkv(s.num_tokens, s.g))  # checked and memoized on the copy
    ira.build_attention_metadata([2], [0], [[s.alloc._free[0]]], BS, buffers=buffers)
    before = snapshot(s.layer.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.unified_kv_cache_update: the step's metadata was built into "
                                         r"MetadataBuffers that a later build_attention_metadata"), \
            ira.set_forward_context(derived):
        s.layer(*qkv(s.num_tokens, s.g))
    assert unchanged(before, s.layer.kv_cache), "a copy of a refilled step wrote the cache"


def test_whole_step_metadata_of_refilled_buffers_is_refused():
    """The whole-step planner's metadata (``plan_step``: the builder's, in the graph's fixed
    shapes) is what the layers run: after a later plan into the same buffers it is refused,
    although its earlier check is memoized on it."""
    from inductor_rocm_attn.compilation.step_graphs import MIXED, StepShape, plan_step

    s = stepped_layer("state_refill_plan")
    buffers = ira.MetadataBuffers(4, 16, 4, "cpu")
    shape = StepShape(MIXED, 8, 4, 8)
    plan = dict(buffers=buffers, block_size=BS, max_model_len=64, device=torch.device("cpu"))
    old = plan_step(shape, s.query_lens, s.context_lens, s.tables, **plan)
    with ira.set_forward_context(old):
        s.layer(*qkv(shape.num_tokens, s.g))  # checked and memoized on the metadata
    newer = plan_step(shape, [2], [0], [[s.alloc._free[0]]], **plan)
    before = snapshot(s.layer.kv_cache)
    with pytest.raises(ValueError, match=r"refilled with another step"), ira.set_forward_context(old):
        s.layer(*qkv(shape.num_tokens, s.g))
    assert unchanged(before, s.layer.kv_cache), "a step of refilled buffers wrote the cache"
    with ira.set_forward_context(newer):  # the buffers' latest step runs
        s.layer(*qkv(shape.num_tokens, s.g))


def test_a_graph_stand_in_replays_the_metadata_it_captured_after_a_refill():
    """RerunGraphBackend replays Python under the metadata it captured, reading each new step
    through its views as a real graph reads the same addresses: that metadata stays valid
    after later builds refill the buffers (others built before the refill do not)."""
    from inductor_rocm_attn.compilation.graph_backends import RerunGraphBackend

    s = stepped_layer("state_replay")
    buffers = ira.MetadataBuffers(4, 16, 4, "cpu")
    lens = [1, 1, 1]
    tables = [[b] for b in s.alloc._free[:3]]
    captured = ira.build_attention_metadata(lens, [0, 0, 0], tables, BS, buffers=buffers)
    q, k, v = qkv(3, s.g)
    with ira.set_forward_context(captured):
        graph, _ = RerunGraphBackend().capture_step(s.layer, (q, k, v))
    other = ira.build_attention_metadata(lens, [0, 0, 0], tables, BS, buffers=buffers)
    ira.build_attention_metadata(lens, [1, 1, 1], tables, BS, buffers=buffers)  # the step the replay reads
    graph.replay()
    with pytest.raises(ValueError, match=r"refilled with another step"), ira.set_forward_context(other):
        s.layer(q, k, v)


def test_a_build_refused_after_its_fill_leaves_no_step_current():
    # the fill overwrote the buffers before the builder refused the step (buffers replaced by
    # hand): the metadata built before them must not run on what the refused build left
    s = stepped_layer("state_refused_fill")
    buffers = ira.MetadataBuffers(4, 16, 4, "cpu")
    tables = [[b] for b in s.alloc._free[:3]]
    earlier = ira.build_attention_metadata([1, 1, 1], [0, 0, 0], tables, BS, buffers=buffers)
    with ira.set_forward_context(earlier):
        s.layer(*qkv(3, s.g))
    buffers.slot_mapping = torch.full((32,), -1, dtype=torch.int64)[::2]
    with pytest.raises(ValueError, match=r"build_attention_metadata: slot_mapping must have unit stride"):
        ira.build_attention_metadata([2, 1], [0, 0], tables[:2], BS, buffers=buffers)
    before = snapshot(s.layer.kv_cache)
    with pytest.raises(ValueError, match=r"refilled with another step"), ira.set_forward_context(earlier):
        s.layer(*qkv(3, s.g))
    assert unchanged(before, s.layer.kv_cache)

@pytest.mark.parametrize("field", ["query_lens", "context_lens", "block_tables"])
@pytest.mark.parametrize("kind", ["dict", "set", "generator"])
def test_builder_per_sequence_arguments_must_be_sequences(field, kind):
    # a dict was taken by its keys: query_lens {0: 2} planned a sequence of 0 tokens
    good = dict(query_lens=[2], context_lens=[0], block_tables=[[0]])
    value = good[field]
    bad = {"dict": {0: value[0]} if field != "block_tables" else {0: [0]},
           "set": {0} if field != "block_tables" else {(0,)},
           "generator": (x for x in value)}[kind]
    with pytest.raises(TypeError, match=rf"build_attention_metadata: {field} must be a sequence with one entry per "
                                        rf"sequence \(a list\), got "):
        ira.build_attention_metadata(**{**good, field: bad}, block_size=BS)


@pytest.mark.parametrize("args, match", [
    ((0, 8, 2), r"MetadataBuffers: max_num_seqs must be a positive int, got 0"),
    ((4, -1, 2), r"MetadataBuffers: max_num_tokens must be a positive int, got -1"),
    ((4, 8, "2"), r"MetadataBuffers: max_blocks_per_seq must be a positive int, got '2'"),
])
def test_metadata_buffers_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        ira.MetadataBuffers(*args, "cpu")


def test_metadata_buffers_device_string():
    with pytest.raises(ValueError, match=r"MetadataBuffers: device 'gpu0' is not a torch device"):
        ira.MetadataBuffers(4, 8, 2, "gpu0")


# --- the block allocator ---------------------------------------------------------------------------


def test_block_allocator_block_size_must_be_the_caches():
    # a block size no cache has: every plan of it was refused later, by the builder
    with pytest.raises(ValueError, match=r"BlockAllocator: block_size 10 is not supported; it must be a positive "
                                         r"multiple of 16"):
        ira.BlockAllocator(8, 10)


@pytest.mark.parametrize("seed", ["x", 1.5, True])
def test_block_allocator_shuffle_seed_must_be_an_int(seed):
    with pytest.raises(TypeError, match=rf"BlockAllocator: shuffle_seed must be an int or None, got {seed!r}"):
        ira.BlockAllocator(8, BS, shuffle_seed=seed)


@pytest.mark.parametrize("n", [-5, 2.5, "3"])
def test_block_allocator_blocks_needed(n):
    alloc = ira.BlockAllocator(8, BS)
    alloc.allocate("a", 20)
    before = _allocator_state(alloc)
    with pytest.raises(ValueError, match=rf"BlockAllocator\.blocks_needed: num_tokens must be an int >= 0, got "
                                         rf"{n!r}"):
        alloc.blocks_needed(n)  # -5 needed 0 blocks
    assert _allocator_state(alloc) == before


# --- the piecewise compile -------------------------------------------------------------------------


def test_graph_backend_with_graphs_off_is_refused():
    # the backend captured anyway: the explicit use_cuda_graphs=False was ignored
    from inductor_rocm_attn.compilation import compile_piecewise
    from inductor_rocm_attn.compilation.graph_backends import RerunGraphBackend

    with pytest.raises(ValueError, match=r"compile_piecewise: graph_backend given with use_cuda_graphs=False"):
        compile_piecewise(torch.nn.Linear(2, 2), [1], use_cuda_graphs=False, graph_backend=RerunGraphBackend())


# --- the fused QK-norm writers switch a layer to interleaved V: only once nothing can refuse the call --


def _layer_with_cache(name, kv_cache_dtype, cache_dtype):
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=name, kv_cache_dtype=kv_cache_dtype)
    cache = ira.allocate_kv_cache(ira.KVCacheSpec(BS, HKV, D, cache_dtype, ira.CacheLayout.LHBNC), 8)
    g = torch.Generator().manual_seed(0)
    cache.view(torch.uint8).copy_(torch.randint(0, 60, cache.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    layer.kv_cache = cache  # assigned by hand: not the dtype the layer names
    return layer


@pytest.mark.parametrize("op", ["qkv", "cos_sin"])
@pytest.mark.parametrize("kv_cache_dtype, cache_dtype", [("float16", torch.float32), ("auto", torch.float8_e4m3fn)])
def test_qk_norm_writer_refused_for_the_cache_dtype_leaves_the_v_layout(op, kv_cache_dtype, cache_dtype):
    # the switch to interleaved V (flag and cached data) ran before the kernel's choice refused the cache
    layer = _layer_with_cache(f"state.qkn.{op}.{kv_cache_dtype}", kv_cache_dtype, cache_dtype)
    md = ira.build_attention_metadata([3], [0], [[1]], BS)
    w, t = torch.ones(D), 3
    q, k, v = torch.randn(t, H, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    before = snapshot(layer.kv_cache, q, k)
    with pytest.raises(ValueError, match=rf"the layer is configured with kv_cache_dtype='{kv_cache_dtype}' but its KV "
                                         rf"cache is {cache_dtype}"), ira.set_forward_context(md):
        if op == "qkv":
            torch.ops.rocm_attn.unified_qk_norm_rope_and_kv_cache_update(
                torch.randn(t, (H + 2 * HKV) * D), w, w, 1e-6, md.positions, torch.randn(64, D), True, H, HKV, D,
                layer.layer_name)
        else:
            torch.ops.rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update(
                q, k, v, w, w, 1e-6, torch.randn(t, D), torch.randn(t, D), True, layer.layer_name)
    assert not layer.interleaved_v, "a refused call switched the layer to interleaved V"
    assert unchanged(before, layer.kv_cache, q, k), "a refused call converted the cache or rotated q/k"


# --- kernel-level ops: the per-head values a layer refuses at construction ---------------------------


@pytest.mark.parametrize("name, bad, match", [
    ("sinks", float("nan"), r"sinks must not hold NaN or \+inf"),
    ("sinks", float("inf"), r"sinks must not hold NaN or \+inf"),
    ("alibi_slopes", float("inf"), r"alibi_slopes must be finite"),
    ("alibi_slopes", float("nan"), r"alibi_slopes must be finite"),
])
@pytest.mark.parametrize("op", ["paged_attention", "encoder_attention"])
def test_kernel_ops_refuse_per_head_values_a_layer_refuses(op, name, bad, match):
    # accepted, they turned every row of the output NaN
    from cases import make_paged_case, poison

    c = make_paged_case([1, 3, 2], [20, 5, 0], dtype=torch.float32)
    per_head = torch.zeros(c.query.shape[1])
    per_head[1] = bad
    out = poison(torch.empty_like(c.query))
    before = snapshot(out, c.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.{op}: {match}"):
        if op == "paged_attention":
            torch.ops.rocm_attn.paged_attention(out, c.query, c.key, c.value, c.kv_cache, c.query_start_loc, c.seq_lens,
                                                c.block_table, c.max_query_len, c.max_seq_len, 0.125, c.k_scale,
                                                c.v_scale, **{name: per_head})
        else:
            t = c.query.shape[0]
            torch.ops.rocm_attn.encoder_attention(c.query, c.key, c.value, torch.tensor([0, t], dtype=torch.int32),
                                                  t, 0.125, **{name: per_head})
    assert unchanged(before, out, c.kv_cache)



# --- the piecewise runner: capture() overwrites the metadata buffers -------------------------------


def test_capture_on_a_runner_without_graphs_is_refused():
    """capture() on a runner compiled without graphs (CPU, or use_cuda_graphs=False) returned
    having captured nothing: every step went on running without graphs."""
    from inductor_rocm_attn.compilation import compile_piecewise
    from inductor_rocm_attn.models import TinyDecoder, qwen3_config

    model = TinyDecoder(qwen3_config(num_layers=1), name="state.no_graphs").eval()
    ira.bind_kv_caches(model, 16, torch.float32, poison=True)
    runner = compile_piecewise(model, [2], max_model_len=64, plugin=False)
    md = runner.prepare([2], [0], [[2]])
    with pytest.raises(RuntimeError, match=r"PiecewiseRunner\.capture: this runner runs without graphs "
                                           r"\(use_cuda_graphs=False: the model is on cpu and no graph_backend"):
        runner.capture()
    assert torch.isfinite(runner(torch.tensor([1, 2]), md)).all()  # the refused capture changed nothing


def test_a_step_prepared_before_capture_is_refused_after_it():
    # capture() fills the buffers with its dummy steps (slots -1): the step prepared before it
    # ran on them, writing no cache and attending over the dummy sequences, silently
    from inductor_rocm_attn.compilation import RerunGraphBackend, compile_piecewise
    from inductor_rocm_attn.models import TinyDecoder, qwen3_config

    cfg = qwen3_config(num_layers=1)
    model = TinyDecoder(cfg, name="state.capture").eval()
    ira.bind_kv_caches(model, 16, torch.float32, poison=True)
    runner = compile_piecewise(model, [4], max_model_len=64, plugin=False, capture=False,
                               graph_backend=RerunGraphBackend())
    md = runner.prepare([3], [0], [[2]])
    ids = torch.tensor([1, 2, 3])
    runner.capture()
    with pytest.raises(ValueError, match=r"PiecewiseRunner: the metadata is not the latest runner\.prepare"):
        runner(ids, md)
    md = runner.prepare([3], [0], [[2]])  # prepared again: runs
    assert torch.isfinite(runner(ids, md)).all()


# --- generate and the transformers helpers: flags given as strings --------------------------------


class _NoStepRunner:
    """A runner's limits and one cache; generate() must refuse its arguments before a step."""

    block_size, max_num_tokens, max_num_seqs, max_model_len = BS, 16, 4, 96

    def __init__(self):
        layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"state.gen.{id(self)}")
        ira.bind_kv_caches(layer, 8, torch.float32)
        self.layers = {layer.layer_name: layer}

    def prepare(self, *args, **kwargs):
        raise AssertionError("generate() planned a step before refusing its arguments")


def test_generate_return_logits_must_be_a_bool():
    from inductor_rocm_attn.integrations.batching import generate

    with pytest.raises(TypeError, match=r"generate: return_logits must be True or False, got 'no'"):
        generate(_NoStepRunner(), [[1, 2]], 2, return_logits="no")


def _tiny_transformers_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn").eval()


@pytest.mark.parametrize("who", ["PagedCache", "eager_runner"])
def test_transformers_poison_flag_must_be_a_bool(who):
    from inductor_rocm_attn.integrations.transformers import PagedCache
    from inductor_rocm_attn.integrations.transformers_runner import eager_runner

    model = _tiny_transformers_model()
    hooks = dict(model.model._forward_pre_hooks)
    with pytest.raises(TypeError, match=rf"{who}: poison must be True or False, got 'False'"):
        (PagedCache if who == "PagedCache" else eager_runner)(model, num_blocks=4, poison="False")
    assert dict(model.model._forward_pre_hooks) == hooks


def test_eager_runner_refuses_metadata_that_is_not_its_latest_prepare():
    """As ``PiecewiseRunner``: an older step's metadata (a forgotten ``prepare()``) or one built
    by hand would write that step's slots again, over the keys and values cached there since."""
    from inductor_rocm_attn.integrations.transformers_runner import eager_runner

    r = eager_runner(_tiny_transformers_model(), num_blocks=8)
    cache = next(iter(r.layers.values())).kv_cache
    prefill = r.prepare([3], [0], [[0]])
    r(torch.tensor([11, 12, 13]), prefill)
    decode = r.prepare([1], [3], [[0]])
    r(torch.tensor([14]), decode)
    before = snapshot(cache)
    for md in (prefill, ira.build_attention_metadata([3], [0], [[0]], r.block_size)):
        with pytest.raises(ValueError, match=r"EagerRunner: the metadata is not the latest runner\.prepare\(\.\.\.\)'s"):
            r(torch.tensor([50, 51, 52]), md)
        assert unchanged(before, cache), "a refused step wrote the cache"
    r(torch.tensor([15]), r.prepare([1], [4], [[0]]))  # the next prepared step runs


# --- fused RoPE layer ops: the query must be the layer's heads, on every call -----------------------


def _fused_rope_call(op, layer, md, q, k, v):
    t = q.shape[0]
    g = torch.Generator().manual_seed(1)
    with ira.set_forward_context(md):
        if op == "rope":
            torch.ops.rocm_attn.unified_rope_and_kv_cache_update(md.positions, q, k, v, torch.randn(64, D, generator=g),
                                                                 True, layer.layer_name)
        elif op == "rope_cos_sin":
            torch.ops.rocm_attn.unified_rope_cos_sin_and_kv_cache_update(
                q, k, v, torch.randn(t, D, generator=g), torch.randn(t, D, generator=g), True, layer.layer_name)
        else:
            w = torch.ones(D)
            torch.ops.rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update(
                q, k, v, w, w, 1e-6, torch.randn(t, D, generator=g), torch.randn(t, D, generator=g), True,
                layer.layer_name)


@pytest.mark.parametrize("op", ["rope", "rope_cos_sin", "qk_norm_rope_cos_sin"])
@pytest.mark.parametrize("shape", [(H + 1, D), (H // 2, D), (H, D // 2)])
@pytest.mark.parametrize("first", [True, False])
def test_fused_rope_layer_ops_refuse_a_query_of_other_heads(op, shape, first):
    # the kernels rotated whatever heads they were given and wrote the cache (the attention
    # refused the query afterwards); a query of another head size was rotated in other pairs
    s = stepped_layer(f"state_heads_{op}")
    t = s.num_tokens
    if not first:  # a good call of the same signature first: the check is not a first-call one
        _fused_rope_call(op, s.layer, s.md, torch.randn(t, H, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D))
    q, k, v = torch.randn(t, *shape), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    before = snapshot(s.layer.kv_cache, q, k)
    with pytest.raises(ValueError, match=rf"query must be the layer's heads, \[{t}, {H}, {D}\] or \[{t}, {H} \* {D}\], "
                                         rf"got \({t}, {shape[0]}, {shape[1]}\)"):
        _fused_rope_call(op, s.layer, s.md, q, k, v)
    assert unchanged(before, s.layer.kv_cache, q, k), "a refused call rotated q/k or wrote the cache"


@pytest.mark.parametrize("key_rows, key_head_size", [(3, D // 2), (5, D)], ids=["other_head_size", "more_rows"])
def test_rotary_only_layer_op_refuses_a_key_of_another_shape(key_rows, key_head_size):
    # a profiling run (no cache write): the rotation of key in place checked its heads on the
    # first call of a signature only, and a key with more rows than positions made the kernel
    # read positions past their end (the error names the layer op called, not its kernel op)
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"state.rotary_only_{key_rows}_{key_head_size}")
    t = 3
    cs = torch.randn(64, D)
    pos = torch.arange(t)
    with ira.profiling_run():
        torch.ops.rocm_attn.unified_rope_and_kv_cache_update(pos, torch.randn(t, H, D), torch.randn(t, HKV, D),
                                                             torch.randn(t, HKV, D), cs, True, layer.layer_name)
        q, k = torch.randn(t, H, D), torch.randn(key_rows, HKV, key_head_size)
        before = snapshot(q, k)
        with pytest.raises(ValueError, match=rf"rocm_attn\.unified_rope_and_kv_cache_update: key must be the "
                                             rf"layer's heads, "
                                             rf"\[{t}, {HKV}, {D}\] or \[{t}, {HKV} \* {D}\], got \({key_rows}, {HKV}, "
                                             rf"{key_head_size}\)"):
            torch.ops.rocm_attn.unified_rope_and_kv_cache_update(pos, q, k, torch.randn(t, HKV, D), cs, True,
                                                                 layer.layer_name)
        assert unchanged(before, q, k)


@pytest.mark.parametrize("field, value, match", [
    ("num_kv_heads", 0, r"num_kv_heads must be a positive int, got 0"),
    ("dtype", torch.int32, r"dtype torch\.int32 is not a cache dtype"),
    ("layout", "lbhnc", r"layout 'lbhnc' is not supported"),
])
def test_backend_customize_spec_refuses_what_no_cache_can_be(field, value, match):
    # answered as a valid spec: the allocation refused it later
    import dataclasses

    spec = dataclasses.replace(ira.KVCacheSpec(BS, HKV, D, torch.float32), **{field: value})
    with pytest.raises(ValueError, match=rf"RocmAttentionBackend\.customize_spec: {match}"):
        ira.RocmAttentionBackend.customize_spec(spec)


@pytest.fixture(scope="module")
def small_runner():
    """A one-layer decoder compiled piecewise, graphs emulated (max_model_len 60)."""
    from inductor_rocm_attn.compilation import RerunGraphBackend, compile_piecewise
    from inductor_rocm_attn.models import TinyDecoder, qwen3_config

    model = TinyDecoder(qwen3_config(num_layers=1), name="state.small_runner").eval()
    ira.bind_kv_caches(model, 16, torch.float32, poison=True)
    return compile_piecewise(model, [4], max_model_len=60, plugin=False, graph_backend=RerunGraphBackend())


def test_prepare_refuses_a_sequence_past_max_model_len(small_runner):
    # planned within the block table's width (max_model_len rounded up to whole blocks): a
    # model with learned positions indexed its embedding past them (a device assert on a GPU),
    # and a whole-step plan's max_seq_len hint was below the sequence
    runner = small_runner
    md = runner.prepare([2], [0], [[3]])
    buffers = runner.buffers
    before = snapshot(buffers.query_start_loc, buffers.seq_lens, buffers.block_table, buffers.slot_mapping,
                      buffers.positions)
    for whole_step in (True, False):
        with pytest.raises(ValueError, match=r"PiecewiseRunner\.prepare: the step has a sequence of 62 tokens, more "
                                             r"than max_model_len=60"):
            runner.prepare([1], [61], [[0, 1, 2, 4]], whole_step=whole_step)
    assert unchanged(before, buffers.query_start_loc, buffers.seq_lens, buffers.block_table, buffers.slot_mapping,
                     buffers.positions)
    assert torch.isfinite(runner(torch.tensor([1, 2]), md)).all()  # the step prepared before still runs


def test_bind_kv_caches_refuses_caches_a_generate_holds(small_runner):
    """bind_kv_caches from on_step swapped the caches under a running generate: its next steps
    read the new caches, without the tokens it had cached."""
    from inductor_rocm_attn.integrations.batching import generate

    caches = [layer.kv_cache for layer in small_runner.layers.values()]

    def rebind(record):
        ira.bind_kv_caches(small_runner.model, 16, torch.float32)

    with pytest.raises(RuntimeError, match=r"bind_kv_caches: a running generate\(\) holds these KV caches"):
        generate(small_runner, [[1, 2, 3]], 3, on_step=rebind)
    assert all(layer.kv_cache is cache for layer, cache in zip(small_runner.layers.values(), caches))


def test_runner_use_graphs_must_be_a_bool(small_runner):
    md = small_runner.prepare([2], [0], [[3]])
    with pytest.raises(TypeError, match=r"PiecewiseRunner: use_graphs must be True or False, got 'no'"):
        small_runner(torch.tensor([1, 2]), md, use_graphs="no")  # the graphs replayed


def test_runners_refuse_metadata_that_is_not_a_prepare_s(small_runner):
    """None (or a dict) as the step's metadata failed as an AttributeError on one of its fields."""
    from inductor_rocm_attn.integrations.transformers_runner import eager_runner

    md = small_runner.prepare([2], [0], [[3]])
    for bad in (None, {"num_actual_tokens": 2}):
        with pytest.raises(ValueError, match=rf"PiecewiseRunner: build the step's metadata with runner\.prepare\(\.\.\.\), "
                                             rf"got {type(bad).__name__}"):
            small_runner(torch.tensor([1, 2]), bad)
    assert torch.isfinite(small_runner(torch.tensor([1, 2]), md)).all()  # the prepared step still runs
    runner = eager_runner(_tiny_transformers_model(), num_blocks=4)
    with pytest.raises(TypeError, match=r"EagerRunner: metadata must be runner\.prepare\(\.\.\.\)'s AttentionMetadata, "
                                        r"got NoneType"):
        runner(torch.tensor([1, 2]), None)


def test_eager_runner_whole_step_is_checked_as_the_piecewise_runner_s():
    from inductor_rocm_attn.integrations.transformers_runner import eager_runner

    runner = eager_runner(_tiny_transformers_model(), num_blocks=4)
    with pytest.raises(ValueError, match=r"EagerRunner\.prepare: whole_step='bogus'; expected True, False or 'mixed'"):
        runner.prepare([2], [0], [[1]], whole_step="bogus")
    runner.prepare([2], [0], [[1]], whole_step="mixed")  # the runners' API: taken, no graphs here



def test_eager_runner_prepare_refuses_block_ids_past_its_caches():
    # the piecewise runner's prepare() refuses them; the eager runner's planned the step and
    # left the refusal to the first layer's check when the step ran
    from inductor_rocm_attn.integrations.transformers_runner import eager_runner

    runner = eager_runner(_tiny_transformers_model(), num_blocks=4)
    with pytest.raises(IndexError, match=r"build_attention_metadata: block_tables\[0\]\[0\] = 4 is outside the cache "
                                         r"\(num_blocks 4: valid block ids 0\.\.3\)"):
        runner.prepare([2], [0], [[4]])
    runner.prepare([2], [0], [[3]])


def test_compile_transformers_refuses_a_max_model_len_past_its_cache(monkeypatch):
    # taken: the runner sized its block-table buffers for it (max_num_seqs x max_model_len /
    # block_size entries; 10**9 tokens: 16 GB, the process was killed for memory) although no
    # sequence can outgrow the cache
    from inductor_rocm_attn.integrations import transformers_runner

    def allocated(*args, **kwargs):
        raise AssertionError("the caches were allocated before the refusal")

    monkeypatch.setattr(transformers_runner, "paged_layers", allocated)
    model = _tiny_transformers_model()
    for max_model_len in (65, 10**9):
        with pytest.raises(ValueError, match=rf"compile_transformers: max_model_len {max_model_len} is more than the "
                                             r"paged KV cache holds \(num_blocks 4 x block_size 16 = 64 tokens\)"):
            transformers_runner.compile_transformers(model, num_blocks=4, max_model_len=max_model_len)


def test_compile_piecewise_max_model_len_within_the_caches():
    # a max_model_len past what the bound caches hold was accepted (the block table clipped to
    # the caches' blocks, the decode graphs planning KV splits for a length no sequence can
    # reach, a step between the two lengths refused by the builder's table width): refused now,
    # before the trace, as compile_transformers refuses it; the default is capped at the caches
    from inductor_rocm_attn.compilation import compile_piecewise
    from inductor_rocm_attn.models import TinyDecoder, qwen3_config

    model = TinyDecoder(qwen3_config(num_layers=2), name="state.wide_model_len").eval()
    ira.bind_kv_caches(model, 6, torch.float32, poison=True)
    ira.bind_kv_caches(model.layers[1], 5, torch.float32, poison=True)  # the smaller cache counts
    for bad in (10**9, 81):
        with pytest.raises(ValueError, match=rf"compile_piecewise: max_model_len {bad} is more than the bound KV caches "
                                             r"hold \(5 blocks x block_size 16 = 80 tokens, the smallest layer cache\); "
                                             r"pass max_model_len <= 80 \(or leave it out: min\(4096, 80\)\)"):
            compile_piecewise(model, [2], max_model_len=bad, plugin=False)
    runner = compile_piecewise(model, [2], plugin=False)  # the default: 4096 capped at the caches
    assert runner.max_model_len == 80 and runner.buffers.block_table.shape[1] == 5
    md = runner.prepare([1, 1], [0, 0], [[1], [4]])  # a step that fits runs
    assert torch.isfinite(runner(torch.tensor([1, 2]), md)).all()


# --- hand-built metadata: a written block must not be another sequence's context -------------------


def test_hand_built_step_writing_a_block_another_sequence_reads_is_refused():
    # the builder refuses it; hand-built metadata whose slots follow each table passed, and
    # the write overwrote sequence 0's cached tokens 0..1
    import dataclasses

    s = stepped_layer("state_shared_block")
    fields = {f.name: getattr(s.md, f.name) for f in dataclasses.fields(s.md) if f.init}
    table = s.md.block_table.clone()
    table[0, 0] = s.tables[2][0]  # sequence 0's first context block is the block sequence 2 writes
    md = ira.AttentionMetadata(**{**fields, "block_table": table, "plan": None})
    before = snapshot(s.layer.kv_cache)
    q, k, v = qkv(s.num_tokens, s.g)
    position = int(md.positions[4])  # sequence 2's first new token
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_kv_cache_update: block {s.tables[2][0]} receives a new "
                                         rf"token of sequence 2 \(token 4, position {position}\) but is used 2 times "
                                         rf"in this step \(block_table\[0\]\[0\], block_table\[2\]\[0\]\)"), \
            ira.set_forward_context(md):
        s.layer(q, k, v)
    assert unchanged(before, s.layer.kv_cache)


# --- fp8 cache scales changed in place: checked before the next write -------------------------------


def _write_call(path, layer, md, g):
    t = md.slot_mapping.shape[0]
    q, k, v = torch.randn(t, H, D, generator=g), torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
    if path == "forward":
        with ira.set_forward_context(md):
            layer(q.view(t, -1), k.view(t, -1), v.view(t, -1))
    elif path == "qk_norm_rope":
        w = torch.ones(D)
        with ira.set_forward_context(md):
            torch.ops.rocm_attn.unified_qk_norm_rope_and_kv_cache_update(
                torch.randn(t, (H + 2 * HKV) * D, generator=g), w, w, 1e-6, md.positions, torch.randn(64, D, generator=g),
                True, H, HKV, D, layer.layer_name)
    else:
        _fused_rope_call(path, layer, md, q, k, v)


@pytest.mark.parametrize("path", ["forward", "rope", "rope_cos_sin", "qk_norm_rope_cos_sin", "qk_norm_rope"])
@pytest.mark.parametrize("name, bad", [("_k_scale", 0.0), ("_v_scale", float("nan")), ("_k_scale", float("inf"))])
def test_fp8_scales_changed_in_place_are_checked_before_the_next_write(path, name, bad):
    """The layer's scales are tensors so they can change without recompiling; one changed in
    place (``layer._k_scale.fill_(...)``) was checked on a signature's first call only: a zero
    scale then stored every key as the fp8 maximum and read it back as 0, silently."""
    s = stepped_layer(f"state_scale_{path}", kv_cache_dtype="fp8", k_scale=0.5, v_scale=0.25)
    g = torch.Generator().manual_seed(3)
    _write_call(path, s.layer, s.md, g)  # the signature's first call: checked in full
    getattr(s.layer, name).fill_(bad)
    before = snapshot(s.layer.kv_cache)
    with pytest.raises(ValueError, match=rf"{name[1:]} must be a positive finite number, got {bad}"):
        _write_call(path, s.layer, s.md, g)
    assert unchanged(before, s.layer.kv_cache), "a refused call wrote the cache"
    getattr(s.layer, name).fill_(0.125)  # a good value set in place is taken
    _write_call(path, s.layer, s.md, g)


def test_a_kv_sharing_layer_s_v_layout_switch_is_refused():
    """A layer sharing another's cache reads it with the target's V interior: switching the
    sharing layer itself changed a flag no read looks at (and said the layout changed)."""
    target = ira.Attention(H, D, num_kv_heads=HKV, layer_name="state.switch_target")
    sharer = ira.Attention(H, D, num_kv_heads=HKV, layer_name="state.switch_sharer",
                           kv_sharing_target_layer_name="state.switch_target")
    ira.bind_kv_caches(torch.nn.ModuleList([target, sharer]), 4, torch.float32)
    with pytest.raises(ValueError, match=r"set_interleaved_v_cache: layer 'state\.switch_sharer' reads the KV cache "
                                         r"of 'state\.switch_target' with that layer's V interior; switch "
                                         r"'state\.switch_target'"):
        sharer.set_interleaved_v_cache(True)
    assert not sharer.impl.interleaved_v
    assert target.set_interleaved_v_cache(True) and target.interleaved_v


# --- one layer writing its cache twice in one step --------------------------------------------------

_SECOND_WRITE = r"this layer writes its KV cache a second time in one forward context"


def test_a_layer_called_at_two_depths_of_one_step_warns():
    # one Attention module serving two depths (a looped model): the second call overwrote the
    # step's slots with the second depth's keys, and the next step read those for the first
    # depth too, silently; it warns now, naming the layer (once per layer), and a step run
    # again in a context of its own (the way to re-run a step) does not
    s = stepped_layer("state_two_depths")
    q, k, v = qkv(s.num_tokens, s.g)
    with ira.set_forward_context(s.md):
        s.layer(q, k, v)
        with pytest.warns(UserWarning, match=rf"rocm_attn\.unified_kv_cache_update \(layer '{s.layer.layer_name}'\): "
                                             rf"{_SECOND_WRITE}.*one layer \(its own name and cache\) per depth"):
            s.layer(q, 2 * k, 2 * v)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + _SECOND_WRITE)
        for _ in range(2):  # the step again, each run in its own context
            with ira.set_forward_context(s.md):
                s.layer(q, k, v)
        with ira.set_forward_context(s.md):  # a fused writer's second write is one too
            with pytest.raises(UserWarning, match=rf"unified_rope_and_kv_cache_update .*{_SECOND_WRITE}"):
                for _ in range(2):
                    t = s.num_tokens
                    torch.ops.rocm_attn.unified_rope_and_kv_cache_update(
                        s.md.positions, q.view(t, H, D).clone(), k.view(t, HKV, D).clone(), v.view(t, HKV, D),
                        torch.randn(64, D, generator=s.g), True, s.layer.layer_name)


def test_a_runner_s_capture_runs_each_warm_up_in_a_context_of_its_own():
    """The capture's warm-up and capture runs of one size each enter the step's context anew:
    no layer writes twice in one context."""
    from inductor_rocm_attn.compilation import RerunGraphBackend, compile_piecewise
    from inductor_rocm_attn.models import TinyDecoder, qwen3_config

    model = TinyDecoder(qwen3_config(num_layers=1), name="state.capture_contexts").eval()
    ira.bind_kv_caches(model, 8, torch.float32, poison=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + _SECOND_WRITE)
        runner = compile_piecewise(model, [2], plugin=False, graph_backend=RerunGraphBackend(),
                                   piecewise_graphs=True)
    assert runner._captured


@pytest.mark.parametrize("enter, name", [("set", "layer"), ("set", "Layers"), ("set", "profilng"), ("profiling", "layer")])
def test_forward_context_refuses_a_misspelt_keyword(enter, name):
    # set_forward_context(md, layer=table) kept the table as an "extra" and resolved the step's
    # layer names through the registry instead, silently; other extras are still kept
    s = stepped_layer("state_ctx_kw")
    table = {s.layer.layer_name: s.layer}
    call = (lambda **kw: ira.set_forward_context(s.md, **kw)) if enter == "set" else ira.profiling_run
    with pytest.raises(TypeError, match=rf"set_forward_context\(\) got an unexpected keyword argument '{name}'; did "
                                        r"you mean '(layers|profiling)'\? \(its keywords: attn_metadata, profiling, "
                                        r"layers; other keywords are kept in the context's extra"):
        with call(**{name: table}):
            pass
    assert get_forward_context().attn_metadata is None
    with ira.set_forward_context(s.md, layers=table, virtual_engine=0, dp_metadata=None) as ctx:
        assert ctx.extra == {"virtual_engine": 0, "dp_metadata": None}
