"""Triton ``rope_cos_sin_and_cache``: RoPE with the caller's per-token cos/sin (optionally
after a per-head RMSNorm) on query/key in place, and the KV-cache write, one kernel.

transformers computes cos/sin once per forward (``[B, T, D]`` from ``position_ids``) and
rotates with ``x * cos + rotate_half(x) * sin``. This kernel takes those cos/sin rows as
they are (``[T, rot_dim]``, any strides) and applies that formula channel for channel, so it
computes the model's function for any cos/sin (scaled variants, mRoPE sections: whatever
the model put in the rows), with no assumption about how the rows were built.

grid = (token tiles, num_q_heads + num_kv_heads). A program loads one head of ``BLOCK_T``
tokens as the two rotation halves (``rotary_embedding._half_cols``: NeoX halves or GPT-J
pairs) plus, under partial rotary, the channels past ``rot_dim``; with ``NORM`` it first
normalizes the head (fp32 statistics, the normalized value rounded to the model dtype as
transformers' ``.to(input_dtype)`` does, then times the weight; with ``GEMMA_NORM`` as
Gemma's RMSNorm: the normalized value times ``1 + weight`` in fp32, then rounded; with
``GEMMA4_NORM`` as Gemma4's: times ``weight`` in fp32, then rounded; with
``NORM_AFTER_ROPE`` it normalizes the rotated, rounded head instead, as Hunyuan does). It
rotates with the cos/sin of each half's own channels (``o1 = x1 cos1 - x2 sin1``, ``o2 = x2 cos2 + x1 sin2``),
rounds once to the model dtype and stores in place. Key programs also scatter the key and
the value into the paged cache (layouts and interleaved V as in ``reshape_and_cache``) when
``WRITE_CACHE``.

``qk_norm_rope_cos_sin_and_cache`` (the launcher with ``NORM``) lives in its own module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import WriterConfig, writer_block_t, writer_num_warps
from .reshape_and_cache import _slot_page, _store_k_cols, _store_v_tile, cache_meta
from .rotary_embedding import _half_cols, head_strides

__all__ = ["rope_cos_sin_and_cache"]


@triton.jit
def _norm_head(x1, x2, xp, w_ptr, d1, d2, dp, mask_r, mask_p, eps, model_ty,
               HEAD_SIZE: tl.constexpr, HAS_PASS: tl.constexpr, GEMMA_NORM: tl.constexpr,
               GEMMA4_NORM: tl.constexpr):
    """Per-head RMSNorm of the two rotation halves and the pass channels (fp32 ``[BLOCK_T, *]``,
    statistics over the whole head): transformers' form (the normalized value rounded to the
    model dtype, then times the weight) or, with ``GEMMA_NORM``, Gemma's (times ``1 + weight``
    in fp32, then rounded) or, with ``GEMMA4_NORM``, Gemma4's (times ``weight`` in fp32, then
    rounded). fp32 out."""
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if HAS_PASS:
        ss += tl.sum(xp * xp, axis=1)
    inv_rms = tl.rsqrt(ss / HEAD_SIZE + eps)[:, None]
    w1 = tl.load(w_ptr + d1, mask=mask_r, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + d2, mask=mask_r, other=0.0).to(tl.float32)
    if GEMMA_NORM:
        x1 = (x1 * inv_rms * (1.0 + w1[None, :])).to(model_ty).to(tl.float32)
        x2 = (x2 * inv_rms * (1.0 + w2[None, :])).to(model_ty).to(tl.float32)
    elif GEMMA4_NORM:
        x1 = (x1 * inv_rms * w1[None, :]).to(model_ty).to(tl.float32)
        x2 = (x2 * inv_rms * w2[None, :]).to(model_ty).to(tl.float32)
    else:
        x1 = (x1 * inv_rms).to(model_ty).to(tl.float32) * w1[None, :]
        x2 = (x2 * inv_rms).to(model_ty).to(tl.float32) * w2[None, :]
    if HAS_PASS:
        wp = tl.load(w_ptr + dp, mask=mask_p, other=0.0).to(tl.float32)
        if GEMMA_NORM:
            xp = (xp * inv_rms * (1.0 + wp[None, :])).to(model_ty).to(tl.float32)
        elif GEMMA4_NORM:
            xp = (xp * inv_rms * wp[None, :]).to(model_ty).to(tl.float32)
        else:
            xp = (xp * inv_rms).to(model_ty).to(tl.float32) * wp[None, :]
    return x1, x2, xp


@triton.jit
def _rope_cos_sin_and_cache_kernel(
    # pointers
    query_ptr, key_ptr, value_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr,
    kv_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    # sizes and scalars
    num_tokens, num_slots, eps,
    # strides (elements)
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ct, stride_cd, stride_st, stride_sd,
    stride_cache_block, stride_cache_group,
    # meta
    NUM_Q_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, NORM: tl.constexpr, GEMMA_NORM: tl.constexpr, GEMMA4_NORM: tl.constexpr,
    NORM_AFTER_ROPE: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    INTERLEAVED_V: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tl.static_assert(BLOCK_R >= ROT_HALF and BLOCK_D >= HEAD_SIZE, "tiles cover the head")
    tl.static_assert(2 * ROT_HALF <= HEAD_SIZE, "rot_dim <= head_size")
    HAS_PASS: tl.constexpr = 2 * ROT_HALF < HEAD_SIZE
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    tok = offs_t.to(tl.int64)
    offs_r, d1, d2, mask_r = _half_cols(ROT_HALF=ROT_HALF, BLOCK_R=BLOCK_R, IS_NEOX=IS_NEOX)
    mask = mask_t[:, None] & mask_r[None, :]
    dp = 2 * ROT_HALF + tl.arange(0, BLOCK_P)
    mask_p = dp < HEAD_SIZE
    mask_pp = mask_t[:, None] & mask_p[None, :]

    # The cos/sin of each half's own channels: the formula holds for any rows.
    c_row = cos_ptr + tok[:, None] * stride_ct
    s_row = sin_ptr + tok[:, None] * stride_st
    cos1 = tl.load(c_row + d1[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(c_row + d2[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(s_row + d1[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(s_row + d2[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)

    if pid_h < NUM_Q_HEADS:
        base = query_ptr + tok[:, None] * stride_qt + pid_h * stride_qh
        stride_d = stride_qd
        w_ptr = q_weight_ptr
    else:
        base = key_ptr + tok[:, None] * stride_kt + (pid_h - NUM_Q_HEADS) * stride_kh
        stride_d = stride_kd
        w_ptr = k_weight_ptr
    model_ty = query_ptr.dtype.element_ty
    x1 = tl.load(base + d1[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + d2[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    if HAS_PASS:
        xp = tl.load(base + dp[None, :] * stride_d, mask=mask_pp, other=0.0).to(tl.float32)
    else:
        xp = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    if NORM and not NORM_AFTER_ROPE:
        x1, x2, xp = _norm_head(x1, x2, xp, w_ptr, d1, d2, dp, mask_r, mask_p, eps, model_ty,
                                HEAD_SIZE=HEAD_SIZE, HAS_PASS=HAS_PASS, GEMMA_NORM=GEMMA_NORM,
                                GEMMA4_NORM=GEMMA4_NORM)
    # Round once: the cache gets exactly the key stored back.
    o1 = (x1 * cos1 - x2 * sin1).to(model_ty)
    o2 = (x2 * cos2 + x1 * sin2).to(model_ty)
    op = xp.to(model_ty)
    if NORM_AFTER_ROPE:
        # Hunyuan: the model's rounded rotation normalized (the weight does not commute with
        # the rotation), the normalized value rounded once more, as the model's RMSNorm does.
        n1, n2, n_p = _norm_head(o1.to(tl.float32), o2.to(tl.float32), op.to(tl.float32), w_ptr, d1, d2, dp,
                                 mask_r, mask_p, eps, model_ty,
                                 HEAD_SIZE=HEAD_SIZE, HAS_PASS=HAS_PASS, GEMMA_NORM=GEMMA_NORM,
                                GEMMA4_NORM=GEMMA4_NORM)
        o1, o2, op = n1.to(model_ty), n2.to(model_ty), n_p.to(model_ty)
    tl.store(base + d1[None, :] * stride_d, o1, mask=mask)
    tl.store(base + d2[None, :] * stride_d, o2, mask=mask)
    if NORM and HAS_PASS:  # the norm changed the channels RoPE leaves alone
        tl.store(base + dp[None, :] * stride_d, op, mask=mask_pp)

    if WRITE_CACHE and pid_h >= NUM_Q_HEADS:
        head = pid_h - NUM_Q_HEADS
        in_slots = offs_t < num_slots
        slot = tl.load(slot_mapping_ptr + offs_t, mask=in_slots, other=-1).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_SIZE
        v_ptrs = value_ptr + tok[:, None] * stride_vt + head * stride_vh + offs_d[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=mask_t[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
        mask_w = in_slots & (slot >= 0)
        page, off = _slot_page(slot, mask_w, head, stride_cache_block, HEAD_SIZE=HEAD_SIZE,
                               BLOCK_SIZE=BLOCK_SIZE)
        _store_k_cols(kv_cache_ptr, o1.to(tl.float32), d1, mask_r, page, off, mask_w, k_scale,
                      BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
        _store_k_cols(kv_cache_ptr, o2.to(tl.float32), d2, mask_r, page, off, mask_w, k_scale,
                      BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
        if HAS_PASS:
            _store_k_cols(kv_cache_ptr, op.to(tl.float32), dp, mask_p, page, off, mask_w, k_scale,
                          BLOCK_SIZE=BLOCK_SIZE, X=X, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX)
        _store_v_tile(kv_cache_ptr, v, slot, page, off, mask_w, head, offs_d, mask_d, v_scale,
                      stride_cache_block, stride_cache_group,
                      HEAD_SIZE=HEAD_SIZE, BLOCK_SIZE=BLOCK_SIZE, X=X, INTERLEAVED_V=INTERLEAVED_V,
                      IS_FP8=IS_FP8, FP8_MAX=FP8_MAX, BLOCK_T=BLOCK_T)


def launch(query, key, value, cos, sin, is_neox, kv_cache, slot_mapping, k_scale, v_scale,
           interleaved_v, *, q_weight=None, k_weight=None, eps=0.0, gemma_norm=False, norm_after_rope=False,
           gemma4_norm=False, cfg: WriterConfig | None = None) -> None:
    """Launch the kernel: with ``q_weight``/``k_weight`` it normalizes first (``NORM``;
    ``gemma_norm``: Gemma's form; ``gemma4_norm``: Gemma4's; ``norm_after_rope``: it normalizes the rotated heads instead).
    An empty ``slot_mapping`` rotates only (``kv_cache`` is then not read: it may be any
    tensor, e.g. an empty one of a layer without a cache)."""
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    head_size = value.shape[-1]
    num_q_heads = query[0].numel() // head_size
    num_kv_heads = value.shape[1]
    rot_half = cos.shape[-1] // 2
    write_cache = slot_mapping.shape[0] > 0
    norm = q_weight is not None
    block_t = cfg.block_t if cfg else writer_block_t(num_tokens)
    warps = (cfg and cfg.num_warps) or writer_num_warps(block_t, triton.next_power_of_2(rot_half))
    grid = (triton.cdiv(num_tokens, block_t), num_q_heads + num_kv_heads)
    meta = cache_meta(kv_cache) if write_cache else dict(BLOCK_SIZE=16, X=1, IS_FP8=False, FP8_MAX=0.0)
    cache = kv_cache if write_cache else key  # a valid pointer the kernel never touches
    _rope_cos_sin_and_cache_kernel[grid](
        query, key, value, cos, sin,
        q_weight if norm else query, k_weight if norm else key,
        cache, slot_mapping, k_scale, v_scale,
        num_tokens, slot_mapping.shape[0], float(eps),
        *head_strides(query, head_size),
        *head_strides(key, head_size),
        value.stride(0), value.stride(1), value.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        cache.stride(0) if write_cache else 0, cache.stride(1) if write_cache else 0,
        NUM_Q_HEADS=num_q_heads, HEAD_SIZE=head_size, ROT_HALF=rot_half, IS_NEOX=bool(is_neox),
        NORM=norm, GEMMA_NORM=bool(norm and gemma_norm), GEMMA4_NORM=bool(norm and gemma4_norm),
        NORM_AFTER_ROPE=bool(norm and norm_after_rope),
        WRITE_CACHE=write_cache,
        INTERLEAVED_V=bool(interleaved_v), BLOCK_T=block_t,
        BLOCK_R=triton.next_power_of_2(rot_half),
        BLOCK_P=triton.next_power_of_2(max(1, head_size - 2 * rot_half)),
        BLOCK_D=triton.next_power_of_2(head_size),
        num_warps=warps,
        **meta,
    )


def rope_cos_sin_and_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
    *,
    cfg: WriterConfig | None = None,
) -> None:
    """RoPE on ``query``/``key`` in place with per-token cos/sin, then the key and ``value``
    into the cache (same semantics as the reference).

    query ``[num_tokens, num_heads, head_size]`` (or ``[num_tokens, num_heads * head_size]``),
    key likewise with num_kv_heads, value ``[num_tokens, num_kv_heads, head_size]`` (any
    strides); cos, sin ``[num_tokens, rot_dim]`` (any strides); kv_cache
    ``[num_blocks, 2, block_size, num_kv_heads * head_size]``; slot_mapping ``[n <=
    num_tokens]`` (entries < 0 skipped; empty: rotate only); k_scale/v_scale one-element
    fp32. ``cfg`` replaces the tile rules of ``configs``.
    """
    launch(query, key, value, cos, sin, is_neox, kv_cache, slot_mapping, k_scale, v_scale,
           interleaved_v, cfg=cfg)
