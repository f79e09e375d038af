"""``rope_cos_sin_and_cache`` and ``qk_norm_rope_cos_sin_and_cache`` (RoPE with the model's
per-token cos/sin, optionally after transformers' per-head RMSNorm, on q/k in place + the
cache write) of every provider against float64 oracles written here: rotated q/k within the
model dtype's rounding, every cache byte within one rounding step (poison included).

cos/sin are random rows (not ``cat(f, f)`` of angles): the ops apply
``x * cos + rotate(x) * sin`` channel for channel, whatever the rows hold.
"""

from __future__ import annotations

import pytest
import torch

import inductor_rocm_attn as ira
import providers_under_test as put
from cases import poison, rel_err
from inductor_rocm_attn.kernels.triton.configs import WriterConfig
from inductor_rocm_attn.layout import CacheLayout, dense_kv
from writer_checks import (
    DEV, FP8, GPU_DTYPES, GPU_GEOMETRY, PREFILL_TILES, assert_cache_equal, cache_query, gen, make_cache,
    oracle_write, pad_slots, prefill_case, scales,
)

OPS = ("rope_cos_sin_and_cache", "qk_norm_rope_cos_sin_and_cache")
CASES = [
    # block, head, rot, layout, interleaved, neox, dtype, q/k form
    (16, 64, 64, CacheLayout.LHBNC, True, True, torch.float16, "heads"),
    (32, 128, 64, CacheLayout.LBHNC, False, False, torch.float16, "flat"),
    (544, 80, 80, CacheLayout.LHBNC, False, True, torch.float32, "flat"),
    (16, 256, 256, CacheLayout.LBHNC, True, False, torch.float16, "heads"),
    (544, 128, 128, CacheLayout.LBHNC, True, True, torch.float32, "heads"),
    # Gemma4's full layers: cos/sin over the whole 512 (1 and 0 past the rotated quarter)
    (32, 512, 512, CacheLayout.LHBNC, False, True, torch.float32, "heads"),
]


def _params(op):
    return [(p, op) for p in put.providers_for(op)]


ALL = [x for op in OPS for x in _params(op)]


def _kernel(provider, op, cache, dtype, head_size, rot_dim, interleaved_v):
    return put.kernel(provider, op, device=DEV, dtype=dtype, head_size=head_size,
                      features=("partial_rotary",) if rot_dim < head_size else (),
                      **cache_query(cache, dtype, interleaved_v))


def oracle_rope_rows(x, cos, sin, is_neox):
    """``x [T, H, D]`` float64 with channel pairs (NeoX: i, i + rot/2; GPT-J: 2i, 2i + 1)
    turned with the cos/sin of each channel's own column: ``a' = a cos_a - b sin_a``,
    ``b' = b cos_b + a sin_b``; channels past ``rot`` unchanged."""
    x = x.to(torch.float64).clone()
    c, s = cos.cpu().to(torch.float64)[:, None, :], sin.cpu().to(torch.float64)[:, None, :]
    half = cos.shape[-1] // 2
    i1 = torch.arange(half) if is_neox else torch.arange(0, 2 * half, 2)
    i2 = i1 + half if is_neox else i1 + 1
    a, b = x[..., i1].clone(), x[..., i2].clone()
    x[..., i1] = a * c[..., i1] - b * s[..., i1]
    x[..., i2] = b * c[..., i2] + a * s[..., i2]
    return x


def oracle_norm(x, w, eps, dtype):
    """transformers' RMSNorm: float64 statistics, normalized value rounded to ``dtype``, then ``w``."""
    x = x.to(torch.float64)
    n = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).to(torch.float64)
    return n * w.cpu().to(torch.float64)


def make_qk(t, hq, hkv, d, dtype, seed, form):
    """q/k/v as strided views of one tensor: ``heads`` = ``[T, H, D]`` head-strided views of a
    ``[T, Hq + 2 Hkv + 1, D]`` tensor; ``flat`` = ``[T, H * D]`` column slices of a padded
    fused ``[T, (Hq + 2 Hkv) D + 8]`` tensor. Returns (base, q, k, v [T, Hkv, D])."""
    g = gen(seed)
    if form == "heads":
        base = torch.randn(t, hq + 2 * hkv + 1, d, generator=g).to(dtype).to(DEV)
        return base, base[:, :hq], base[:, hq:hq + hkv], base[:, hq + hkv:hq + 2 * hkv]
    base = torch.randn(t, (hq + 2 * hkv) * d + 8, generator=g).to(dtype).to(DEV)
    q, k = base[:, : hq * d], base[:, hq * d: (hq + hkv) * d]
    return base, q, k, base[:, (hq + hkv) * d: (hq + 2 * hkv) * d].view(t, hkv, d)


def make_rows(t, rot, dtype, seed):
    """cos/sin ``[T, rot]``: random rows, strided (columns of a ``[T, 2, rot]`` tensor)."""
    cs = torch.randn(t, 2, rot, generator=gen(seed)).to(dtype).to(DEV)
    return cs[:, 0], cs[:, 1]


def _exact_fraction(x, want):
    return (x.cpu() == want).double().mean().item()


def _run(fn, op, q, k, v, w, cos, sin, is_neox, cache, slots, ks, vs, interleaved_v, eps=1e-6):
    if op == "rope_cos_sin_and_cache":
        fn(q, k, v, cos, sin, is_neox, cache, slots, ks, vs, interleaved_v)
    else:
        fn(q, k, v, w[0], w[1], eps, cos, sin, is_neox, cache, slots, ks, vs, interleaved_v)


def _expect(op, q, k, v, w, cos, sin, is_neox, cache, slots, ks, vs, interleaved_v, eps=1e-6):
    """(q, k) ``[T, H, D]`` after the op, and into the CPU ``cache`` what it writes."""
    t, d, dtype = v.shape[0], v.shape[2], v.dtype
    out = []
    for x, wi in ((q, 0), (k, 1)):
        x = x.cpu().reshape(t, -1, d).to(torch.float64)
        if op != "rope_cos_sin_and_cache":
            x = oracle_norm(x, w[wi], eps, dtype)
        out.append(oracle_rope_rows(x, cos, sin, is_neox).to(dtype))
    oracle_write(cache, out[1], v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    return out


@pytest.mark.parametrize("block_size,head_size,rot_dim,layout,interleaved_v,is_neox,dtype,form", CASES)
@pytest.mark.parametrize("provider,op", ALL)
def test_writer(provider, op, block_size, head_size, rot_dim, layout, interleaved_v, is_neox, dtype, form):
    t, hq, hkv = 9, 4, 2
    seed = block_size + head_size + rot_dim
    cache, slots = make_cache(block_size, hkv, head_size, dtype, layout, t, seed)
    fn = _kernel(provider, op, cache, dtype, head_size, rot_dim, interleaved_v)
    cache_in = cache.cpu().clone()
    cache_want = cache_in.clone()
    base, q, k, v = make_qk(t, hq, hkv, head_size, dtype, seed, form)
    base_in = base.cpu().clone()
    w = (1 + 0.1 * torch.randn(2, head_size, generator=gen(seed + 1))).to(dtype).to(DEV)
    cos, sin = make_rows(t, rot_dim, dtype, seed + 2)
    slots = pad_slots(slots)[: t - 2].to(DEV)
    ks, vs = scales(dtype)
    qe, ke = _expect(op, q, k, v, w, cos, sin, is_neox, cache_want, slots, ks, vs, interleaved_v)
    _run(fn, op, q, k, v, w, cos, sin, is_neox, cache, slots, ks, vs, interleaved_v)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-6)
    q, k = q.reshape(t, hq, head_size), k.reshape(t, hkv, head_size)
    assert rel_err(q, qe) < tol and rel_err(k, ke) < tol
    if dtype != torch.float32:
        # Rounded where the function rounds: (almost) every element is the oracle's exactly.
        # (The norm rounded once less matches about 2/3 of fp16 elements.)
        assert min(_exact_fraction(q, qe), _exact_fraction(k, ke)) > 0.99
    # v and everything outside q and k untouched
    qk_mask = torch.zeros_like(base_in, dtype=torch.bool)
    if form == "heads":
        qk_mask[:, : hq + hkv] = True
    else:
        qk_mask[:, : (hq + hkv) * head_size] = True
    assert torch.equal(base.cpu()[~qk_mask], base_in[~qk_mask])
    # A model-dtype cache holds exactly the k the op returned (and v): bit for bit.
    cache_op = cache_in.clone()
    oracle_write(cache_op, k.cpu(), v.cpu().reshape(t, hkv, head_size), slots.cpu(), ks.cpu(), vs.cpu(),
                 interleaved_v)
    assert_cache_equal(cache.cpu(), cache_op, dtype)


def oracle_norm_gemma(x, w, eps, dtype):
    """Gemma's RMSNorm: float64 statistics, times ``1 + w``, rounded to ``dtype`` once."""
    x = x.to(torch.float64)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.cpu().to(torch.float64))).to(dtype)


GEMMA_CASES = [c for c in CASES if c[6] != torch.float32] + [CASES[2]]


def _norm_writer_case(provider, block_size, head_size, rot_dim, layout, interleaved_v, dtype, form, seed_mult,
                      weights):
    """A QK-norm writer case of 9 tokens, 4 query / 2 KV heads: the kernel, a poisoned cache and
    its copy, q/k/v of ``form``, per-head weights (``weights``: "0.3" small offsets as Gemma
    stores them, "1 + 0.5" far from 1), per-token cos/sin, padded slots and scales."""
    t, hq, hkv, eps = 9, 4, 2, 1e-6
    seed = seed_mult * block_size + head_size + rot_dim
    cache, slots = make_cache(block_size, hkv, head_size, dtype, layout, t, seed)
    fn = _kernel(provider, "qk_norm_rope_cos_sin_and_cache", cache, dtype, head_size, rot_dim, interleaved_v)
    cache_in = cache.cpu().clone()
    _, q, k, v = make_qk(t, hq, hkv, head_size, dtype, seed, form)
    w = torch.randn(2, head_size, generator=gen(seed + 1))
    w = (0.3 * w if weights == "0.3" else 1 + 0.5 * w).to(dtype).to(DEV)
    cos, sin = make_rows(t, rot_dim, dtype, seed + 2)
    slots = pad_slots(slots)[: t - 2].to(DEV)
    ks, vs = scales(dtype)
    return t, hq, hkv, eps, fn, cache, cache_in, q, k, v, w, cos, sin, slots, ks, vs


@pytest.mark.parametrize("block_size,head_size,rot_dim,layout,interleaved_v,is_neox,dtype,form", GEMMA_CASES)
@pytest.mark.parametrize("provider", put.providers_for("qk_norm_rope_cos_sin_and_cache"))
def test_gemma_norm_writer(provider, block_size, head_size, rot_dim, layout, interleaved_v, is_neox, dtype, form):
    """``gemma_norm=True``: the normalized value times ``1 + weight`` rounded once (Gemma's
    RMSNorm), then RoPE and the cache write as without it. The weights are small, as Gemma's
    are (they are stored as offsets from 1)."""
    t, hq, hkv, eps, fn, cache, cache_in, q, k, v, w, cos, sin, slots, ks, vs = _norm_writer_case(
        provider, block_size, head_size, rot_dim, layout, interleaved_v, dtype, form, 7, '0.3')
    want = [oracle_rope_rows(oracle_norm_gemma(x.cpu().reshape(t, -1, head_size), w[i], eps, dtype).to(torch.float64),
                             cos, sin, is_neox).to(dtype) for i, x in enumerate((q, k))]
    # the other form on the same inputs: the test tells the two apart
    other = [oracle_rope_rows(oracle_norm(x.cpu().reshape(t, -1, head_size).to(torch.float64), w[i], eps, dtype),
                              cos, sin, is_neox).to(dtype) for i, x in enumerate((q, k))]
    fn(q, k, v, w[0], w[1], eps, cos, sin, is_neox, cache, slots, ks, vs, interleaved_v, gemma_norm=True)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-6)
    q, k = q.reshape(t, hq, head_size), k.reshape(t, hkv, head_size)
    assert rel_err(q, want[0]) < tol and rel_err(k, want[1]) < tol
    assert rel_err(q, other[0]) > 0.1  # (1 + w) against w: not a rounding difference
    if dtype != torch.float32:
        assert min(_exact_fraction(q, want[0]), _exact_fraction(k, want[1])) > 0.99
    cache_op = cache_in.clone()
    oracle_write(cache_op, k.cpu(), v.cpu().reshape(t, hkv, head_size), slots.cpu(), ks.cpu(), vs.cpu(),
                 interleaved_v)
    assert_cache_equal(cache.cpu(), cache_op, dtype)


def oracle_norm_gemma4(x, w, eps, dtype):
    """Gemma4's RMSNorm (``Gemma4RMSNorm``): float64 statistics, times ``w``, rounded to ``dtype`` once."""
    x = x.to(torch.float64)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.cpu().to(torch.float64)).to(dtype)


# Gemma4's head sizes: 256 (sliding layers), 512 (full layers, cos/sin over the whole head)
GEMMA4_CASES = [CASES[3], CASES[5], (16, 512, 512, CacheLayout.LBHNC, True, True, torch.float16, "flat")]


@pytest.mark.parametrize("block_size,head_size,rot_dim,layout,interleaved_v,is_neox,dtype,form", GEMMA4_CASES)
@pytest.mark.parametrize("provider", put.providers_for("qk_norm_rope_cos_sin_and_cache"))
def test_gemma4_norm_writer(provider, block_size, head_size, rot_dim, layout, interleaved_v, is_neox, dtype, form):
    """``gemma4_norm=True``: the normalized value times ``weight`` in fp32, rounded once
    (Gemma4's RMSNorm), then RoPE and the cache write. Told apart from transformers' form
    (the normalized value rounded before the weight) in fp16, and from Gemma's ``1 + weight``."""
    t, hq, hkv, eps, fn, cache, cache_in, q, k, v, w, cos, sin, slots, ks, vs = _norm_writer_case(
        provider, block_size, head_size, rot_dim, layout, interleaved_v, dtype, form, 5, '1 + 0.5')
    heads = [x.cpu().reshape(t, -1, head_size).to(torch.float64) for x in (q, k)]
    want = [oracle_rope_rows(oracle_norm_gemma4(x, w[i], eps, dtype).to(torch.float64), cos, sin, is_neox).to(dtype)
            for i, x in enumerate(heads)]
    gemma = [oracle_rope_rows(oracle_norm_gemma(x, w[i], eps, dtype).to(torch.float64), cos, sin, is_neox).to(dtype)
             for i, x in enumerate(heads)]
    hf = [oracle_rope_rows(oracle_norm(x, w[i], eps, dtype), cos, sin, is_neox).to(dtype) for i, x in enumerate(heads)]
    q_in, k_in = q.clone(), k.clone()
    fn(q, k, v, w[0], w[1], eps, cos, sin, is_neox, cache, slots, ks, vs, interleaved_v, gemma4_norm=True)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-6)
    q, k = q.reshape(t, hq, head_size), k.reshape(t, hkv, head_size)
    assert not torch.equal(q, q_in.reshape(q.shape)) and not torch.equal(k, k_in.reshape(k.shape))
    assert rel_err(q, want[0]) < tol and rel_err(k, want[1]) < tol
    assert rel_err(q, gemma[0]) > 0.1  # w against 1 + w: not a rounding difference
    if dtype != torch.float32:
        assert min(_exact_fraction(q, want[0]), _exact_fraction(k, want[1])) > 0.99
        # transformers' rounding of the normalized value before w: most values differ in the last bit
        assert _exact_fraction(q, hf[0]) < _exact_fraction(q, want[0])
    cache_op = cache_in.clone()
    oracle_write(cache_op, k.cpu(), v.cpu().reshape(t, hkv, head_size), slots.cpu(), ks.cpu(), vs.cpu(),
                 interleaved_v)
    assert_cache_equal(cache.cpu(), cache_op, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size,head_size,rot_dim,layout,interleaved_v", [
    (16, 256, 256, CacheLayout.LHBNC, True), (32, 512, 512, CacheLayout.LBHNC, False),
    (16, 512, 512, CacheLayout.LHBNC, True)])
@pytest.mark.parametrize("provider", put.providers_for("qk_norm_rope_cos_sin_and_cache"))
def test_gemma4_norm_writer_gpu(provider, dtype, block_size, head_size, rot_dim, layout, interleaved_v):
    """Gemma4's sliding (256) and full (512) layers' writer on the GPU, in the model dtypes."""
    test_gemma4_norm_writer(provider, block_size, head_size, rot_dim, layout, interleaved_v, True, dtype, "flat")


def test_gemma_and_gemma4_norm_together_are_refused_before_any_write():
    t, d = 3, 64
    q, k, v = torch.randn(t, 2, d), torch.randn(t, 1, d), torch.randn(t, 1, d)
    cache, slots = make_cache(16, 1, d, torch.float32, CacheLayout.LHBNC, t, 3)
    cache_in, q_in = cache.clone(), q.clone()
    w, cos, sin = torch.randn(d), torch.randn(t, d), torch.randn(t, d)
    ks, vs = scales(torch.float32)
    with pytest.raises(ValueError, match="qk_norm_rope_cos_sin_and_cache: gemma_norm=True and gemma4_norm=True"):
        torch.ops.rocm_attn.qk_norm_rope_cos_sin_and_cache(q, k, v, w, w, 1e-6, cos, sin, True, cache,
                                                           pad_slots(slots)[:t], ks, vs, False, gemma_norm=True,
                                                           gemma4_norm=True)
    torch.testing.assert_close(cache, cache_in, rtol=0, atol=0, equal_nan=True)  # poisoned: NaN kept
    assert torch.equal(q, q_in)


def oracle_norm_after_rope(x, w, eps, cos, sin, is_neox, dtype, gemma):
    """Hunyuan's order: the rotation rounded to ``dtype``, then the RMSNorm of the rotated
    head (``oracle_norm`` or, ``gemma``, ``oracle_norm_gemma``), rounded to ``dtype``."""
    rotated = oracle_rope_rows(x.to(torch.float64), cos, sin, is_neox).to(dtype)
    norm = oracle_norm_gemma if gemma else oracle_norm
    return norm(rotated, w, eps, dtype).to(dtype)


AFTER_CASES = [c + (False,) for c in CASES] + [c + (True,) for c in GEMMA_CASES[:1]]


@pytest.mark.parametrize("block_size,head_size,rot_dim,layout,interleaved_v,is_neox,dtype,form,gemma", AFTER_CASES)
@pytest.mark.parametrize("provider", put.providers_for("qk_norm_rope_cos_sin_and_cache"))
def test_norm_after_rope_writer(provider, block_size, head_size, rot_dim, layout, interleaved_v, is_neox, dtype,
                                form, gemma):
    """``norm_after_rope=True`` (Hunyuan): RoPE first, then the per-head RMSNorm of the rotated
    head, each rounded where the model rounds; the cache gets the key stored back. The weights
    are far from 1, so the norm-first order (``w`` before the rotation: it does not commute
    with it) is told apart."""
    t, hq, hkv, eps, fn, cache, cache_in, q, k, v, w, cos, sin, slots, ks, vs = _norm_writer_case(
        provider, block_size, head_size, rot_dim, layout, interleaved_v, dtype, form, 3, '1 + 0.5')
    heads = [x.cpu().reshape(t, -1, head_size) for x in (q, k)]
    want = [oracle_norm_after_rope(x, w[i].cpu(), eps, cos, sin, is_neox, dtype, gemma) for i, x in enumerate(heads)]
    first = oracle_norm_gemma if gemma else oracle_norm
    other = [oracle_rope_rows(first(x, w[i], eps, dtype).to(torch.float64), cos, sin, is_neox).to(dtype)
             for i, x in enumerate(heads)]
    fn(q, k, v, w[0], w[1], eps, cos, sin, is_neox, cache, slots, ks, vs, interleaved_v, gemma_norm=gemma,
       norm_after_rope=True)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-6)
    q, k = q.reshape(t, hq, head_size), k.reshape(t, hkv, head_size)
    assert rel_err(q, want[0]) < tol and rel_err(k, want[1]) < tol
    assert rel_err(q, other[0]) > 0.05  # the norm-first order on the same inputs: not a rounding difference
    if dtype != torch.float32:
        assert min(_exact_fraction(q, want[0]), _exact_fraction(k, want[1])) > 0.99
    cache_op = cache_in.clone()
    oracle_write(cache_op, k.cpu(), v.cpu().reshape(t, hkv, head_size), slots.cpu(), ks.cpu(), vs.cpu(),
                 interleaved_v)
    assert_cache_equal(cache.cpu(), cache_op, dtype)


@pytest.mark.parametrize("provider,op", ALL)
def test_empty_slot_mapping_rotates_only(provider, op):
    """A layer without a cache (or a profiling run): q/k rotated in place, the cache not read."""
    t, hq, hkv, d, dtype = 5, 2, 1, 64, torch.float32
    fn = put.kernel(provider, op, device=DEV, dtype=dtype, head_size=d)
    _, q, k, v = make_qk(t, hq, hkv, d, dtype, 3, "heads")
    w = (1 + 0.1 * torch.randn(2, d, generator=gen(4))).to(DEV)
    cos, sin = make_rows(t, d, dtype, 5)
    ks, vs = scales(dtype)
    want = []
    for x, wi in ((q, 0), (k, 1)):
        x64 = x.cpu().to(torch.float64)
        if op != "rope_cos_sin_and_cache":
            x64 = oracle_norm(x64, w[wi], 1e-6, dtype)
        want.append(oracle_rope_rows(x64, cos, sin, True).to(dtype))
    _run(fn, op, q, k, v, w, cos, sin, True, torch.empty(0, device=DEV), torch.empty(0, dtype=torch.int64,
         device=DEV), ks, vs, False)
    assert rel_err(q, want[0]) < 1e-6 and rel_err(k, want[1]) < 1e-6


@pytest.mark.parametrize("block_size,block_t,dtype,interleaved_v,layout", PREFILL_TILES)
@pytest.mark.parametrize("op", OPS)
def test_triton_prefill_tiles(op, block_size, block_t, dtype, interleaved_v, layout):
    """Tiles of consecutive slots take the contiguous-store path (``WriterConfig.block_t``)."""
    hq, hkv, d = 2, 2, 64
    cache, slots, t = prefill_case(block_size, dtype, layout, seed=block_size + block_t)
    fn = put.kernel("triton", op, device=DEV, dtype=dtype, head_size=d, **cache_query(cache, dtype, interleaved_v))
    cache_in = cache.cpu().clone()
    _, q, k, v = make_qk(t, hq, hkv, d, dtype, block_t, "heads")
    w = torch.ones(2, d, dtype=dtype, device=DEV)
    cos, sin = make_rows(t, d, dtype, 7)
    ks, vs = scales(dtype)
    kwargs = dict(cfg=WriterConfig(block_t))
    if op == "rope_cos_sin_and_cache":
        fn(q, k, v, cos, sin, False, cache, slots, ks, vs, interleaved_v, **kwargs)
    else:
        fn(q, k, v, w[0], w[1], 1e-6, cos, sin, False, cache, slots, ks, vs, interleaved_v, **kwargs)
    # the cache holds exactly the k the op returned (and v), at the tile path's slots
    cache_op = cache_in.clone()
    oracle_write(cache_op, k.cpu(), v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    assert_cache_equal(cache.cpu(), cache_op, dtype)


@pytest.mark.parametrize("bad,match", [
    ("cos_rows", r"cos must be \[num_tokens, rot_dim\] = \[6, even rot_dim <= head_size 64\]"),
    ("cos_odd", r"cos must be \[num_tokens, rot_dim\]"),
    ("sin_shape", r"sin \(6, 32\) and cos \(6, 64\) differ"),
    ("key_heads", r"key must be \[num_tokens, heads, head_size\].*2 heads"),
    ("weight", r"q_weight must be \[head_size\] = \[64\], got \(32,\)"),
    ("dtype", r"value dtype torch.float16 != query dtype torch.float32"),
    ("weight_dtypes", r"q_weight dtype torch.float32 != k_weight dtype torch.float16"),
])
def test_bad_input_names_op_and_value(bad, match):
    t, d = 6, 64
    q, k, v = torch.randn(t, 4, d), torch.randn(t, 2, d), torch.randn(t, 2, d)
    cos, sin, w = torch.randn(t, d), torch.randn(t, d), torch.ones(d)
    if bad == "cos_rows":
        cos = torch.randn(t + 1, d)
    elif bad == "cos_odd":
        cos = sin = torch.randn(t, 31)
    elif bad == "sin_shape":
        sin = torch.randn(t, 32)
    elif bad == "key_heads":
        k = torch.randn(t, 3, d)
    elif bad == "weight":
        w = torch.ones(32)
    elif bad == "dtype":
        v = v.half()
    k_weight = w.half() if bad == "weight_dtypes" else w
    spec_cache = torch.zeros(4, 2, 16, 2 * d)
    slots, one = torch.arange(t), torch.ones(1)
    before = q.clone()
    with pytest.raises(ValueError, match="rocm_attn.qk_norm_rope_cos_sin_and_cache: " + match):
        torch.ops.rocm_attn.qk_norm_rope_cos_sin_and_cache(q, k, v, w, k_weight, 1e-6, cos, sin, True, spec_cache,
                                                            slots, one, one, False)
    assert torch.equal(q, before)  # validated before anything is written


def _check_gpu(provider, op, *, dtype, cache_dtype, block_size, layout, interleaved_v, is_neox, rot_dim):
    t, hq, hkv, d = 300, 32, 8, 128
    seed = block_size + int(interleaved_v) + rot_dim
    cache, slots = make_cache(block_size, hkv, d, cache_dtype, layout, t, seed)
    fn = _kernel(provider, op, cache, dtype, d, rot_dim, interleaved_v)
    cache_in = cache.cpu().clone()
    _, q, k, v = make_qk(t, hq, hkv, d, dtype, seed, "heads")
    w = torch.randn(2, d, generator=gen(seed)).mul(0.1).add(1).to(dtype).to(DEV)
    cos, sin = make_rows(t, rot_dim, dtype, seed + 1)
    slots = pad_slots(slots, 7)[: t - 5].to(DEV)
    ks, vs = scales(dtype, 0.05, 0.03)
    qe, ke = _expect(op, q, k, v, w, cos, sin, is_neox, cache_in.clone(), slots, ks, vs, interleaved_v)
    _run(fn, op, q, k, v, w, cos, sin, is_neox, cache, slots, ks, vs, interleaved_v)
    torch.cuda.synchronize()
    assert rel_err(q, qe) < 1e-2 and rel_err(k, ke) < 1e-2
    # The cache holds what the op stored: the k it returned (and v), quantized for an fp8 cache.
    # A model-dtype cache is compared bit for bit; fp8 within one step of the oracle's code.
    cache_op = cache_in.clone()
    oracle_write(cache_op, k.cpu().reshape(t, hkv, d), v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    assert_cache_equal(cache.cpu(), cache_op, cache.dtype, exact=cache.dtype not in FP8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cache_dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size,layout,interleaved_v", GPU_GEOMETRY)
@pytest.mark.parametrize("provider,op", ALL)
def test_writer_gpu(provider, op, dtype, cache_dtype, block_size, layout, interleaved_v):
    _check_gpu(provider, op, dtype=dtype, cache_dtype=cache_dtype, block_size=block_size, layout=layout,
               interleaved_v=interleaved_v, is_neox=True, rot_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox,rot_dim", [(False, 128), (True, 64)])
@pytest.mark.parametrize("provider,op", ALL)
def test_writer_gpu_gptj_partial(provider, op, is_neox, rot_dim):
    _check_gpu(provider, op, dtype=torch.bfloat16, cache_dtype=torch.bfloat16, block_size=16,
               layout=CacheLayout.LHBNC, interleaved_v=True, is_neox=is_neox, rot_dim=rot_dim)


# --- the layer-level ops (the impl's per-step path) ---------------------------------------------


def _layer(name, layout="LHBNC"):
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name=name, cache_layout=layout)
    layer.kv_cache = poison(ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 6))
    return layer


def test_layer_qk_norm_op_switches_to_interleaved_v_and_keeps_cached_tokens():
    """A layer whose graph came from Inductor's cache (no pass switched it) holds tokens in the
    standard V layout; the first fused write converts them, then writes interleaved V."""
    layer = _layer("cos_sin_writers.switch")
    md0 = ira.build_attention_metadata([3], [0], [[2]], 16)
    g = gen(11)
    k0, v0 = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    with ira.set_forward_context(md0):
        torch.ops.rocm_attn.unified_kv_cache_update(k0, v0, layer.layer_name)
    assert not layer.interleaved_v
    md = ira.build_attention_metadata([2], [3], [[2]], 16)
    q, k, v = torch.randn(2, 4, 64, generator=g), torch.randn(2, 2, 64, generator=g), torch.randn(2, 2, 64, generator=g)
    w = torch.rand(2, 64, generator=g) + 0.5
    cos, sin = make_rows(2, 64, torch.float32, 12)
    want_q = oracle_rope_rows(oracle_norm(q, w[0], 1e-6, torch.float32), cos, sin, True).float()
    want_k = oracle_rope_rows(oracle_norm(k, w[1], 1e-6, torch.float32), cos, sin, True).float()
    with ira.set_forward_context(md):
        torch.ops.rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update(q, k, v, w[0], w[1], 1e-6, cos, sin,
                                                                             True, layer.layer_name)
    assert layer.interleaved_v
    assert rel_err(q, want_q) < 1e-6 and rel_err(k, want_k) < 1e-6
    kd, vd = dense_kv(layer.kv_cache, 2, True)
    assert torch.equal(kd[2, :3], k0) and torch.equal(vd[2, :3], v0)  # converted in place
    assert torch.equal(kd[2, 3:5], k) and torch.equal(vd[2, 3:5], v)
    assert kd[2, 5:].isnan().all()


@pytest.mark.parametrize("op", ["unified_rope_cos_sin_and_kv_cache_update",
                                "unified_qk_norm_rope_cos_sin_and_kv_cache_update"])
def test_layer_op_profiling_run_rotates_and_writes_nothing(op):
    layer = _layer(f"cos_sin_writers.profile.{op}", "LBHNC")
    before = layer.kv_cache.clone()
    g = gen(13)
    q, k, v = torch.randn(3, 4, 64, generator=g), torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    w = torch.rand(2, 64, generator=g) + 0.5
    cos, sin = make_rows(3, 64, torch.float32, 14)
    q0, k0 = q.clone(), k.clone()
    args = (q, k, v, cos, sin, False) if "norm" not in op else (q, k, v, w[0], w[1], 1e-6, cos, sin, False)
    with ira.profiling_run():
        getattr(torch.ops.rocm_attn, op)(*args, layer.layer_name)
    want = [oracle_norm(x, wi, 1e-6, torch.float32) if "norm" in op else x.double() for x, wi in ((q0, w[0]), (k0, w[1]))]
    assert rel_err(q, oracle_rope_rows(want[0], cos, sin, False)) < 1e-6
    assert rel_err(k, oracle_rope_rows(want[1], cos, sin, False)) < 1e-6
    assert torch.equal(layer.kv_cache.view(torch.uint8), before.view(torch.uint8))
