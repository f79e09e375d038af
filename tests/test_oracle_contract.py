"""The corners of the contract against an oracle written from docs/design.md alone
(tests/contract_oracle.py: flat cache storage with the design's page formulas, fp8 rounding
on the fp8 grid, attention row by row in float64, RoPE pair by pair).

Each case runs the op ``torch.ops.rocm_attn.*`` (its validation, then a provider): the
PyTorch reference (what the op picks on CPU) and the Triton kernels (the op's provider choice
replaced by Triton's kernel, run in Triton's interpreter on CPU in fp16/fp32). Inputs are
fresh random draws (a new seed every run, named in the failure), never zero; outputs and
caches are poisoned (NaN bytes) first, so a row or slot not written shows. The corners:

- attention: contexts of 0 and 1 tokens, a query that is the whole sequence, sequences that
  end on a block boundary, sequences without new tokens, block tables whose unused entries are
  -1, huge or blocks full of NaN, of exact width (the longest row ends the tensor) or with
  extra rows, prefix blocks shared by two sequences, two layers' caches under one block
  table, the tail of a last block holding NaN or huge stale values, windows of 1 / the
  context / the sequence / more, soft caps of 1 and 1e4, ALiBi slopes of both signs with GQA
  and over 600-token contexts, sinks of -1e4, -inf and +30 with windows, per-head tensors of
  any float dtype, scales far from 1/sqrt(D), every head size with GQA 1 and 8 and a ratio of
  72 (more query heads than one decode program takes), block sizes 16..544, mixed batches of
  decode, verify (2..8 tokens), prefill and empty sequences, with and without the launch
  hints, padding rows, output = query, strided q/k/v, int32/int64 indices, scales of shape ()
  and (1,), LHBNC, LBHNC and hybrid caches (pages inside larger blocks), an fp16 cache of an
  fp32 model, fp8 e4m3/e5m2 caches with tiny and large scales
  and saturating values (compared with the oracle over the values the cache holds,
  dequantized), key=None;
- the writers: slots < 0, a shorter or empty slot_mapping, the cache's first and last slot,
  positions 0 and the last row of the cos/sin table (of any float dtype), partial rotary down
  to 2 channels, NeoX and GPT-J pairs, flat and strided q/k, QK-norm eps 0 / 1e-6 / 1, Gemma's
  norm, norm_after_rope, q_out / k_out aliasing qkv, interleaved V, an fp16 cache of an fp32
  model, fp8 with tiny and large scales, NaN stored as NaN and +-inf saturated;
- refusals at the same corners (one past the last slot, position or block);
- bounded hypothesis searches over the combined attention space and over the writers;
- NaN / Inf in q, k, v stay in the rows that see them (decode and verify paths);
- the Triton soft cap's tanh near 0.

Triton's interpreter gets some fp8 conversions wrong (fp32 -> fp8 rounding that carries into
the exponent: 7.9 -> 4.0; NaN -> e4m3 stored as 384; e5m2 subnormals -> fp16 read as 0), which
a GPU converts exactly: there the Triton writers get fp8 values the rounding cannot touch
(grid values times power-of-two scales, saturating ones) and the fused fp8 writes are skipped,
and the e5m2 large-scale attention case runs an fp32 model.

Tolerances, per output element, relative to its row's scale (the largest |v| among the keys
the row sees: the output is a weighted mean of those values):
- fp32 kernels 1e-5; fp16 3u (u = 2^-11: P rounded for the PV product and the output
  rounded, each at most u of the row's scale, plus the fp32 arithmetic); the reference rounds
  once from float64: u (fp16), 1e-6 (fp32);
- plus 16 fp32 ulps of the row's largest |logit| (a logit computed in fp32 moves every
  weight by that much relative; large scales and ALiBi biases make logits large);
- fp8 caches: the same bounds against the oracle over the dequantized stored values (the
  cache's rounding is then part of the input, not of the error).
Writers: every q/k element within one ulp of the model dtype of the float64 value (the one
rounding), plus fp32 arithmetic slack of 8 fp32 ulps of the head's largest term (two ulps
more for the QK-norm forms, whose norm rounds in between); the cache holds exactly the
quantized q/k/v the op returned (bit for bit, -0 == +0), every other byte stays poisoned.
"""

from __future__ import annotations

import contextlib
import math
import random
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings, strategies as st

import contract_oracle as oracle
import providers_under_test as put
from inductor_rocm_attn import providers
from inductor_rocm_attn.kernels.triton.attention_common import _tanh

# the huge stale values of unused cache slots overflow in the interpreter's numpy before the mask
# drops them; NaN inputs meet masked weights of 0 there (both on purpose)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
OPS = torch.ops.rocm_attn
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U16 = 2.0 ** -11
U32 = 2.0 ** -24
PROVIDERS = ["reference", "triton"]


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _poison(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0xFF)
    return t


def _on(provider: str):
    """Run the ops with ``provider``'s kernels after their validation (the reference is what
    the op picks on CPU; Triton runs in its interpreter)."""
    if provider == "reference":
        return contextlib.nullcontext()
    if not put.INTERPRETER:
        pytest.skip("Triton runs here in its interpreter on CPU tensors only")
    import attention_checks  # noqa: F401  (the interpreter's loop-bound fix)

    kernel = providers.REGISTRY["triton"].load
    return mock.patch.object(providers, "select", lambda op, **kw: ("triton", kernel(op)))


def _scale(x: float, shape_0d: bool) -> torch.Tensor:
    """A per-tensor scale, of shape () or (1,) (both are the contract's)."""
    return torch.tensor(x) if shape_0d else torch.tensor([x])


def _replay(seed, what, fn):
    try:
        return fn()
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {what}: {e}") from e


# --- paged attention ----------------------------------------------------------------------------


def _cache(num_blocks, block_size, num_kv_heads, head_size, dtype, layout):
    """A poisoned cache of logical shape [num_blocks, 2, block_size, Hkv * D] in the design's
    LHBNC (K of all blocks, then V of all blocks) or LBHNC (per block K page, V page) order;
    HYBRID: LBHNC pages inside blocks of three pages (a hybrid attention/Mamba cache: the
    page before them belongs to someone else)."""
    row = num_kv_heads * head_size
    if layout == "LHBNC":
        cache = torch.empty(2, num_blocks, block_size, row, dtype=dtype).transpose(0, 1)
    elif layout == "HYBRID":
        page = block_size * row
        buf = torch.empty(3 * num_blocks * page, dtype=dtype)
        cache = buf.as_strided((num_blocks, 2, block_size, row), (3 * page, page, row, 1), page)
    else:
        cache = torch.empty(num_blocks, 2, block_size, row, dtype=dtype)
    return _poison(cache)


def make_step(r: random.Random, seqs, *, num_heads, num_kv_heads, head_size, block_size=16,
              dtype=torch.float32, cache_dtype=None, layout="LHBNC", interleaved_v=False,
              k_scale=1.0, v_scale=1.0, magnitude=1.0, table_garbage="nan_block", stale_tail="nan",
              shared_prefix=0, extra_table_rows=0, extra_table_cols=2, pad_rows=0, key_from_cache=False):
    """A step of sequences ``seqs = [(context_len, query_len), ...]`` over a cache written by
    the oracle's writer. Unused block-table entries hold ``table_garbage`` ("nan_block": ids of
    blocks full of NaN, "neg": -1, "huge": 2**30); the slots of a last block past its sequence
    hold ``stale_tail`` ("nan" or "huge": the largest finite value of the cache dtype). With
    ``shared_prefix`` > 0 every sequence reads the first sequence's first blocks (read-only).
    """
    g = torch.Generator().manual_seed(r.randrange(1 << 30))
    cache_dtype = cache_dtype or dtype
    lens = [c + q for c, q in seqs]
    own = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(own) + 4
    ids = list(range(num_blocks))
    r.shuffle(ids)
    spare = ids[sum(own):]  # never written: NaN throughout
    tables, i = [], 0
    for n in own:
        tables.append(ids[i:i + n])
        i += n
    for s in range(1, len(tables)):
        k = min(shared_prefix, len(tables[s]) - 1, len(tables[0]) - 1)
        if k > 0 and all(c >= k * block_size for c, _ in (seqs[0], seqs[s])):
            tables[s][:k] = tables[0][:k]  # a shared, already cached prefix
    width = max(own + [1]) + extra_table_cols  # 0: the longest sequence's row ends the tensor
    garbage = {"nan_block": lambda: r.choice(spare), "neg": lambda: -1, "huge": lambda: 2 ** 30}[table_garbage]
    table = torch.tensor([t + [garbage() for _ in range(width - len(t))] for t in tables]
                         + [[garbage() for _ in range(width)] for _ in range(extra_table_rows)], dtype=torch.int32)
    cache = _cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout)
    if stale_tail == "huge":  # every never-written slot of the used blocks: the largest finite value
        big = torch.finfo(cache_dtype).max
        for s, n in enumerate(lens):
            if n % block_size:
                last = tables[s][-1]
                tail = torch.arange(n % block_size, block_size)
                junk = torch.full((len(tail), num_kv_heads, head_size), big, dtype=torch.float64)
                oracle.write(cache, junk, -junk, last * block_size + tail, 1.0, 1.0, interleaved_v)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * magnitude).to(dtype)

    qs, ks, vs = [], [], []
    first_k = first_v = None  # the first sequence's tokens (a shared prefix holds them)
    for s, (ctx, ql) in enumerate(seqs):
        n = ctx + ql
        k_all, v_all = rnd(n, num_kv_heads, head_size), rnd(n, num_kv_heads, head_size)
        slots = torch.tensor([tables[s][p // block_size] * block_size + p % block_size for p in range(n)])
        shared = shared_prefix and s > 0 and tables[s][:1] == tables[0][:1]
        first = len([b for b in tables[s] if b in tables[0]]) * block_size if shared else 0
        # cached before the step: the context (a decode's own token too; key=None: every token)
        cached = n if (ql == 1 or key_from_cache) else ctx
        write = torch.arange(n) < cached
        write[:first] = False  # the shared prefix holds the first sequence's tokens
        if shared:
            k_all[:first], v_all[:first] = first_k[:first], first_v[:first]
        oracle.write(cache, k_all, v_all, torch.where(write, slots, -1), k_scale, v_scale, interleaved_v)
        if s == 0:
            first_k, first_v = k_all, v_all
        qs.append(rnd(ql, num_heads, head_size))
        ks.append(k_all[ctx:])
        vs.append(v_all[ctx:])
    query, key, value = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    if pad_rows:  # padding of a captured size: any query, NaN key/value
        query = torch.cat([query, rnd(pad_rows, num_heads, head_size)])
        nan = torch.full((pad_rows, num_kv_heads, head_size), math.nan, dtype=dtype)
        key, value = torch.cat([key, nan]), torch.cat([value, nan])
    if r.random() < 0.5:  # q/k/v as the three slices of one projection (strided rows)
        fused = torch.cat([query, key, value], 1)
        query, key, value = fused.split([num_heads, num_kv_heads, num_kv_heads], 1)
    index = r.choice([torch.int32, torch.int64])
    qsl = torch.tensor([0] + torch.tensor([q for _, q in seqs]).cumsum(0).tolist(), dtype=index)
    return dict(query=query, key=None if key_from_cache else key, value=None if key_from_cache else value,
                cache=cache, query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=index),
                block_table=table.to(index), k_scale=k_scale, v_scale=v_scale, interleaved_v=interleaved_v,
                scale_0d=r.random() < 0.5)


def run_attention(provider, st_, *, scale, causal=True, window=-1, alibi=None, sinks=None, soft_cap=0.0,
                  hints=True, **knobs):
    out = _poison(torch.empty_like(st_["query"]))
    qlens = (st_["query_start_loc"][1:] - st_["query_start_loc"][:-1]).tolist()
    mq = max(qlens) if hints else max(st_["query"].shape[0], 1)
    ms = int(st_["seq_lens"].max()) if hints else st_["block_table"].shape[1] * st_["cache"].shape[2]
    if knobs.get("out_is_query"):  # allowed: each program reads its rows before it writes them
        out = st_["query"] = st_["query"].clone()
        st_["query_in"] = out.clone()
    with _on(provider):
        OPS.paged_attention(out, st_["query"], st_["key"], st_["value"], st_["cache"], st_["query_start_loc"],
                            st_["seq_lens"], st_["block_table"], mq, ms, scale,
                            _scale(st_["k_scale"], st_["scale_0d"]), _scale(st_["v_scale"], st_["scale_0d"]), causal,
                            window,
                            alibi, sinks, soft_cap, st_["interleaved_v"], None)
    return out


def check_attention(provider, st_, **kw):
    out = run_attention(provider, st_, **kw)
    want, row_scale, logit_max = oracle.paged_attention(
        st_.get("query_in", st_["query"]), st_["key"], st_["value"], st_["cache"], st_["query_start_loc"],
        st_["seq_lens"], st_["block_table"], scale=kw["scale"], k_scale=st_["k_scale"], v_scale=st_["v_scale"],
        causal=kw.get("causal", True), window=kw.get("window", -1), alibi=kw.get("alibi"),
        sinks=kw.get("sinks"), soft_cap=kw.get("soft_cap", 0.0), interleaved_v=st_["interleaved_v"])
    dtype = out.dtype
    if provider == "reference":
        tol_out = 1e-6 if dtype == torch.float32 else U16
    else:
        tol_out = 1e-5 if dtype == torch.float32 else 3 * U16
    rows = ~torch.isnan(want[:, :, 0])
    got = out.to(torch.float64)
    if "query_in" in st_:  # the padding rows hold the query they had
        assert torch.equal(out[~rows], st_["query_in"][~rows]), "padding rows (past query_start_loc[-1]) were written"
    else:
        assert torch.isnan(got[~rows]).all(), "padding rows (past query_start_loc[-1]) were written"
    assert not torch.isnan(got[rows]).any(), "rows left unwritten or NaN"
    bound = (tol_out * row_scale + 16 * U32 * logit_max * row_scale)[:, :, None] + 1e-300
    err = ((got - want).abs() / bound)[rows]
    worst = float(err.max()) if err.numel() else 0.0
    if worst > 1:
        t, h, _ = [int(i) for i in torch.nonzero((got - want).abs() > bound)[0]]
        raise AssertionError(f"{provider}: row (token {t}, head {h}) beyond the bound by {worst:.2f}x: got "
                             f"{got[t, h, :4].tolist()} want {want[t, h, :4].tolist()}")
    return out


# Each scenario: the step (make_step's arguments) and the attention options. D = 32 unless
# given; fp32 unless given.
SCENARIOS = {
    "decode_ctx0_ctx1": dict(seqs=[(0, 1), (1, 1), (15, 1)]),
    "prefill_query_is_whole_sequence": dict(seqs=[(0, 9), (0, 16), (0, 33)], hints=False),
    "verify_query_is_whole_sequence": dict(seqs=[(0, 2), (0, 8), (0, 5)]),
    "sequences_end_on_block_boundaries": dict(seqs=[(15, 1), (31, 1), (12, 4), (24, 8), (16, 16)]),
    "table_garbage_negative": dict(seqs=[(5, 1), (7, 3), (3, 12)], table_garbage="neg"),
    "table_garbage_huge": dict(seqs=[(5, 1), (7, 3), (3, 12)], table_garbage="huge", extra_table_rows=2),
    "table_exact_width": dict(seqs=[(7, 3), (3, 12), (40, 8), (47, 1)], extra_table_cols=0, table_garbage="huge"),
    "table_exact_width_decode_last": dict(seqs=[(7, 3), (3, 12), (63, 1)], extra_table_cols=0, block_size=32,
                                          hints=False),
    "sequences_without_new_tokens": dict(seqs=[(20, 1), (30, 0), (9, 3), (25, 0), (30, 11), (7, 0)]),
    "stale_tail_huge": dict(seqs=[(5, 1), (18, 3), (20, 12)], stale_tail="huge"),
    "stale_tail_huge_key_from_cache": dict(seqs=[(5, 1), (18, 3), (20, 12)], stale_tail="huge",
                                           key_from_cache=True),
    "shared_prefix_blocks": dict(seqs=[(40, 1), (37, 4), (33, 10)], shared_prefix=2),
    "mixed_batch_no_hints": dict(seqs=[(20, 1), (0, 0), (9, 3), (30, 11), (1, 1), (4, 8)], hints=False),
    "mixed_batch_padding_rows": dict(seqs=[(20, 1), (9, 3), (30, 11)], pad_rows=3),
    "window_1": dict(seqs=[(20, 1), (9, 3), (30, 11)], window=1),
    "window_1_noncausal": dict(seqs=[(20, 1), (9, 3), (30, 11)], window=1, causal=False),
    "window_equal_context": dict(seqs=[(20, 1), (9, 3), (11, 11)], window=20),
    "window_equal_sequence": dict(seqs=[(20, 1), (9, 3), (30, 11)], window=41),
    "window_beyond_sequence_noncausal": dict(seqs=[(20, 1), (9, 3), (30, 11)], window=500, causal=False),
    "softcap_1": dict(seqs=[(20, 1), (9, 3), (30, 11)], soft_cap=1.0, scale_mult=4.0),
    "softcap_huge": dict(seqs=[(20, 1), (9, 3), (30, 11)], soft_cap=1e4),
    "alibi_both_signs_gqa": dict(seqs=[(20, 1), (9, 3), (30, 11)], alibi="both", gqa=4, kv=2),
    "alibi_window_noncausal": dict(seqs=[(20, 1), (9, 3), (30, 11)], alibi="both", window=6, causal=False),
    "sinks_extreme_window": dict(seqs=[(20, 1), (9, 3), (30, 11)], sinks="extreme", window=3, gqa=2, kv=2),
    "sinks_extreme_window_1": dict(seqs=[(20, 1), (9, 3), (30, 11)], sinks="extreme", window=1, gqa=2, kv=2),
    "scale_small": dict(seqs=[(20, 1), (9, 3), (30, 11)], scale_mult=0.01),
    "scale_large": dict(seqs=[(20, 1), (9, 3), (30, 11)], scale_mult=8.0),
    "alibi_long_context": dict(seqs=[(600, 1), (550, 5), (300, 12)], alibi="both", block_size=32, gqa=2),
    "output_is_query": dict(seqs=[(20, 1), (9, 3), (30, 11), (3, 1)], out_is_query=True, gqa=4, pad_rows=2),
    "gqa_over_one_decode_program": dict(seqs=[(20, 1), (9, 3), (4, 10)], gqa=72, kv=1),
    "block_48_fp16": dict(seqs=[(47, 1), (40, 8), (30, 18)], block_size=48, dtype=torch.float16),
    "block_544_fp16": dict(seqs=[(543, 1), (600, 3), (100, 12)], block_size=544, dtype=torch.float16),
    "fp16_cache_of_fp32_model": dict(seqs=[(20, 1), (9, 3), (30, 11)], cache_dtype=torch.float16, magnitude=300.0),
    "fp8_e4m3_tiny_scale_saturates": dict(seqs=[(20, 1), (9, 3), (30, 11)], cache_dtype=E4M3, scales=(2 ** -6, 2 ** -7),
                                          magnitude=8.0),
    "fp8_e4m3_large_scale": dict(seqs=[(20, 1), (9, 3), (30, 11)], cache_dtype=E4M3, scales=(96.0, 200.0),
                                 dtype=torch.float16, interleaved_v=True),
    "fp8_e5m2_tiny_scale_saturates": dict(seqs=[(20, 1), (9, 3), (30, 11)], cache_dtype=E5M2, scales=(2 ** -14, 1e-5),
                                          layout="LBHNC"),
    # fp32: Triton's interpreter converts e5m2 subnormals to fp16 wrongly (to 0; a GPU converts exactly)
    "fp8_e5m2_large_scale_key_from_cache": dict(seqs=[(20, 1), (9, 3), (30, 11)], cache_dtype=E5M2,
                                                scales=(3e3, 5e3), key_from_cache=True),
}


def _options(r, sc, num_heads, head_size):
    g = torch.Generator().manual_seed(r.randrange(1 << 30))
    opts = dict(scale=head_size ** -0.5 * sc.get("scale_mult", 1.0), causal=sc.get("causal", True),
                window=sc.get("window", -1), soft_cap=sc.get("soft_cap", 0.0), hints=sc.get("hints", True),
                out_is_query=sc.get("out_is_query", False))
    if sc.get("alibi") == "both":  # slopes of both signs, some large
        opts["alibi"] = (torch.rand(num_heads, generator=g) - 0.5) * 2
    if sc.get("sinks") == "extreme":
        opts["sinks"] = torch.tensor([[-1e4, -math.inf, 30.0, 0.5][h % 4] for h in range(num_heads)])
    per_head = r.choice([torch.float32, torch.float32, torch.float16, torch.float64])  # any float dtype
    for name in ("alibi", "sinks"):
        if name in opts:
            opts[name] = opts[name].to(per_head)
    return opts


def _scenario_step(r, sc, head_size=32, **over):
    gqa, kv = sc.get("gqa", 1), sc.get("kv", 1)
    ks, vs = sc.get("scales", (1.0, 1.0))
    kw = dict(num_heads=gqa * kv, num_kv_heads=kv, head_size=head_size, block_size=sc.get("block_size", 16),
              dtype=sc.get("dtype", torch.float32), cache_dtype=sc.get("cache_dtype"),
              layout=sc.get("layout", r.choice(["LHBNC", "LBHNC", "HYBRID"])),
              interleaved_v=sc.get("interleaved_v", r.random() < 0.5), k_scale=_f32(ks), v_scale=_f32(vs),
              magnitude=sc.get("magnitude", 1.0), table_garbage=sc.get("table_garbage", "nan_block"),
              stale_tail=sc.get("stale_tail", "nan"), shared_prefix=sc.get("shared_prefix", 0),
              extra_table_rows=sc.get("extra_table_rows", 0), extra_table_cols=sc.get("extra_table_cols", 2),
              pad_rows=sc.get("pad_rows", 0),
              key_from_cache=sc.get("key_from_cache", False))
    kw.update(over)
    return make_step(r, sc["seqs"], **kw), kw


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_attention_corner(name, provider):
    seed = random.randrange(1 << 30)
    r = random.Random(seed)
    sc = SCENARIOS[name]
    step, kw = _scenario_step(r, sc)
    opts = _options(r, sc, kw["num_heads"], kw["head_size"])
    _replay(seed, name, lambda: check_attention(provider, step, **opts))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_attention_layers_share_block_ids(provider):
    """Two layers' caches (other layouts, dtypes, V interiors) addressed by one block table:
    each attention reads its own layer's cache."""
    seed = random.randrange(1 << 30)
    seqs = [(17, 1), (30, 4), (5, 11)]
    steps = []
    for layout, il, cache, mag in (("LHBNC", False, None, 1.0), ("HYBRID", True, E4M3, 3.0)):
        # the same draws (block ids, garbage) with other values: the magnitude scales them
        steps.append(make_step(random.Random(seed), seqs, num_heads=4, num_kv_heads=2, head_size=64,
                               dtype=torch.float16, cache_dtype=cache, layout=layout, interleaved_v=il,
                               k_scale=0.25, v_scale=0.5, magnitude=mag))
    assert torch.equal(steps[0]["block_table"], steps[1]["block_table"])
    for st_ in steps:
        _replay(seed, "layer", lambda: check_attention(provider, st_, scale=0.125, window=9))


HEAD_SIZES = (32, 64, 80, 96, 128, 160, 192, 224, 256, 512)  # capabilities.HEAD_SIZES, written out


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("gqa", [1, 8])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_attention_head_sizes(head_size, gqa, provider):
    """Every head size, GQA 1 and 8, a block size drawn from 16..80, a batch of a decode, a
    verify and a prefill, the model dtype and cache dtype drawn (fp8 included)."""
    seed = random.randrange(1 << 30)
    r = random.Random(seed)
    bs = r.choice([16, 32, 48, 80])
    dtype = r.choice([torch.float16, torch.float32])
    cache = r.choice([None, None, E4M3, E5M2])
    sc = dict(seqs=[(r.randint(0, 2 * bs), 1), (r.randint(0, bs), r.randint(2, 8)), (r.randint(0, bs), 9)],
              gqa=gqa, kv=r.choice([1, 2]), block_size=bs, dtype=dtype, cache_dtype=cache,
              scales=(r.uniform(0.05, 2), r.uniform(0.05, 2)) if cache else (1.0, 1.0),
              window=r.choice([-1, -1, 1, bs, r.randint(1, 3 * bs)]), causal=r.random() < 0.8,
              soft_cap=r.choice([0.0, 0.0, 5.0]), alibi="both" if r.random() < 0.3 else None,
              sinks="extreme" if r.random() < 0.3 else None)
    step, kw = _scenario_step(r, sc, head_size=head_size)
    opts = _options(r, sc, kw["num_heads"], head_size)
    _replay(seed, sc, lambda: check_attention(provider, step, **opts))


# --- cache writers ------------------------------------------------------------------------------

WRITER_OPS = ["reshape_and_cache", "rotary_embedding", "rope_and_cache", "qk_norm_rope_and_cache",
              "rope_cos_sin_and_cache", "qk_norm_rope_cos_sin_and_cache", "qk_norm_rope_cos_sin_and_cache:gemma",
              "qk_norm_rope_cos_sin_and_cache:norm_after_rope"]
# (cache dtype, k_scale, v_scale): the model dtype, fp8 with tiny scales (values saturate) and
# large ones (values shrink towards the fp8 subnormals)
WRITER_CACHES = {"model": (None, 1.0, 1.0), "e4m3_tiny": (E4M3, 2 ** -9, 1e-3), "e4m3_large": (E4M3, 64.0, 300.0),
                 "e5m2_tiny": (E5M2, 2 ** -13, 3e-5), "e5m2_large": (E5M2, 2.0 ** 12, 5e3),
                 "fp16_of_fp32_model": (torch.float16, 1.0, 1.0)}


def _like(cache: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
    """A tensor with ``cache``'s geometry over another storage (a copy of the cache's)."""
    return torch.empty(0, dtype=cache.dtype).set_(storage.untyped_storage(), cache.storage_offset(),
                                                 cache.shape, cache.stride())


def _within_rounding(got, exact, dtype, what, terms, extra=0.0):
    """Each element within one ulp of ``exact`` (the one rounding, with room for the fp32
    arithmetic) plus 8 fp32 ulps of its head's largest term ``terms`` [T, H] (cancellation)."""
    got, exact = got.to(torch.float64), exact.to(torch.float64)
    eps = {torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}[dtype]
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(torch.finfo(dtype).tiny)))) * eps
    bound = ulp + (8 * U32 * terms + extra)[..., None]
    bad = (got - exact).abs() > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements beyond one rounding, e.g. got "
                           f"{got[bad][:3].tolist()} want {exact[bad][:3].tolist()}")


def _slots(r, g, num_tokens, num_slots_total, short):
    """Distinct slots with the cache's first and last slot among them, padding (-1, -7) and,
    with ``short``, fewer entries than tokens (the rest are not written)."""
    if short and r.random() < 0.25:  # no slots: the fused writers only rotate
        return torch.empty(0, dtype=r.choice([torch.int32, torch.int64]))
    n = num_tokens - (r.randint(1, 2) if short and num_tokens > 2 else 0)
    inner = torch.randperm(num_slots_total - 2, generator=g)[: n - 2] + 1  # neither the first nor the last
    inner[torch.randperm(n - 2, generator=g)[: max(1, n // 4)]] = r.choice([-1, -7])
    slots = torch.cat([torch.tensor([0, num_slots_total - 1]), inner])
    slots = slots[torch.randperm(n, generator=g)]
    return slots.to(r.choice([torch.int32, torch.int64]))


def _fp8_exact(x, cache_dtype, scale, g):
    """Values the interpreter's broken fp32 -> fp8 rounding cannot touch: fp8 grid values
    times the (power-of-two) scale, and a quarter of them beyond the saturation bound."""
    codes = torch.randint(0, 256, x.shape, generator=g, dtype=torch.uint8).view(cache_dtype).to(torch.float64)
    codes = torch.where(torch.isfinite(codes) & (codes != 0), codes, torch.ones_like(codes))
    big = torch.rand(x.shape, generator=g) < 0.25
    codes = torch.where(big, codes.sign() * torch.finfo(cache_dtype).max * 4, codes)
    return (codes * scale).to(x.dtype)


def _writer_inputs(r, g, op, provider, cache_kind):
    cache_dtype, ks, vs = WRITER_CACHES[cache_kind]
    dtype = torch.float32 if cache_dtype == torch.float16 else r.choice([torch.float16, torch.float32])
    fp8 = cache_dtype in (E4M3, E5M2)
    if provider == "triton" and fp8:
        if op != "reshape_and_cache":
            pytest.skip("Triton's interpreter rounds fp32 -> fp8 wrongly (7.9 -> 4.0): the fused fp8 writes "
                        "run on a GPU only; reshape_and_cache takes values exact in fp8")
        ks, vs = 2.0 ** round(math.log2(ks)), 2.0 ** round(math.log2(vs))  # exact products
        if dtype == torch.float16 and max(ks, vs) * torch.finfo(cache_dtype).max * 4 > 6e4:
            dtype = torch.float32
    d = r.choice(HEAD_SIZES)
    hkv = r.choice([1, 2, 3])
    hq = hkv * r.choice([1, 2, 5])
    bs = r.choice([16, 48, 80])
    t = r.randint(5, 12)
    nb = math.ceil(t / bs) + 1
    cache = _cache(nb, bs, hkv, d, cache_dtype or dtype, r.choice(["LHBNC", "LBHNC", "HYBRID"]))
    slots = _slots(r, g, t, nb * bs, short=r.random() < 0.5)
    mag = r.choice([1.0, 1.0, 0.01, 40.0])
    fused = torch.randn(t, hq + 2 * hkv + 1, d, generator=g, dtype=torch.float64) * mag
    fused = fused.to(dtype)
    if provider == "triton" and fp8:
        fused[:, hq:hq + hkv] = _fp8_exact(fused[:, hq:hq + hkv], cache_dtype, ks, g)
        fused[:, hq + hkv:hq + 2 * hkv] = _fp8_exact(fused[:, hq + hkv:hq + 2 * hkv], cache_dtype, vs, g)
    if op == "reshape_and_cache" and r.random() < 0.5:  # stored as NaN; +-inf saturate in fp8
        kv = fused[:, hq:hq + 2 * hkv]
        spots = torch.rand(kv.shape, generator=g) < 0.05
        # (Triton's interpreter stores NaN as 384 in e4m3: there +-inf only)
        odd = [math.inf, -math.inf] + ([] if provider == "triton" and cache_dtype == E4M3 else [math.nan])
        kv[spots] = torch.tensor(odd, dtype=dtype)[torch.randint(0, len(odd), (int(spots.sum()),), generator=g)]
    q, k, v = fused[:, :hq], fused[:, hq:hq + hkv], fused[:, hq + hkv:hq + 2 * hkv]
    if r.random() < 0.5:  # contiguous tensors rather than views of one projection
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return dict(dtype=dtype, cache=cache, slots=slots, ks=_f32(ks), vs=_f32(vs), q=q, k=k, v=v, d=d, hq=hq,
                hkv=hkv, t=t, interleaved_v=r.random() < 0.5)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("cache_kind", list(WRITER_CACHES))
@pytest.mark.parametrize("op", WRITER_OPS)
def test_writer_corners(op, cache_kind, provider):
    """Each writer against the oracle: the q/k it returns within one rounding of the float64
    chain, the cache holding exactly those k (and v) quantized at the non-padding slots of
    the first len(slot_mapping) tokens (the first and last slot of the cache among them),
    every other byte as before. Positions 0 and the table's last row, partial rotary."""
    if op == "rotary_embedding" and cache_kind != "model":
        pytest.skip("rotary_embedding writes no cache")
    seed = random.randrange(1 << 30)
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    w = _writer_inputs(r, g, op.split(":")[0], provider, cache_kind)
    _replay(seed, f"{op} {cache_kind}", lambda: _run_writer(r, g, op, provider, w))


def _run_writer(r, g, op, provider, w):
    name, _, variant = op.partition(":")
    dtype, cache, slots, q, k, v, d, t = w["dtype"], w["cache"], w["slots"], w["q"], w["k"], w["v"], w["d"], w["t"]
    il, neox = w["interleaved_v"], r.random() < 0.5
    kst, vst = _scale(w["ks"], r.random() < 0.5), _scale(w["vs"], r.random() < 0.5)
    before = oracle._flat(cache).clone()
    rot = r.choice([d, d, d // 2, 16, 2])
    eps = r.choice([0.0, 1e-6, 1.0])
    max_pos = r.randint(t, 64)
    pos = torch.randint(0, max_pos, (t,), generator=g)
    pos[0], pos[-1] = 0, max_pos - 1  # the first and last row of the table
    theta = torch.rand(max_pos, rot // 2, generator=g, dtype=torch.float64) * 2 * math.pi
    table = torch.cat([theta.cos(), theta.sin()], 1).to(r.choice([dtype, torch.float32, torch.float64]))
    cos, sin = (torch.randn(t, rot, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    qw, kw_ = ((torch.randn(d, generator=g, dtype=torch.float64) * 0.3 + (0.0 if variant == "gemma" else 1.0))
               .to(dtype) for _ in range(2))
    q0, k0 = q.to(torch.float64), k.to(torch.float64)
    k_stored = k
    extra = 0.0
    with _on(provider):
        if name == "reshape_and_cache":
            OPS.reshape_and_cache(k, v, cache, slots, kst, vst, il)
        elif name == "rotary_embedding":
            flat = r.random() < 0.5 and q.is_contiguous() and k.is_contiguous()
            no_key = r.random() < 0.25  # key is optional
            OPS.rotary_embedding(pos, q.view(t, -1) if flat else q, None if no_key else k.view(t, -1) if flat else k,
                                 d, table, neox)
            want_q, want_k = oracle.rope_table(q0, pos, table, neox), oracle.rope_table(k0, pos, table, neox)
            if no_key:
                want_k = k0
            terms = (q0.abs().amax(-1) * 2, k0.abs().amax(-1) * 2)
        elif name == "rope_and_cache":
            OPS.rope_and_cache(pos, q, k, v, cache, slots, table, neox, kst, vst, il)
            want_q, want_k = oracle.rope_table(q0, pos, table, neox), oracle.rope_table(k0, pos, table, neox)
            terms = (q0.abs().amax(-1) * 2, k0.abs().amax(-1) * 2)
        elif name == "qk_norm_rope_and_cache":
            qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], 1)
            q_out = _poison(torch.empty(t, w["hq"], d, dtype=dtype))
            k_stored = _poison(torch.empty(t, w["hkv"], d, dtype=dtype))
            if r.random() < 0.3:  # allowed: q_out / k_out are qkv's own q / k slices
                q_out = qkv[:, : w["hq"] * d].view(t, w["hq"], d)
                k_stored = qkv[:, w["hq"] * d: (w["hq"] + w["hkv"]) * d].view(t, w["hkv"], d)
                v = v.clone()
            OPS.qk_norm_rope_and_cache(qkv, qw, kw_, eps, pos, table, neox, cache, slots, kst, vst, il, w["hq"],
                                       w["hkv"], d, q_out, k_stored)
            # fp32 statistics, times the weight, no rounding before RoPE
            nq, nk = oracle.rms_normalized(q0, eps) * qw.double(), oracle.rms_normalized(k0, eps) * kw_.double()
            want_q, want_k = oracle.rope_table(nq, pos, table, neox), oracle.rope_table(nk, pos, table, neox)
            terms = (nq.abs().amax(-1) * 2, nk.abs().amax(-1) * 2)
            q = q_out
        elif name == "rope_cos_sin_and_cache":
            flat = r.random() < 0.5 and q.is_contiguous() and k.is_contiguous()
            OPS.rope_cos_sin_and_cache(q.view(t, -1) if flat else q, k.view(t, -1) if flat else k, v, cos, sin, neox,
                                       cache, slots, kst, vst, il)
            want_q, want_k = oracle.rope_rows(q0, cos, sin, neox), oracle.rope_rows(k0, cos, sin, neox)
            gain = float(cos.abs().max() + sin.abs().max())
            terms = (q0.abs().amax(-1) * gain, k0.abs().amax(-1) * gain)
        else:
            OPS.qk_norm_rope_cos_sin_and_cache(q, k, v, qw, kw_, eps, cos, sin, neox, cache, slots, kst, vst, il,
                                               variant == "gemma", variant == "norm_after_rope")
            gain = float(cos.abs().max() + sin.abs().max())

            def norm(x, wt):  # transformers' Qwen3RMSNorm / Gemma3RMSNorm on float64 statistics
                n = oracle.rms_normalized(x, eps)
                if variant == "gemma":
                    return (n * (1 + wt.double())).to(dtype).double()
                return n.to(dtype).double() * wt.double()

            if variant == "norm_after_rope":
                want_q, want_k = (norm(oracle.rope_rows(x, cos, sin, neox).to(dtype).double(), wt)
                                  for x, wt in ((q0, qw), (k0, kw_)))
                terms = (want_q.abs().amax(-1), want_k.abs().amax(-1))
                extra = 2 * 2.0 ** -10 * float(max(terms[0].max(), terms[1].max())) if dtype == torch.float16 else 0.0
                # the rotation's rounding moves the norm's input by an ulp: the norm (of
                # scale ~1/rms) carries it on
                extra += 4 * U32 * float(max(terms[0].max(), terms[1].max()))
            else:
                nq, nk = norm(q0, qw), norm(k0, kw_)
                want_q, want_k = oracle.rope_rows(nq, cos, sin, neox), oracle.rope_rows(nk, cos, sin, neox)
                terms = (nq.abs().amax(-1) * gain, nk.abs().amax(-1) * gain)
                if dtype == torch.float16:  # the norm's rounding (fp32 statistics) may flip an ulp
                    extra = 2 * 2.0 ** -10 * float(max(terms[0].max(), terms[1].max()))
    if name != "reshape_and_cache":
        _within_rounding(q, want_q, dtype, "q", terms[0], extra)
        _within_rounding(k_stored, want_k, dtype, "k", terms[1], extra)
    if name == "rotary_embedding":
        assert torch.equal(oracle._flat(cache).view(torch.uint8), before.view(torch.uint8))
        return
    want = _like(cache, before)
    oracle.write(want, k_stored.reshape(t, w["hkv"], d), v, slots, w["ks"], w["vs"], il)
    bad = ~oracle.same_values(oracle._flat(cache), before)
    assert not bad.any(), (f"cache: {int(bad.sum())} elements differ from the oracle's write, e.g. got "
                           f"{oracle._flat(cache)[bad][:4].tolist()} want {before[bad][:4].tolist()}")


# --- random search ------------------------------------------------------------------------------


@st.composite
def attention_cases(draw):
    """A step and its options from the combined space (small, so each example takes well
    under a second in the interpreter)."""
    n = draw(st.integers(1, 4))
    seqs = [(draw(st.integers(0, 40)), draw(st.sampled_from([0, 1, 1, 2, 3, 5, 8, 9, 13])))
            for _ in range(n)]
    if all(q == 0 for _, q in seqs):
        seqs[0] = (seqs[0][0], 1)
    cache = draw(st.sampled_from([None, None, E4M3, E5M2]))
    window = draw(st.sampled_from([-1, -1, 0, 1, 2, 7, 16, 41, 1000]))
    sc = dict(seqs=seqs, gqa=draw(st.sampled_from([1, 2, 3, 4, 8])), kv=draw(st.sampled_from([1, 2])),
              block_size=draw(st.sampled_from([16, 32, 48])),
              dtype=draw(st.sampled_from([torch.float16, torch.float32])),
              cache_dtype=cache, layout=draw(st.sampled_from(["LHBNC", "LBHNC", "HYBRID"])),
              interleaved_v=draw(st.booleans()),
              scales=(draw(st.sampled_from([2 ** -8, 0.05, 1.0, 1.7])),
                      draw(st.sampled_from([2 ** -8, 0.3, 1.0, 2.0]))) if cache else (1.0, 1.0),
              window=window, causal=draw(st.booleans()), soft_cap=draw(st.sampled_from([0.0, 0.0, 1.0, 30.0, 1e4])),
              alibi=draw(st.sampled_from([None, None, "both"])), sinks=draw(st.sampled_from([None, None, "extreme"])),
              scale_mult=draw(st.sampled_from([1.0, 0.05, 4.0])), hints=draw(st.booleans()),
              table_garbage=draw(st.sampled_from(["nan_block", "neg", "huge"])),
              stale_tail=draw(st.sampled_from(["nan", "huge"])), key_from_cache=draw(st.booleans()),
              pad_rows=draw(st.sampled_from([0, 0, 2])), shared_prefix=draw(st.sampled_from([0, 1])),
              extra_table_cols=draw(st.sampled_from([0, 2])))
    return sc, draw(st.sampled_from([32, 64, 80])), draw(st.integers(0, 2 ** 30))


@pytest.mark.parametrize("provider", PROVIDERS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=attention_cases())
def test_attention_random_search(provider, case):
    sc, head_size, seed = case
    r = random.Random(seed)
    step, kw = _scenario_step(r, sc, head_size=head_size)
    opts = _options(r, sc, kw["num_heads"], head_size)
    check_attention(provider, step, **opts)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, _tanh(tl.load(x_ptr + offs)))


def test_triton_tanh_is_accurate_near_zero():
    """The Triton kernels' soft cap ``cap * tanh(s / cap)``: tanh within 4e-7 relative
    everywhere, near 0 too (there ``1 - 2 / (exp(2x) + 1)`` loses everything but ~2^-24
    absolute, which a large cap multiplies)."""
    if not put.INTERPRETER:
        pytest.skip("runs the jit helper in Triton's interpreter")
    x = torch.cat([torch.logspace(-7, 1.3, 1024, dtype=torch.float64), torch.tensor([0.4999, 0.5, 0.5001, 30.0])])
    x = torch.cat([x, -x, torch.zeros(8, dtype=torch.float64)]).to(torch.float32)
    x = torch.cat([x, torch.full((4096 - len(x),), 0.25)])
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, N=len(x))
    want = torch.tanh(x.double())
    rel = ((y.double() - want).abs() / want.abs().clamp_min(1e-300))[want != 0]
    assert float(rel.max()) < 4e-7, f"tanh({float(x[rel.argmax()])}): relative error {float(rel.max()):.2e}"
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))


# --- refusals at the same corners ---------------------------------------------------------------


def _bytes(*ts):
    return [oracle._flat(t).view(torch.uint8).clone() if t.dim() == 4 else t.clone() for t in ts]


def _unchanged(before, *ts):
    for b, t in zip(before, ts):
        now = oracle._flat(t).view(torch.uint8) if t.dim() == 4 else t
        assert torch.equal(now.view(torch.uint8), b.view(torch.uint8)), "a refused call wrote"


def test_refused_one_past_the_end():
    """One past the last slot, the table's last row and the cache's last block: refused with
    an IndexError before anything is written (the last ones themselves are accepted above)."""
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    nb, bs, hkv, d, t = 3, 16, 2, 64, 4
    cache = _cache(nb, bs, hkv, d, torch.float16, "LBHNC")
    k, v = (torch.randn(t, hkv, d, generator=g).half() for _ in range(2))
    q = torch.randn(t, 2 * hkv, d, generator=g).half()
    one = torch.ones(1)
    slots = torch.tensor([0, 5, nb * bs - 1, nb * bs])
    before = _bytes(cache, q, k)
    with pytest.raises(IndexError, match=f"slot_mapping entry {nb * bs} .token 3"):
        OPS.reshape_and_cache(k, v, cache, slots, one, one, False)
    _unchanged(before, cache, q, k)
    table = torch.randn(10, 32, generator=g)
    pos = torch.tensor([0, 9, 3, 10])
    with pytest.raises(IndexError, match="positions entry 10 .token 3"):
        OPS.rope_and_cache(pos, q, k, v, cache, slots[:3], table, True, one, one, False)
    _unchanged(before, cache, q, k)
    qkv = torch.randn(t, 4 * hkv * d, generator=g).half()
    outs = [_poison(torch.empty(t, h, d, dtype=torch.float16)) for h in (2 * hkv, hkv)]
    with pytest.raises(IndexError, match="positions entry 10"):
        OPS.qk_norm_rope_and_cache(qkv, one.half().expand(d).contiguous(), one.half().expand(d).contiguous(), 1e-6,
                                   pos, table, False, cache, slots[:3], one, one, False, 2 * hkv, hkv, d, *outs)
    _unchanged(before + _bytes(*outs), cache, q, k, *outs)
    out = _poison(torch.empty_like(q))
    for bad, err, match in ((nb, IndexError, f"block_table.0, 1. = {nb}"), (-1, IndexError, "block_table.0, 1. = -1")):
        bt = torch.tensor([[1, bad, 0]], dtype=torch.int32)  # 17 tokens use two blocks
        with pytest.raises(err, match=match):
            OPS.paged_attention(out, q, k, v, cache, torch.tensor([0, 4], dtype=torch.int32),
                                torch.tensor([17], dtype=torch.int32), bt, 4, 17, 0.1, one, one)
        assert torch.isnan(out.float()).all()
    with pytest.raises(ValueError, match="needs 2 blocks but block_table has 1 columns"):
        OPS.paged_attention(out, q, k, v, cache, torch.tensor([0, 4], dtype=torch.int32),
                            torch.tensor([17], dtype=torch.int32), torch.tensor([[1]], dtype=torch.int32), 4, 17,
                            0.1, one, one)
    assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("provider", PROVIDERS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(WRITER_OPS), cache_kind=st.sampled_from(list(WRITER_CACHES)), seed=st.integers(0, 2 ** 30))
def test_writer_random_search(provider, op, cache_kind, seed):
    if provider == "triton" and WRITER_CACHES[cache_kind][0] in (E4M3, E5M2) and op != "reshape_and_cache":
        cache_kind = "model"  # the interpreter's fp8 rounding (see _writer_inputs)
    if op == "rotary_embedding":
        cache_kind = "model"
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    w = _writer_inputs(r, g, op.split(":")[0], provider, cache_kind)
    _run_writer(r, g, op, provider, w)


# --- non-finite inputs --------------------------------------------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_nonfinite_stays_in_its_rows(provider, dtype):
    """NaN / Inf propagate as in float64 SDPA over the keys a row sees (design, "Non-finite
    inputs"), on the decode and verify paths (the launch hints keep every sequence off the
    prefill kernel): a NaN query element turns its own (token, head) row NaN; a NaN key or
    value of a cached token outside every row's window reaches no row; a NaN key channel of a
    verify sequence's last draft token only the last row (the one that sees it). A NaN value
    channel of that token: the last row, and under the design's row-block rule of the Triton
    verify kernel also that channel of the sequence's earlier rows of the same KV head; no
    other row, no other channel."""
    seed = random.randrange(1 << 30)
    r = random.Random(seed)
    seqs = [(12, 1), (9, 4), (20, 8), (16, 2)]
    st_ = make_step(r, seqs, num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype, block_size=16,
                    layout=r.choice(["LHBNC", "LBHNC"]), interleaved_v=r.random() < 0.5)
    window = 4  # cached position 0 is outside every row's window (contexts >= 9)
    qsl = st_["query_start_loc"].tolist()
    row_block_rule = torch.zeros(st_["query"].shape, dtype=torch.bool)  # where the rule may add NaN
    for s, (ctx, ql) in enumerate(seqs):
        blk = int(st_["block_table"][s, 0])
        junk_k = torch.full((1, 2, 32), r.choice([math.nan, math.inf]), dtype=torch.float64)
        junk_v = torch.full((1, 2, 32), r.choice([math.nan, -math.inf]), dtype=torch.float64)
        oracle.write(st_["cache"], junk_k, junk_v, torch.tensor([blk * 16]), 1.0, 1.0, st_["interleaved_v"])
        if ql > 1:  # the last draft token: a NaN key channel in KV head 0, a NaN value channel in head 1
            last = qsl[s + 1] - 1
            st_["key"][last, 0, 3] = math.nan
            st_["value"][last, 1, 5] = math.nan
            if provider == "triton":
                row_block_rule[qsl[s]:last, 2:4, 5] = True
    st_["query"][qsl[0], 2, 7] = math.nan  # the decode row of head 2 only
    scale = 32 ** -0.5
    out = run_attention(provider, st_, scale=scale, window=window)
    want, row_scale, logit_max = oracle.paged_attention(
        st_["query"], st_["key"], st_["value"], st_["cache"], st_["query_start_loc"], st_["seq_lens"],
        st_["block_table"], scale=scale, window=window, interleaved_v=st_["interleaved_v"])
    got = out.to(torch.float64)
    assert torch.isnan(want).any() and (~torch.isnan(want)).any(), "the case exercises both kinds of rows"
    missing = torch.isnan(want) & ~torch.isnan(got)
    extra = torch.isnan(got) & ~torch.isnan(want) & ~row_block_rule
    for what, where in (("NaN missing", missing), ("NaN where the oracle has none", extra)):
        assert not where.any(), f"seed {seed}: {what} at (token, head, channel) {torch.nonzero(where)[:4].tolist()}"
    tol = (1e-6 if dtype == torch.float32 else U16) if provider == "reference" else (
        1e-5 if dtype == torch.float32 else 3 * U16)
    bound = ((tol + 16 * U32 * logit_max) * row_scale)[:, :, None].expand_as(got)
    fine = ~torch.isnan(want) & ~torch.isnan(got)
    bad = (got - want).abs()[fine] > bound[fine]
    assert not bad.any(), f"seed {seed}: {int(bad.sum())} finite elements beyond the bound"
