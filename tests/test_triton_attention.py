"""Triton attention kernels (paged decode + prefix prefill, encoder) against the float64 oracle.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1): fp16/fp32 only (bf16 is broken there), small shapes. The ``gpu`` tests
run the same matrix on CUDA in bf16/fp16 with fp8 caches and larger shapes.

Every check draws fresh random inputs, poisons the output with NaN first and compares with
``cases.dense_oracle`` (independent float64 attention) by relative norm. Tolerances: fp32
1e-5, fp16 3e-3, bf16 1e-2 (the output rounding alone is ~2.5e-4 / 2e-3 of the norm); fp8
caches compare with the oracle over the rounded cache values, same tolerances (bf16 2e-2);
fused fp8 output quant (GPU only: the interpreter's fp32->fp8 cast is wrong when rounding
carries into the exponent): every element within one e4m3 step (+1%) of exact / output_scale.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

import cases

pytest.importorskip("triton")

if not torch.cuda.is_available():
    # Triton 3.6's interpreter turns scalars into 1-element numpy arrays, and NumPy >= 2.3
    # refuses int() of those: a loop with a loaded bound (range(lo, hi)) then fails. Make
    # __index__ read the element (interpreter only; compiled kernels are unaffected).
    import triton.runtime.interpreter as _interp

    if not getattr(_interp, "_rocm_attn_index_fix", False):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._rocm_attn_index_fix = True

from inductor_rocm_attn.kernels.triton import encoder_attention, paged_attention  # noqa: E402
from inductor_rocm_attn.kernels.triton.paged_attention import (  # noqa: E402
    DECODE_KINDS, MAX_SPLITS, MIN_SPLIT_TOKENS, decode_config, num_kv_splits)
from inductor_rocm_attn.layout import fp8_max  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
GPU = "cuda"


def _seed() -> int:
    return random.randrange(1 << 30)


def _features(num_heads, *, alibi=False, sinks=False, device="cpu", g=None):
    slopes = (torch.rand(num_heads, generator=g) * 0.5).to(device) if alibi else None
    sink = (torch.randn(num_heads, generator=g) * 2).to(device) if sinks else None
    return slopes, sink


def _check_fp8_steps(got, ref, fp8_dtype, seed):
    """Each fp8 output is within one fp8 step of the exact value / output_scale (clamped),
    plus 3% of its row's rms for the kernel's own bf16-level error before the cast (P is
    rounded to bf16 for the PV product: the bf16 output's worst element measured 1.6% of its
    row's rms over 36 runs on the H200, benchmarks/diag_decode_accuracy.py; the old bound,
    1% of the whole output's rms, failed ~1 run in 4 for every decode config)."""
    m = fp8_max(fp8_dtype)
    ref = ref.clamp(-m, m)
    mant = torch.finfo(fp8_dtype).nmant if hasattr(torch.finfo(fp8_dtype), "nmant") else 3
    tiny = torch.finfo(fp8_dtype).smallest_normal
    step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(tiny))) - mant)
    bad = (got - ref).abs() > step + 0.03 * ref.pow(2).mean(-1, keepdim=True).sqrt()
    assert not bad.any(), (f"{int(bad.sum())} fp8 outputs off by more than one step (seed {seed}); "
                           f"e.g. got {got[bad][:4].tolist()} want {ref[bad][:4].tolist()}")


def _check_paged(query_lens, context_lens, *, num_heads=4, num_kv_heads=2, head_size=64,
                 block_size=16, dtype=torch.float16, cache_dtype=None, layout="LHBNC",
                 interleaved_v=False, causal=True, sliding_window=-1, alibi=False, sinks=False,
                 softcap=0.0, out_fp8=False, num_splits=None, device="cpu", key_from_cache=False,
                 pad_rows=0, tol=None, decode_cfg=None, prefill_cfg=None, hints=False,
                 index_dtype=torch.int32, scale_mult=1.0, rescale_margin=None, kv_pad_nan=0):
    seed = _seed()
    fp8 = cache_dtype is not None and cache_dtype != dtype
    c = cases.make_paged_case(
        query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
        layout=layout, interleaved_v=interleaved_v, k_scale=0.07 if fp8 else 1.0,
        v_scale=0.05 if fp8 else 1.0, device=device, seed=seed,
    )
    g = torch.Generator().manual_seed(seed + 1)
    slopes, sink = _features(num_heads, alibi=alibi, sinks=sinks, device=device, g=g)
    scale = head_size ** -0.5 * scale_mult
    key, value = c.key, c.value
    if key_from_cache:  # prefill reads its new tokens from the cache as well
        from inductor_rocm_attn.kernels import reference as ref

        ref.reshape_and_cache(key, value, c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale,
                              interleaved_v)
        if fp8:  # what is read back is the rounded value
            pytest.skip("key=None with an fp8 cache: oracle would need requantised new tokens")
        key = value = None
    if kv_pad_nan:  # key/value rows past the batch (graph padding) may hold anything
        nan = torch.full((kv_pad_nan, *key.shape[1:]), float("nan"), dtype=key.dtype, device=device)
        key, value = torch.cat([key, nan]), torch.cat([value, nan])
    if index_dtype != torch.int32:
        c.query_start_loc, c.seq_lens, c.block_table = (
            x.to(index_dtype) for x in (c.query_start_loc, c.seq_lens, c.block_table))
    t = c.query.shape[0]
    query = c.query
    if pad_rows:  # rows past query_start_loc[-1] must stay untouched
        query = torch.cat([query, torch.randn(pad_rows, *query.shape[1:], device=device).to(dtype)])
    out_dtype = torch.float8_e4m3fn if out_fp8 else dtype
    out = cases.poison(torch.empty(query.shape, dtype=out_dtype, device=device))
    out_scale = torch.tensor([0.02], device=device) if out_fp8 else None
    paged_attention(
        out, query, key, value, c.kv_cache, c.query_start_loc, c.seq_lens, c.block_table, scale,
        c.k_scale, c.v_scale, causal, sliding_window, slopes, sink, softcap, interleaved_v,
        out_scale, num_splits=num_splits, decode_cfg=decode_cfg, prefill_cfg=prefill_cfg,
        rescale_margin=rescale_margin,
        **(dict(max_query_len=c.max_query_len, max_seq_len=c.max_seq_len) if hints else {}),
    )
    ref_out = cases.dense_oracle(c, scale=scale, causal=causal, sliding_window=sliding_window,
                                 alibi_slopes=slopes, sinks=sink, logits_soft_cap=softcap)
    got = out[:t].to(torch.float64).cpu()
    assert not torch.isnan(got).any(), f"unwritten or NaN output rows (seed {seed})"
    if out_fp8:
        _check_fp8_steps(got, ref_out / 0.02, out_dtype, seed)
        return 0.0
    err = cases.rel_err(got, ref_out)
    assert err < (tol or TOL[dtype]), f"rel err {err:.3e} (seed {seed})"
    if pad_rows:
        assert torch.isnan(out[t:].to(torch.float32)).all(), "padding rows were written"
    return err


# --- interpreter (CPU) matrix: each row covers several features at once --------------------

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
     dict(sliding_window=37, decode_cfg=(16, 4, 1, "rows3"), num_splits=2)),
    ("gqa8_d256_split", [1, 1, 5], [40, 17, 9],
     dict(num_heads=8, num_kv_heads=1, head_size=256, num_splits=2)),
    ("bs784_lbhnc", [1, 4], [790, 3],
     dict(num_heads=2, num_kv_heads=1, block_size=784, layout="LBHNC")),
    ("prefill_block_gather_path_with_hints", [6, 1, 9], [40, 33, 0],
     dict(prefill_cfg=(16, 32, 4, 1), hints=True, interleaved_v=True)),
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


@pytest.mark.parametrize("query_lens,context_lens,kw", [c[1:] for c in CPU_CASES],
                         ids=[c[0] for c in CPU_CASES])
def test_paged_attention_interpreter(query_lens, context_lens, kw):
    if torch.cuda.is_available():
        pytest.skip("interpreter matrix; the gpu tests cover CUDA")
    _check_paged(query_lens, context_lens, **kw)


@pytest.mark.parametrize("kind", ["streams", "streams3", "keys", "keys3"])
@pytest.mark.parametrize("query_lens,context_lens,kw", [c[1:] for c in CPU_CASES],
                         ids=[c[0] for c in CPU_CASES])
def test_paged_decode_variants_interpreter(query_lens, context_lens, kw, kind):
    """The other decode kinds over the same matrix: one stream per warp (2 streams of 16
    keys), keys-major (32-key tiles, 2 warps)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter matrix; the gpu tests cover CUDA")
    tile = kw.get("decode_cfg", (32,))[0]
    _check_paged(query_lens, context_lens, **{**kw, "decode_cfg": (max(tile, 32), 2, 1, kind)})


@pytest.mark.parametrize("kind", ["rows", "rows3"])
@pytest.mark.parametrize("query_lens,context_lens,kw", [c[1:] for c in CPU_CASES],
                         ids=[c[0] for c in CPU_CASES])
def test_paged_k_rows_interpreter(query_lens, context_lens, kw, kind):
    """16-key tiles (the GPU decode default; prefill context tiles too): each tile is one run
    of a block, so K is read as the page's packet rows (``PAGED_K_ROWS``) over the whole
    matrix: block sizes 16/32/544/784, head sizes with padding, fp32 (x=4) and fp8 (x=16)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter matrix; the gpu tests cover CUDA")
    assert sys.modules["inductor_rocm_attn.kernels.triton.paged_attention"].PAGED_K_ROWS
    _check_paged(query_lens, context_lens,
                 **{**kw, "decode_cfg": (16, 1, 1, kind), "prefill_cfg": (16, 16, 4, 1)})


@pytest.mark.parametrize("query_lens,context_lens,kw", [c[1:] for c in CPU_CASES],
                         ids=[c[0] for c in CPU_CASES])
def test_paged_k_rows_multi_run_interpreter(monkeypatch, query_lens, context_lens, kw):
    """K read as packet rows for tiles of several runs (level 2): 32-key decode tiles and
    32-key prefill context tiles, two runs over 16-token blocks (one over 32/544)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter matrix; the gpu tests cover CUDA")
    pa = sys.modules["inductor_rocm_attn.kernels.triton.paged_attention"]
    monkeypatch.setattr(pa, "PAGED_K_ROWS", 2)
    monkeypatch.setattr(pa, "PREFILL_K_ROWS", 2)
    _check_paged(query_lens, context_lens,
                 **{**kw, "decode_cfg": (32, 2, 1, "rows3"), "prefill_cfg": (16, 32, 4, 1)})


@pytest.mark.parametrize("margin", [0.0, 8.0])
@pytest.mark.parametrize("query_lens,context_lens,kw", [
    ([1, 1, 7], [90, 40, 50], dict(num_splits=2)),
    ([1, 9], [70, 33], dict(decode_cfg=(16, 4, 1, "rows3"), sinks=True, interleaved_v=True)),
    ([12, 1], [0, 100], dict(dtype=torch.float32, causal=False, alibi=True)),
], ids=["splits", "three_loops_sinks", "fp32_noncausal_alibi"])
def test_lazy_rescale_with_peaked_logits(query_lens, context_lens, kw, margin):
    """Logits 12x the usual spread (running maxima jump by far more than the margin from tile
    to tile, in both directions): the lazy rescale (margin 8, log2 units) must take its
    rescale branch exactly when needed; margin 0 is the rescale-every-tile update."""
    if torch.cuda.is_available():
        pytest.skip("interpreter matrix; the gpu tests cover CUDA")
    _check_paged(query_lens, context_lens, scale_mult=12.0, rescale_margin=margin, **kw)


@pytest.mark.parametrize("query_lens,context_lens,kw", [
    ([1, 40, 17, 33], [5, 0, 30, 9], dict(prefill_cfg=(16, 16, 4, 1))),
    ([23, 1, 64], [16, 7, 0], dict(prefill_cfg=(16, 32, 4, 1), sliding_window=19, sinks=True)),
])
@pytest.mark.parametrize("longest_first", [True, False], ids=["longest_first", "grid_order"])
def test_prefill_row_block_order(monkeypatch, longest_first, query_lens, context_lens, kw):
    """Causal row blocks run last-first within each sequence (PREFILL_LONGEST_FIRST) or in
    grid order: every row block is still computed once, also with uneven lengths and decode
    rows mixed in."""
    if torch.cuda.is_available():
        pytest.skip("interpreter matrix; the gpu tests cover CUDA")
    monkeypatch.setattr(sys.modules["inductor_rocm_attn.kernels.triton.paged_attention"],
                        "PREFILL_LONGEST_FIRST", longest_first)
    _check_paged(query_lens, context_lens, **kw)


@pytest.mark.parametrize("query_lens,context_lens,kw", [
    ([1, 40, 17, 33], [5, 0, 30, 9], dict(prefill_cfg=(16, 16, 4, 1), kv_pad_nan=5)),
    ([23, 1, 64], [16, 7, 0], dict(prefill_cfg=(16, 32, 4, 1), sliding_window=19, sinks=True,
                                   dtype=torch.float32, kv_pad_nan=3)),
    ([9, 30], [0, 4], dict(prefill_cfg=(16, 16, 4, 1), causal=False, alibi=True)),
])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_prefill_dense_paths(monkeypatch, tma, query_lens, context_lens, kw):
    """New tokens' K/V through tensor descriptors (PREFILL_DENSE_TMA) and through pointers
    (ROCm, odd strides): tiles reaching into the next sequence or the NaN padding after the
    batch stay out of the sums."""
    if torch.cuda.is_available():
        pytest.skip("interpreter matrix; the gpu tests cover CUDA")
    made = _spy_dense_descriptors(monkeypatch, tma)
    _check_paged(query_lens, context_lens, **kw)
    assert made and (made[-1] is not None) == tma, "the wrong K/V path was taken"


def _spy_dense_descriptors(monkeypatch, tma):
    """Set PREFILL_DENSE_TMA; the returned list collects what ``_dense_descriptors`` gave."""
    pa = sys.modules["inductor_rocm_attn.kernels.triton.paged_attention"]
    monkeypatch.setattr(pa, "PREFILL_DENSE_TMA", tma)
    made = []
    real = pa._dense_descriptors
    monkeypatch.setattr(pa, "_dense_descriptors", lambda *a: made.append(real(*a)) or made[-1])
    return made


@pytest.mark.parametrize("draw", range(4))
def test_paged_attention_interpreter_random(draw):
    """Fresh random geometry, features and batch each run (the seed is in the message)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter matrix; the gpu tests cover CUDA")
    seed = _seed()
    r = random.Random(seed)
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
        _check_paged(query_lens, context_lens, **kw)
    except Exception as e:  # any failure names its draw, so it can be replayed
        raise AssertionError(f"draw seed {seed}: {query_lens} {context_lens} {kw}: "
                             f"{type(e).__name__}: {e}") from e


ENC_CASES = [
    ("plain", dict()),
    ("causal_window_alibi_sinks_softcap", dict(causal=True, sliding_window=5, alibi=True,
                                                sinks=True, softcap=3.0)),
    ("noncausal_window_gqa", dict(sliding_window=4, num_kv_heads=1)),
    ("fp32_d256", dict(dtype=torch.float32, head_size=256)),
]
# The interpreter's fp32 -> fp8 cast is wrong where rounding carries into the exponent
# (1.98 -> 1.0, 31.9 -> 16 with triton 3.6): fused fp8 output quant is tested on the GPU only.
ENC_GPU_ONLY = [("fp8_out", dict(out_fp8=True))]


def _check_encoder(seq_lens, *, num_heads=4, num_kv_heads=2, head_size=80, dtype=torch.float16,
                   causal=False, sliding_window=-1, alibi=False, sinks=False, softcap=0.0,
                   out_fp8=False, device="cpu"):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0).tolist()), dtype=torch.int32)
    t = int(cu[-1])
    q = torch.randn(t, num_heads, head_size, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_size, generator=g).to(dtype)
    slopes, sink = _features(num_heads, alibi=alibi, sinks=sinks, g=g)
    scale = 0.9 * head_size ** -0.5
    ref = torch.zeros(t, num_heads, head_size, dtype=torch.float64)
    for s in range(len(seq_lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            ref[a:b] = cases.oracle_attention(
                q[a:b], k[a:b], v[a:b], q_start_pos=0, scale=scale, causal=causal,
                sliding_window=sliding_window, alibi_slopes=slopes, sinks=sink,
                logits_soft_cap=softcap)
    out_dtype = torch.float8_e4m3fn if out_fp8 else dtype
    out = cases.poison(torch.empty(q.shape, dtype=out_dtype, device=device))
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    out_scale = torch.tensor([0.02], device=device) if out_fp8 else None
    encoder_attention(out, dev(q), dev(k), dev(v), dev(cu), scale, causal, sliding_window,
                      dev(slopes), dev(sink), softcap, out_scale)
    got = out.to(torch.float64).cpu()
    assert not torch.isnan(got).any(), f"unwritten output (seed {seed})"
    if out_fp8:
        _check_fp8_steps(got, ref / 0.02, out_dtype, seed)
        return
    err = cases.rel_err(got, ref)
    assert err < TOL[dtype], f"rel err {err:.3e} (seed {seed})"


@pytest.mark.parametrize("kw", [c[1] for c in ENC_CASES], ids=[c[0] for c in ENC_CASES])
def test_encoder_attention_interpreter(kw):
    if torch.cuda.is_available():
        pytest.skip("interpreter matrix; the gpu tests cover CUDA")
    _check_encoder([7, 0, 23, 3], **kw)


def test_decode_config_rules():
    # measured entries (bf16, d=128, block 16): one warp for GQA 4 and for GQA 2 with
    # interleaved V (its V loaded as packets)
    assert decode_config(128, 4, 16, torch.bfloat16) == (16, 1, 3, "rows3")
    assert decode_config(128, 2, 16, torch.bfloat16, interleaved_v=True) == (16, 1, 3, "rows3")
    # one warp only where its [16, HEAD] tile fits the registers and was measured faster
    assert decode_config(64, 8, 32, torch.float16)[1] == 1
    assert decode_config(128, 32, 16, torch.bfloat16)[1] == 4  # 32 GQA rows
    assert decode_config(256, 4, 16, torch.bfloat16)[1] == 4  # d = 256
    assert decode_config(128, 4, 32, torch.float8_e4m3fn)[1] == 4  # fp8 cache
    assert decode_config(128, 4, 32, torch.bfloat16, interleaved_v=True)[1] == 1
    for cfg in (decode_config(h, g, 16, d) for h in (64, 128, 256) for g in (1, 8, 32)
                for d in (torch.bfloat16, torch.float8_e5m2)):
        assert cfg[3] in DECODE_KINDS


def test_unknown_decode_kind_is_an_error():
    c = cases.make_paged_case([1], [5], num_heads=2, num_kv_heads=1, head_size=64,
                              block_size=16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"paged_attention: decode kind 'bogus'.*streams"):
        paged_attention(torch.empty_like(c.query), c.query, c.key, c.value, c.kv_cache,
                        c.query_start_loc, c.seq_lens, c.block_table, 0.125, c.k_scale, c.v_scale,
                        True, -1, None, None, 0.0, False, None, decode_cfg=(16, 1, 1, "bogus"))


def test_num_kv_splits_from_shapes_only():
    # fills the GPU twice already: no split
    assert num_kv_splits(64, 8, 1, 4096, 132) == 1
    # one sequence: split, but never below MIN_SPLIT_TOKENS keys a split
    s = num_kv_splits(1, 8, 1, 4096, 132)
    assert 1 < s <= 4096 // MIN_SPLIT_TOKENS
    assert num_kv_splits(1, 8, 1, MIN_SPLIT_TOKENS, 132) == 1
    assert num_kv_splits(1, 1, 1, 1 << 20, 132) <= MAX_SPLITS


def test_short_splits_run_the_three_loop_config_as_one_loop(monkeypatch):
    """The heuristic's "rows3" runs as one masked loop when each split holds few tiles (B=1:
    64 splits), and as three loops otherwise; an explicit decode_cfg is taken as given."""
    pa = sys.modules["inductor_rocm_attn.kernels.triton.paged_attention"]
    launched = []

    class _Recorder:  # stands for a kernel: records the launch, runs nothing
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid, kw.get("ONE_LOOP")))

    monkeypatch.setattr(pa, "_interpret", lambda: False)
    monkeypatch.setattr(pa, "_num_sms", lambda index=0: 132)
    monkeypatch.setattr(pa, "_paged_decode_kernel", _Recorder())
    monkeypatch.setattr(pa, "_decode_reduce_kernel", _Recorder())

    def run(batch, ctx, **kw):
        launched.clear()
        q = torch.randn(batch, 32, 128, dtype=torch.bfloat16)
        cache = torch.empty(batch * ctx // 16, 2, 16, 8 * 128, dtype=torch.bfloat16)
        table = torch.arange(batch * ctx // 16, dtype=torch.int32).view(batch, -1)
        paged_attention(torch.empty_like(q), q, None, None, cache,
                        torch.arange(batch + 1, dtype=torch.int32),
                        torch.full((batch,), ctx, dtype=torch.int32), table, 0.1,
                        torch.ones(1), torch.ones(1), True, -1, None, None, 0.0, False, None,
                        1, ctx, **kw)
        (grid, one_loop), *_ = launched
        return grid[2], one_loop

    assert decode_config(128, 4, 16, torch.bfloat16)[3] == "rows3"
    splits, one_loop = run(1, 4096)
    assert splits == 64 and one_loop  # 4 tiles a split
    splits, one_loop = run(64, 4096)
    assert splits == 1 and not one_loop
    assert run(1, 4096, decode_cfg=(16, 1, 3, "rows3"))[1] is False


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
GPU_FEATURES = [
    ("plain", dict()),
    ("window_alibi", dict(sliding_window=300, alibi=True)),
    ("sinks_softcap_noncausal", dict(sinks=True, softcap=8.0, causal=False)),
    ("split", dict(num_splits=7)),
    ("three_loop_decode", dict(sliding_window=500, decode_cfg=(32, 4, 3, "rows3"))),
    ("one_warp_three_loop_decode", dict(sliding_window=500, decode_cfg=(16, 1, 3, "rows3"))),
    ("keys_major_decode_alibi_softcap", dict(sliding_window=500, alibi=True, softcap=8.0,
                                             decode_cfg=(16, 1, 3, "keys3"))),
    ("keys_major_one_loop_split_sinks", dict(sinks=True, num_splits=5,
                                             decode_cfg=(32, 2, 3, "keys"))),
    ("rows_decode_window_alibi", dict(sliding_window=300, alibi=True, decode_cfg=(64, 4, 3, "rows"))),
    ("streams_decode_window_alibi", dict(sliding_window=300, alibi=True,
                                         decode_cfg=(64, 4, 3, "streams3"))),
    ("streams_one_loop_split_sinks", dict(sinks=True, softcap=8.0, num_splits=5,
                                          decode_cfg=(32, 2, 3, "streams"))),
]


# every geometry x feature set in bf16, every geometry plain in fp16
GPU_MATRIX = [(g, f, torch.bfloat16) for g in GPU_CASES for f in GPU_FEATURES] + [
    (g, GPU_FEATURES[0], torch.float16) for g in GPU_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("geom,feat,dtype", [(g[1], f[1], d) for g, f, d in GPU_MATRIX],
                         ids=[f"{g[0]}-{f[0]}-{str(d)[6:]}" for g, f, d in GPU_MATRIX])
def test_paged_attention_gpu(geom, feat, dtype):
    # mixed batch: long and short decodes, prefills with and without a cached prefix
    _check_paged([1, 1, 300, 1, 77, 1], [2000, 15, 1200, 1, 0, 700], dtype=dtype, device=GPU,
                 **geom, **feat)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("interleaved_v", [False, True])
@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("decode_cfg", [None, (64, 4, 3, "rows"), (64, 4, 3, "streams3"),
                                        (32, 1, 3, "keys3")],
                         ids=["default", "rows", "streams3", "keys3"])
def test_paged_attention_gpu_fp8_cache(cache_dtype, interleaved_v, num_splits, decode_cfg):
    _check_paged([1, 130, 1], [1500, 400, 33], num_heads=32, num_kv_heads=8, head_size=128,
                 dtype=torch.bfloat16, cache_dtype=cache_dtype, interleaved_v=interleaved_v,
                 num_splits=num_splits, device=GPU, tol=2e-2, decode_cfg=decode_cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_attention_gpu_fp8_output(num_splits):
    _check_paged([1, 200, 1], [900, 300, 5], num_heads=16, num_kv_heads=4, head_size=128,
                 dtype=torch.bfloat16, out_fp8=True, num_splits=num_splits, device=GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kw", [
    dict(num_heads=32, num_kv_heads=8, head_size=128, kv_pad_nan=7),
    dict(num_heads=16, num_kv_heads=2, head_size=64, sliding_window=300, alibi=True,
         rescale_margin=8.0),
    dict(num_heads=8, num_kv_heads=8, head_size=128, sinks=True, softcap=8.0, causal=False,
         kv_pad_nan=3),
], ids=["gqa4_d128_nan_pad", "gqa8_d64_window_alibi_margin8", "mha_sinks_softcap_noncausal"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_prefill_dense_paths_gpu(monkeypatch, tma, dtype, kw):
    """The new tokens' K/V through TMA descriptors (PREFILL_DENSE_TMA) and through pointers."""
    if tma and not sys.modules["inductor_rocm_attn.kernels.triton.paged_attention"]._tma_capable(
            torch.cuda.current_device()):
        pytest.skip("TMA needs an NVIDIA GPU of sm_90 or newer")
    made = _spy_dense_descriptors(monkeypatch, tma)
    _check_paged([1, 300, 1, 77, 130], [2000, 1200, 1, 0, 5], dtype=dtype, device=GPU, **kw)
    assert made and (made[-1] is not None) == tma, "the wrong K/V path was taken"


@pytest.mark.gpu
def test_paged_attention_gpu_fp32_and_key_none():
    _check_paged([1, 40], [300, 90], num_heads=8, num_kv_heads=2, head_size=128,
                 dtype=torch.float32, device=GPU)
    _check_paged([1, 40, 3], [300, 90, 0], num_heads=8, num_kv_heads=2, head_size=128,
                 dtype=torch.bfloat16, device=GPU, key_from_cache=True, pad_rows=5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kw", [c[1] for c in ENC_CASES + ENC_GPU_ONLY if c[0] != "fp32_d256"],
                         ids=[c[0] for c in ENC_CASES + ENC_GPU_ONLY if c[0] != "fp32_d256"])
def test_encoder_attention_gpu(kw, dtype):
    _check_encoder([700, 1, 0, 333, 1030], dtype=dtype, device=GPU, head_size=128, **kw)
