"""Triton ``qk_norm_rope_and_cache``: split qkv, per-head RMSNorm on q/k, RoPE, cache k/v.

grid = (token tiles, num_heads + num_kv_heads), one kernel. Each program loads one head of
``BLOCK_T`` tokens from ``qkv`` as the two RoPE halves of ``rotary_embedding`` (plus the
un-rotated channels under partial rotary), normalises them in fp32 with the per-row factor
``rsqrt(mean(x^2) + eps)`` and their weights, rotates and rounds once to the model dtype.
Query programs write ``q``; KV programs write ``k`` (and ``v`` when asked: ``STORE_V``) and
scatter both into the cache. q and k go to the caller's buffers through their strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import WriterConfig, writer_block_t, writer_num_warps
from .reshape_and_cache import _slot_page, _store_k_cols, _store_v_tile, cache_meta
from .rotary_embedding import _half_cols, _load_cos_sin, _rotate

__all__ = ["qk_norm_rope_and_cache"]


@triton.jit
def _norm_rope(
    src,  # [BLOCK_T, 1] pointers to channel 0 of each token's head
    stride_d, w_ptr, d1, d2, mask_r, dp, mask_p, mask_t, cos, sin, eps,
    HEAD_SIZE: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """RMSNorm then RoPE of one head tile: (o1, o2, pass) fp32, channels (d1, d2, dp)."""
    m = mask_t[:, None] & mask_r[None, :]
    x1 = tl.load(src + d1[None, :] * stride_d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + d2[None, :] * stride_d, mask=m, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if HAS_PASS:
        xp = tl.load(src + dp[None, :] * stride_d, mask=mask_t[:, None] & mask_p[None, :], other=0.0)
        xp = xp.to(tl.float32)
        ss += tl.sum(xp * xp, axis=1)
    else:
        xp = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    inv_rms = tl.rsqrt(ss / HEAD_SIZE + eps)[:, None]
    w1 = tl.load(w_ptr + d1, mask=mask_r, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + d2, mask=mask_r, other=0.0).to(tl.float32)
    x1 = x1 * inv_rms * w1[None, :]
    x2 = x2 * inv_rms * w2[None, :]
    if HAS_PASS:
        wp = tl.load(w_ptr + dp, mask=mask_p, other=0.0).to(tl.float32)
        xp = xp * inv_rms * wp[None, :]
    o1, o2 = _rotate(x1, x2, cos, sin)
    return o1, o2, xp


@triton.jit
def _qk_norm_rope_and_cache_kernel(
    # pointers
    qkv_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, cos_sin_ptr,
    kv_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    q_ptr, k_ptr, v_ptr,  # outputs [T, H, D], any strides (v: only with STORE_V)
    # sizes and scalars
    num_tokens, num_slots, eps,
    # strides (elements)
    stride_qkv_t, stride_qkv_d,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_cs,
    stride_cache_block, stride_cache_group,
    # meta
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    INTERLEAVED_V: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, STORE_V: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tl.static_assert(BLOCK_R >= ROT_HALF and BLOCK_D >= HEAD_SIZE, "tiles cover the head")
    tl.static_assert(2 * ROT_HALF <= HEAD_SIZE, "rot_dim <= head_size")
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    HAS_PASS: tl.constexpr = 2 * ROT_HALF < HEAD_SIZE

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_r, d1, d2, mask_r = _half_cols(ROT_HALF=ROT_HALF, BLOCK_R=BLOCK_R, IS_NEOX=IS_NEOX)
    dp = 2 * ROT_HALF + tl.arange(0, BLOCK_P)
    mask_p = dp < HEAD_SIZE
    pos = tl.load(positions_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    cos, sin = _load_cos_sin(cos_sin_ptr, pos, stride_cs, offs_r, mask_r, mask_t, ROT_HALF=ROT_HALF)
    tok = offs_t.to(tl.int64)
    row = qkv_ptr + tok[:, None] * stride_qkv_t
    model_ty = qkv_ptr.dtype.element_ty
    mask = mask_t[:, None] & mask_r[None, :]
    mask_pp = mask_t[:, None] & mask_p[None, :]

    if pid_h < NUM_HEADS:
        src = row + (pid_h * HEAD_SIZE) * stride_qkv_d
        o1, o2, xp = _norm_rope(src, stride_qkv_d, q_weight_ptr, d1, d2, mask_r, dp, mask_p, mask_t,
                                cos, sin, eps, HEAD_SIZE=HEAD_SIZE, HAS_PASS=HAS_PASS, BLOCK_T=BLOCK_T,
                                BLOCK_P=BLOCK_P)
        dst = q_ptr + tok[:, None] * stride_qt + pid_h * stride_qh
        tl.store(dst + d1[None, :] * stride_qd, o1.to(model_ty), mask=mask)
        tl.store(dst + d2[None, :] * stride_qd, o2.to(model_ty), mask=mask)
        if HAS_PASS:
            tl.store(dst + dp[None, :] * stride_qd, xp.to(model_ty), mask=mask_pp)
    else:
        head = pid_h - NUM_HEADS
        in_slots = offs_t < num_slots
        slot = tl.load(slot_mapping_ptr + offs_t, mask=in_slots, other=-1).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_SIZE
        v_src = row + ((NUM_HEADS + NUM_KV_HEADS + head) * HEAD_SIZE) * stride_qkv_d
        v = tl.load(v_src + offs_d[None, :] * stride_qkv_d, mask=mask_t[:, None] & mask_d[None, :], other=0.0)
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
        src = row + ((NUM_HEADS + head) * HEAD_SIZE) * stride_qkv_d
        o1, o2, xp = _norm_rope(src, stride_qkv_d, k_weight_ptr, d1, d2, mask_r, dp, mask_p, mask_t,
                                cos, sin, eps, HEAD_SIZE=HEAD_SIZE, HAS_PASS=HAS_PASS, BLOCK_T=BLOCK_T,
                                BLOCK_P=BLOCK_P)
        # Round once to the model dtype: the cache gets exactly the k returned. (New names:
        # Triton needs a name bound in both branches to keep one type; o1/o2/xp are fp32 there.)
        k1 = o1.to(model_ty)
        k2 = o2.to(model_ty)
        kp = xp.to(model_ty)
        k_dst = k_ptr + tok[:, None] * stride_kt + head * stride_kh
        tl.store(k_dst + d1[None, :] * stride_kd, k1, mask=mask)
        tl.store(k_dst + d2[None, :] * stride_kd, k2, mask=mask)
        if HAS_PASS:
            tl.store(k_dst + dp[None, :] * stride_kd, kp, mask=mask_pp)
        if STORE_V:  # a contiguous [T, Hkv, D] copy of the V slice
            v_off = (tok[:, None] * NUM_KV_HEADS + head) * HEAD_SIZE
            tl.store(v_ptr + v_off + offs_d[None, :], v, mask=mask_t[:, None] & mask_d[None, :])

        mask_w = in_slots & (slot >= 0)
        page, off = _slot_page(slot, mask_w, head, stride_cache_block, HEAD_SIZE=HEAD_SIZE,
                               BLOCK_SIZE=BLOCK_SIZE)
        _store_k_cols(kv_cache_ptr, k1.to(tl.float32), d1, mask_r, page, off, mask_w, k_scale,
                      BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
        _store_k_cols(kv_cache_ptr, k2.to(tl.float32), d2, mask_r, page, off, mask_w, k_scale,
                      BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
        if HAS_PASS:
            _store_k_cols(kv_cache_ptr, kp.to(tl.float32), dp, mask_p, page, off, mask_w, k_scale,
                          BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
        _store_v_tile(kv_cache_ptr, v.to(tl.float32), slot, page, off, mask_w, head, offs_d, mask_d, v_scale,
                      stride_cache_block, stride_cache_group,
                      HEAD_SIZE=HEAD_SIZE, BLOCK_SIZE=BLOCK_SIZE, X=X, INTERLEAVED_V=INTERLEAVED_V,
                      IS_FP8=IS_FP8, FP8_MAX=FP8_MAX, BLOCK_T=BLOCK_T)


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
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    return_kv: bool = True,
    *,
    cfg: WriterConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Split, normalise, rotate and cache (same semantics as the reference).

    qkv: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]``, any token stride.
    q_weight, k_weight: ``[head_size]``. positions: ``[num_tokens]``. cos_sin_cache:
    ``[max_position, rot_dim]``. kv_cache / slot_mapping / scales as in ``reshape_and_cache``.
    q and k (in ``qkv.dtype``) are stored into ``q_out [T, num_heads, head_size]`` /
    ``k_out [T, num_kv_heads, head_size]`` through their strides, or into fresh contiguous
    tensors when those are None. Returns ``(q, k, v)``: v is a fresh contiguous copy of the V
    slice when ``return_kv``, else None (nothing is stored for it). ``cfg`` replaces the tile
    rules of ``configs``.
    """
    t = qkv.shape[0]
    q = qkv.new_empty(t, num_heads, head_size) if q_out is None else q_out
    k = qkv.new_empty(t, num_kv_heads, head_size) if k_out is None else k_out
    v = qkv.new_empty(t, num_kv_heads, head_size) if return_kv else None
    if t == 0:
        return q, k, v
    rot_half = cos_sin_cache.shape[-1] // 2
    block_d = triton.next_power_of_2(head_size)
    block_t = cfg.block_t if cfg else writer_block_t(t)
    warps = (cfg and cfg.num_warps) or writer_num_warps(block_t, triton.next_power_of_2(rot_half))
    grid = (triton.cdiv(t, block_t), num_heads + num_kv_heads)
    _qk_norm_rope_and_cache_kernel[grid](
        qkv, q_weight, k_weight, positions, cos_sin_cache,
        kv_cache, slot_mapping, k_scale, v_scale,
        q, k, k if v is None else v,
        t, slot_mapping.shape[0], float(eps),
        qkv.stride(0), qkv.stride(1),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size, ROT_HALF=rot_half, IS_NEOX=bool(is_neox),
        INTERLEAVED_V=bool(interleaved_v), STORE_V=v is not None, BLOCK_T=block_t,
        BLOCK_R=triton.next_power_of_2(rot_half),
        BLOCK_P=triton.next_power_of_2(max(1, head_size - 2 * rot_half)), BLOCK_D=block_d,
        num_warps=warps,
        **cache_meta(kv_cache),
    )
    return q, k, v
