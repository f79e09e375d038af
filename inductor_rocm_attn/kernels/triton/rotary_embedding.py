"""Triton ``rotary_embedding``: NeoX / GPT-J RoPE on query and key, in place.

One program rotates ``BLOCK_T`` tokens x one head (query heads first, then key heads) over
the full head width. Rotation is done per channel with a *partner* channel so one code path
covers NeoX and GPT-J, partial rotary (``rot_dim < head_size``) and head sizes that are not
powers of two:

    out[d] = x[d] * cos[col(d)] + sign(d) * x[partner(d)] * sin[col(d)]

NeoX (``h = rot_dim / 2``): partner(d) = d + h (sign -1) for d < h, d - h (sign +1) for
h <= d < rot_dim. GPT-J: partner(d) = d ^ 1, sign -1 on even d. Channels d >= rot_dim pass
through (cos 1, sin 0). The partner load hits the same cache lines as the tile itself, so
the kernel still reads each byte from HBM once.

The jit helpers ``_rope_partner`` / ``_load_cos_sin`` are shared with the fused writers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reshape_and_cache import num_warps_for, pick_block_t

__all__ = ["rotary_embedding"]


@triton.jit
def _rope_partner(offs_d, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Per channel: (partner channel, sign of the partner term, cos/sin column, is rotated)."""
    in_rot = offs_d < 2 * ROT_HALF
    if IS_NEOX:
        first = offs_d < ROT_HALF
        partner = tl.where(first, offs_d + ROT_HALF, offs_d - ROT_HALF)
        sign = tl.where(first, -1.0, 1.0)
        col = tl.where(first, offs_d, offs_d - ROT_HALF)
    else:  # GPT-J: pairs (2i, 2i + 1)
        even = (offs_d % 2) == 0
        partner = tl.where(even, offs_d + 1, offs_d - 1)
        sign = tl.where(even, -1.0, 1.0)
        col = offs_d // 2
    partner = tl.where(in_rot, partner, offs_d)
    sign = tl.where(in_rot, sign, 0.0)
    col = tl.where(in_rot, col, 0)
    return partner, sign, col, in_rot


@triton.jit
def _load_cos_sin(cos_sin_ptr, pos, stride_cs, col, in_rot, mask_t, ROT_HALF: tl.constexpr):
    """cos, sin ``[BLOCK_T, BLOCK_D]`` fp32 for the tokens' positions; (1, 0) off the rotated part."""
    cs_ptrs = cos_sin_ptr + pos[:, None] * stride_cs + col[None, :]
    m = mask_t[:, None] & in_rot[None, :]
    cos = tl.load(cs_ptrs, mask=m, other=1.0).to(tl.float32)
    sin = tl.load(cs_ptrs + ROT_HALF, mask=m, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_embedding_kernel(
    # pointers
    positions_ptr, query_ptr, key_ptr, cos_sin_ptr,
    # sizes
    num_tokens, num_q_heads,
    # strides (elements)
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_cs,
    # meta
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """grid = (cdiv(num_tokens, BLOCK_T), num_q_heads + num_k_heads)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < num_tokens
    partner, sign, col, in_rot = _rope_partner(offs_d, ROT_HALF, IS_NEOX)
    pos = tl.load(positions_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    cos, sin = _load_cos_sin(cos_sin_ptr, pos, stride_cs, col, in_rot, mask_t, ROT_HALF)

    tok = offs_t.to(tl.int64)
    if pid_h < num_q_heads:
        base = query_ptr + tok[:, None] * stride_qt + pid_h * stride_qh
        stride_d = stride_qd
    else:
        base = key_ptr + tok[:, None] * stride_kt + (pid_h - num_q_heads) * stride_kh
        stride_d = stride_kd
    # Only the rotated channels are read and written: the rest stay untouched in place.
    mask = mask_t[:, None] & in_rot[None, :]
    x = tl.load(base + offs_d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    out = x * cos + sign[None, :] * xp * sin
    tl.store(base + offs_d[None, :] * stride_d, out.to(query_ptr.dtype.element_ty), mask=mask)


def head_strides(t: torch.Tensor, head_size: int) -> tuple[int, int, int]:
    """(token, head, channel) strides of ``[T, H * D]`` or ``[T, H, D]`` without a copy."""
    if t.dim() == 3:
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), head_size * t.stride(1), t.stride(1)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    block_t: int | None = None,
) -> None:
    """Rotate ``query`` and ``key`` in place (same semantics as the reference).

    positions: ``[num_tokens]`` int32/int64.
    query: ``[num_tokens, num_heads * head_size]`` or ``[num_tokens, num_heads, head_size]``,
    any token stride (e.g. a slice of qkv); key likewise with num_kv_heads, or None.
    cos_sin_cache: ``[max_position, rot_dim]`` (cos half, then sin half), ``rot_dim <= head_size``.
    """
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    num_q_heads = query.numel() // (num_tokens * head_size)
    num_k_heads = 0 if key is None else key.numel() // (num_tokens * head_size)
    k = query if key is None else key  # a valid pointer when there is no key
    rot_half = cos_sin_cache.shape[-1] // 2
    block_d = triton.next_power_of_2(head_size)
    block_t = block_t or pick_block_t(num_tokens)
    grid = (triton.cdiv(num_tokens, block_t), num_q_heads + num_k_heads)
    _rotary_embedding_kernel[grid](
        positions, query, k, cos_sin_cache,
        num_tokens, num_q_heads,
        *head_strides(query, head_size),
        *head_strides(k, head_size),
        cos_sin_cache.stride(0),
        HEAD_SIZE=head_size, ROT_HALF=rot_half, IS_NEOX=bool(is_neox),
        BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=num_warps_for(block_t, block_d),
    )
