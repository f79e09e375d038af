"""``reshape_and_cache`` of every provider against the float64 oracle writer (every cache
byte compared, poison included). Inputs, oracles and the interpreter's limits:
``writer_checks.py``."""

from __future__ import annotations

import pytest
import torch

import providers_under_test as put
from inductor_rocm_attn.kernels.triton.configs import WriterConfig
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, cache_x, k_view, v_view
from writer_checks import (
    DEV, GPU_DTYPES, GPU_GEOMETRY, GPU_PAD_CASES, LAYOUTS, PAD_CASES, PREFILL_TILES, assert_cache_equal,
    cache_query, fp8_exact, guarded_cache, make_cache, make_qkv, oracle_write, pad_slots, padded_slots,
    prefill_case, scales, split,
)

OP = "reshape_and_cache"
PROVIDERS = put.providers_for(OP)
GEOMETRY = [(16, 64), (32, 80), (544, 128), (16, 256), (32, 128), (544, 80), (16, 512)]


def _kernel(provider, cache, dtype, head_size, interleaved_v):
    return put.kernel(provider, OP, device=DEV, dtype=dtype, head_size=head_size,
                      **cache_query(cache, dtype, interleaved_v))


@pytest.mark.parametrize("block_size,head_size", GEOMETRY)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved_v", [False, True])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_reshape_and_cache(provider, block_size, head_size, layout, interleaved_v):
    dtype = torch.float16 if head_size != 80 else torch.float32
    t, hkv = 13, 2
    seed = block_size + head_size + interleaved_v
    out, slots = make_cache(block_size, hkv, head_size, dtype, layout, t, seed)
    fn = _kernel(provider, out, dtype, head_size, interleaved_v)
    expected = out.cpu().clone()
    qkv = make_qkv(t, 2, hkv, head_size, dtype, seed, pad_cols=8)
    _, k, v = split(qkv, 2, hkv, head_size)
    k = k.view(t, hkv, head_size)  # strided views of the fused tensor
    slots = pad_slots(slots)[: t - 2].to(DEV)  # the last 2 tokens have no slot: not written
    ks, vs = scales(dtype)
    fn(k, v, out, slots, ks, vs, interleaved_v)
    oracle_write(expected, k.cpu(), v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    assert_cache_equal(out.cpu(), expected, dtype, exact=True)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("layout,interleaved_v,block_size", [
    (CacheLayout.LHBNC, False, 16), (CacheLayout.LBHNC, True, 32), (CacheLayout.LHBNC, True, 544),
])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_reshape_and_cache_fp8_exact_values(provider, cache_dtype, layout, interleaved_v, block_size):
    """fp8 layout, scale and saturation with inputs that need no rounding (interpreter-safe)."""
    t, hkv, d = 11, 2, 64
    dtype = torch.float16
    ks_val, vs_val = 0.5, 0.25
    out, slots = make_cache(block_size, hkv, d, cache_dtype, layout, t, seed=7)
    fn = _kernel(provider, out, dtype, d, interleaved_v)
    expected = out.cpu().clone()
    k = fp8_exact((t, hkv, d), dtype, ks_val, 1)
    v = fp8_exact((t, hkv, d), dtype, vs_val, 2)
    if cache_dtype == torch.float8_e5m2:  # e5m2 grid is coarser: snap the inputs to it
        k = (k.float() / ks_val).to(cache_dtype).float().mul(ks_val).to(dtype)
        v = (v.float() / vs_val).to(cache_dtype).float().mul(vs_val).to(dtype)
    slots = pad_slots(slots).to(DEV)
    ks, vs = scales(dtype, ks_val, vs_val)
    fn(k, v, out, slots, ks, vs, interleaved_v)
    oracle_write(expected, k.cpu(), v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    assert_cache_equal(out.cpu(), expected, cache_dtype, exact=True)


def _nonfinite(provider, dtype, cache_dtype):
    t, hkv, d = 9, 2, 64
    cache, slots = make_cache(16, hkv, d, cache_dtype, CacheLayout.LHBNC, t, seed=3)
    fn = _kernel(provider, cache, dtype, d, True)
    expected = cache.cpu().clone()
    k = fp8_exact((t, hkv, d), dtype, 0.5, 1)
    v = fp8_exact((t, hkv, d), dtype, 0.25, 2)
    if cache_dtype == torch.float8_e5m2:  # e5m2 grid is coarser: snap the inputs to it
        k = (k.float() / 0.5).to(cache_dtype).float().mul(0.5).to(dtype)
        v = (v.float() / 0.25).to(cache_dtype).float().mul(0.25).to(dtype)
    for x in (k, v):
        x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        x[t - 1, 1, 5] = float("nan")
    ks, vs = scales(dtype, 0.5, 0.25)
    fn(k, v, cache, slots.to(DEV), ks, vs, True)
    oracle_write(expected, k.cpu(), v.cpu(), slots, ks.cpu(), vs.cpu(), True)
    got = cache.cpu()
    # NaN stays NaN (its bit pattern may differ); everything else bit for bit: an fp16/bf16
    # cache copies +-inf, an fp8 cache saturates it to +-fp8 max (quantize = divide, saturate).
    nan_got, nan_want = got.float().isnan(), expected.float().isnan()
    assert torch.equal(nan_got, nan_want), f"NaN at {int((nan_got ^ nan_want).sum())} other places"
    bits = {1: torch.uint8, 2: torch.int16}[got.element_size()]
    same = got.view(bits) == expected.view(bits)
    assert bool((same | nan_want).all()), f"{int((~same & ~nan_want).sum())} non-NaN elements differ"
    assert int((expected.float().isinf() | (expected.float().abs() == torch.finfo(cache_dtype).max)).sum()) >= 4, \
        "the case tests nothing"


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e5m2, torch.float8_e4m3fn],
                         ids=["fp16", "e5m2", "e4m3"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_reshape_and_cache_nonfinite(provider, cache_dtype):
    """A NaN key/value is written as NaN in every cache dtype; +-inf is copied into a model-dtype
    cache and saturates to +-max in an fp8 one."""
    if provider == "triton" and put.INTERPRETER and cache_dtype == torch.float8_e4m3fn:
        pytest.skip("the interpreter converts NaN to e4m3 as 384 (the GPU test covers e4m3)")
    _nonfinite(provider, torch.float16, cache_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn],
                         ids=["bf16", "e5m2", "e4m3"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_reshape_and_cache_nonfinite_gpu(provider, cache_dtype):
    _nonfinite(provider, torch.bfloat16, cache_dtype)


@pytest.mark.parametrize("block_size,block_t,dtype,interleaved_v,layout", PREFILL_TILES)
def test_triton_prefill_tiles(block_size, block_t, dtype, interleaved_v, layout):
    """Tiles of consecutive slots take the contiguous-store path (``WriterConfig.block_t``)."""
    cache, slots, t = prefill_case(block_size, dtype, layout, seed=block_size + block_t)
    fn = _kernel("triton", cache, dtype, 64, interleaved_v)
    expected = cache.cpu().clone()
    qkv = make_qkv(t, 2, 2, 64, dtype, seed=block_t)
    _, k, v = split(qkv, 2, 2, 64)
    ks, vs = scales(dtype)
    fn(k.view(t, 2, 64), v, cache, slots, ks, vs, interleaved_v, cfg=WriterConfig(block_t))
    oracle_write(expected, k.view(t, 2, 64).cpu(), v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(),
                 interleaved_v)
    assert_cache_equal(cache.cpu(), expected, dtype, exact=True)


def _padding(provider, t, n_slots, n_real, block_t, *, dtype, cache_dtype, hkv, d, block_size,
             interleaved_v):
    num_blocks = max(1, n_real) // block_size + 3
    guarded = guarded_cache(block_size, hkv, d, cache_dtype, num_blocks)
    cache = guarded.t
    fn = _kernel(provider, cache, dtype, d, interleaved_v)
    expected = cache.cpu().clone()
    qkv = make_qkv(t, 2, hkv, d, dtype, seed=t + n_real)
    _, k, v = split(qkv, 2, hkv, d)
    k = k.view(t, hkv, d)
    slots = padded_slots(num_blocks * block_size, t, n_slots, n_real, seed=n_slots)
    ks, vs = scales(dtype)
    fn(k, v, cache, slots, ks, vs, interleaved_v,
       **(dict(cfg=WriterConfig(block_t)) if provider == "triton" and block_t else {}))
    oracle_write(expected, k.cpu(), v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    assert_cache_equal(cache.cpu(), expected, cache_dtype, exact=cache_dtype == dtype)
    guarded.assert_intact("kv_cache")


@pytest.mark.parametrize("t,n_slots,n_real,block_t", PAD_CASES)
@pytest.mark.parametrize("interleaved_v", [False, True])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_reshape_and_cache_padding(provider, t, n_slots, n_real, block_t, interleaved_v):
    """Padding tokens (slot -1, tokens past slot_mapping) across token tiles: no byte of the
    cache outside the real tokens' slots changes, nothing past the cache is written."""
    _padding(provider, t, n_slots, n_real, block_t, dtype=torch.float16, cache_dtype=torch.float16,
             hkv=2, d=64, block_size=16, interleaved_v=interleaved_v)


@pytest.mark.gpu
@pytest.mark.parametrize("t,n_slots,n_real,block_t", GPU_PAD_CASES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_reshape_and_cache_padding_gpu(provider, t, n_slots, n_real, block_t, cache_dtype):
    _padding(provider, t, n_slots, n_real, block_t, dtype=torch.bfloat16, cache_dtype=cache_dtype,
             hkv=8, d=128, block_size=16, interleaved_v=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cache_dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size,layout,interleaved_v", GPU_GEOMETRY)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_reshape_and_cache_gpu(provider, dtype, cache_dtype, block_size, layout, interleaved_v):
    t, hq, hkv, d = 300, 32, 8, 128
    seed = block_size + int(interleaved_v)
    cache, slots = make_cache(block_size, hkv, d, cache_dtype, layout, t, seed)
    fn = _kernel(provider, cache, dtype, d, interleaved_v)
    expected = cache.cpu().clone()
    qkv = make_qkv(t, hq, hkv, d, dtype, seed)
    slots = pad_slots(slots, 7)[: t - 5].to(DEV)
    ks, vs = scales(dtype, 0.05, 0.03)
    _, k, v = split(qkv, hq, hkv, d)
    k = k.view(t, hkv, d)
    fn(k, v, cache, slots, ks, vs, interleaved_v)
    oracle_write(expected, k.cpu(), v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    torch.cuda.synchronize()
    assert_cache_equal(cache.cpu(), expected, cache_dtype, exact=cache_dtype == dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cache_dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size,layout,interleaved_v", GPU_GEOMETRY[:2])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_reshape_and_cache_gpu_head_size_512(provider, dtype, cache_dtype, block_size, layout, interleaved_v):
    """Gemma4's full-attention head size (native refuses it: skipped there)."""
    t, hkv, d = 100, 2, 512
    cache, slots = make_cache(block_size, hkv, d, cache_dtype, layout, t, 512 + block_size)
    fn = _kernel(provider, cache, dtype, d, interleaved_v)
    expected = cache.cpu().clone()
    _, k, v = split(make_qkv(t, 4, hkv, d, dtype, 7), 4, hkv, d)
    k = k.view(t, hkv, d)
    slots = pad_slots(slots, 3)[: t - 2].to(DEV)
    ks, vs = scales(dtype, 0.05, 0.03)
    fn(k, v, cache, slots, ks, vs, interleaved_v)
    oracle_write(expected, k.cpu(), v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    torch.cuda.synchronize()
    assert_cache_equal(cache.cpu(), expected, cache_dtype, exact=cache_dtype == dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", PROVIDERS)
def test_reshape_and_cache_gpu_int64_cache_offsets(provider):
    """A cache past 2^31 elements: the last block must be written at the right place."""
    free = torch.cuda.mem_get_info()[0]
    hkv, d, bs = 8, 128, 16
    page = hkv * d * bs
    num_blocks = (2 ** 31) // page + 8
    if 2 * num_blocks * page * 2 > free // 2:
        pytest.skip("not enough GPU memory for a > 2^31-element cache")
    fn = put.kernel(provider, OP, device="cuda", dtype=torch.bfloat16, head_size=d, block_size=bs,
                    layout=CacheLayout.LHBNC, interleaved_v=True)
    spec = KVCacheSpec(bs, hkv, d, torch.bfloat16, CacheLayout.LHBNC)
    cache = allocate_kv_cache(spec, num_blocks, "cuda")
    slots = torch.tensor([(num_blocks - 1) * bs + 3, 5], device="cuda")
    k = torch.randn(2, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, hkv, d, device="cuda", dtype=torch.bfloat16)
    ones = torch.ones(1, device="cuda")
    fn(k, v, cache, slots, ones, ones, True)
    x = cache_x(torch.bfloat16)
    kv_ = k_view(cache, hkv)[num_blocks - 1, :, :, 3, :].reshape(hkv, d)
    vv_ = v_view(cache, hkv, True)[num_blocks - 1, :, 3 // x, :, 3 % x]
    assert torch.equal(kv_, k[0]) and torch.equal(vv_, v[0])
    del cache
