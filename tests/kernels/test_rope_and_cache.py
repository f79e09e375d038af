"""``rope_and_cache`` (RoPE on q/k in place + the cache write) of every provider against the
float64 oracles (``writer_checks``): rotated q/k within the model dtype's rounding
(``round_tol``), every cache byte (poison included) equal to the oracle writer's over the
rotated k the op left in place (fp8 caches: within one step on a tiny fraction)."""

from __future__ import annotations

import pytest
import torch

import providers_under_test as put
from cases import rel_err
from inductor_rocm_attn.kernels.triton.configs import WriterConfig
from inductor_rocm_attn.layout import CacheLayout
from writer_checks import (
    DEV, GPU_DTYPES, GPU_GEOMETRY, GPU_PAD_CASES, PAD_CASES, PREFILL_TILES, assert_cache_equal,
    cache_query, gen, guarded_cache, guarded_rows, make_cache, make_cos_sin, make_qkv, oracle_rope,
    oracle_write, pad_slots, padded_slots, prefill_case, round_tol, scales, split,
)

OP = "rope_and_cache"
PROVIDERS = put.providers_for(OP)
# Providers that leave the keys of tokens without a cache slot (padding, past slot_mapping)
# unrotated: their keys are compared on the written tokens only.
ROTATES_CACHED_KEYS_ONLY = {"aiter"}

FUSED_CASES = [
    # block, head, rot, layout, interleaved, neox, dtype
    (16, 64, 64, CacheLayout.LHBNC, True, True, torch.float16),
    (32, 128, 64, CacheLayout.LBHNC, False, False, torch.float16),
    (544, 80, 80, CacheLayout.LHBNC, False, True, torch.float32),
    (16, 256, 256, CacheLayout.LBHNC, True, False, torch.float16),
    (544, 128, 128, CacheLayout.LBHNC, True, True, torch.float32),
    (16, 512, 128, CacheLayout.LBHNC, False, True, torch.float16),  # head 512, a quarter rotated
]


def _kernel(provider, cache, dtype, head_size, rot_dim, interleaved_v):
    return put.kernel(provider, OP, device=DEV, dtype=dtype, head_size=head_size,
                      features=("partial_rotary",) if rot_dim < head_size else (),
                      **cache_query(cache, dtype, interleaved_v))


def _expect(qkv, positions, cos_sin, is_neox, hq, hkv, d):
    """The q/k/v columns of qkv after the op (float64 chain rounded once), from a CPU copy."""
    t, dtype = qkv.shape[0], qkv.dtype
    q, k, v = split(qkv, hq, hkv, d)
    q_rot = oracle_rope(q.reshape(t, hq, d), positions, cos_sin, is_neox).to(dtype)
    k_rot = oracle_rope(k.reshape(t, hkv, d), positions, cos_sin, is_neox).to(dtype)
    return torch.cat([q_rot.reshape(t, -1), k_rot.reshape(t, -1), v.reshape(t, -1)], dim=1)


def _cache_of(before, qkv, slots, ks, vs, interleaved_v, hq, hkv, d):
    """``before`` with the rotated k the op left in qkv, and v, written by the oracle writer:
    the cache holds exactly the k the op returns (rounded once to the model dtype)."""
    _, k, v = split(qkv.cpu(), hq, hkv, d)
    want = before.clone()
    oracle_write(want, k.reshape(k.shape[0], hkv, d), v, slots.cpu(), ks.cpu(), vs.cpu(), interleaved_v)
    return want


@pytest.mark.parametrize("block_size,head_size,rot_dim,layout,interleaved_v,is_neox,dtype", FUSED_CASES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_rope_and_cache(provider, block_size, head_size, rot_dim, layout, interleaved_v, is_neox, dtype):
    t, hq, hkv = 10, 4, 2
    seed = block_size + head_size + rot_dim
    cache, slots = make_cache(block_size, hkv, head_size, dtype, layout, t, seed)
    fn = _kernel(provider, cache, dtype, head_size, rot_dim, interleaved_v)
    cache_want = cache.cpu().clone()
    qkv = make_qkv(t, hq, hkv, head_size, dtype, seed, pad_cols=8)
    qkv_in = qkv.cpu().clone()
    positions = torch.randint(0, 1000, (t,), generator=gen(seed)).to(DEV)
    cos_sin = make_cos_sin(1024, rot_dim, torch.float32)
    slots = pad_slots(slots)[: t - 1].to(DEV)
    ks, vs = scales(dtype)
    q, k, v = split(qkv, hq, hkv, head_size)
    fn(positions, q, k, v, cache, slots, cos_sin, is_neox, ks, vs, interleaved_v)
    want = _expect(qkv_in, positions, cos_sin, is_neox, hq, hkv, head_size)
    assert rel_err(qkv[:, : want.shape[1]], want) < round_tol(dtype)
    assert torch.equal(qkv[:, want.shape[1]:].cpu(), qkv_in[:, want.shape[1]:])  # padding columns
    cache_want = _cache_of(cache_want, qkv, slots, ks, vs, interleaved_v, hq, hkv, head_size)
    assert_cache_equal(cache.cpu(), cache_want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_op_takes_query_and_key_as_rows_of_heads(dtype):
    """The op (``torch.ops.rocm_attn.rope_and_cache``) takes q and k as ``[T, H * D]`` rows, as
    ``rotary_embedding`` and the cos/sin writers do and every provider is called here: the
    2-D slices of a fused qkv projection; a key whose heads disagree with the value's is refused."""
    t, hq, hkv, d, block_size = 9, 4, 2, 64, 16
    cache, slots = make_cache(block_size, hkv, d, dtype, CacheLayout.LBHNC, t, seed=3)
    cache_want = cache.cpu().clone()
    qkv = make_qkv(t, hq, hkv, d, dtype, seed=4, pad_cols=8)
    qkv_in = qkv.cpu().clone()
    positions = torch.randint(0, 1000, (t,), generator=gen(5)).to(DEV)
    cos_sin = make_cos_sin(1024, 32, torch.float32)  # partial rotary
    slots = pad_slots(slots)[: t - 1].to(DEV)
    ks, vs = scales(dtype)
    q, k, v = split(qkv, hq, hkv, d)
    assert q.dim() == 2 and k.dim() == 2 and not k.is_contiguous()
    torch.ops.rocm_attn.rope_and_cache(positions, q, k, v, cache, slots, cos_sin, False, ks, vs, True)
    want = _expect(qkv_in, positions, cos_sin, False, hq, hkv, d)
    assert rel_err(qkv[:, : want.shape[1]], want) < round_tol(dtype)
    cache_want = _cache_of(cache_want, qkv, slots, ks, vs, True, hq, hkv, d)
    assert_cache_equal(cache.cpu(), cache_want, dtype)
    with pytest.raises(ValueError, match=r"^rocm_attn\.rope_and_cache: key and value must both be"):
        torch.ops.rocm_attn.rope_and_cache(positions, q, qkv[:, : 3 * d], v, cache, slots, cos_sin, False, ks, vs,
                                           True)  # 3 key heads for a value of 2


@pytest.mark.parametrize("block_size,block_t,dtype,interleaved_v,layout", PREFILL_TILES)
def test_triton_prefill_tiles(block_size, block_t, dtype, interleaved_v, layout):
    """Tiles of consecutive slots take the contiguous-store path (``WriterConfig.block_t``)."""
    hq, hkv, d = 2, 2, 64
    cache, slots, t = prefill_case(block_size, dtype, layout, seed=block_size + block_t)
    fn = _kernel("triton", cache, dtype, d, d, interleaved_v)
    cache_want = cache.cpu().clone()
    qkv = make_qkv(t, hq, hkv, d, dtype, seed=block_t)
    qkv_in = qkv.cpu().clone()
    positions = torch.randint(0, 100, (t,), generator=gen(1)).to(DEV)
    cos_sin = make_cos_sin(128, d, torch.float32)
    ks, vs = scales(dtype)
    q, k, v = split(qkv, hq, hkv, d)
    fn(positions, q, k, v, cache, slots, cos_sin, True, ks, vs, interleaved_v, cfg=WriterConfig(block_t))
    assert rel_err(qkv, _expect(qkv_in, positions, cos_sin, True, hq, hkv, d)) < round_tol(dtype)
    cache_want = _cache_of(cache_want, qkv, slots, ks, vs, interleaved_v, hq, hkv, d)
    assert_cache_equal(cache.cpu(), cache_want, dtype)


def _padding(provider, t, n_slots, n_real, block_t, *, dtype, cache_dtype, hq, hkv, d):
    block_size, interleaved_v = 16, True
    num_blocks = max(1, n_real) // block_size + 3
    guarded = guarded_cache(block_size, hkv, d, cache_dtype, num_blocks)
    cache = guarded.t
    fn = _kernel(provider, cache, dtype, d, d, interleaved_v)
    before = cache.cpu().clone()
    rows = guarded_rows(t, (hq + 2 * hkv) * d, dtype, seed=t + n_real)
    qkv = rows.t
    qkv_in = qkv.cpu().clone()
    positions = torch.randint(0, 1000, (t,), generator=gen(t)).to(DEV)
    positions[n_real:] = 0  # padding tokens at position 0, as engines pad
    cos_sin = make_cos_sin(1024, d, torch.float32)
    slots = padded_slots(num_blocks * block_size, t, n_slots, n_real, seed=n_slots)
    ks, vs = scales(dtype)
    q, k, v = split(qkv, hq, hkv, d)
    fn(positions, q, k, v, cache, slots, cos_sin, True, ks, vs, interleaved_v,
       **(dict(cfg=WriterConfig(block_t)) if provider == "triton" and block_t else {}))
    rows.assert_intact("qkv")
    guarded.assert_intact("kv_cache")
    want = _expect(qkv_in, positions, cos_sin, True, hq, hkv, d)
    got = qkv.cpu()
    real = slice(0, n_real)  # the q/k of padding tokens are unspecified
    assert rel_err(got[real, : hq * d], want[real, : hq * d]) < round_tol(dtype)
    k_cols = slice(hq * d, (hq + hkv) * d)
    written = slots[:n_real].cpu() >= 0  # tokens a provider must rotate (ROTATES_CACHED_KEYS_ONLY)
    assert rel_err(got[real, k_cols][written], want[real, k_cols][written]) < round_tol(dtype)
    assert torch.equal(got[:, k_cols.stop:], qkv_in[:, k_cols.stop:])  # v untouched
    cache_want = _cache_of(before, got, slots, ks, vs, interleaved_v, hq, hkv, d)
    assert_cache_equal(cache.cpu(), cache_want, cache_dtype, exact=cache_dtype == dtype)


@pytest.mark.parametrize("t,n_slots,n_real,block_t", PAD_CASES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_rope_and_cache_padding(provider, t, n_slots, n_real, block_t):
    """Padding tokens (slot -1, tokens past slot_mapping) across token tiles: the real tokens
    rotated and cached, no other cache byte changed, nothing written outside qkv / the cache."""
    _padding(provider, t, n_slots, n_real, block_t, dtype=torch.float16, cache_dtype=torch.float16,
             hq=4, hkv=2, d=64)


@pytest.mark.gpu
@pytest.mark.parametrize("t,n_slots,n_real,block_t", GPU_PAD_CASES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_rope_and_cache_padding_gpu(provider, t, n_slots, n_real, block_t, cache_dtype):
    _padding(provider, t, n_slots, n_real, block_t, dtype=torch.bfloat16, cache_dtype=cache_dtype,
             hq=32, hkv=8, d=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cache_dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size,layout,interleaved_v", GPU_GEOMETRY)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_rope_and_cache_gpu(provider, dtype, cache_dtype, block_size, layout, interleaved_v):
    t, hq, hkv, d = 300, 32, 8, 128
    seed = block_size + int(interleaved_v)
    cache, slots = make_cache(block_size, hkv, d, cache_dtype, layout, t, seed)
    fn = _kernel(provider, cache, dtype, d, d, interleaved_v)
    cache_want = cache.cpu().clone()
    qkv = make_qkv(t, hq, hkv, d, dtype, seed)
    qkv_in = qkv.cpu().clone()
    positions = torch.randint(0, 4000, (t,), generator=gen(seed)).to(DEV)
    cos_sin = make_cos_sin(4096, d, torch.float32)
    slots = pad_slots(slots, 7)[: t - 5].to(DEV)
    ks, vs = scales(dtype, 0.05, 0.03)
    q, k, v = split(qkv, hq, hkv, d)
    fn(positions, q, k, v, cache, slots, cos_sin, True, ks, vs, interleaved_v)
    want = _expect(qkv_in, positions, cos_sin, True, hq, hkv, d)
    torch.cuda.synchronize()
    got = qkv.cpu()
    if provider in ROTATES_CACHED_KEYS_ONLY:
        written = torch.zeros(t, dtype=torch.bool)
        written[: slots.shape[0]] = slots.cpu() >= 0
        k_cols = slice(hq * d, (hq + hkv) * d)
        assert rel_err(got[:, : hq * d], want[:, : hq * d]) < round_tol(dtype)
        assert rel_err(got[written, k_cols], want[written, k_cols]) < round_tol(dtype)
    else:
        assert rel_err(got, want) < round_tol(dtype)
    cache_want = _cache_of(cache_want, got, slots, ks, vs, interleaved_v, hq, hkv, d)
    assert_cache_equal(cache.cpu(), cache_want, cache_dtype, exact=cache_dtype == dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size,layout,interleaved_v,is_neox", [
    (16, CacheLayout.LHBNC, True, True), (32, CacheLayout.LBHNC, True, False),
    (16, CacheLayout.LBHNC, False, True),
])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_rope_and_cache_gpu_bf16_neox_gptj(provider, cache_dtype, block_size, layout, interleaved_v,
                                           is_neox):
    """bf16 with a bf16 or fp8-e4m3 cache, NeoX and GPT-J (the cases AITER supports)."""
    t, hq, hkv, d = 200, 32, 8, 128
    dtype = torch.bfloat16
    cache, slots = make_cache(block_size, hkv, d, cache_dtype, layout, t, seed=block_size)
    fn = _kernel(provider, cache, dtype, d, d, interleaved_v)
    cache_want = cache.cpu().clone()
    qkv = make_qkv(t, hq, hkv, d, dtype, seed=5)
    qkv_in = qkv.cpu().clone()
    positions = torch.randint(0, 4000, (t,), generator=gen(6)).to(DEV)
    cos_sin = make_cos_sin(4096, d, torch.float32)
    slots = pad_slots(slots, 5)[: t - 3].to(DEV)
    ks, vs = scales(dtype, 0.05, 0.03)
    q, k, v = split(qkv, hq, hkv, d)
    fn(positions, q, k, v, cache, slots, cos_sin, is_neox, ks, vs, interleaved_v)
    want = _expect(qkv_in, positions, cos_sin, is_neox, hq, hkv, d)
    torch.cuda.synchronize()
    got = qkv.cpu()
    assert rel_err(got[:, : hq * d], want[:, : hq * d]) < round_tol(dtype)
    written = torch.ones(t, dtype=torch.bool)
    if provider in ROTATES_CACHED_KEYS_ONLY:
        written[:] = False
        written[: slots.shape[0]] = slots.cpu() >= 0
    k_cols = slice(hq * d, (hq + hkv) * d)
    assert rel_err(got[written, k_cols], want[written, k_cols]) < round_tol(dtype)
    cache_want = _cache_of(cache_want, got, slots, ks, vs, interleaved_v, hq, hkv, d)
    assert_cache_equal(cache.cpu(), cache_want, cache_dtype, exact=cache_dtype == dtype)
