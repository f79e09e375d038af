"""Inputs, float64 oracles and comparisons for the cache writers and RoPE kernels.

The oracles are written apart from ``kernels.reference`` (which is itself a provider under
test): the cache write addresses each (block, K/V group) page as a flat array with the
interior formulas of the design (K ``[heads, head/x, block, x]``, V ``[heads, head, block]``
or interleaved ``[heads, block/x, head, x]``, x = 16 bytes / element), RoPE rotates channel
pairs as complex numbers, RMSNorm is computed per head in float64. Each result is rounded
once to the model dtype, as the op's contract says.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors in fp16/fp32
only: the interpreter's bf16 is broken and its fp32 -> fp8 conversion rounds wrongly at
binade boundaries (measured: 1.94 -> 1.0 in e4m3), so on CPU fp8 is checked with values
that are exact in fp8 (layout, scale, saturation) and fp8 rounding on the GPU. Every cache
and output is poisoned (NaN bytes) first; cache comparisons cover every byte, so a slot that
must not be written (padding, tokens past ``slot_mapping``) has to stay poisoned. The fused
writers' caches are compared bit for bit with the oracle writer applied to the q/k/v the op
returned (the cache holds exactly those), and those values with the float64 chain within
the model dtype's rounding (``round_tol``).
"""

from __future__ import annotations

import math

import torch

from cases import Guarded, poison
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, is_fp8_dtype

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
LAYOUTS = (CacheLayout.LHBNC, CacheLayout.LBHNC)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make_cache(block_size, num_kv_heads, head_size, dtype, layout, num_tokens, seed):
    """Poisoned cache with room for ``num_tokens`` at random slots + a slot_mapping for them."""
    num_blocks = math.ceil(num_tokens / block_size) + 2
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, dtype, CacheLayout(layout))
    cache = poison(allocate_kv_cache(spec, num_blocks, DEV))
    slots = torch.randperm(num_blocks * block_size, generator=gen(seed))[:num_tokens]
    return cache, slots


def make_cos_sin(max_pos, rot_dim, dtype, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat((f.cos(), f.sin()), dim=-1).to(dtype).to(DEV)


def make_qkv(t, hq, hkv, d, dtype, seed, pad_cols=0):
    """A fused ``[T, (hq + 2 hkv) d + pad]`` tensor: its q/k/v slices are strided views."""
    w = (hq + 2 * hkv) * d + pad_cols
    return torch.randn(t, w, generator=gen(seed), dtype=torch.float32).to(dtype).to(DEV)


def split(qkv, hq, hkv, d):
    t = qkv.shape[0]
    q = qkv[:, : hq * d]
    k = qkv[:, hq * d: (hq + hkv) * d]
    v = qkv[:, (hq + hkv) * d: (hq + 2 * hkv) * d].view(t, hkv, d)
    return q, k, v


def pad_slots(slots, pad_every=3):
    s = slots.clone()
    s[1::pad_every] = -1  # padding: must be skipped
    return s


def scales(dtype, ks=0.5, vs=2.0):
    return (torch.tensor([ks], dtype=torch.float32, device=DEV),
            torch.tensor([vs], dtype=torch.float32, device=DEV))


def cache_query(cache, model_dtype, interleaved_v):
    """The ``supports`` keywords that describe a cache (for ``providers_under_test.kernel``)."""
    import providers_under_test as put
    from inductor_rocm_attn.layout import cache_layout_of

    return dict(block_size=cache.shape[2], layout=cache_layout_of(cache), interleaved_v=interleaved_v,
                kv_cache_dtype=put.cache_dtype_name(cache.dtype, model_dtype))


# --- oracles ---------------------------------------------------------------------------------


def _to_cache(x, cache_dtype, scale):
    """Model-dtype values -> cache storage: fp8 (any of the four kinds, the ROCm fnuz ones
    too) divides by the scale and saturates."""
    x = x.to(torch.float64)
    if is_fp8_dtype(cache_dtype):
        m = torch.finfo(cache_dtype).max
        return (x / float(scale)).clamp(-m, m).to(cache_dtype)
    return x.to(cache_dtype)


def oracle_write(cache, key, value, slot_mapping, k_scale, v_scale, interleaved_v):
    """Write ``key``/``value`` ``[n, kv_heads, head]`` (the first ``len(slot_mapping)``
    tokens) into CPU ``cache`` at their slots, skipping slots < 0."""
    _, _, block_size, width = cache.shape
    heads, d = key.shape[1], key.shape[2]
    assert width == heads * d
    x = 16 // cache.element_size()
    h = torch.arange(heads)[:, None] * (d * block_size)  # a head's page offset in the group
    dd = torch.arange(d)[None, :]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, t = divmod(slot, block_size)
        k_page, v_page = cache[blk, 0], cache[blk, 1]
        assert k_page.is_contiguous() and v_page.is_contiguous()
        k_page.view(-1)[h + (dd // x) * (block_size * x) + t * x + dd % x] = _to_cache(
            key[i], cache.dtype, k_scale)
        if interleaved_v:
            v_idx = h + (t // x) * (d * x) + dd * x + t % x
        else:
            v_idx = h + dd * block_size + t
        v_page.view(-1)[v_idx] = _to_cache(value[i], cache.dtype, v_scale)


def oracle_rope(x, positions, cos_sin_cache, is_neox):
    """``x`` ``[T, H, D]`` rotated over the first ``rot_dim`` channels, float64: each channel
    pair (NeoX: i and i + rot/2; GPT-J: 2i and 2i + 1) times ``cos + i sin``."""
    x = x.to(torch.float64).clone()
    cs = cos_sin_cache.cpu().to(torch.float64)[positions.cpu().long()]
    half = cs.shape[-1] // 2
    turn = torch.complex(cs[:, :half], cs[:, half:])[:, None, :]
    i1 = torch.arange(half) if is_neox else torch.arange(0, 2 * half, 2)
    i2 = i1 + half if is_neox else i1 + 1
    z = torch.complex(x[..., i1], x[..., i2]) * turn
    x[..., i1], x[..., i2] = z.real, z.imag
    return x


def oracle_rms_norm(x, weight, eps):
    """Per-head RMSNorm in float64: ``x`` ``[T, H, D]``, ``weight`` ``[D]``."""
    x = x.to(torch.float64)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.cpu().to(torch.float64)


# --- comparisons -----------------------------------------------------------------------------


def assert_cache_equal(out, expected, cache_dtype, exact=True, max_off=1e-3):
    """Every byte, NaN poison included.

    ``exact``: bit for bit. A model-dtype cache always is: the op rounds k/v once to the
    model dtype and stores exactly that (a copy), so compare with the oracle writer applied
    to the values the op returned (``writer_checks.oracle_write``). ``exact=False`` is for
    fp8 caches only (the GPU: the interpreter's fp8 rounding is wrong): every code within one
    fp8 step of the expected one, and at most ``max_off`` of the elements off at all. The
    kernel quantizes with an fp32 quotient ``x / scale`` (``div.full``: 2 ulp) against the
    oracle's float64 one; the two fall on different sides of an fp8 rounding boundary with
    probability ~2^-18 per element, far below ``max_off``."""
    if exact:
        bad = (out.view(torch.uint8) != expected.view(torch.uint8)).sum().item()
        assert bad == 0, f"{bad} cache bytes differ"
        return
    assert cache_dtype in FP8, "a model-dtype cache is a copy of the stored values: compare exactly"
    o, e = out.double(), expected.double()
    assert torch.equal(o.isnan(), e.isnan()), "written/unwritten slots differ"
    # fp8 codes are monotonic in magnitude: "one step" = codes at most 1 apart (across 0 too).
    a, b = out.view(torch.uint8).long(), expected.view(torch.uint8).long()
    ma, mb = a & 0x7F, b & 0x7F
    same_sign = (a >> 7) == (b >> 7)
    dist = torch.where(same_sign, (ma - mb).abs(), ma + mb)
    assert int(dist.max()) <= 1, f"{int((dist > 1).sum())} fp8 cache elements beyond one step"
    off = (a != b).double().mean().item()
    assert off <= max_off, f"{off:.5f} of the fp8 cache elements are one step off (> {max_off})"


def round_tol(dtype, roundings=1):
    """Norm-wise relative error of a result rounded ``roundings`` times to ``dtype`` from
    fp32 arithmetic: each rounding moves an element by at most the unit roundoff u
    (half an ulp), so the norm by at most u; twice that per rounding leaves room for the
    fp32 arithmetic before it (fp32 itself: a few ulps of fp32 arithmetic, 1e-6)."""
    u = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}.get(dtype)
    return 1e-6 if u is None else 2 * u * roundings


def fp8_exact(shape, dtype, scale, seed):
    """Random values that are exactly representable as ``fp8 * scale`` (plus a few to saturate)."""
    x = torch.randn(shape, generator=gen(seed)) * 8
    x = x.to(torch.float8_e4m3fn).to(torch.float32) * scale
    flat = x.view(-1)
    flat[::17] = 1e4 * scale  # saturates to the fp8 max
    flat[5::17] = -1e4 * scale
    return x.to(dtype).to(DEV)


def prefill_slots(lens_and_starts, block_size, num_blocks, seed):
    """Sequences written from offset ``start`` of fresh random blocks, tokens in slot order."""
    perm = torch.randperm(num_blocks, generator=gen(seed)).tolist()
    out = []
    for length, start in lens_and_starts:
        pos = torch.arange(start, start + length)
        blocks = torch.tensor([perm.pop() for _ in range(math.ceil((start + length) / block_size))])
        out.append(blocks[pos // block_size] * block_size + pos % block_size)
    return torch.cat(out)


def prefill_case(block_size, dtype, layout, seed):
    """The prefill-tiles case of the writers: three sequences (aligned full tiles, one
    starting mid-block, a short one) with one padded token; returns (cache, slots, t)."""
    hkv, d = 2, 64
    seqs = [(40, 0), (21, 5), (7, 0)]
    t = sum(n for n, _ in seqs)
    num_blocks = sum(math.ceil((n + s) / block_size) for n, s in seqs) + 2
    spec = KVCacheSpec(block_size, hkv, d, dtype, layout)
    cache = poison(allocate_kv_cache(spec, num_blocks, DEV))
    slots = prefill_slots(seqs, block_size, num_blocks, seed=seed)
    slots[45] = -1
    return cache, slots.to(DEV), t


# --- padded batches ----------------------------------------------------------------------------

# (tokens, slot_mapping entries, real tokens, Triton's block_t) of the padding tests: the
# padding runs (slot -1, then tokens with no entry) cross token tiles, and the token count is
# a multiple of no tile. The GPU rows use the tuned tile (8 tokens above 512).
PAD_CASES = [(29, 25, 21, 8), (16, 16, 2, 16), (37, 20, 0, 8), (45, 45, 30, 4)]
GPU_PAD_CASES = [(1000, 700, 600, None), (777, 777, 1, None), (130, 100, 3, None)]


def padded_slots(num_slots, t, n_slots, n_real, seed):
    """slot_mapping of a padded batch of ``t`` tokens: ``n_slots`` (<= t) entries, the first
    ``n_real`` at distinct random slots below ``num_slots`` (every fourth of them padding,
    -1), the rest -1; the tokens past ``n_slots`` have no entry (not written either)."""
    slots = torch.full((n_slots,), -1, dtype=torch.int64)
    slots[:n_real] = torch.randperm(num_slots, generator=gen(seed))[:n_real]
    slots[3:n_real:4] = -1
    assert n_slots <= t
    return slots.to(DEV)


def guarded_cache(block_size, num_kv_heads, head_size, dtype, num_blocks, guard=2):
    """A poisoned LBHNC cache (blocks outermost) between ``guard`` blocks of guard bytes
    (``cases.Guarded``): a write past either end of the cache lands in a guard block."""
    return Guarded((num_blocks, 2, block_size, num_kv_heads * head_size), dtype, DEV, guard=guard)


def guarded_rows(t, width, dtype, seed, guard=16):
    """A random ``[t, width]`` tensor between guard rows (in-place q/k of the RoPE ops)."""
    g = Guarded((t, width), dtype, DEV, guard=guard)
    g.t.copy_(torch.randn(t, width, generator=gen(seed)).to(dtype))
    return g


# (block_size, block_t, dtype, interleaved_v, layout) of the prefill-tiles tests
PREFILL_TILES = [
    (16, 16, torch.float16, True, CacheLayout.LHBNC), (32, 8, torch.float16, False, CacheLayout.LBHNC),
    (544, 16, torch.float32, True, CacheLayout.LBHNC), (16, 8, torch.float32, False, CacheLayout.LHBNC),
]
# (model dtype, cache dtype) of the GPU writer tests; their cache geometries
GPU_DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
              (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2)]
GPU_GEOMETRY = [(16, CacheLayout.LHBNC, True), (32, CacheLayout.LBHNC, False),
                (544, CacheLayout.LHBNC, False), (16, CacheLayout.LBHNC, True)]
