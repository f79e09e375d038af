"""Triton ``qk_norm_rope_and_cache``: split qkv, per-head RMSNorm on q/k, RoPE, cache k/v.

grid = (token tiles, num_heads + num_kv_heads), one kernel. Each program loads one head tile
of ``qkv`` ``[BLOCK_T, head_size]``, normalises it in fp32 (``x * rsqrt(mean(x^2) + eps) * w``),
rotates it with the partner-channel RoPE of ``rotary_embedding`` (the partner is normalised
with the same per-row factor and its own weight) and rounds once to the model dtype. Query
programs write ``q``; KV programs write ``k`` and ``v`` and scatter both into the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reshape_and_cache import _store_kv_tile, cache_meta, num_warps_for, pick_block_t
from .rotary_embedding import _load_cos_sin, _rope_partner

__all__ = ["qk_norm_rope_and_cache"]


@triton.jit
def _norm_rope_tile(
    src_ptrs,  # [BLOCK_T, 1] pointers to channel 0 of each token's head
    w_ptr, offs_d, partner, sign, mask, cos, sin, eps, stride_d,
    HEAD_SIZE: tl.constexpr,
):
    """RMSNorm then RoPE of one head tile, fp32 ``[BLOCK_T, BLOCK_D]``."""
    x = tl.load(src_ptrs + offs_d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src_ptrs + partner[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    mask_d = offs_d < HEAD_SIZE
    w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=mask_d, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_SIZE + eps)[:, None]
    x = x * inv_rms * w[None, :]
    xp = xp * inv_rms * wp[None, :]
    return x * cos + sign[None, :] * xp * sin


@triton.jit
def _qk_norm_rope_and_cache_kernel(
    # pointers
    qkv_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, cos_sin_ptr,
    kv_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    q_ptr, k_ptr, v_ptr,  # outputs [T, H, D] contiguous
    # sizes and scalars
    num_tokens, num_slots, eps,
    # strides (elements)
    stride_qkv_t, stride_qkv_d,
    stride_cs,
    stride_cache_block, stride_cache_group,
    # meta
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    INTERLEAVED_V: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < num_tokens
    mask_d = offs_d < HEAD_SIZE
    mask = mask_t[:, None] & mask_d[None, :]
    partner, sign, col, in_rot = _rope_partner(offs_d, ROT_HALF, IS_NEOX)
    pos = tl.load(positions_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    cos, sin = _load_cos_sin(cos_sin_ptr, pos, stride_cs, col, in_rot, mask_t, ROT_HALF)
    tok = offs_t.to(tl.int64)
    row = qkv_ptr + tok[:, None] * stride_qkv_t
    model_ty = qkv_ptr.dtype.element_ty

    if pid_h < NUM_HEADS:
        src = row + (pid_h * HEAD_SIZE) * stride_qkv_d
        q = _norm_rope_tile(src, q_weight_ptr, offs_d, partner, sign, mask, cos, sin, eps,
                            stride_qkv_d, HEAD_SIZE)
        q_ptrs = q_ptr + (tok[:, None] * NUM_HEADS + pid_h) * HEAD_SIZE + offs_d[None, :]
        tl.store(q_ptrs, q.to(model_ty), mask=mask)
    else:
        head = pid_h - NUM_HEADS
        src = row + ((NUM_HEADS + head) * HEAD_SIZE) * stride_qkv_d
        k = _norm_rope_tile(src, k_weight_ptr, offs_d, partner, sign, mask, cos, sin, eps,
                            stride_qkv_d, HEAD_SIZE).to(model_ty)
        v_src = row + ((NUM_HEADS + NUM_KV_HEADS + head) * HEAD_SIZE) * stride_qkv_d
        v = tl.load(v_src + offs_d[None, :] * stride_qkv_d, mask=mask, other=0.0)
        out_offs = (tok[:, None] * NUM_KV_HEADS + head) * HEAD_SIZE + offs_d[None, :]
        tl.store(k_ptr + out_offs, k, mask=mask)
        tl.store(v_ptr + out_offs, v, mask=mask)

        in_slots = offs_t < num_slots
        slot = tl.load(slot_mapping_ptr + offs_t, mask=in_slots, other=-1).to(tl.int64)
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
        _store_kv_tile(
            kv_cache_ptr, k.to(tl.float32), v.to(tl.float32), slot, in_slots & (slot >= 0),
            head, offs_d, mask_d, k_scale, v_scale, stride_cache_block, stride_cache_group,
            HEAD_SIZE, BLOCK_SIZE, X, INTERLEAVED_V, IS_FP8, FP8_MAX, BLOCK_T,
        )


def qk_norm_rope_and_cache(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    *,
    block_t: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split, normalise, rotate and cache (same semantics as the reference).

    qkv: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]``, any token stride.
    q_weight, k_weight: ``[head_size]``. positions: ``[num_tokens]``. cos_sin_cache:
    ``[max_position, rot_dim]``. kv_cache / slot_mapping / scales as in ``reshape_and_cache``.
    Returns fresh contiguous ``q [T, num_heads, head_size]``, ``k``/``v``
    ``[T, num_kv_heads, head_size]`` in ``qkv.dtype``.
    """
    t = qkv.shape[0]
    q = qkv.new_empty(t, num_heads, head_size)
    k = qkv.new_empty(t, num_kv_heads, head_size)
    v = qkv.new_empty(t, num_kv_heads, head_size)
    if t == 0:
        return q, k, v
    block_d = triton.next_power_of_2(head_size)
    block_t = block_t or pick_block_t(t)
    grid = (triton.cdiv(t, block_t), num_heads + num_kv_heads)
    _qk_norm_rope_and_cache_kernel[grid](
        qkv, q_weight, k_weight, positions, cos_sin_cache,
        kv_cache, slot_mapping, k_scale, v_scale,
        q, k, v,
        t, slot_mapping.shape[0], float(eps),
        qkv.stride(0), qkv.stride(1),
        cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size, ROT_HALF=cos_sin_cache.shape[-1] // 2, IS_NEOX=bool(is_neox),
        INTERLEAVED_V=bool(interleaved_v), BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=num_warps_for(block_t, block_d),
        **cache_meta(kv_cache),
    )
    return q, k, v
