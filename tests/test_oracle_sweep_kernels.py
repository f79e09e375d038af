"""Seeded random sweeps of the attention paths and the cache writers against the float64
oracles, row by row.

Each test draws fresh cases (a new seed every run, named in the failure message with the
draw: replay it with ``_draw_<name>(random.Random(seed))``), poisons every output first and
compares each (token, head) row with the oracle on its own (``cases.row_rel_err``), so one
wrong row among many right ones fails. What is drawn:

- the native decode kernels in the CPU emulation (csrc/emulate, as test_native_emulated.py
  builds and calls them; both warp widths and the tensor-core kernel): bf16/fp16 models,
  caches of the model dtype, of the other 16-bit dtype, fp8 e4m3/e5m2/e4m3fnuz with random
  scales (saturating ones too), LHBNC/LBHNC, standard/interleaved V, GQA 1..16, block 16/32,
  context lengths at block edges (1, block-1, block, block+1, ...), KV splits up to 64 (empty
  splits) merged by the reduce kernel or the last split, window, ALiBi, soft cap, sinks
  (a -inf sink among them), empty padding sequences, padding rows;
- the Triton paged_attention in its interpreter (fp16/fp32): mixed steps of decode, verify
  (2..8 query tokens) and prefill sequences, empty ones, with and without the launch
  hints, random decode / verify / prefill configs and split counts, windows that cross the
  prefix boundary, causal and not, ALiBi, soft cap, sinks, fp8 caches, key=None;
- the cache writers (reference, Triton, native emulation) against the independent oracles
  of writer_checks.py: RoPE neox and GPT-J, partial rotary, per-token cos/sin rows, QK-norm
  (transformers' and Gemma's), strided q/k/v, slots -1 and a shorter slot_mapping.

The ``Attention`` layer's sweep is test_oracle_sweep_layer.py.

Tolerances per row, from the unit roundoff u of the dtype the kernels round to (fp16
2^-11, bf16 2^-8): the output is rounded once and P once for the PV product, each moving
a row by at most u: fp16 3u (1.5e-3), bf16 2u (7.8e-3); fp32 1e-5 (fp32 arithmetic). A
cache of the other 16-bit dtype: the native tensor-core kernel computes in the cache's
dtype (an fp16 query rounded to bf16, csrc/paged_decode_mma.cuh), so bf16's bound, grown
with the logit scale (a logit moves by ~scale |q| |k| u). Measured worst rows over the
sweeps this file was cut from (1400 native, 460 Triton draws): bf16 2.8e-3, fp16 5.1e-4,
fp32 2.3e-6.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import cases
from inductor_rocm_attn.kernels import native
from inductor_rocm_attn.kernels import reference as ref
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, cache_x, is_fp8_dtype

E4M3, E5M2, E4M3NUZ = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz
U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 3 * U[torch.float16], torch.bfloat16: 2 * U[torch.bfloat16]}
ON_GPU = torch.cuda.is_available()


def _f32(x: float) -> float:
    """``x`` as the fp32 scale tensor holds it (the oracle multiplies by the same value)."""
    return float(torch.tensor(x, dtype=torch.float32))


def _replay(name, seed, draw, fn):
    try:
        return fn()
    except Exception as e:  # name the draw so it can be replayed
        raise AssertionError(f"{name} seed {seed}: {draw}: {type(e).__name__}: {e}") from e


def _assert_rows(got, want, tol, what=""):
    assert not torch.isnan(got.double()).any(), f"{what}unwritten or NaN output rows"
    err = cases.row_rel_err(got, want)
    worst = divmod(int(err.argmax()), err.shape[1])
    assert err.max() < tol, f"{what}row (token, head) {worst} rel err {err.max():.3e} > {tol:.2e}"


# --- the oracle's view of a case ----------------------------------------------------------------


def _read_cache(kv_cache, block, t, num_kv_heads, head_size, group):
    """Token ``t`` of ``block``, K (group 0) or standard V (1), ``[heads, D]``: the page read
    as a flat array with the design's interior formulas, apart from layout.py's views."""
    x = cache_x(kv_cache.dtype)
    page = kv_cache[block, group].reshape(-1)
    h = torch.arange(num_kv_heads)[:, None] * (head_size * kv_cache.shape[2])
    d = torch.arange(head_size)[None, :]
    bs = kv_cache.shape[2]
    return page[h + (d // x) * (bs * x) + t * x + d % x] if group == 0 else page[h + d * bs + t]


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cache_dtype", [None, torch.float16, torch.bfloat16, E4M3, E5M2],
                         ids=["auto", "fp16", "bf16", "e4m3", "e5m2"])
def test_case_oracle_holds_what_the_cache_holds(model_dtype, cache_dtype):
    """``cases.make_paged_case``'s dense K/V (what every attention oracle reads) are, for every
    cached token, exactly the cache's values dequantized; a prefill's new tokens are the
    step's k/v as given. (A cache of the other 16-bit dtype holds rounded values too.)"""
    seed = random.randrange(1 << 30)
    fp8 = cache_dtype is not None and is_fp8_dtype(cache_dtype)
    ks, vs = (_f32(random.uniform(0.02, 2)), _f32(random.uniform(0.02, 2))) if fp8 else (1.0, 1.0)
    c = cases.make_paged_case([1, 5, 1], [20, 17, 0], num_heads=4, num_kv_heads=2, head_size=64,
                              dtype=model_dtype, cache_dtype=cache_dtype, k_scale=ks, v_scale=vs, seed=seed)
    qsl = c.query_start_loc.tolist()
    for s, (ql, cl) in enumerate(zip(c.query_lens, c.context_lens)):
        cached = cl + ql if ql == 1 else cl  # a decode token is in the cache before attention
        for p in range(cl + ql):
            for group, full, scale in ((0, c.k_full[s], ks), (1, c.v_full[s], vs)):
                if p < cached:
                    blk = int(c.block_table[s, p // 16])
                    want = _read_cache(c.kv_cache, blk, p % 16, 2, 64, group).to(torch.float64) * (scale if fp8 else 1)
                else:
                    new = c.key if group == 0 else c.value
                    want = new[qsl[s] + p - cl].to(torch.float64)
                assert torch.equal(full[p], want), f"seq {s} pos {p} group {group}: oracle != cache (seed {seed})"


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, E4M3, E5M2, E4M3NUZ, torch.float8_e5m2fnuz],
                         ids=["fp16", "bf16", "e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"])
def test_writer_oracle_matches_the_reference_writer(cache_dtype):
    """The independent writer oracle (writer_checks.oracle_write: the design's page formulas,
    the fp8 quantization of every fp8 kind) and the reference writer (the other tests'
    oracle) store the same bytes, random scales (saturating ones too) and slots -1."""
    from writer_checks import oracle_write

    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    for interleaved in (False, True):
        cache = cases.poison(allocate_kv_cache(KVCacheSpec(16, 2, 64, cache_dtype, CacheLayout.LBHNC), 4))
        want = cache.clone()
        key, value = (torch.randn(30, 2, 64, generator=g).to(torch.float32) * 20 for _ in range(2))
        slots = torch.randperm(64, generator=g)[:30]
        slots[::7] = -1
        ks, vs = _f32(random.uniform(0.01, 2)), _f32(random.uniform(0.01, 2))
        ref.reshape_and_cache(key, value, cache, slots, torch.tensor([ks]), torch.tensor([vs]), interleaved)
        oracle_write(want, key, value, slots, ks, vs, interleaved)
        diff = (cache.view(torch.uint8) != want.view(torch.uint8)).sum().item()
        assert diff == 0, f"{diff} bytes differ (interleaved {interleaved}, seed {seed})"


# --- native decode in the CPU emulation ----------------------------------------------------------


def _draw_native(r: random.Random) -> dict:
    kv, gqa = r.choice([1, 1, 2, 3]), r.choice([1, 2, 3, 4, 5, 7, 8, 9, 12, 16])
    bs, d = r.choice([16, 32]), r.choice([64, 128])
    dtype = r.choice([torch.bfloat16, torch.float16])
    cache = r.choice([None, None, E4M3, E5M2, E4M3NUZ, "other16"])
    if cache == "other16":
        cache = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    edge = [1, 2, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs + 1, 3 * bs + 7]
    lens = [r.choice(edge) if r.random() < 0.6 else r.randint(1, 200) for _ in range(r.randint(1, 3))]
    longest = max(lens)
    draw = dict(lens=lens, num_heads=kv * gqa, num_kv_heads=kv, head_size=d, block_size=bs, dtype=dtype,
                cache_dtype=cache, layout=r.choice(["LHBNC", "LBHNC"]), interleaved_v=r.random() < 0.5,
                sliding_window=-1 if r.random() < 0.5 else r.choice([1, 2, bs, bs + 1, longest - 1 or 1, longest,
                                                                     r.randint(1, longest + 2)]),
                alibi=r.random() < 0.3, sinks=r.random() < 0.3, softcap=r.choice([0.0, 0.0, 0.0, 2.0, 30.0]),
                scale_mult=r.choice([1.0, 1.0, 0.1, 4.0]), index_dtype=r.choice([torch.int32, torch.int64]),
                pad_rows=r.choice([0, 0, 2]), empty_seq=r.random() < 0.2, seed=r.randrange(1 << 30))
    if cache is not None and is_fp8_dtype(cache):
        draw["k_scale"] = _f32(r.choice([0.07, 0.3, 1.0, 0.004, r.uniform(0.01, 2)]))  # 0.004: saturates
        draw["v_scale"] = _f32(r.choice([0.05, 0.5, 1.0, 0.003, r.uniform(0.01, 2)]))
    warp, tc = r.choice([(32, False), (64, False), (32, True)])
    plan = dict(warp=warp, tensor_cores=tc, split_merge=r.choice(["reduce", "last_split"]),
                num_sms=r.choice([8, 132]), max_seq_len=r.choice([None, longest, longest + r.randint(0, 500)]))
    if r.random() < 0.6:
        plan["num_splits"] = r.choice([1, 2, 3, 5, 8, 9, 13, 33, 64])  # more than tiles: empty splits
    eb = (cache or dtype).itemsize
    fits = [(w, st) for w in (1, 2, 4) for st in (2, 3, 4)
            if native.decode_smem_bytes(d, eb, native.heads_per_cta(gqa), w, st) <= 227 << 10]
    if r.random() < 0.4:
        plan["num_warps"], plan["stages"] = r.choice(fits)
    draw["plan"] = plan
    return draw


def _native_tol(dw):
    dtype, cache = dw["dtype"], dw["cache_dtype"]
    if cache in (torch.float16, torch.bfloat16) and cache != dtype:
        # the tensor-core kernel rounds an fp16 query to bf16: each logit moves by up to
        # ~u |scale q . k|, an error that grows with the logit scale (measured on the mma kernel,
        # 40 draws each: scale x0.1 1.7e-3, x1 4.5e-3, x4 1.3e-2; the CUDA-core kernel 2.5e-4)
        return KERNEL_TOL[torch.bfloat16] * (1 + dw["scale_mult"])
    return KERNEL_TOL[dtype]


def _run_native(dw):
    from test_native_emulated import emulated_decode

    nh, nkv, d, dtype = dw["num_heads"], dw["num_kv_heads"], dw["head_size"], dw["dtype"]
    qlens, clens = [1] * len(dw["lens"]), [n - 1 for n in dw["lens"]]
    if dw["empty_seq"]:  # a padding sequence of a whole-step graph: no query, no keys
        qlens.insert(1, 0)
        clens.insert(1, 0)
    seed = dw["seed"]
    c = cases.make_paged_case(qlens, clens, num_heads=nh, num_kv_heads=nkv, head_size=d,
                              block_size=dw["block_size"], dtype=dtype, cache_dtype=dw["cache_dtype"],
                              layout=dw["layout"], interleaved_v=dw["interleaved_v"],
                              k_scale=dw.get("k_scale", 1.0), v_scale=dw.get("v_scale", 1.0), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    slopes = torch.rand(nh, generator=g) * 0.5 if dw["alibi"] else None
    sink = torch.randn(nh, generator=g) * 2 if dw["sinks"] else None
    if sink is not None and nh > 1:
        sink[-1] = float("-inf")  # no sink for that head
    scale = d ** -0.5 * dw["scale_mult"]
    qsl, sl, bt = (x.to(dw["index_dtype"]) for x in (c.query_start_loc, c.seq_lens, c.block_table))
    t, pad = c.query.shape[0], dw["pad_rows"]
    query = torch.cat([c.query, torch.randn(pad, nh, d, generator=g).to(dtype)]) if pad else c.query
    out = cases.poison(torch.empty_like(query))
    emulated_decode(out, query, c.kv_cache, qsl, sl, bt, scale, c.k_scale, c.v_scale, dw["sliding_window"],
                    slopes, sink, dw["softcap"], dw["interleaved_v"], **dw["plan"])
    want = cases.dense_oracle(c, scale=scale, causal=True, sliding_window=dw["sliding_window"],
                              alibi_slopes=slopes, sinks=sink, logits_soft_cap=dw["softcap"])
    if pad:
        assert torch.isnan(out[t:].float()).all(), "rows past the batch were written"
    _assert_rows(out[:t], want, _native_tol(dw))


@pytest.mark.parametrize("draw", range(24))
def test_native_decode_emulated_sweep(draw):
    import test_native_emulated

    if test_native_emulated.CXX is None:
        pytest.skip("no host C++ compiler (g++) for the CPU emulation")
    seed = random.randrange(1 << 30)
    dw = _draw_native(random.Random(seed))
    _replay("native decode", seed, dw, lambda: _run_native(dw))


# --- Triton paged_attention (interpreter on CPU) ---------------------------------------------------


def _draw_triton(r: random.Random) -> dict:
    from inductor_rocm_attn.kernels.triton.configs import DecodeConfig, PrefillConfig

    kinds = ("streams", "streams3", "rows", "rows3", "keys", "keys3")

    def decode_cfg(verify):
        kind = r.choice(kinds[2:4] if verify else kinds)
        tile = r.choice([16, 32, 64])
        warps = min(r.choice([1, 2, 4]), tile // 16) if kind.startswith("streams") else r.choice([1, 2, 4])
        merges = ["auto", "reduce"] + ([] if kind.startswith("streams") else ["last_split"])
        return DecodeConfig(tile, warps, r.choice([1, 2, 3]), kind, k_rows=r.choice([0, 1, 2]),
                            rescale_margin=r.choice([0.0, 8.0]), one_loop_max_tiles=r.choice([0, 8]),
                            split_merge=r.choice(merges))

    kv, gqa, bs, d = r.choice([1, 2]), r.choice([1, 2, 3, 4, 8]), r.choice([16, 32]), r.choice([32, 64])
    dtype = r.choice([torch.float16, torch.float16, torch.float32])
    cache = r.choice([None, None, None, E4M3, E5M2])
    qlens, clens = [], []
    for _ in range(r.randint(1, 4)):
        kind = r.choice(["decode", "verify", "verify", "prefill", "empty"])
        qlens.append({"decode": 1, "verify": r.randint(2, 8), "prefill": r.randint(9, 24), "empty": 0}[kind])
        clens.append(r.choice([0, 1, bs - 1, bs, bs + 1, 2 * bs + 3]) if r.random() < 0.5 else r.randint(0, 90))
    if sum(qlens) == 0:
        qlens[0] = 1
    longest = max(q + c for q, c in zip(qlens, clens))
    draw = dict(query_lens=qlens, context_lens=clens, num_heads=kv * gqa, num_kv_heads=kv, head_size=d,
                block_size=bs, dtype=dtype, cache_dtype=cache, layout=r.choice(["LHBNC", "LBHNC"]),
                interleaved_v=r.random() < 0.5, causal=r.random() < 0.7,
                # windows of a few tokens cross the boundary between the prefix and the new tokens
                sliding_window=-1 if r.random() < 0.5 else r.choice([1, 2, 3, 5, 8, bs, bs + 1,
                                                                     r.randint(1, longest + 2)]),
                alibi=r.random() < 0.3, sinks=r.random() < 0.3, softcap=r.choice([0.0, 0.0, 0.0, 3.0]),
                scale_mult=r.choice([1.0, 1.0, 0.2, 3.0]), key_from_cache=r.random() < 0.2,
                pad_rows=r.choice([0, 0, 3]), index_dtype=r.choice([torch.int32, torch.int64]),
                seed=r.randrange(1 << 30))
    if cache is not None:
        draw["k_scale"] = _f32(r.choice([0.07, 0.5, 1.0, 0.004, r.uniform(0.01, 2)]))
        draw["v_scale"] = _f32(r.choice([0.05, 0.5, 1.0, 0.003, r.uniform(0.01, 2)]))
    knobs = {}
    if r.random() < 0.75:
        knobs.update(max_query_len=max(qlens) + r.choice([0, 0, 1, 5]), max_seq_len=longest + r.choice([0, 100]))
    if r.random() < 0.5:
        knobs["num_splits"] = r.choice([1, 2, 3, 5, 9])
    if r.random() < 0.6:
        knobs["decode_cfg"] = decode_cfg(verify=False)
    if r.random() < 0.4:
        knobs["verify_cfg"] = decode_cfg(verify=True)
    if r.random() < 0.3:
        knobs["verify_max_query_len"] = r.choice([1, 2, 4, 8])
    if r.random() < 0.4:
        knobs["prefill_cfg"] = PrefillConfig(
            r.choice([16, 32]), r.choice([16, 32]), r.choice([1, 2, 4]), r.choice([1, 2]), k_rows=r.choice([0, 1, 2]),
            context_margin=r.choice([0.0, 8.0]), dense_margin=r.choice([0.0, 8.0]), longest_first=r.random() < 0.5,
            dense_tma=r.random() < 0.5)
    draw["knobs"] = knobs
    return draw


def _run_triton(dw):
    import importlib

    launcher = importlib.import_module("inductor_rocm_attn.kernels.triton.paged_attention")
    qlens, clens = dw["query_lens"], dw["context_lens"]
    nh, nkv, d, dtype, cache = dw["num_heads"], dw["num_kv_heads"], dw["head_size"], dw["dtype"], dw["cache_dtype"]
    ks, vs = dw.get("k_scale", 1.0), dw.get("v_scale", 1.0)
    seed = dw["seed"]
    c = cases.make_paged_case(qlens, clens, num_heads=nh, num_kv_heads=nkv, head_size=d,
                              block_size=dw["block_size"], dtype=dtype, cache_dtype=cache, layout=dw["layout"],
                              interleaved_v=dw["interleaved_v"], k_scale=ks, v_scale=vs, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    slopes = torch.rand(nh, generator=g) * 0.5 if dw["alibi"] else None
    sink = torch.randn(nh, generator=g) * 2 if dw["sinks"] else None
    scale = d ** -0.5 * dw["scale_mult"]
    key, value = c.key, c.value
    if dw["key_from_cache"]:  # the prefills read their new tokens from the cache too
        ref.reshape_and_cache(key, value, c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale, dw["interleaved_v"])
        key = value = None
        if cache is not None:  # read back rounded
            m = torch.finfo(cache).max
            for s, (ql, cl) in enumerate(zip(qlens, clens)):
                if ql > 1:
                    for full, sc in ((c.k_full[s], ks), (c.v_full[s], vs)):
                        full[cl:] = (full[cl:] / sc).clamp(-m, m).to(cache).double() * sc
    t, pad = c.query.shape[0], dw["pad_rows"]
    query = c.query
    if pad:
        query = torch.cat([query, torch.randn(pad, nh, d, generator=g).to(dtype)])
        if key is not None:  # padding K/V rows may hold anything
            nan = torch.full((pad, nkv, d), float("nan"), dtype=dtype)
            key, value = torch.cat([key, nan]), torch.cat([value, nan])
    guarded = cases.Guarded(query.shape, dtype)
    out = guarded.t
    qsl, sl, bt = (x.to(dw["index_dtype"]) for x in (c.query_start_loc, c.seq_lens, c.block_table))
    launcher.paged_attention(out, query, key, value, c.kv_cache, qsl, sl, bt, scale, c.k_scale, c.v_scale,
                             dw["causal"], dw["sliding_window"], slopes, sink, dw["softcap"], dw["interleaved_v"],
                             None, **dw["knobs"])
    guarded.assert_intact()
    if pad:
        assert torch.isnan(out[t:].float()).all(), "rows past the batch were written"
    want = cases.dense_oracle(c, scale=scale, causal=dw["causal"], sliding_window=dw["sliding_window"],
                              alibi_slopes=slopes, sinks=sink, logits_soft_cap=dw["softcap"])
    _assert_rows(out[:t], want, KERNEL_TOL[dtype])


@pytest.mark.skipif(ON_GPU, reason="the Triton interpreter sweep runs on CPU")
@pytest.mark.parametrize("draw", range(12))
def test_triton_paged_attention_sweep(draw):
    import attention_checks  # noqa: F401  (the interpreter's loop-bound fix)

    seed = random.randrange(1 << 30)
    dw = _draw_triton(random.Random(seed))
    _replay("triton paged_attention", seed, dw, lambda: _run_triton(dw))


# --- cache writers ---------------------------------------------------------------------------------


def _draw_writer(r: random.Random) -> dict:
    provider = r.choice(["reference", "triton", "native"])
    ops = ["reshape_and_cache", "rope_and_cache", "qk_norm_rope_and_cache", "rope_cos_sin_and_cache",
           "qk_norm_rope_cos_sin_and_cache", "rotary_embedding"]
    op = "reshape_and_cache" if provider == "native" else r.choice(ops)
    dtype = r.choice([torch.float16, torch.float32] + ([] if provider == "triton" else [torch.bfloat16]))
    cache = r.choice([None, None, E4M3, E5M2])
    if provider == "native" and (cache is None and dtype == torch.float32 or r.random() < 0.3):
        cache = r.choice([torch.float16, torch.bfloat16, E4M3NUZ])
    if provider == "triton" and op != "reshape_and_cache":
        cache = None  # the interpreter's fp32 -> fp8 cast rounds wrongly at binade boundaries
    d = r.choice([64, 128, 256, 32] if provider == "native" else [32, 64, 80, 128])
    hkv = r.choice([1, 2, 3])
    t = r.randint(1, 40)
    return dict(provider=provider, op=op, dtype=dtype, cache=cache, head_size=d, num_kv_heads=hkv,
                num_heads=hkv * r.choice([1, 2, 4]), block_size=r.choice([16, 32, 48]), num_tokens=t,
                layout=r.choice(list(CacheLayout)), interleaved_v=r.random() < 0.5, neox=r.random() < 0.5,
                rot=r.choice([d, d, d // 2, 16]), num_slots=r.choice([t, t, max(0, t - r.randint(0, 3))]),
                pad=r.random() < 0.5, k_scale=_f32(r.choice([0.5, 1.0, 0.07, r.uniform(0.01, 3)])),
                v_scale=_f32(r.choice([2.0, 1.0, 0.05, r.uniform(0.01, 3)])), eps=r.choice([1e-6, 1e-5, 0.1]),
                strided=r.random() < 0.5, gemma=r.random() < 0.3, flat=r.random() < 0.5,
                block_t=r.choice([None, 1, 2, 4, 8, 16]), magnitude=r.choice([1.0, 1.0, 30.0, 0.01]),
                fp32_table=r.random() < 0.5, seed=r.randrange(1 << 30),
                native_variant=r.choice([None, *native.WRITER_VARIANTS]))


def _within_rounding(got, exact, dtype, what, inputs, gain, extra=0.0):
    """Every element within one ulp of the exact value (one rounding: half an ulp, the rest
    for the fp32 arithmetic), plus the fp32 arithmetic's error under cancellation: 8 fp32
    ulps of the terms' size (each head row's largest input times ``gain`` = |cos| + |sin|)."""
    got, exact = got.double().cpu(), exact.double().cpu()
    eps = 2 * {torch.float32: 2.0 ** -24, **U}[dtype]
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(torch.finfo(dtype).tiny)))) * eps
    slack = 8 * 2.0 ** -24 * gain * inputs.double().abs().amax(-1, keepdim=True)
    bad = (got - exact).abs() > ulp + slack + extra
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements beyond one rounding, e.g. got "
                           f"{got[bad][:3].tolist()} want {exact[bad][:3].tolist()}")


def _run_writer(dw):
    import providers_under_test as put
    from test_rope_cos_sin_and_cache import oracle_rope_rows
    from writer_checks import assert_cache_equal, make_cos_sin, oracle_rms_norm, oracle_rope, oracle_write

    g = torch.Generator().manual_seed(dw["seed"])
    provider, op, dtype = dw["provider"], dw["op"], dw["dtype"]
    d, hq, hkv, t, bs = dw["head_size"], dw["num_heads"], dw["num_kv_heads"], dw["num_tokens"], dw["block_size"]
    cache_dtype = dw["cache"] or dtype
    num_blocks = math.ceil(t / bs) + 2
    cache = cases.poison(allocate_kv_cache(KVCacheSpec(bs, hkv, d, cache_dtype, dw["layout"]), num_blocks))
    slots = torch.randperm(num_blocks * bs, generator=g)[: dw["num_slots"]]
    if dw["pad"] and len(slots) > 1:
        slots[torch.randperm(len(slots), generator=g)[: len(slots) // 3 or 1]] = -1
    slots = slots.to(torch.int32 if dw["seed"] % 3 == 0 else torch.int64)
    ks_f, vs_f = dw["k_scale"], dw["v_scale"]
    base = torch.randn(t, hq + 2 * hkv + 1, d, generator=g) * dw["magnitude"]
    if provider == "triton" and is_fp8_dtype(cache_dtype):
        # values exact as fp8 * scale (powers-of-two scales): the interpreter's fp8 rounding is wrong
        ks_f, vs_f = 0.5, 2.0
        e = (base * 8).to(cache_dtype).float()
        base = torch.cat([e[:, :hq + hkv] * ks_f, e[:, hq + hkv:] * vs_f], 1)
    ks, vs = torch.tensor([ks_f]), torch.tensor([vs_f])
    base = base.to(dtype)
    q, k, v = base[:, :hq], base[:, hq:hq + hkv], base[:, hq + hkv:hq + 2 * hkv]
    if not dw["strided"]:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    il, neox = dw["interleaved_v"], dw["neox"]
    before = cache.clone()

    def check_cache(k_stored):
        want = before.clone()
        oracle_write(want, k_stored, v, slots.long(), ks_f, vs_f, il)
        assert_cache_equal(cache, want, cache_dtype, exact=True)

    kw = {"cfg": __import__("inductor_rocm_attn.kernels.triton.configs", fromlist=["WriterConfig"]).WriterConfig(
        dw["block_t"])} if provider == "triton" and dw["block_t"] else {}
    if op == "reshape_and_cache":
        if provider == "native":
            from test_native_emulated import emulated_write

            emulated_write(k, v, cache, slots, ks, vs, il, variant=dw["native_variant"])
        else:
            put.load(provider, op)(k, v, cache, slots, ks, vs, il)
        check_cache(k)
        return
    fn = put.load(provider, op)
    pos = torch.randint(0, 300, (t,), generator=g)
    if op in ("rotary_embedding", "rope_and_cache", "qk_norm_rope_and_cache"):
        cs = make_cos_sin(301, dw["rot"], torch.float32 if dw["fp32_table"] else dtype)
        if op != "qk_norm_rope_and_cache":
            cs = cs.to(dtype)
    if op == "rotary_embedding":
        q0, k0 = q.clone(), k.clone()
        fn(pos, q.reshape(t, hq * d) if dw["flat"] and not dw["strided"] else q,
           k.reshape(t, hkv * d) if dw["flat"] and not dw["strided"] else k, d, cs, neox, **kw)
        _within_rounding(q, oracle_rope(q0, pos, cs, neox), dtype, "q", q0, 2.0)
        _within_rounding(k, oracle_rope(k0, pos, cs, neox), dtype, "k", k0, 2.0)
        return
    if op == "rope_and_cache":
        q0, k0 = q.clone(), k.clone()
        fn(pos, q, k, v, cache, slots, cs, neox, ks, vs, il, **kw)
        _within_rounding(q, oracle_rope(q0, pos, cs, neox), dtype, "q", q0, 2.0)
        _within_rounding(k, oracle_rope(k0, pos, cs, neox), dtype, "k", k0, 2.0)
        check_cache(k)
        return
    if op == "qk_norm_rope_and_cache":
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], 1)
        qw = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
        kw_ = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
        q_out = cases.poison(torch.empty(t, hq, d, dtype=dtype))
        k_out = cases.poison(torch.empty(t, hkv, d, dtype=dtype))
        fn(qkv, qw, kw_, dw["eps"], pos, cs, neox, cache, slots, ks, vs, il, hq, hkv, d, q_out, k_out, False, **kw)
        for name, got, x, w in (("q", q_out, q, qw), ("k", k_out, k, kw_)):
            normed = oracle_rms_norm(x, w, dw["eps"])
            _within_rounding(got, oracle_rope(normed, pos, cs, neox), dtype, name, normed, 2.0)
        check_cache(k_out)
        return
    rot = dw["rot"]  # per-token cos/sin: random rows, applied channel for channel
    cos, sin = torch.randn(t, rot, generator=g).to(dtype), torch.randn(t, 2 * rot, generator=g).to(dtype)[:, ::2]
    gain = float(cos.abs().max() + sin.abs().max())
    q0, k0 = q.clone(), k.clone()
    extra = 0.0
    if op == "rope_cos_sin_and_cache":
        fn(q, k, v, cos, sin, neox, cache, slots, ks, vs, il, **kw)
        nq, nk = q0.double(), k0.double()
    else:
        off = 0.0 if dw["gemma"] else 1.0
        qw = (off + 0.3 * torch.randn(d, generator=g)).to(dtype)
        kw_ = (off + 0.3 * torch.randn(d, generator=g)).to(dtype)
        fn(q, k, v, qw, kw_, dw["eps"], cos, sin, neox, cache, slots, ks, vs, il, dw["gemma"], **kw)
        norm = ref.rms_norm_heads_gemma if dw["gemma"] else ref.rms_norm_heads_rounded
        nq, nk = norm(q0.double(), qw, dw["eps"], dtype), norm(k0.double(), kw_, dw["eps"], dtype)
        if dtype != torch.float32:
            # the norm's one rounding (fp32 statistics against float64 ones) may flip an ulp
            extra = 2 * U[dtype] * max(nq.abs().max().item(), nk.abs().max().item()) * gain
    _within_rounding(q, oracle_rope_rows(nq, cos, sin, neox), dtype, "q", nq, gain, extra)
    _within_rounding(k, oracle_rope_rows(nk, cos, sin, neox), dtype, "k", nk, gain, extra)
    check_cache(k)


@pytest.mark.parametrize("draw", range(16))
def test_cache_writers_sweep(draw):
    import attention_checks  # noqa: F401  (the interpreter's loop-bound fix)
    import providers_under_test as put
    import test_native_emulated

    seed = random.randrange(1 << 30)
    dw = _draw_writer(random.Random(seed))
    if dw["provider"] == "triton" and not put.INTERPRETER:
        pytest.skip("the Triton writers run here in the interpreter (CPU) only")
    if dw["provider"] == "native" and test_native_emulated.CXX is None:
        pytest.skip("no host C++ compiler (g++) for the CPU emulation")
    _replay("cache writer", seed, dw, lambda: _run_writer(dw))
