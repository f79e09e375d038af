"""Triton ``reshape_and_cache``: K/V ``[num_tokens, num_kv_heads, head_size]`` -> paged cache.

One program writes a tile of ``BLOCK_T`` tokens x one KV head (all ``head_size`` channels)
of K and V. The cache interiors are those of DESIGN.md (see ``layout.py``); the kernel reads
the layout (LHBNC or LBHNC) from two strides of the logical cache tensor, so both layouts
share one compiled kernel per (block size, head size, dtype):

- page base of (block b, KV head h) = ``b * stride_cache_block + h * head_size * block_size``
  (the V group adds ``stride_cache_group``);
- K:            ``base + (d // x) * block_size * x + t * x + d % x``
- V standard:   ``base + d * block_size + t``
- V interleaved ``base + (t // x) * head_size * x + d * x + t % x``

The jit helpers ``_store_kv_tile`` / ``_quantize`` are shared with the fused RoPE writers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...layout import cache_x, fp8_max, is_fp8_dtype
from .configs import WriterConfig, writer_block_t, writer_num_warps

__all__ = ["reshape_and_cache"]


@triton.jit
def _quantize(x, scale, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp32 values -> what the cache stores, still fp32: fp8 divides by the scale and
    saturates (+-inf to +-FP8_MAX); NaN stays NaN (the GPU's default min/max would turn it
    into -FP8_MAX)."""
    if IS_FP8:
        x = tl.clamp(x / scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return x


@triton.jit
def _slot_page(slot, mask_t, head, stride_cache_block,
               HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """(page base, offset in block) of each token's slot for one KV head; int64."""
    # Padding tokens point at slot 0 so no out-of-range address is ever formed.
    slot = tl.where(mask_t, slot, 0)
    # int64: the cache can exceed 2^31 elements.
    page = (slot // BLOCK_SIZE) * stride_cache_block + head.to(tl.int64) * (HEAD_SIZE * BLOCK_SIZE)
    return page, slot % BLOCK_SIZE


@triton.jit
def _store_k_cols(
    kv_cache_ptr,
    k,  # [BLOCK_T, N] fp32 values of channels offs_d
    offs_d, mask_d,  # [N] channel offsets (any subset of the head) and mask
    page, off, mask_t,  # [BLOCK_T] from _slot_page; mask_t: real token with slot >= 0
    k_scale,
    BLOCK_SIZE: tl.constexpr, X: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    """Store K channels into the ``[head_size // x, block_size, x]`` page: 16-byte runs of x."""
    offs_k = (offs_d // X) * (BLOCK_SIZE * X) + offs_d % X
    k_ptrs = kv_cache_ptr + (page + off * X)[:, None] + offs_k[None, :]
    k = _quantize(k, k_scale, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX).to(kv_cache_ptr.dtype.element_ty)
    tl.store(k_ptrs, k, mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _store_v_tile(
    kv_cache_ptr,
    v,  # [BLOCK_T, BLOCK_D] fp32
    slot, page, off, mask_t,  # [BLOCK_T]
    head,  # KV head index (scalar)
    offs_d, mask_d,  # [BLOCK_D]
    v_scale, stride_cache_block, stride_cache_group,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    INTERLEAVED_V: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Store a V tile into the standard ``[head_size, block_size]`` or interleaved
    ``[block_size // x, head_size, x]`` page of each token's block."""
    v = _quantize(v, v_scale, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX).to(kv_cache_ptr.dtype.element_ty)
    v_group = kv_cache_ptr + stride_cache_group
    # V runs along tokens. When the tile's tokens fill consecutive slots of one block from an
    # x-aligned offset (prefill), address them as off0 + i so the compiler sees contiguous
    # tokens and emits 16-byte stores; otherwise (decode, padding) scatter per element.
    offs_i = tl.arange(0, BLOCK_T)
    slot0 = tl.sum(tl.where(offs_i == 0, slot, 0), axis=0)
    off0 = slot0 % BLOCK_SIZE
    n_seq = tl.sum(((slot == slot0 + offs_i) & mask_t).to(tl.int32), axis=0)
    if BLOCK_T >= X:
        fast = (n_seq == BLOCK_T) & (off0 % X == 0) & (off0 + BLOCK_T <= BLOCK_SIZE)
    else:
        fast = False
    if fast:
        off0 = (off0 // X) * X  # same value; tells the compiler it is x-aligned
        # From the strides (not a reduction of page) so the compiler knows it is 16-aligned.
        page0 = (slot0 // BLOCK_SIZE) * stride_cache_block + head.to(tl.int64) * (HEAD_SIZE * BLOCK_SIZE)
        tok = off0 + offs_i
        if INTERLEAVED_V:
            v_ptrs = v_group + page0 + ((tok // X) * (HEAD_SIZE * X) + tok % X)[:, None] + (offs_d * X)[None, :]
        else:
            v_ptrs = v_group + page0 + tok[:, None] + (offs_d * BLOCK_SIZE)[None, :]
        tl.store(v_ptrs, v, mask=mask_d[None, :])
    else:
        if INTERLEAVED_V:
            v_tok = (off // X) * (HEAD_SIZE * X) + off % X
            v_ptrs = v_group + (page + v_tok)[:, None] + (offs_d * X)[None, :]
        else:
            v_ptrs = v_group + (page + off)[:, None] + (offs_d * BLOCK_SIZE)[None, :]
        tl.store(v_ptrs, v, mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _reshape_and_cache_kernel(
    # pointers
    key_ptr, value_ptr, kv_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    # sizes
    num_tokens,
    # strides (elements)
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cache_block, stride_cache_group,
    # meta
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    INTERLEAVED_V: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """grid = (cdiv(num_tokens, BLOCK_T), num_kv_heads)."""
    tl.static_assert(BLOCK_D >= HEAD_SIZE, "BLOCK_D covers the head")
    pid_t = tl.program_id(0)
    head = tl.program_id(1)

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_SIZE
    in_range = offs_t < num_tokens
    slot = tl.load(slot_mapping_ptr + offs_t, mask=in_range, other=-1).to(tl.int64)
    mask_t = in_range & (slot >= 0)
    # Loads are masked by range only, so they do not wait for the slot load.
    mask = in_range[:, None] & mask_d[None, :]

    tok = offs_t.to(tl.int64)
    k_ptrs = key_ptr + tok[:, None] * stride_kt + head * stride_kh + offs_d[None, :] * stride_kd
    v_ptrs = value_ptr + tok[:, None] * stride_vt + head * stride_vh + offs_d[None, :] * stride_vd
    k = tl.load(k_ptrs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptrs, mask=mask, other=0.0).to(tl.float32)

    k_scale = tl.load(k_scale_ptr).to(tl.float32)
    v_scale = tl.load(v_scale_ptr).to(tl.float32)
    page, off = _slot_page(slot, mask_t, head, stride_cache_block, HEAD_SIZE=HEAD_SIZE,
                           BLOCK_SIZE=BLOCK_SIZE)
    _store_k_cols(kv_cache_ptr, k, offs_d, mask_d, page, off, mask_t, k_scale,
                  BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
    _store_v_tile(kv_cache_ptr, v, slot, page, off, mask_t, head, offs_d, mask_d, v_scale,
                  stride_cache_block, stride_cache_group,
                  HEAD_SIZE=HEAD_SIZE, BLOCK_SIZE=BLOCK_SIZE, X=X, INTERLEAVED_V=INTERLEAVED_V,
                  IS_FP8=IS_FP8, FP8_MAX=FP8_MAX, BLOCK_T=BLOCK_T)


def cache_meta(kv_cache: torch.Tensor) -> dict:
    """Constexpr arguments every cache writer derives from the cache tensor."""
    fp8 = is_fp8_dtype(kv_cache.dtype)
    return dict(
        BLOCK_SIZE=kv_cache.shape[2],
        X=cache_x(kv_cache.dtype),
        IS_FP8=fp8,
        FP8_MAX=fp8_max(kv_cache.dtype) if fp8 else 0.0,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
    *,
    cfg: WriterConfig | None = None,
) -> None:
    """Write ``key``/``value`` into the paged cache (same semantics as the reference).

    key, value: ``[num_tokens, num_kv_heads, head_size]`` fp16/bf16/fp32, any strides
    (e.g. slices of a fused qkv tensor).
    kv_cache: ``[num_blocks, 2, block_size, num_kv_heads * head_size]`` LHBNC or LBHNC,
    model dtype or fp8 (e4m3fn/e5m2; quantized as ``x / scale`` saturated to the fp8 max).
    slot_mapping: ``[n]`` int32/int64 with ``n <= num_tokens``; only the first ``n`` tokens are
    written and entries < 0 (padding) are skipped.
    k_scale, v_scale: one-element fp32 tensors. ``cfg`` replaces the tile rules of ``configs``.
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    block_d = triton.next_power_of_2(head_size)
    block_t = cfg.block_t if cfg else writer_block_t(n)
    warps = (cfg and cfg.num_warps) or writer_num_warps(block_t, block_d)
    grid = (triton.cdiv(n, block_t), num_kv_heads)
    _reshape_and_cache_kernel[grid](
        key, value, kv_cache, slot_mapping, k_scale, v_scale,
        n,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        HEAD_SIZE=head_size, INTERLEAVED_V=bool(interleaved_v),
        BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=warps,
        **cache_meta(kv_cache),
    )
