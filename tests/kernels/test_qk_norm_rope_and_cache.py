"""``qk_norm_rope_and_cache`` (split qkv, per-head RMSNorm on q/k, RoPE, cache write) of every
provider against the float64 oracles (``writer_checks``): q/k/v within the model dtype's
rounding (``round_tol``), every cache byte (poison included) equal to the oracle writer's
over the k/v the op returned (fp8 caches: within one step on a tiny fraction)."""

from __future__ import annotations

import pytest
import torch

import providers_under_test as put
from cases import poison, rel_err
from inductor_rocm_attn.kernels.triton.configs import WriterConfig
from inductor_rocm_attn.layout import CacheLayout
from writer_checks import (
    DEV, GPU_DTYPES, GPU_GEOMETRY, GPU_PAD_CASES, PAD_CASES, PREFILL_TILES, assert_cache_equal,
    cache_query, gen, guarded_cache, guarded_rows, make_cache, make_cos_sin, make_qkv,
    oracle_rms_norm, oracle_rope, oracle_write, pad_slots, padded_slots, prefill_case, round_tol,
    scales, split,
)

OP = "qk_norm_rope_and_cache"
PROVIDERS = put.providers_for(OP)
# Providers that round the normalised k to the model dtype before RoPE: their q/k carry two
# roundings (``round_tol(dtype, 2)``). Every provider's cache is compared with its own
# returned k/v written by the oracle writer.
ROUNDS_BEFORE_ROPE = {"aiter"}

FUSED_CASES = [
    # block, head, rot, layout, interleaved, neox, dtype
    (16, 64, 64, CacheLayout.LHBNC, True, True, torch.float16),
    (32, 128, 64, CacheLayout.LBHNC, False, False, torch.float16),
    (544, 80, 80, CacheLayout.LHBNC, False, True, torch.float32),
    (16, 256, 256, CacheLayout.LBHNC, True, False, torch.float16),
    (544, 128, 128, CacheLayout.LBHNC, True, True, torch.float32),
    (16, 512, 128, CacheLayout.LHBNC, True, True, torch.float16),  # Gemma4's full layers: a quarter rotated
]


def _kernel(provider, cache, dtype, head_size, rot_dim, interleaved_v):
    return put.kernel(provider, OP, device=DEV, dtype=dtype, head_size=head_size,
                      features=("partial_rotary",) if rot_dim < head_size else (),
                      **cache_query(cache, dtype, interleaved_v))


def _expect(qkv, q_w, k_w, eps, positions, cos_sin, is_neox, hq, hkv, d):
    """(q, k, v) the op returns: the float64 chain rounded once to the model dtype."""
    t, dtype = qkv.shape[0], qkv.dtype
    q, k, v = split(qkv.cpu(), hq, hkv, d)
    q = oracle_rope(oracle_rms_norm(q.reshape(t, hq, d), q_w, eps), positions, cos_sin, is_neox)
    k = oracle_rope(oracle_rms_norm(k.reshape(t, hkv, d), k_w, eps), positions, cos_sin, is_neox)
    return q.to(dtype), k.to(dtype), v.contiguous()


def _cache_of(before, k, v, slots, ks, vs, interleaved_v):
    """``before`` with the k/v the op returned written by the oracle writer: the cache holds
    exactly the returned values."""
    want = before.clone()
    oracle_write(want, k.cpu(), v.cpu(), slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    return want


@pytest.mark.parametrize("block_size,head_size,rot_dim,layout,interleaved_v,is_neox,dtype", FUSED_CASES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_qk_norm_rope_and_cache(provider, block_size, head_size, rot_dim, layout, interleaved_v,
                                is_neox, dtype):
    t, hq, hkv = 9, 4, 2
    seed = 1 + block_size + head_size + rot_dim
    cache, slots = make_cache(block_size, hkv, head_size, dtype, layout, t, seed)
    fn = _kernel(provider, cache, dtype, head_size, rot_dim, interleaved_v)
    cache_want = cache.cpu().clone()
    qkv = make_qkv(t, hq, hkv, head_size, dtype, seed, pad_cols=8)[:, : (hq + 2 * hkv) * head_size]
    g = gen(seed + 1)
    q_w = (1 + 0.1 * torch.randn(head_size, generator=g)).to(dtype).to(DEV)
    k_w = (1 + 0.1 * torch.randn(head_size, generator=g)).to(dtype).to(DEV)
    positions = torch.randint(0, 1000, (t,), generator=g).to(DEV)
    cos_sin = make_cos_sin(1024, rot_dim, dtype)
    slots = pad_slots(slots)[: t - 2].to(DEV)
    ks, vs = scales(dtype)
    q, k, v = fn(qkv, q_w, k_w, 1e-6, positions, cos_sin, is_neox, cache, slots, ks, vs,
                 interleaved_v, hq, hkv, head_size)
    qe, ke, ve = _expect(qkv, q_w, k_w, 1e-6, positions, cos_sin, is_neox, hq, hkv, head_size)
    assert rel_err(q, qe) < round_tol(dtype) and rel_err(k, ke) < round_tol(dtype)
    assert torch.equal(v.cpu(), ve)
    assert q.shape == (t, hq, head_size) and q.is_contiguous()
    assert_cache_equal(cache.cpu(), _cache_of(cache_want, k, v, slots, ks, vs, interleaved_v), dtype)


@pytest.mark.parametrize("block_size,block_t,dtype,interleaved_v,layout", PREFILL_TILES)
def test_triton_prefill_tiles(block_size, block_t, dtype, interleaved_v, layout):
    """Tiles of consecutive slots take the contiguous-store path (``WriterConfig.block_t``)."""
    hq, hkv, d = 2, 2, 64
    cache, slots, t = prefill_case(block_size, dtype, layout, seed=block_size + block_t)
    fn = _kernel("triton", cache, dtype, d, d, interleaved_v)
    cache_want = cache.cpu().clone()
    qkv = make_qkv(t, hq, hkv, d, dtype, seed=block_t)
    positions = torch.randint(0, 100, (t,), generator=gen(1)).to(DEV)
    cos_sin = make_cos_sin(128, d, torch.float32)
    ks, vs = scales(dtype)
    w = torch.ones(d, dtype=dtype, device=DEV)
    q, k, v = fn(qkv, w, w, 1e-6, positions, cos_sin, False, cache, slots, ks, vs, interleaved_v,
                 hq, hkv, d, cfg=WriterConfig(block_t))
    _, ke, _ = _expect(qkv, w, w, 1e-6, positions, cos_sin, False, hq, hkv, d)
    assert rel_err(k, ke) < round_tol(dtype)
    assert_cache_equal(cache.cpu(), _cache_of(cache_want, k, v, slots, ks, vs, interleaved_v), dtype)


def _padding(provider, t, n_slots, n_real, block_t, *, dtype, cache_dtype, hq, hkv, d):
    block_size, interleaved_v = 16, True
    num_blocks = max(1, n_real) // block_size + 3
    guarded = guarded_cache(block_size, hkv, d, cache_dtype, num_blocks)
    cache = guarded.t
    fn = _kernel(provider, cache, dtype, d, d, interleaved_v)
    before = cache.cpu().clone()
    rows = guarded_rows(t, (hq + 2 * hkv) * d, dtype, seed=t + n_real)
    qkv = rows.t
    w = (1 + 0.1 * torch.randn(2, d, generator=gen(t))).to(dtype).to(DEV)
    positions = torch.randint(0, 1000, (t,), generator=gen(t)).to(DEV)
    positions[n_real:] = 0  # padding tokens at position 0, as engines pad
    cos_sin = make_cos_sin(1024, d, torch.float32)
    slots = padded_slots(num_blocks * block_size, t, n_slots, n_real, seed=n_slots)
    ks, vs = scales(dtype)
    q, k, v = fn(qkv, w[0], w[1], 1e-6, positions, cos_sin, False, cache, slots, ks, vs,
                 interleaved_v, hq, hkv, d,
                 **(dict(cfg=WriterConfig(block_t)) if provider == "triton" and block_t else {}))
    rows.assert_intact("qkv")
    guarded.assert_intact("kv_cache")
    qe, ke, ve = _expect(qkv, w[0], w[1], 1e-6, positions, cos_sin, False, hq, hkv, d)
    tol = round_tol(dtype, 2 if provider in ROUNDS_BEFORE_ROPE else 1)
    assert rel_err(q[:n_real], qe[:n_real]) < tol and rel_err(k[:n_real], ke[:n_real]) < tol
    assert torch.equal(v[:n_real].cpu(), ve[:n_real])
    assert_cache_equal(cache.cpu(), _cache_of(before, k, v, slots, ks, vs, interleaved_v),
                       cache_dtype, exact=cache_dtype == dtype)


@pytest.mark.parametrize("t,n_slots,n_real,block_t", PAD_CASES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_qk_norm_rope_and_cache_padding(provider, t, n_slots, n_real, block_t):
    """Padding tokens (slot -1, tokens past slot_mapping) across token tiles: the real tokens
    normalised, rotated and cached, no other cache byte changed, nothing written outside the
    cache (guard blocks) or read into it from past qkv."""
    _padding(provider, t, n_slots, n_real, block_t, dtype=torch.float16, cache_dtype=torch.float16,
             hq=4, hkv=2, d=64)


@pytest.mark.gpu
@pytest.mark.parametrize("t,n_slots,n_real,block_t", GPU_PAD_CASES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_qk_norm_rope_and_cache_padding_gpu(provider, t, n_slots, n_real, block_t, cache_dtype):
    _padding(provider, t, n_slots, n_real, block_t, dtype=torch.bfloat16, cache_dtype=cache_dtype,
             hq=32, hkv=8, d=128)


def _check_gpu(provider, fn, *, hq, hkv, d, cache, slots, qkv, w, positions, cos_sin, is_neox,
               ks, vs, interleaved_v):
    before = cache.cpu().clone()  # poisoned
    out = fn(qkv, w[0], w[1], 1e-6, positions, cos_sin, is_neox, cache, slots, ks, vs, interleaved_v,
             hq, hkv, d)
    want = _expect(qkv, w[0], w[1], 1e-6, positions, cos_sin, is_neox, hq, hkv, d)
    torch.cuda.synchronize()
    # Providers that round the normalised k before RoPE round twice.
    tol = round_tol(qkv.dtype, 2 if provider in ROUNDS_BEFORE_ROPE else 1)
    for o, e in zip(out, want):
        assert o.shape == e.shape and rel_err(o, e) < tol
    assert_cache_equal(cache.cpu(), _cache_of(before, out[1], out[2], slots, ks, vs, interleaved_v),
                       cache.dtype, exact=cache.dtype == qkv.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cache_dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size,layout,interleaved_v", GPU_GEOMETRY)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_qk_norm_rope_and_cache_gpu(provider, dtype, cache_dtype, block_size, layout, interleaved_v):
    t, hq, hkv, d = 300, 32, 8, 128
    seed = block_size + int(interleaved_v)
    cache, slots = make_cache(block_size, hkv, d, cache_dtype, layout, t, seed)
    fn = _kernel(provider, cache, dtype, d, d, interleaved_v)
    w = torch.randn(2, d, generator=gen(seed), dtype=torch.float32).mul(0.1).add(1).to(dtype).to(DEV)
    ks, vs = scales(dtype, 0.05, 0.03)
    _check_gpu(provider, fn, hq=hq, hkv=hkv, d=d, cache=cache, slots=pad_slots(slots, 7)[: t - 5].to(DEV),
               qkv=make_qkv(t, hq, hkv, d, dtype, seed), w=w,
               positions=torch.randint(0, 4000, (t,), generator=gen(seed)).to(DEV),
               cos_sin=make_cos_sin(4096, d, torch.float32), is_neox=False, ks=ks, vs=vs,
               interleaved_v=interleaved_v)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size,layout,interleaved_v,is_neox,rot_dim", [
    (16, CacheLayout.LHBNC, True, True, 128), (544, CacheLayout.LBHNC, False, False, 128),
    (32, CacheLayout.LHBNC, True, True, 64),
])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_qk_norm_rope_and_cache_gpu_bf16_neox_gptj(provider, cache_dtype, block_size, layout,
                                                   interleaved_v, is_neox, rot_dim):
    """bf16 with a bf16 or fp8-e4m3 cache, NeoX and GPT-J, partial rotary (AITER's cases)."""
    t, hq, hkv, d = 150, 16, 4, 128
    dtype = torch.bfloat16
    cache, slots = make_cache(block_size, hkv, d, cache_dtype, layout, t, seed=block_size)
    fn = _kernel(provider, cache, dtype, d, rot_dim, interleaved_v)
    w = torch.randn(2, d, generator=gen(10)).mul(0.1).add(1).to(dtype).to(DEV)
    ks, vs = scales(dtype, 0.05, 0.03)
    _check_gpu(provider, fn, hq=hq, hkv=hkv, d=d, cache=cache,
               slots=pad_slots(slots, 4)[: t - 2].to(DEV), qkv=make_qkv(t, hq, hkv, d, dtype, seed=9),
               w=w, positions=torch.randint(0, 4000, (t,), generator=gen(11)).to(DEV),
               cos_sin=make_cos_sin(4096, rot_dim, torch.float32), is_neox=is_neox, ks=ks, vs=vs,
               interleaved_v=interleaved_v)


@pytest.mark.parametrize("return_kv", [False, True])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_writes_into_strided_caller_buffers(provider, return_kv):
    """q/k go to the caller's ``q_out``/``k_out`` through their strides (here head-strided views
    of one poisoned tensor: its other heads stay poisoned); v is copied out only with
    ``return_kv``."""
    t, hq, hkv, d, dtype = 7, 4, 2, 64, torch.float32
    cache, slots = make_cache(16, hkv, d, dtype, CacheLayout.LHBNC, t, seed=5)
    fn = _kernel(provider, cache, dtype, d, d, True)
    cache_in = cache.cpu().clone()
    qkv = make_qkv(t, hq, hkv, d, dtype, seed=6)
    w = (1 + 0.1 * torch.randn(2, d, generator=gen(7))).to(dtype).to(DEV)
    positions = torch.randint(0, 100, (t,), generator=gen(8)).to(DEV)
    cos_sin = make_cos_sin(128, d, dtype)
    ks, vs = scales(dtype)
    out = poison(torch.empty(t, hq + hkv + 1, d, dtype=dtype, device=DEV))
    q_out, k_out = out[:, :hq], out[:, hq + 1:]
    q, k, v = fn(qkv, w[0], w[1], 1e-6, positions, cos_sin, True, cache, slots.to(DEV), ks, vs, True, hq, hkv, d,
                 q_out, k_out, return_kv)
    qe, ke, ve = _expect(qkv, w[0], w[1], 1e-6, positions, cos_sin, True, hq, hkv, d)
    assert q is q_out and k is k_out
    assert rel_err(q_out, qe) < 1e-6 and rel_err(k_out, ke) < 1e-6
    assert out[:, hq].isnan().all()  # the head between them: not written
    assert (v is None) if not return_kv else (torch.equal(v.cpu(), ve) and v.is_contiguous())
    # the cache holds exactly the k the op returned and the v of qkv: bit for bit
    assert_cache_equal(cache.cpu(), _cache_of(cache_in, k_out, ve, slots, ks, vs, True), dtype)
