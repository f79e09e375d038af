"""Triton ``rope_and_cache``: RoPE on query/key in place and the KV-cache write, one kernel.

grid = (token tiles, num_q_heads + num_kv_heads). A query-head program rotates its tile in
place. A KV-head program rotates its key tile, writes it back, loads the value tile and
scatters both into the paged cache (layouts and interleaved V as in ``reshape_and_cache``).
The unfused sequence reads the rotated key again for the cache write; here it never leaves
registers, and the whole op is one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reshape_and_cache import _store_kv_tile, cache_meta, num_warps_for, pick_block_t
from .rotary_embedding import _load_cos_sin, _rope_partner, head_strides

__all__ = ["rope_and_cache"]


@triton.jit
def _rope_and_cache_kernel(
    # pointers
    positions_ptr, query_ptr, key_ptr, value_ptr, kv_cache_ptr, slot_mapping_ptr,
    cos_sin_ptr, k_scale_ptr, v_scale_ptr,
    # sizes
    num_tokens, num_slots, num_q_heads,
    # strides (elements)
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cs,
    stride_cache_block, stride_cache_group,
    # meta
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
    partner, sign, col, in_rot = _rope_partner(offs_d, ROT_HALF, IS_NEOX)
    pos = tl.load(positions_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    cos, sin = _load_cos_sin(cos_sin_ptr, pos, stride_cs, col, in_rot, mask_t, ROT_HALF)
    tok = offs_t.to(tl.int64)
    model_ty = query_ptr.dtype.element_ty

    if pid_h < num_q_heads:
        q_base = query_ptr + tok[:, None] * stride_qt + pid_h * stride_qh
        mask = mask_t[:, None] & in_rot[None, :]
        x = tl.load(q_base + offs_d[None, :] * stride_qd, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(q_base + partner[None, :] * stride_qd, mask=mask, other=0.0).to(tl.float32)
        out = x * cos + sign[None, :] * xp * sin
        tl.store(q_base + offs_d[None, :] * stride_qd, out.to(model_ty), mask=mask)
    else:
        head = pid_h - num_q_heads
        k_base = key_ptr + tok[:, None] * stride_kt + head * stride_kh
        mask = mask_t[:, None] & mask_d[None, :]
        x = tl.load(k_base + offs_d[None, :] * stride_kd, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(k_base + partner[None, :] * stride_kd, mask=mask, other=0.0).to(tl.float32)
        # Round to the model dtype once: the cache gets exactly the key written back.
        k = (x * cos + sign[None, :] * xp * sin).to(model_ty)
        tl.store(k_base + offs_d[None, :] * stride_kd, k, mask=mask_t[:, None] & in_rot[None, :])

        in_slots = offs_t < num_slots
        slot = tl.load(slot_mapping_ptr + offs_t, mask=in_slots, other=-1).to(tl.int64)
        mask_w = in_slots & (slot >= 0)
        v_ptrs = value_ptr + tok[:, None] * stride_vt + head * stride_vh + offs_d[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=mask_w[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
        _store_kv_tile(
            kv_cache_ptr, k.to(tl.float32), v, slot, mask_w, head, offs_d, mask_d,
            k_scale, v_scale, stride_cache_block, stride_cache_group,
            HEAD_SIZE, BLOCK_SIZE, X, INTERLEAVED_V, IS_FP8, FP8_MAX, BLOCK_T,
        )


def rope_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
    *,
    block_t: int | None = None,
) -> None:
    """RoPE on ``query``/``key`` in place, then the rotated key and ``value`` into the cache.

    positions: ``[num_tokens]``; query ``[num_tokens, num_heads(*)head_size]`` (2-D or 3-D,
    any token stride); key likewise with num_kv_heads; value ``[num_tokens, num_kv_heads,
    head_size]``; kv_cache ``[num_blocks, 2, block_size, num_kv_heads * head_size]``;
    slot_mapping ``[n <= num_tokens]`` (entries < 0 skipped); cos_sin_cache
    ``[max_position, rot_dim]``; k_scale/v_scale one-element fp32. All tokens are rotated,
    the first ``n`` are cached.
    """
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    head_size = value.shape[-1]
    num_kv_heads = kv_cache.shape[3] // head_size
    num_q_heads = query.numel() // (num_tokens * head_size)
    block_d = triton.next_power_of_2(head_size)
    block_t = block_t or pick_block_t(num_tokens)
    grid = (triton.cdiv(num_tokens, block_t), num_q_heads + num_kv_heads)
    _rope_and_cache_kernel[grid](
        positions, query, key, value, kv_cache, slot_mapping, cos_sin_cache, k_scale, v_scale,
        num_tokens, slot_mapping.shape[0], num_q_heads,
        *head_strides(query, head_size),
        *head_strides(key, head_size),
        *head_strides(value, head_size),
        cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1),
        HEAD_SIZE=head_size, ROT_HALF=cos_sin_cache.shape[-1] // 2, IS_NEOX=bool(is_neox),
        INTERLEAVED_V=bool(interleaved_v), BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=num_warps_for(block_t, block_d),
        **cache_meta(kv_cache),
    )
