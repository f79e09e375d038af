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

from .configs import WriterConfig, writer_block_t, writer_num_warps
from .reshape_and_cache import _slot_page, _store_k_cols, _store_v_tile, cache_meta
from .rotary_embedding import _half_cols, _load_cos_sin, _rotate, head_strides

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
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tl.static_assert(BLOCK_R >= ROT_HALF and BLOCK_D >= HEAD_SIZE, "tiles cover the head")
    tl.static_assert(2 * ROT_HALF <= HEAD_SIZE, "rot_dim <= head_size")
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_r, d1, d2, mask_r = _half_cols(ROT_HALF=ROT_HALF, BLOCK_R=BLOCK_R, IS_NEOX=IS_NEOX)
    pos = tl.load(positions_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    cos, sin = _load_cos_sin(cos_sin_ptr, pos, stride_cs, offs_r, mask_r, mask_t, ROT_HALF=ROT_HALF)
    tok = offs_t.to(tl.int64)
    model_ty = query_ptr.dtype.element_ty
    mask = mask_t[:, None] & mask_r[None, :]

    if pid_h < num_q_heads:
        q_base = query_ptr + tok[:, None] * stride_qt + pid_h * stride_qh
        x1 = tl.load(q_base + d1[None, :] * stride_qd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(q_base + d2[None, :] * stride_qd, mask=mask, other=0.0).to(tl.float32)
        o1, o2 = _rotate(x1, x2, cos, sin)
        tl.store(q_base + d1[None, :] * stride_qd, o1.to(model_ty), mask=mask)
        tl.store(q_base + d2[None, :] * stride_qd, o2.to(model_ty), mask=mask)
    else:
        head = pid_h - num_q_heads
        # Issue every independent load first: slot, key halves, value.
        in_slots = offs_t < num_slots
        slot = tl.load(slot_mapping_ptr + offs_t, mask=in_slots, other=-1).to(tl.int64)
        k_base = key_ptr + tok[:, None] * stride_kt + head * stride_kh
        x1 = tl.load(k_base + d1[None, :] * stride_kd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_base + d2[None, :] * stride_kd, mask=mask, other=0.0).to(tl.float32)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_SIZE
        v_ptrs = value_ptr + tok[:, None] * stride_vt + head * stride_vh + offs_d[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=mask_t[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)

        # Round to the model dtype once: the cache gets exactly the key written back.
        # (k1/k2, not o1/o2: a name bound in both branches must keep one type on a GPU.)
        o1, o2 = _rotate(x1, x2, cos, sin)
        k1 = o1.to(model_ty)
        k2 = o2.to(model_ty)
        tl.store(k_base + d1[None, :] * stride_kd, k1, mask=mask)
        tl.store(k_base + d2[None, :] * stride_kd, k2, mask=mask)

        mask_w = in_slots & (slot >= 0)
        page, off = _slot_page(slot, mask_w, head, stride_cache_block, HEAD_SIZE=HEAD_SIZE,
                               BLOCK_SIZE=BLOCK_SIZE)
        _store_k_cols(kv_cache_ptr, k1.to(tl.float32), d1, mask_r, page, off, mask_w, k_scale,
                      BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
        _store_k_cols(kv_cache_ptr, k2.to(tl.float32), d2, mask_r, page, off, mask_w, k_scale,
                      BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
        if 2 * ROT_HALF < HEAD_SIZE:  # partial rotary: the untouched channels go to the cache too
            dp = 2 * ROT_HALF + tl.arange(0, BLOCK_P)
            mask_p = dp < HEAD_SIZE
            xp = tl.load(k_base + dp[None, :] * stride_kd, mask=mask_t[:, None] & mask_p[None, :], other=0.0)
            _store_k_cols(kv_cache_ptr, xp.to(tl.float32), dp, mask_p, page, off, mask_w, k_scale,
                          BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
        _store_v_tile(kv_cache_ptr, v, slot, page, off, mask_w, head, offs_d, mask_d, v_scale,
                      stride_cache_block, stride_cache_group,
                      HEAD_SIZE=HEAD_SIZE, BLOCK_SIZE=BLOCK_SIZE, X=X, INTERLEAVED_V=INTERLEAVED_V,
                      IS_FP8=IS_FP8, FP8_MAX=FP8_MAX, BLOCK_T=BLOCK_T)


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
    cfg: WriterConfig | None = None,
) -> None:
    """RoPE on ``query``/``key`` in place, then the rotated key and ``value`` into the cache.

    positions: ``[num_tokens]``; query ``[num_tokens, num_heads(*)head_size]`` (2-D or 3-D,
    any token stride); key likewise with num_kv_heads; value ``[num_tokens, num_kv_heads,
    head_size]``; kv_cache ``[num_blocks, 2, block_size, num_kv_heads * head_size]``;
    slot_mapping ``[n <= num_tokens]`` (entries < 0 skipped); cos_sin_cache
    ``[max_position, rot_dim]``; k_scale/v_scale one-element fp32. All tokens are rotated,
    the first ``n`` are cached. ``cfg`` replaces the tile rules of ``configs``.
    """
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    head_size = value.shape[-1]
    num_kv_heads = kv_cache.shape[3] // head_size
    num_q_heads = query.numel() // (num_tokens * head_size)
    rot_half = cos_sin_cache.shape[-1] // 2
    block_d = triton.next_power_of_2(head_size)
    block_t = cfg.block_t if cfg else writer_block_t(num_tokens)
    warps = (cfg and cfg.num_warps) or writer_num_warps(block_t, triton.next_power_of_2(rot_half))
    grid = (triton.cdiv(num_tokens, block_t), num_q_heads + num_kv_heads)
    _rope_and_cache_kernel[grid](
        positions, query, key, value, kv_cache, slot_mapping, cos_sin_cache, k_scale, v_scale,
        num_tokens, slot_mapping.shape[0], num_q_heads,
        *head_strides(query, head_size),
        *head_strides(key, head_size),
        *head_strides(value, head_size),
        cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1),
        HEAD_SIZE=head_size, ROT_HALF=rot_half, IS_NEOX=bool(is_neox),
        INTERLEAVED_V=bool(interleaved_v), BLOCK_T=block_t,
        BLOCK_R=triton.next_power_of_2(rot_half),
        BLOCK_P=triton.next_power_of_2(max(1, head_size - 2 * rot_half)), BLOCK_D=block_d,
        num_warps=warps,
        **cache_meta(kv_cache),
    )
