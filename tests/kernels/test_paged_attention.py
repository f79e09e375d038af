"""``paged_attention`` (paged decode + prefix prefill) of every provider against the float64
oracle, and the Triton provider's launch configs and code paths.

Without a GPU the reference runs on CPU tensors and Triton in its interpreter (conftest sets
TRITON_INTERPRET=1): fp16/fp32 only (bf16 is broken there), small shapes. The ``gpu`` tests
run the GPU providers over a larger matrix in bf16/fp16 with fp8 caches. Checks and
tolerances: ``attention_checks.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import random

import pytest
import torch

import providers_under_test as put
from attention_checks import GPU, check_paged, check_paged_nonfinite, seed
from inductor_rocm_attn.kernels.triton.configs import (PAGED_K_ROWS, DecodeConfig, PrefillConfig, decode_config,
                                                       prefill_config)

PROVIDERS = put.providers_for("paged_attention")
ON_GPU = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(ON_GPU, reason="CPU matrix; the gpu tests cover CUDA")

# --- CPU matrix (reference; Triton in the interpreter): each row covers several features ----

CPU_CASES = [
    # id, query_lens, context_lens, kwargs
    ("gqa1_d64_bs16_decode", [1, 1, 1], [5, 33, 70], dict(num_heads=2, num_kv_heads=2)),
    ("gqa4_d80_bs32_lbhnc_interleaved_mixed", [1, 7, 1, 12], [40, 19, 3, 0],
     dict(num_heads=8, num_kv_heads=2, head_size=80, block_size=32, layout="LBHNC",
          interleaved_v=True)),
    ("gqa8_d128_bs16_window_alibi", [1, 9, 1], [50, 30, 7],
     dict(num_heads=8, num_kv_heads=1, head_size=128, sliding_window=13, alibi=True)),
    ("gqa4_d64_bs544_sinks_softcap", [1, 6], [600, 560],
     dict(num_heads=4, num_kv_heads=1, block_size=544, sinks=True, softcap=4.0, layout="LBHNC")),
    ("noncausal_window_interleaved", [1, 10, 5], [21, 17, 0],
     dict(causal=False, sliding_window=6, interleaved_v=True)),
    ("noncausal_plain", [1, 11], [9, 20], dict(causal=False, alibi=True)),
    ("split_forced_all_features", [1, 1, 8], [90, 17, 40],
     dict(num_heads=8, num_kv_heads=2, num_splits=3, sliding_window=40, alibi=True, sinks=True,
          softcap=6.0, interleaved_v=True)),
    ("split_forced_more_splits_than_tiles", [1, 1], [3, 100], dict(num_splits=5)),
    ("decode_three_loops_window", [1, 1, 1], [100, 7, 64],
     dict(sliding_window=37, decode_cfg=DecodeConfig(16, 4, 1, "rows3"), num_splits=2)),
    ("gqa8_d256_split", [1, 1, 5], [40, 17, 9],
     dict(num_heads=8, num_kv_heads=1, head_size=256, num_splits=2)),
    ("bs784_lbhnc", [1, 4], [790, 3],
     dict(num_heads=2, num_kv_heads=1, block_size=784, layout="LBHNC")),
    ("prefill_block_gather_path_with_hints", [6, 1, 9], [40, 33, 0],
     dict(prefill_cfg=PrefillConfig(16, 32, 4, 1), hints=True, interleaved_v=True)),
    ("decode_only_hint_skips_prefill_launch", [1, 1], [30, 5], dict(hints=True, sinks=True)),
    ("gqa96_two_head_chunks_int64_index", [1, 2], [20, 5],
     dict(num_heads=96, num_kv_heads=1, head_size=32, index_dtype=torch.int64, alibi=True)),
    ("fp32_d256_gqa2", [1, 5], [30, 20],
     dict(num_heads=4, num_kv_heads=2, head_size=256, dtype=torch.float32)),
    ("fp8_e4m3_cache", [1, 6, 1], [45, 20, 9], dict(cache_dtype=torch.float8_e4m3fn, num_splits=2)),
    ("fp8_e5m2_cache_interleaved", [1, 6], [30, 25],
     dict(cache_dtype=torch.float8_e5m2, interleaved_v=True, layout="LBHNC")),
    ("key_none_reads_cache", [1, 6, 4], [20, 11, 0], dict(key_from_cache=True, interleaved_v=True)),
    ("padding_rows_and_empty_seq", [1, 0, 5], [12, 30, 8], dict(pad_rows=3)),
]
CPU_PARAMS = dict(argnames="query_lens,context_lens,kw", argvalues=[c[1:] for c in CPU_CASES],
                  ids=[c[0] for c in CPU_CASES])
# Head size 512 (Gemma4's full-attention layers), with the launch configs a GPU takes for it
# (a split decode, verify rows and a prefill in each batch); apart from CPU_CASES, whose rows
# every Triton variant test below runs again.
D512_CASES = [
    ("fp16_interleaved_split", [1, 9, 4, 1], [40, 19, 7, 3],
     dict(num_heads=8, num_kv_heads=1, head_size=512, interleaved_v=True, num_splits=2, hints=True,
          decode_cfg=decode_config(512, 8, 16, torch.float16),
          prefill_cfg=prefill_config(512, 8, 16, torch.float16))),
    ("fp32_lbhnc_window", [1, 10], [30, 20],
     dict(num_heads=4, num_kv_heads=2, head_size=512, dtype=torch.float32, layout="LBHNC",
          sliding_window=17, decode_cfg=decode_config(512, 2, 16, torch.float32),
          prefill_cfg=prefill_config(512, 2, 16, torch.float32))),
]


@cpu_only
@pytest.mark.parametrize(**CPU_PARAMS)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention(provider, query_lens, context_lens, kw):
    check_paged(provider, query_lens, context_lens, **kw)


@cpu_only
@pytest.mark.parametrize("query_lens,context_lens,kw", [c[1:] for c in D512_CASES], ids=[c[0] for c in D512_CASES])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_head_size_512(provider, query_lens, context_lens, kw):
    check_paged(provider, query_lens, context_lens, **kw)


@cpu_only
@pytest.mark.parametrize("draw", range(4))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_random(provider, draw):
    """Fresh random geometry, features and batch each run (the seed is in the message)."""
    seed_ = seed()
    r = random.Random(seed_)
    kv_heads = r.choice([1, 2])
    b = r.randint(1, 4)
    query_lens = [r.choice([0, 1, 1, r.randint(2, 12)]) for _ in range(b)]
    context_lens = [r.randint(0, 70) for _ in range(b)]
    if all(q == 0 for q in query_lens):
        query_lens[0] = 1
    context_lens = [max(c, 1) if q == 1 else c for q, c in zip(query_lens, context_lens)]
    kw = dict(
        num_heads=kv_heads * r.choice([1, 2, 4, 8]), num_kv_heads=kv_heads,
        head_size=r.choice([32, 64, 80, 96, 128]), block_size=r.choice([16, 32, 48, 64]),
        layout=r.choice(["LHBNC", "LBHNC"]), interleaved_v=r.random() < 0.5,
        causal=r.random() < 0.7, sliding_window=r.choice([-1, -1, r.randint(1, 40)]),
        alibi=r.random() < 0.3, sinks=r.random() < 0.3, softcap=r.choice([0.0, 0.0, 5.0]),
        num_splits=r.choice([None, 1, 3]),
    )
    try:
        check_paged(provider, query_lens, context_lens, **kw)
    except pytest.skip.Exception:
        raise
    except Exception as e:  # any failure names its draw, so it can be replayed
        raise AssertionError(f"draw seed {seed_}: {query_lens} {context_lens} {kw}: "
                             f"{type(e).__name__}: {e}") from e


# --- Triton: decode kinds, K read levels, lazy rescale, row order, dense K/V paths (CPU) ------


@cpu_only
@pytest.mark.parametrize("kind", ["streams", "streams3", "keys", "keys3"])
@pytest.mark.parametrize(**CPU_PARAMS)
def test_triton_decode_kinds(query_lens, context_lens, kw, kind):
    """The other decode kinds over the same matrix: one stream per warp (2 streams of 16
    keys), keys-major (32-key tiles, 2 warps)."""
    tile = kw["decode_cfg"].tile_n if "decode_cfg" in kw else 32
    check_paged("triton", query_lens, context_lens,
                **{**kw, "decode_cfg": DecodeConfig(max(tile, 32), 2, 1, kind)})


@cpu_only
@pytest.mark.parametrize("kind", ["rows", "rows3"])
@pytest.mark.parametrize(**CPU_PARAMS)
def test_triton_k_rows(query_lens, context_lens, kw, kind):
    """16-key tiles (the GPU decode default; prefill context tiles too): each tile is one run
    of a block, so K is read as the page's packet rows (``PAGED_K_ROWS``) over the whole
    matrix: block sizes 16/32/544/784, head sizes with padding, fp32 (x=4) and fp8 (x=16)."""
    assert PAGED_K_ROWS >= 1 and DecodeConfig(16, 1, 1, kind).k_rows == PAGED_K_ROWS
    check_paged("triton", query_lens, context_lens, **{
        **kw, "decode_cfg": DecodeConfig(16, 1, 1, kind), "prefill_cfg": PrefillConfig(16, 16, 4, 1)})


@cpu_only
@pytest.mark.parametrize(**CPU_PARAMS)
def test_triton_k_rows_multi_run(query_lens, context_lens, kw):
    """K read as packet rows for tiles of several runs (level 2): 32-key decode tiles and
    32-key prefill context tiles, two runs over 16-token blocks (one over 32/544)."""
    check_paged("triton", query_lens, context_lens, **{
        **kw, "decode_cfg": DecodeConfig(32, 2, 1, "rows3", k_rows=2),
        "prefill_cfg": PrefillConfig(16, 32, 4, 1, k_rows=2)})


SPLIT_CASES = [c for c in CPU_CASES if c[3].get("num_splits", 1) > 1]


@cpu_only
@pytest.mark.parametrize(argnames="query_lens,context_lens,kw",
                         argvalues=[c[1:] for c in SPLIT_CASES], ids=[c[0] for c in SPLIT_CASES])
def test_triton_split_merge_reduce_kernel(query_lens, context_lens, kw):
    """The KV splits' partials merged by the reduce kernel, over every split case of the
    matrix (which runs the default: up to 8 splits, the last split program merges)."""
    check_paged("triton", query_lens, context_lens, decode_changes=dict(split_merge="reduce"), **kw)


@cpu_only
def test_triton_last_split_merge_counters_reset():
    """Each launch leaves the merge counters at 0, so back-to-back launches (graph
    replays) merge correctly. Counters left far from 0 mean no program takes the last
    ticket and the (poisoned) output stays unwritten: the check fails, so it can."""
    pa_mod = importlib.import_module("inductor_rocm_attn.kernels.triton.paged_attention")

    kw = dict(num_heads=8, num_kv_heads=2, num_splits=4, decode_changes=dict(split_merge="last_split"))
    for _ in range(3):
        check_paged("triton", [1, 1, 1], [70, 5, 130], **kw)
        assert all(int(b.abs().sum()) == 0 for b in pa_mod._MERGE_COUNTERS.values())
    next(iter(pa_mod._MERGE_COUNTERS.values())).fill_(1000)
    try:
        with pytest.raises(AssertionError, match="unwritten"):
            check_paged("triton", [1, 1, 1], [70, 5, 130], **kw)
    finally:
        for b in pa_mod._MERGE_COUNTERS.values():
            b.zero_()


@cpu_only
def test_triton_merge_counters_grow_and_keep_old_buffers():
    """More (sequence, KV head) rows than the counter buffer holds: it grows, zeroed, and the
    old buffer is kept (a captured graph may still address it)."""
    pa_mod = importlib.import_module("inductor_rocm_attn.kernels.triton.paged_attention")
    dev = torch.device("cpu")
    first = pa_mod._merge_counters(dev, 10)
    assert first is not None and first.numel() >= 10 and int(first.abs().sum()) == 0
    assert pa_mod._merge_counters(dev, first.numel()) is first
    grown = pa_mod._merge_counters(dev, first.numel() + 1)
    assert grown.numel() > first.numel() and int(grown.abs().sum()) == 0
    assert any(b is first for b in pa_mod._RETIRED_COUNTERS)
    assert pa_mod._merge_counters(dev, 10) is grown


@cpu_only
@pytest.mark.parametrize("margin", [0.0, 8.0])
@pytest.mark.parametrize("query_lens,context_lens,kw", [
    ([1, 1, 7], [90, 40, 50], dict(num_splits=2)),
    ([1, 9], [70, 33], dict(decode_cfg=DecodeConfig(16, 4, 1, "rows3"), sinks=True,
                            interleaved_v=True)),
    ([12, 1], [0, 100], dict(dtype=torch.float32, causal=False, alibi=True)),
], ids=["splits", "three_loops_sinks", "fp32_noncausal_alibi"])
def test_triton_lazy_rescale_with_peaked_logits(query_lens, context_lens, kw, margin):
    """Logits 12x the usual spread (running maxima jump by far more than the margin from tile
    to tile, in both directions): the lazy rescale (margin 8, log2 units) must take its
    rescale branch exactly when needed; margin 0 is the rescale-every-tile update."""
    check_paged("triton", query_lens, context_lens, scale_mult=12.0,
                decode_changes=dict(rescale_margin=margin),
                prefill_changes=dict(context_margin=margin, dense_margin=margin), **kw)


@cpu_only
@pytest.mark.parametrize("query_lens,context_lens,kw", [
    ([1, 40, 17, 33], [5, 0, 30, 9], dict(prefill_cfg=PrefillConfig(16, 16, 4, 1))),
    ([23, 1, 64], [16, 7, 0], dict(prefill_cfg=PrefillConfig(16, 32, 4, 1), sliding_window=19,
                                   sinks=True)),
])
@pytest.mark.parametrize("longest_first", [True, False], ids=["longest_first", "grid_order"])
def test_triton_prefill_row_block_order(longest_first, query_lens, context_lens, kw):
    """Causal row blocks run last-first within each sequence (``PrefillConfig.longest_first``)
    or in grid order: every row block is still computed once, also with uneven lengths and
    decode rows mixed in."""
    check_paged("triton", query_lens, context_lens,
                prefill_changes=dict(longest_first=longest_first), **kw)


@cpu_only
@pytest.mark.parametrize("query_lens,context_lens,kw", [
    ([1, 40, 17, 33], [5, 0, 30, 9], dict(prefill_cfg=PrefillConfig(16, 16, 4, 1), kv_pad_nan=5)),
    ([23, 1, 64], [16, 7, 0], dict(prefill_cfg=PrefillConfig(16, 32, 4, 1), sliding_window=19,
                                   sinks=True, dtype=torch.float32, kv_pad_nan=3)),
    ([9, 30], [0, 4], dict(prefill_cfg=PrefillConfig(16, 16, 4, 1), causal=False, alibi=True)),
])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_triton_prefill_dense_paths(tma, query_lens, context_lens, kw):
    """New tokens' K/V through tensor descriptors (``PrefillConfig.dense_tma``) and through
    pointers (ROCm, odd strides): tiles reaching into the next sequence or the NaN padding
    after the batch stay out of the sums."""
    check_paged("triton", query_lens, context_lens, prefill_changes=dict(dense_tma=tma),
                expect_dense_tma=tma, **kw)


# --- padding rows past the batch (graph padding) ------------------------------------------------

# The output sits between guard rows (``cases.Guarded``) and its padding rows are poisoned:
# both must be bit-identical afterwards, and every real row right. The interpreter's prefill
# row block is 16 rows (``configs.prefill_config``): the padding crosses row-block boundaries,
# sequences of length 0 sit in the middle and at the end, and the token counts are multiples
# of no tile.
PAD_CASES = [
    # id, query_lens, context_lens, padding rows, kwargs
    ("prefill2_pad14", [2], [0], 14, {}),  # the smallest case: 2 + 14 rows, BLOCK_M 16
    ("prefill_pad_two_blocks", [2], [5], 37, {}),
    ("mixed_empty_middle", [1, 5, 0, 19], [30, 7, 12, 3], 29, {}),
    ("prefill_empty_end", [1, 7, 0], [20, 0, 9], 20, dict(sliding_window=5)),
    ("decode_split_empty_end", [1, 1, 0], [17, 40, 5], 17, dict(num_splits=3, sinks=True)),
    ("long_prefill_last_hints", [3, 33], [0, 10], 13, dict(hints=True)),
    ("noncausal_mixed", [1, 5, 0, 19], [30, 7, 12, 3], 29, dict(causal=False, alibi=True)),
    ("key_from_cache", [4, 0, 18], [3, 2, 0], 30, dict(key_from_cache=True)),
]
PAD_PARAMS = dict(argnames="query_lens,context_lens,pad_rows,kw", argvalues=[c[1:] for c in PAD_CASES],
                  ids=[c[0] for c in PAD_CASES])


@cpu_only
@pytest.mark.parametrize(**PAD_PARAMS)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_padding_rows(provider, query_lens, context_lens, pad_rows, kw):
    check_paged(provider, query_lens, context_lens, pad_rows=pad_rows, **kw)


@cpu_only
@pytest.mark.parametrize("prefill_cfg", [PrefillConfig(16, 16, 4, 1), PrefillConfig(32, 16, 4, 1)],
                         ids=["block_m16", "block_m32"])
@pytest.mark.parametrize("longest_first", [True, False], ids=["longest_first", "grid_order"])
@pytest.mark.parametrize(**PAD_PARAMS)
def test_triton_padding_rows_row_order(query_lens, context_lens, pad_rows, kw, longest_first,
                                       prefill_cfg):
    """Every row order and row-block size: a program whose row block lies outside its
    sequence's rows (padding, an empty sequence) exits before it loads or stores anything."""
    check_paged("triton", query_lens, context_lens, pad_rows=pad_rows, prefill_cfg=prefill_cfg,
                prefill_changes=dict(longest_first=longest_first), **kw)


# --- non-finite inputs: NaN / +-inf propagate as float64 SDPA over each row's visible keys -----

NAN, INF = float("nan"), float("inf")
# Batch: a decode (context 30), a 7-token prefill on a 12-token prefix, a 20-token prefill on
# a 5-token prefix (rows 0..15 and 16..19 in the interpreter's 16-row blocks). Entries:
# (tensor, seq, pos, head, channel, value), pos a query row ("q") or key position ("k"/"v").
NONFINITE_CASES = [
    ("q_nan", [("q", 2, 3, 1, 5, NAN)], {}),
    ("k_nan_context", [("k", 1, 4, 0, 2, NAN)], {}),
    ("k_inf_new_token", [("k", 2, 15, 1, 7, INF)], {}),  # rows >= 10 see it: NaN or weight 0
    ("k_neg_inf_new_token", [("k", 2, 8, 0, 1, -INF)], {}),
    ("v_inf_new_token", [("v", 2, 15, 1, 3, INF)], {}),  # rows 0..9 of its row block mask it
    ("v_nan_new_token", [("v", 2, 17, 0, 0, NAN)], {}),
    ("v_nan_context", [("v", 1, 4, 1, 9, NAN)], {}),
    ("v_both_infs_one_channel", [("v", 2, 7, 0, 6, INF), ("v", 2, 13, 0, 6, -INF)], {}),
    ("decode_k_nan_split", [("k", 0, 17, 0, 0, NAN)], dict(num_splits=3)),
    ("decode_v_neg_inf_own_token", [("v", 0, 30, 1, 4, -INF)], dict(num_splits=2)),
    ("window_v_nan_masked_both_sides", [("v", 2, 8, 0, 0, NAN)], dict(sliding_window=4)),
    ("window_k_nan_context_edge", [("k", 2, 3, 1, 2, NAN)], dict(sliding_window=6)),
    ("noncausal_window_v_inf", [("v", 2, 8, 1, 1, INF)], dict(causal=False, sliding_window=4)),
    ("noncausal_q_nan_k_inf", [("q", 1, 2, 3, 0, NAN), ("k", 2, 20, 0, 5, INF)], dict(causal=False)),
]
NONFINITE_PARAMS = dict(argnames="inject,kw", argvalues=[c[1:] for c in NONFINITE_CASES],
                        ids=[c[0] for c in NONFINITE_CASES])
NONFINITE_BATCH = ([1, 7, 20], [30, 12, 5])


@pytest.mark.parametrize("trial", range(8))
def test_sdpa_visible_matches_per_row_sdpa(trial):
    """The non-finite oracle (one batched softmax) against float64 SDPA called on each row and
    head alone over the keys it sees: NaN / +-inf at the same places, the rest equal. Random
    shapes, windows and NaN / +-inf entries in q, k and v, some rows with underflowing weights."""
    from attention_checks import sdpa_visible

    rng = random.Random(seed() + trial)
    for _ in range(40):
        hkv, d = rng.choice([1, 2]), rng.choice([4, 8])
        hq, lk = hkv * rng.choice([1, 2, 4]), rng.randint(1, 40)
        lq = rng.randint(1, min(lk, 12))
        q, k, v = (torch.randn(n, h, d, dtype=torch.float64)
                   for n, h in ((lq, hq), (lk, hkv), (lk, hkv)))
        for _ in range(rng.randint(1, 3)):
            t = rng.choice([q, k, v])
            t[rng.randrange(t.shape[0]), rng.randrange(t.shape[1]), rng.randrange(d)] = \
                rng.choice([INF, -INF, NAN])
        if rng.random() < 0.2:
            q *= 100  # some seen keys' weights underflow to 0: 0 * inf = NaN
        start = lk - lq if rng.random() < 0.8 else rng.randint(0, 10)
        causal, window, encoder = rng.random() < 0.7, rng.choice([-1, 3, 10]), rng.random() < 0.3
        kw = dict(q_start_pos=start, scale=rng.choice([0.3, 1.0]), causal=causal,
                  sliding_window=window, encoder=encoder)
        got = sdpa_visible(q, k, v, **kw)
        kp, want = torch.arange(lk), torch.zeros_like(got)
        for i in range(lq):
            qp = start + i
            seen = (kp <= qp) if causal else torch.ones(lk, dtype=torch.bool)
            if window > 0:
                seen &= (qp - kp < window) & ((kp - qp < window) if encoder else True)
            for h in range(hq):
                if seen.any():
                    want[i, h] = torch.nn.functional.scaled_dot_product_attention(
                        q[i, h][None], k[seen, h // (hq // hkv)], v[seen, h // (hq // hkv)],
                        scale=kw["scale"])[0]
        for f in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(f(got), f(want)), kw
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-10, atol=1e-12)


@cpu_only
@pytest.mark.parametrize(**NONFINITE_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_nonfinite(provider, dtype, inject, kw):
    """A NaN query gives NaN for its row and head; NaN / inf in a key's K or V gives NaN /
    +-inf exactly where float64 SDPA over each row's visible keys does; rows that mask the
    key (also rows of the same kernel tile) are not affected."""
    check_paged_nonfinite(provider, *NONFINITE_BATCH, inject, dtype=dtype, **kw)


@cpu_only
@pytest.mark.parametrize("kind", ["rows3", "streams", "keys3"])
@pytest.mark.parametrize("inject", [[("k", 0, 17, 0, 0, NAN)], [("v", 0, 3, 1, 4, INF)],
                                    [("q", 0, 0, 2, 1, NAN)]], ids=["k_nan", "v_inf", "q_nan"])
def test_triton_decode_kinds_nonfinite(kind, inject):
    check_paged_nonfinite("triton", *NONFINITE_BATCH, inject, dtype=torch.float16,
                          decode_cfg=DecodeConfig(32, 2, 1, kind), num_splits=2)


# --- GPU matrix ------------------------------------------------------------------------------

GPU_CASES = [
    ("gqa1_d64_bs16", dict(num_heads=8, num_kv_heads=8, head_size=64, block_size=16)),
    ("gqa4_d128_bs16", dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16)),
    ("gqa8_d128_bs32_interleaved", dict(num_heads=16, num_kv_heads=2, head_size=128,
                                        block_size=32, interleaved_v=True)),
    ("gqa4_d80_bs544_lbhnc", dict(num_heads=8, num_kv_heads=2, head_size=80, block_size=544,
                                  layout="LBHNC")),
    ("gqa2_d96_bs784", dict(num_heads=4, num_kv_heads=2, head_size=96, block_size=784)),
    ("gqa6_d160_bs1056_interleaved", dict(num_heads=12, num_kv_heads=2, head_size=160,
                                          block_size=1056, interleaved_v=True)),
    ("gqa1_d192_bs16", dict(num_heads=4, num_kv_heads=4, head_size=192)),
    ("gqa4_d224_bs32_lbhnc", dict(num_heads=8, num_kv_heads=2, head_size=224, block_size=32,
                                  layout="LBHNC")),
    ("gqa8_d256_bs16", dict(num_heads=16, num_kv_heads=2, head_size=256)),
    ("gqa16_d32_bs16", dict(num_heads=16, num_kv_heads=1, head_size=32)),
]
GPU_FEATURES = [  # every provider
    ("plain", dict()),
    ("window_alibi", dict(sliding_window=300, alibi=True)),
    ("sinks_softcap_noncausal", dict(sinks=True, softcap=8.0, causal=False)),
    ("window_noncausal", dict(sliding_window=300, causal=False)),  # one-sided: later keys visible
]
TRITON_GPU_FEATURES = [  # Triton launch knobs: splits, decode kinds
    ("split", dict(num_splits=7)),
    ("three_loop_decode", dict(sliding_window=500, decode_cfg=DecodeConfig(32, 4, 3, "rows3"))),
    ("one_warp_three_loop_decode", dict(sliding_window=500,
                                        decode_cfg=DecodeConfig(16, 1, 3, "rows3"))),
    ("keys_major_decode_alibi_softcap", dict(sliding_window=500, alibi=True, softcap=8.0,
                                             decode_cfg=DecodeConfig(16, 1, 3, "keys3"))),
    ("keys_major_one_loop_split_sinks", dict(sinks=True, num_splits=5,
                                             decode_cfg=DecodeConfig(32, 2, 3, "keys"))),
    ("rows_decode_window_alibi", dict(sliding_window=300, alibi=True,
                                      decode_cfg=DecodeConfig(64, 4, 3, "rows"))),
    ("streams_decode_window_alibi", dict(sliding_window=300, alibi=True,
                                         decode_cfg=DecodeConfig(64, 4, 3, "streams3"))),
    ("streams_one_loop_split_sinks", dict(sinks=True, softcap=8.0, num_splits=5,
                                          decode_cfg=DecodeConfig(32, 2, 3, "streams"))),
    ("split_last_split_merge_sinks", dict(sinks=True, num_splits=7, sliding_window=500,
                                          decode_changes=dict(split_merge="last_split"))),
    ("split_reduce_kernel_alibi", dict(alibi=True, num_splits=6,
                                       decode_changes=dict(split_merge="reduce"))),
]


def _gpu_matrix(features, fp16_too):
    """Every geometry x feature set in bf16 (and every geometry plain in fp16)."""
    m = [(g, f, torch.bfloat16) for g in GPU_CASES for f in features]
    if fp16_too:
        m += [(g, features[0], torch.float16) for g in GPU_CASES]
    return dict(argnames="geom,feat,dtype", argvalues=[(g[1], f[1], d) for g, f, d in m],
                ids=[f"{g[0]}-{f[0]}-{str(d)[6:]}" for g, f, d in m])


# mixed batch: long and short decodes, prefills with and without a cached prefix
GPU_BATCH = ([1, 1, 300, 1, 77, 1], [2000, 15, 1200, 1, 0, 700])


@pytest.mark.gpu
@pytest.mark.parametrize(**_gpu_matrix(GPU_FEATURES, fp16_too=True))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_gpu(provider, geom, feat, dtype):
    check_paged(provider, *GPU_BATCH, dtype=dtype, device=GPU, **geom, **feat)


@pytest.mark.gpu
@pytest.mark.parametrize(**_gpu_matrix(TRITON_GPU_FEATURES, fp16_too=False))
def test_triton_paged_attention_gpu(geom, feat, dtype):
    check_paged("triton", *GPU_BATCH, dtype=dtype, device=GPU, **geom, **feat)


# Head size 512 (Gemma4's full-attention layers) with the configs a GPU picks for it: a
# batch with decodes (long ones split), verify rows (2..8 tokens) and prefills with and
# without a cached prefix; every cache kind the configs are keyed by.
GPU_D512 = [
    ("gqa8_bf16", dict(num_heads=16, num_kv_heads=2)),
    ("gqa8_fp16_interleaved_lbhnc", dict(num_heads=16, num_kv_heads=2, dtype=torch.float16,
                                         interleaved_v=True, layout="LBHNC")),
    ("gqa2_bf16_window_sinks_softcap", dict(num_heads=4, num_kv_heads=2, sliding_window=300,
                                            sinks=True, softcap=30.0)),
    ("gqa8_bf16_split64", dict(num_heads=16, num_kv_heads=2, num_splits=64)),
    ("gqa8_fp8_e4m3_cache", dict(num_heads=16, num_kv_heads=2, cache_dtype=torch.float8_e4m3fn, tol=2e-2)),
    ("gqa8_fp8_e5m2_cache_split64", dict(num_heads=16, num_kv_heads=2, cache_dtype=torch.float8_e5m2,
                                         num_splits=64, tol=2e-2)),
    ("gqa4_fp32", dict(num_heads=8, num_kv_heads=2, dtype=torch.float32)),
    ("gqa4_fp32_model_bf16_cache", dict(num_heads=8, num_kv_heads=2, dtype=torch.float32,
                                        cache_dtype=torch.bfloat16, tol=2e-2)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [c[1] for c in GPU_D512], ids=[c[0] for c in GPU_D512])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_gpu_head_size_512(provider, kw):
    kw = {"dtype": torch.bfloat16, **kw}
    check_paged(provider, [1, 4, 1, 8, 300, 1, 77], [2000, 900, 15, 40, 1200, 1, 0], head_size=512,
                hints=True, device=GPU, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("interleaved_v", [False, True])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_gpu_fp8_cache(provider, cache_dtype, interleaved_v):
    check_paged(provider, [1, 130, 1], [1500, 400, 33], num_heads=32, num_kv_heads=8,
                head_size=128, dtype=torch.bfloat16, cache_dtype=cache_dtype,
                interleaved_v=interleaved_v, device=GPU, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("interleaved_v", [False, True])
@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("decode_cfg", [None, DecodeConfig(64, 4, 3, "rows"),
                                        DecodeConfig(64, 4, 3, "streams3"),
                                        DecodeConfig(32, 1, 3, "keys3"),
                                        DecodeConfig(16, 1, 3, "rows3"),
                                        DecodeConfig(16, 1, 3, "rows3", fp8_fp16_dot=True),
                                        DecodeConfig(64, 4, 3, "rows", fp8_fp16_dot=True)],
                         ids=["default", "rows", "streams3", "keys3", "rows3", "rows3_fp16_dot",
                              "rows_fp16_dot"])
def test_triton_paged_attention_gpu_fp8_cache(cache_dtype, interleaved_v, num_splits, decode_cfg):
    check_paged("triton", [1, 130, 1], [1500, 400, 33], num_heads=32, num_kv_heads=8,
                head_size=128, dtype=torch.bfloat16, cache_dtype=cache_dtype,
                interleaved_v=interleaved_v, num_splits=num_splits, device=GPU, tol=2e-2,
                decode_cfg=decode_cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_gpu_fp8_output(provider, num_splits):
    if num_splits is not None and provider != "triton":
        pytest.skip(f"{provider}: num_splits is a Triton launch knob")
    check_paged(provider, [1, 200, 1], [900, 300, 5], num_heads=16, num_kv_heads=4,
                head_size=128, dtype=torch.bfloat16, out_fp8=True, num_splits=num_splits,
                device=GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["last_split", "reduce"])
@pytest.mark.parametrize("case", [
    dict(out_fp8=True, num_splits=3),
    dict(cache_dtype=torch.float8_e4m3fn, num_splits=8, tol=2e-2),
    dict(num_splits=64, sinks=True),
    dict(num_splits=5, decode_cfg=DecodeConfig(32, 1, 3, "keys3")),
], ids=["fp8_out", "fp8_cache", "64_splits_sinks", "keys3"])
def test_triton_split_merge_gpu(merge, case):
    """Every merge of the splits on the GPU (64 splits: "last_split" given, not "auto"),
    three launches in a row (the counters of the last-split merge go back to 0 after each)."""
    case = dict(case)
    cfg = case.pop("decode_cfg", None)
    kw = dict(decode_cfg=dataclasses.replace(cfg, split_merge=merge)) if cfg else dict(
        decode_changes=dict(split_merge=merge))
    for _ in range(3):
        check_paged("triton", [1, 1, 1, 1], [3000, 17, 900, 1], num_heads=32, num_kv_heads=8,
                    head_size=128, dtype=torch.bfloat16, device=GPU, **kw, **case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kw", [
    dict(num_heads=32, num_kv_heads=8, head_size=128, kv_pad_nan=7),
    dict(num_heads=16, num_kv_heads=2, head_size=64, sliding_window=300, alibi=True,
         decode_changes=dict(rescale_margin=8.0),
         prefill_changes=dict(context_margin=8.0, dense_margin=8.0)),
    dict(num_heads=8, num_kv_heads=8, head_size=128, sinks=True, softcap=8.0, causal=False,
         kv_pad_nan=3),
], ids=["gqa4_d128_nan_pad", "gqa8_d64_window_alibi_margin8", "mha_sinks_softcap_noncausal"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_triton_prefill_dense_paths_gpu(tma, dtype, kw):
    """The new tokens' K/V through TMA descriptors (``PrefillConfig.dense_tma``) and through
    pointers."""
    from inductor_rocm_attn.kernels.triton.paged_attention import launch_target

    if tma and not launch_target(torch.device(GPU, torch.cuda.current_device())).tma:
        pytest.skip("TMA needs an NVIDIA GPU of sm_90 or newer")
    kw = dict(kw)  # the parameter is shared by every (tma, dtype)
    changes = {**kw.pop("prefill_changes", {}), "dense_tma": tma}
    check_paged("triton", [1, 300, 1, 77, 130], [2000, 1200, 1, 0, 5], dtype=dtype, device=GPU,
                prefill_changes=changes, expect_dense_tma=tma, **kw)


# GPU row blocks are 64-128 rows (configs.prefill_config): padding of 128-300 rows crosses
# several; the compute-sanitizer memcheck run goes over these.
GPU_PAD_CASES = [
    ("prefill2_pad254", [2], [0], 254),
    ("mixed_empty_middle_pad300", [1, 130, 0, 77, 1], [900, 40, 50, 0, 33], 300),
    ("prefill_empty_end_pad128", [1, 300, 0], [2000, 1200, 9], 128),
    ("decode_empty_end_pad129", [1, 1, 0, 1], [1500, 40, 7, 300], 129),
]


@pytest.mark.gpu
@pytest.mark.parametrize("query_lens,context_lens,pad_rows", [c[1:] for c in GPU_PAD_CASES],
                         ids=[c[0] for c in GPU_PAD_CASES])
@pytest.mark.parametrize("geom", [dict(num_heads=32, num_kv_heads=8, head_size=128),
                                  dict(num_heads=8, num_kv_heads=8, head_size=64, causal=False)],
                         ids=["gqa4_d128", "mha_d64_noncausal"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_padding_rows_gpu(provider, query_lens, context_lens, pad_rows, geom):
    check_paged(provider, query_lens, context_lens, pad_rows=pad_rows, dtype=torch.bfloat16,
                device=GPU, **geom)


@pytest.mark.gpu
@pytest.mark.parametrize("query_lens,context_lens,pad_rows", [c[1:] for c in GPU_PAD_CASES],
                         ids=[c[0] for c in GPU_PAD_CASES])
@pytest.mark.parametrize("knobs", [
    dict(prefill_changes=dict(longest_first=False)), dict(prefill_changes=dict(dense_tma=False)),
    dict(num_splits=5, hints=True), dict(key_from_cache=True, sliding_window=100),
], ids=["grid_order", "dense_pointers", "split5_hints", "key_none_window"])
def test_triton_padding_rows_gpu(query_lens, context_lens, pad_rows, knobs):
    check_paged("triton", query_lens, context_lens, pad_rows=pad_rows, dtype=torch.bfloat16,
                device=GPU, num_heads=32, num_kv_heads=8, head_size=128, **knobs)


# GPU tiles (64-128 rows, 16-128 keys): the entries sit inside row blocks and key tiles.
GPU_NONFINITE_BATCH = ([1, 130, 300], [2000, 40, 900])
GPU_NONFINITE_CASES = [
    ("q_nan", [("q", 2, 70, 1, 5, NAN)], {}),
    ("k_nan_context", [("k", 2, 333, 0, 2, NAN)], {}),
    ("k_inf_new_token", [("k", 2, 900 + 200, 3, 7, INF)], {}),
    ("v_inf_new_token", [("v", 2, 900 + 150, 1, 3, INF)], {}),
    ("v_nan_new_token_window", [("v", 1, 40 + 60, 0, 0, NAN)], dict(sliding_window=50)),
    ("v_both_infs", [("v", 2, 900 + 10, 0, 6, INF), ("v", 2, 900 + 100, 0, 6, -INF)], {}),
    ("decode_k_nan", [("k", 0, 1234, 0, 0, NAN)], {}),
    ("decode_v_inf_split", [("v", 0, 77, 2, 9, INF)], dict(num_splits=8)),
    ("noncausal_window_v_inf", [("v", 2, 900 + 40, 1, 1, INF)], dict(causal=False, sliding_window=64)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("inject,kw", [c[1:] for c in GPU_NONFINITE_CASES],
                         ids=[c[0] for c in GPU_NONFINITE_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_nonfinite_gpu(provider, dtype, inject, kw):
    """The GPU's default float max drops NaN (the interpreter's keeps it): the outputs agree
    anyway, since a NaN score reaches its row through its own weight exp2(NaN - m)."""
    check_paged_nonfinite(provider, *GPU_NONFINITE_BATCH, inject, dtype=dtype, device=GPU,
                          num_heads=32, num_kv_heads=8, head_size=128, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_attention_gpu_fp32_and_key_none(provider):
    check_paged(provider, [1, 40], [300, 90], num_heads=8, num_kv_heads=2, head_size=128,
                dtype=torch.float32, device=GPU)
    check_paged(provider, [1, 40, 3], [300, 90, 0], num_heads=8, num_kv_heads=2, head_size=128,
                dtype=torch.bfloat16, device=GPU, key_from_cache=True, pad_rows=5)
