"""Whole-step graphs of mixed steps (``compilation.step_graphs``): one captured graph per size
serves any mix of prefill chunks, verify batches (2..8 query tokens) and decodes.

1. Kernels: the Triton launcher (interpreter on CPU) over a step planned in a graph's fixed
   shapes (sequences padded with empty ones, padding rows past ``query_start_loc[-1]`` holding
   NaN, ``max_query_len`` = the captured size, ``max_seq_len`` = ``max_model_len``, the block
   table at full width with unread entries out of range) against the float64 oracle, and the
   padding rows left untouched.
2. Planning: ``prepare`` picks the decode graph for decode-only steps, the mixed graph for
   the rest, in the captured shapes.
3. Models on CPU with ``RerunGraphBackend`` (a replay reruns the step on the tensors it was
   captured with, under the capture's metadata, so anything not routed through the
   persistent buffers comes out stale): 200 steps of a serving schedule through whole-step
   graphs, bitwise equal to the same step run without graphs and within fp32 rounding of
   the eager model with its own caches. Our TinyDecoder and a transformers Qwen3.
4. The same on a GPU with CUDA graphs (``gpu`` mark): capture fails on any host sync.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import sys

import pytest
import torch

import cases
import inductor_rocm_attn as ira

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "kernels"))
from attention_checks import TOL  # noqa: E402 (also fixes Triton 3.6's interpreter for NumPy >= 2.3)

from inductor_rocm_attn.compilation import RerunGraphBackend, compile_piecewise
from inductor_rocm_attn.compilation.step_graphs import DECODE, MIXED, StepShape, step_shapes
from inductor_rocm_attn.metadata import MetadataBuffers
from inductor_rocm_attn.models import qwen3_config
from decoder_pairs import decoder_pair

# --- 1. kernels over a fixed-shape (padded) step ------------------------------------------------

# id, query_lens, context_lens, captured tokens T, captured sequences S, kwargs. Every case
# mixes paths; T, S above the step's own counts (padding rows, empty sequences).
FIXED_CASES = [
    ("decode_verify_prefill", [1, 3, 20, 1, 8], [30, 17, 9, 0, 40], 64, 8, {}),
    ("verify_prefill_boundary", [9, 8, 2, 1], [5, 33, 0, 70], 32, 8, {}),
    ("small_size_verify_only", [1, 3, 2], [12, 7, 25], 8, 8, {}),  # T <= 8: no prefill launch
    ("size4_pow2_rows", [2, 1], [19, 3], 4, 4, {}),
    ("splits_window_sinks", [1, 5, 1, 14], [50, 21, 33, 2], 32, 6,
     dict(num_splits=3, sliding_window=9, sinks=True)),
    ("only_decodes_in_mixed_shape", [1, 1, 1], [16, 3, 31], 16, 8, {}),
    ("one_prefill_fills_size", [16], [7], 16, 4, dict(dtype=torch.float32)),
    ("noncausal_alibi", [1, 6, 12], [9, 14, 3], 32, 5, dict(causal=False, alibi=True)),
]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter


def _fixed_step_launch(query_lens, context_lens, size, num_seqs, *, max_model_len=96, dtype=torch.float16,
                       num_heads=4, num_kv_heads=2, head_size=32, block_size=16, causal=True,
                       sliding_window=-1, sinks=False, alibi=False, num_splits=None, device=DEVICE):
    from inductor_rocm_attn.kernels.triton.paged_attention import paged_attention

    seed = random.randrange(1 << 30)
    c = cases.make_paged_case(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_size=head_size, block_size=block_size, dtype=dtype, seed=seed)
    b, t = len(query_lens), sum(query_lens)
    width = -(-max_model_len // block_size)
    assert c.block_table.shape[1] <= width and b <= num_seqs and t <= size
    bad_block = c.kv_cache.shape[0] + 1000  # never read: a read would fault or show
    table = torch.full((num_seqs, width), bad_block, dtype=torch.int32)
    table[:b, : c.block_table.shape[1]] = c.block_table
    qsl = torch.full((num_seqs + 1,), t, dtype=torch.int32)
    qsl[: b + 1] = c.query_start_loc
    seq_lens = torch.zeros(num_seqs, dtype=torch.int32)
    seq_lens[:b] = c.seq_lens
    nan = float("nan")
    pad = size - t

    def padded(x):  # rows past the step's tokens: padding, NaN (they may hold anything)
        return torch.cat([x, torch.full((pad, *x.shape[1:]), nan, dtype=x.dtype)])

    query, key, value = padded(c.query), padded(c.key), padded(c.value)
    g = torch.Generator().manual_seed(seed + 1)
    slopes = torch.rand(num_heads, generator=g) * 0.5 if alibi else None
    sink = torch.randn(num_heads, generator=g) * 2 if sinks else None
    scale = head_size ** -0.5
    guarded = cases.Guarded(query.shape, dtype, device)
    out = guarded.t
    dev = [None if x is None else x.to(device) for x in (query, key, value, c.kv_cache, qsl, seq_lens, table,
                                                         c.k_scale, c.v_scale, slopes, sink)]
    query, key, value, kv_cache, qsl, seq_lens, table, k_scale, v_scale, slopes_d, sink_d = dev
    paged_attention(out, query, key, value, kv_cache, qsl, seq_lens, table, scale, k_scale,
                    v_scale, causal, sliding_window, slopes_d, sink_d, 0.0, False, None,
                    max_query_len=size, max_seq_len=max_model_len, num_splits=num_splits)
    guarded.assert_intact()
    assert torch.isnan(out[t:].float()).all(), "padding rows were written"
    want = cases.dense_oracle(c, scale=scale, causal=causal, sliding_window=sliding_window,
                              alibi_slopes=slopes, sinks=sink, logits_soft_cap=0.0)
    got = out[:t].double().cpu()
    assert not torch.isnan(got).any(), f"unwritten or NaN rows (seed {seed})"
    err = cases.rel_err(got, want)
    assert err < TOL[dtype], f"rel err {err:.3e} (seed {seed})"


@pytest.mark.parametrize("query_lens,context_lens,size,num_seqs,kw", [c[1:] for c in FIXED_CASES],
                         ids=[c[0] for c in FIXED_CASES])
def test_triton_fixed_shape_step(query_lens, context_lens, size, num_seqs, kw):
    """Every path launched with the graph's grid: decode, verify and prefill programs of
    empty sequences and past the batch exit before any load or store; real rows are right."""
    _fixed_step_launch(query_lens, context_lens, size, num_seqs, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_fixed_shape_step_gpu_tiles(dtype):
    """GPU tiles (prefill row blocks of 64-128 rows, KV splits from max_model_len): a 4160-token
    graph size holding 3 prefill chunks, verify sequences and decodes of 64 sequences."""
    qlens = [300, 130, 9] + [8, 5, 2] * 4 + [1] * 40
    clens = [1200, 0, 700] + [900, 33, 1500] * 4 + [1000 + 7 * i for i in range(40)]
    _fixed_step_launch(qlens, clens, 4160, 64, max_model_len=2304, dtype=dtype, num_heads=16, num_kv_heads=8,
                       head_size=128)


# --- 2. planning ----------------------------------------------------------------------------------


def test_step_shapes():
    got = step_shapes([1, 4, 16, 64], 8, decode=True, mixed=True)
    assert got == [StepShape(MIXED, 64, 8, 64), StepShape(MIXED, 16, 8, 16), StepShape(MIXED, 4, 4, 4),
                   StepShape(DECODE, 4, 4, 1), StepShape(DECODE, 1, 1, 1)]
    # size 1 always decodes: the mixed kind alone still serves it (with a decode graph)
    assert step_shapes([1, 2], 8, decode=False, mixed=True) == [StepShape(MIXED, 2, 2, 2),
                                                               StepShape(DECODE, 1, 1, 1)]
    assert step_shapes([1, 2], 8, decode=True, mixed=False) == [StepShape(DECODE, 2, 2, 1),
                                                               StepShape(DECODE, 1, 1, 1)]


# --- 3. models on CPU through whole-step graphs -------------------------------------------------


@dataclasses.dataclass
class Seq:
    sid: int
    prompt: int  # prompt tokens
    target: int  # final length
    cached: int = 0
    speculative: bool = False  # verifies 2..8 draft tokens a step once its prompt is cached


@dataclasses.dataclass
class ScheduleStats:
    steps: int = 0
    decode_graph_steps: int = 0
    mixed_graph_steps: int = 0
    chunk_steps: int = 0  # a prompt continued from a cached part (context > 0, > 8 tokens)
    verify_steps: int = 0  # a sequence with 2..8 query tokens and a context
    padded_seq_steps: int = 0  # fewer sequences than the graph holds: empty ones padded in
    max_rel_err: float = 0.0
    argmax_agreement: float = 1.0


def serve(runner, reference, *, steps: int, max_tokens: int, max_seqs: int, max_len: int, vocab: int,
          seed: int) -> ScheduleStats:
    """Drive ``runner`` through a serving schedule: prompts join (chunked when they exceed
    the step's budget), speculative sequences verify 2..8 tokens a step, others decode; some
    steps decode only. Each step: graphs vs no graphs (bitwise), vs ``reference(ids, qlens,
    clens, tables)`` (the eager model with its own caches)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    alloc = ira.BlockAllocator(next(iter(runner.layers.values())).kv_cache.shape[0], runner.block_size,
                               shuffle_seed=seed)
    active: list[Seq] = []
    st = ScheduleStats()
    agree = total = next_id = 0
    captures = runner.stats.num_captures
    for _ in range(steps):
        for s in [s for s in active if s.cached >= s.target]:
            alloc.free(s.sid)
            active.remove(s)
        # A decode-only step: sequences with a cached prompt decode one token, the others wait.
        decode_only = rng.random() < 0.3 and any(s.cached >= s.prompt for s in active)
        chunks, room = [], max_tokens
        for s in active:
            if room <= 0 or len(chunks) == max_seqs:
                break
            if s.cached < s.prompt:  # prompt left: a chunk of it (maybe the whole rest)
                if decode_only:
                    continue
                n = min(s.prompt - s.cached, room)
            elif s.speculative and not decode_only:
                n = min(rng.randint(2, 8), room, s.target - s.cached)
            else:
                n = 1
            chunks.append((s, n))
            room -= n
        while not decode_only and room > 1 and len(chunks) < max_seqs and (not chunks or rng.random() < 0.4):
            s = Seq(next_id, rng.randint(2, 3 * max_tokens // 2), 0, speculative=rng.random() < 0.4)
            s.target = rng.randint(s.prompt + 1, max_len)
            next_id += 1
            active.append(s)
            n = min(s.prompt, room)
            chunks.append((s, n))
            room -= n
        qlens = [n for _, n in chunks]
        clens = [s.cached for s, _ in chunks]
        tables = [list(alloc.allocate(s.sid, n)) for s, n in chunks]
        ids = torch.randint(0, vocab, (sum(qlens),), generator=g).to(runner.device)
        md = runner.prepare(qlens, clens, tables)
        shape = runner.whole_step_shape(md)
        assert shape is not None, (qlens, clens)  # every step replays a whole-step graph
        # decode-only steps take their size's decode graph where there is one (sizes up to
        # max_num_seqs), every other step its size's mixed graph
        decode = max(qlens) == 1 and runner.padded_size(len(ids)) in runner._step_graphs
        assert shape.kind == (DECODE if decode else MIXED)
        assert md.seq_lens.shape[0] == shape.num_seqs and md.slot_mapping.shape[0] == shape.num_tokens
        st.decode_graph_steps += shape.kind == DECODE
        st.mixed_graph_steps += shape.kind == MIXED
        st.chunk_steps += any(q > 8 and c > 0 for q, c in zip(qlens, clens))
        st.verify_steps += any(2 <= q <= 8 and c > 0 for q, c in zip(qlens, clens))
        st.padded_seq_steps += len(qlens) < shape.num_seqs
        pieces = runner(ids, md, use_graphs=False).clone()  # writes the same K/V as the replay
        out = runner(ids, md).clone()
        assert torch.equal(out, pieces), f"step {st.steps}: graph replay differs from the pieces"
        ref = reference(ids, qlens, clens, tables)
        o, r = out.double(), ref.double()
        assert torch.isfinite(o).all()
        st.max_rel_err = max(st.max_rel_err, float((o - r).norm() / r.norm()))
        agree += int((o.argmax(-1) == r.argmax(-1)).sum())
        total += len(ids)
        for s, n in chunks:
            s.cached += n
        st.steps += 1
    st.argmax_agreement = agree / total
    assert runner.stats.num_captures == captures  # steady state: nothing captured again
    return st


def _check_schedule(st: ScheduleStats, tol: float, agreement: float = 1.0):
    print(st)
    assert st.decode_graph_steps > 10 and st.mixed_graph_steps > 10, st
    assert st.chunk_steps > 5 and st.verify_steps > 10 and st.padded_seq_steps > 10, st
    assert st.max_rel_err < tol and st.argmax_agreement >= agreement, st


SIZES = [1, 2, 4, 8, 16, 32, 64]


def _tiny_pair(device="cpu", dtype=torch.float32, num_blocks=256, **cfg):
    return decoder_pair(qwen3_config(**{"num_layers": 3, **cfg}), num_blocks, dtype, device)


def _eager_reference(ref, block_size, device):
    @torch.no_grad()
    def run(ids, qlens, clens, tables):
        md = ira.build_attention_metadata(qlens, clens, tables, block_size, device)
        with ira.set_forward_context(md):
            return ref(ids, md.positions)

    return run


@pytest.mark.compile
def test_tiny_decoder_200_steps_through_whole_step_graphs():
    model, ref = _tiny_pair()
    runner = compile_piecewise(model, capture_sizes=SIZES, max_num_seqs=8, max_model_len=160,
                               mixed_graphs=True, graph_backend=RerunGraphBackend())
    # decode graphs at sizes <= 8 sequences, mixed graphs at every size >= 2; no piece graphs
    assert sorted(runner._step_graphs) == [1, 2, 4, 8] and sorted(runner._mixed_graphs) == SIZES[1:]
    assert runner.stats.num_captures == 4 + 6 and not runner._piece_sizes
    st = serve(runner, _eager_reference(ref, runner.block_size, "cpu"), steps=200, max_tokens=64,
               max_seqs=8, max_len=150, vocab=model.cfg.vocab_size, seed=0)
    _check_schedule(st, tol=1e-5)
    # whole_step="mixed": a decode-only step through the mixed graph, equal to the decode graph's
    alloc = ira.BlockAllocator(256, runner.block_size, shuffle_seed=4)
    tables = [list(alloc.allocate(i, n)) for i, n in enumerate([9, 30, 17])]
    prompt = torch.randint(0, model.cfg.vocab_size, (8 + 29 + 16,))
    runner(prompt, runner.prepare([8, 29, 16], [0, 0, 0], tables))  # the context the decodes read
    ids = torch.randint(0, model.cfg.vocab_size, (3,))
    md = runner.prepare([1, 1, 1], [8, 29, 16], tables)
    assert runner.whole_step_shape(md) == StepShape(DECODE, 4, 4, 1)
    decode = runner(ids, md).clone()
    md = runner.prepare([1, 1, 1], [8, 29, 16], tables, whole_step="mixed")
    assert runner.whole_step_shape(md) == StepShape(MIXED, 4, 4, 4)
    assert decode.isfinite().all() and torch.equal(runner(ids, md), decode)
    assert runner.prepare([1, 1, 1], [8, 29, 16], tables, whole_step=False) is not None
    with pytest.raises(ValueError, match="whole_step='decode'"):
        runner.prepare([1], [8], tables[:1], whole_step="decode")
    for falsy in (0, None, ""):  # taken for False (piecewise graphs) before
        with pytest.raises(ValueError, match=rf"whole_step={falsy!r}; expected True, False or 'mixed'"):
            runner.prepare([1], [8], tables[:1], whole_step=falsy)



@pytest.mark.compile
def test_refused_prepare_keeps_the_previous_step():
    """A refused prepare() set the runner's whole-step shape before planning the step: the
    previous step's metadata then named another graph (here a mixed step the decode graph of
    its size, whose launch skips the prefill rows on a GPU) and whole_step_shape() said so."""
    model, _ = _tiny_pair(num_layers=1, num_blocks=16)
    runner = compile_piecewise(model, capture_sizes=[1, 2, 4], max_num_seqs=4, max_model_len=64,
                               graph_backend=RerunGraphBackend())
    md = runner.prepare([2, 1], [0, 0], [[0], [1]])
    assert runner.whole_step_shape(md) == StepShape(MIXED, 4, 4, 4)
    ids = torch.tensor([5, 6, 7])
    want = runner(ids, md, use_graphs=False).clone()
    for whole_step in (True, False):  # a decode step (decode graph of size 2), then piecewise
        with pytest.raises(IndexError, match=r"block_tables\[0\]\[0\] = 99 is outside the cache"):
            runner.prepare([1, 1], [2, 1], [[99], [1]], whole_step=whole_step)
        assert runner.whole_step_shape(md) == StepShape(MIXED, 4, 4, 4) and runner.replays_whole_step(md)
    assert torch.equal(runner(ids, md), want)
    with pytest.raises(ValueError, match=r"PiecewiseRunner\.capture: num_warmup must be an int >= 0, got -1"):
        runner.capture(num_warmup=-1)
    with pytest.raises(ValueError, match=r"PiecewiseRunner\.capture: compile_threads must be a positive int, got 0"):
        runner.capture(compile_threads=0)
    assert runner.whole_step_shape(md) == StepShape(MIXED, 4, 4, 4)

@pytest.mark.compile
def test_a_runner_of_one_token_steps_compiles():
    """capture_sizes=[1] (batch-1 decoding) failed in the compile: the trace runs at 2 tokens
    (Dynamo specializes 1) and filled the runner's buffers, sized for 1 token."""
    model, ref = _tiny_pair(num_layers=1, num_blocks=16)
    runner = compile_piecewise(model, capture_sizes=[1], max_model_len=64, graph_backend=RerunGraphBackend())
    assert (runner.max_num_tokens, runner.max_num_seqs, sorted(runner._step_graphs)) == (1, 1, [1])
    reference = _eager_reference(ref, runner.block_size, "cpu")
    for pos, token in enumerate([5, 17, 3, 9]):  # one token a step, each through the decode graph
        ids = torch.tensor([token])
        md = runner.prepare([1], [pos], [[2]])
        assert runner.replays_whole_step(md)
        torch.testing.assert_close(runner(ids, md), reference(ids, [1], [pos], [[2]]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"PiecewiseRunner\.prepare: the step has 2 tokens, more than max_num_tokens=1"):
        runner.prepare([2], [0], [[3]])


class _FailingBackend(RerunGraphBackend):
    """Fails the capture of its ``fail_at``-th whole step (counted over every capture)."""

    def __init__(self):
        super().__init__()
        self.fail_at, self.steps = None, 0

    def capture_step(self, fn, args):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("capture failed (test)")
        return super().capture_step(fn, args)


@pytest.mark.compile
def test_a_capture_that_fails_part_way_leaves_no_graphs():
    """A capture that raised part-way (on a GPU: out of memory at a smaller size) left the
    graphs it had captured so far in use, beside the previous capture's piece graphs and
    checked against the previous capture's caches. Now the runner runs without graphs until
    a capture completes."""
    model, _ = _tiny_pair(num_layers=1, num_blocks=16)
    backend = _FailingBackend()
    runner = compile_piecewise(model, capture_sizes=[1, 2, 4], max_num_seqs=4, max_model_len=64,
                               piecewise_graphs=True, graph_backend=backend)
    ids = torch.tensor([5, 6, 7])
    md = runner.prepare([2, 1], [0, 0], [[0], [1]])
    assert runner.replays_whole_step(md)
    want = runner(ids, md).clone()
    backend.fail_at = backend.steps + 2  # the largest size's mixed graph, then a failure
    with pytest.raises(RuntimeError, match=r"capture failed \(test\)"):
        runner.capture()
    for whole_step in (True, False):
        md = runner.prepare([2, 1], [0, 0], [[0], [1]], whole_step=whole_step)
        assert not runner.replays_whole_step(md) and runner.whole_step_graph(md) is None
        assert torch.equal(runner(ids, md), want)
    assert all(not piece.graphs for piece in runner.pieces)
    runner.capture()
    md = runner.prepare([2, 1], [0, 0], [[0], [1]])
    assert runner.replays_whole_step(md) and torch.equal(runner(ids, md), want)


@pytest.mark.compile
def test_graphs_refuse_a_v_layout_switched_after_their_capture():
    """A captured graph keeps the V layout and the cache its launches were captured with: a
    later compile of the same layers that switched them (a second runner with the fusions) left
    the first runner's graphs writing and reading the old layout, silently, and so did a cache
    bound after the capture. Now a replay refuses until capture() runs again; a switch of
    another model's layer, or a switch back, is no change."""
    model, _ = _tiny_pair(num_layers=1, num_blocks=16)
    runner = compile_piecewise(model, capture_sizes=[1, 2, 4], max_num_seqs=4, max_model_len=64,
                               graph_backend=RerunGraphBackend())
    other, _ = _tiny_pair(num_layers=1, num_blocks=16)
    ids = torch.tensor([5, 6, 7])
    md = runner.prepare([2, 1], [0, 0], [[0], [1]])
    want = runner(ids, md).clone()
    name, layer = next(iter(runner.layers.items()))
    was = layer.impl.interleaved_v
    for o in other.modules():
        if isinstance(o, ira.Attention):
            o.impl.set_interleaved_v_cache(not o.impl.interleaved_v, o.kv_cache)
    assert torch.equal(runner(ids, runner.prepare([2, 1], [0, 0], [[0], [1]])), want)
    layer.impl.set_interleaved_v_cache(not was, layer.kv_cache)
    md = runner.prepare([2, 1], [0, 0], [[0], [1]])
    with pytest.raises(RuntimeError, match=rf"the V cache layout of layer '{name}' changed after this runner "
                                           rf"captured its graphs \(interleaved_v {was} -> {not was}"):
        runner(ids, md)
    assert torch.equal(runner(ids, md, use_graphs=False), want)  # no graph: the layers' layout at run time
    runner.capture()  # (its warm-up's fused write switches the layer back: the writer's run-time guard)
    assert torch.equal(runner(ids, runner.prepare([2, 1], [0, 0], [[0], [1]])), want)
    now = layer.impl.interleaved_v
    layer.impl.set_interleaved_v_cache(not now, layer.kv_cache)
    with pytest.raises(RuntimeError, match="call runner.capture\\(\\) again"):
        runner(ids, runner.prepare([2, 1], [0, 0], [[0], [1]]))
    layer.impl.set_interleaved_v_cache(now, layer.kv_cache)
    # a cache bound after the capture (the graphs keep the old one; on a GPU a new, larger
    # cache's block ids would reach past it)
    layer.kv_cache = layer.kv_cache.clone()
    with pytest.raises(RuntimeError, match=rf"layer '{name}' is bound to another KV cache than when this runner "
                                           r"captured its graphs; the graphs would keep the old one"):
        runner(ids, runner.prepare([2, 1], [0, 0], [[0], [1]]))
    # another cache at the address of the one captured (here fewer blocks of the same storage)
    runner.capture()
    kv = layer.kv_cache
    layer.kv_cache = kv.as_strided((kv.shape[0] // 2, *kv.shape[1:]), kv.stride())
    with pytest.raises(RuntimeError, match=rf"layer '{name}' is bound to another KV cache than when this runner "
                                           r"captured its graphs; the graphs would keep the old one"):
        runner(ids, runner.prepare([2, 1], [0, 0], [[0], [1]]))


def test_prepare_plans_fixed_shapes():
    """The plan of a whole-step graph: the step's sequences then empty ones, its tokens then
    padding rows (slot -1), the block table at full width, the fixed hints."""
    from inductor_rocm_attn.compilation.step_graphs import dummy_step, plan_step

    buffers = MetadataBuffers(8, 64, 10, "cpu")
    shape = StepShape(MIXED, 16, 8, 16)
    md = plan_step(shape, [1, 5, 3], [4, 0, 20], [[7], [2], [3, 9]], buffers=buffers, block_size=16,
                   max_model_len=160, device=torch.device("cpu"))
    assert md.query_start_loc.tolist() == [0, 1, 6, 9, 9, 9, 9, 9, 9]
    assert md.seq_lens.tolist() == [5, 5, 23, 0, 0, 0, 0, 0]
    assert md.slot_mapping.tolist() == [7 * 16 + 4, 32, 33, 34, 35, 36, 9 * 16 + 4, 9 * 16 + 5,
                                        9 * 16 + 6] + [-1] * 7
    assert md.positions.tolist()[:9] == [4, 0, 1, 2, 3, 4, 20, 21, 22] and md.positions[9:].eq(0).all()
    assert tuple(md.block_table.shape) == (8, 10) and md.block_table[2, :2].tolist() == [3, 9]
    assert (md.max_query_len, md.max_seq_len, md.num_actual_tokens) == (16, 160, 9)
    # the capture's dummy: nothing written, positions 0, every table entry a readable block
    md = dummy_step(shape, buffers=buffers, max_model_len=160, block_size=16)
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 16]
    assert md.slot_mapping.eq(-1).all() and md.positions.eq(0).all() and md.block_table.eq(0).all()
    assert (md.max_query_len, md.num_actual_tokens) == (16, 16)


# --- transformers ----------------------------------------------------------------------------------


@pytest.mark.compile
def test_transformers_200_steps_through_whole_step_graphs():
    transformers = pytest.importorskip("transformers")
    from inductor_rocm_attn.integrations.transformers_runner import compile_transformers, eager_runner

    config = transformers.Qwen3Config(vocab_size=256, max_position_embeddings=256, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                                      num_hidden_layers=3, hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn",
                                                          dtype=torch.float32).eval()
    twin = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="rocm_attn",
                                                         dtype=torch.float32).eval()
    twin.load_state_dict(model.state_dict())
    runner = compile_transformers(model, num_blocks=128, capture_sizes=[1, 2, 4, 8, 16, 32], max_num_seqs=6,
                                  max_model_len=128, poison=True, mixed_graphs=True,
                                  graph_backend=RerunGraphBackend())
    assert sorted(runner._mixed_graphs) == [2, 4, 8, 16, 32] and sorted(runner._step_graphs) == [1, 2, 4]
    eager = eager_runner(twin, num_blocks=128, max_num_seqs=6, max_num_tokens=32, poison=True)

    def reference(ids, qlens, clens, tables):
        return eager(ids, eager.prepare(qlens, clens, tables))

    st = serve(runner, reference, steps=200, max_tokens=32, max_seqs=6, max_len=120, vocab=256, seed=1)
    _check_schedule(st, tol=1e-5)


# --- 4. GPU: CUDA graphs ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_whole_step_graphs_200_mixed_steps():
    """CUDA graphs (bf16) of whole steps up to 256 tokens (GPU prefill row blocks of 64-128
    rows, the verify kernel, split decode): bitwise the same step without graphs, within bf16
    rounding of the eager model. Capture itself fails on any host sync."""
    cfg = dict(hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=4, head_size=64)
    model, ref = _tiny_pair("cuda", torch.bfloat16, num_blocks=4096, **cfg)
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    runner = compile_piecewise(model, capture_sizes=sizes, max_num_seqs=32, max_model_len=1024,
                               mixed_graphs=True)
    assert runner.stats.num_captures == 8 + 6  # mixed at sizes >= 2, decode at sizes <= 32
    st = serve(runner, _eager_reference(ref, runner.block_size, "cuda"), steps=200, max_tokens=256,
               max_seqs=32, max_len=1000, vocab=model.cfg.vocab_size, seed=0)
    # bf16: compiled vs eager differs by rounding; near-tied random logits may flip (see
    # test_graph_capture's GPU test): the floor catches a wrong model, not rounding.
    _check_schedule(st, tol=2e-2, agreement=0.95)
