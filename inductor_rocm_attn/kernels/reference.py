"""PyTorch reference kernels: the CPU implementation of every op and the test oracle.

They compute in float64 and round once at the end, so a fast kernel is compared with the
exact function, not with another rounding order. Semantics follow docs/design.md; the comments
name the places where the ROCM_ATTN backend's behaviour is subtle.
"""

from __future__ import annotations

import math

import torch

from ..layout import cache_x, dense_kv, fp8_max, is_fp8_dtype, k_view, v_view

_ACC = torch.float64


def _heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """``[T, H * D]`` or ``[T, H, D]`` as ``[T, H, D]`` (H from the row size: -1 is ambiguous
    for a step without tokens)."""
    return t.view(t.shape[0], math.prod(t.shape[1:]) // head_size, head_size)


# --- cache writes ----------------------------------------------------------------------------


def _quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """Model-dtype values -> cache storage (fp8: divide by the scale, saturate)."""
    if is_fp8_dtype(cache_dtype):
        m = fp8_max(cache_dtype)
        return (x.to(_ACC) / scale.to(_ACC)).clamp(-m, m).to(cache_dtype)
    return x.to(cache_dtype)


def _dequantize_from_cache(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if is_fp8_dtype(x.dtype):
        return x.to(_ACC) * scale.to(_ACC)
    return x.to(_ACC)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into the paged cache.

    ``slot_mapping[i] = block * block_size + offset`` for token i; entries < 0 are padding
    and are skipped. Only the first ``slot_mapping.numel()`` tokens are written.
    """
    n = slot_mapping.shape[0]
    if n == 0:  # nothing to write (the cache may then be a placeholder)
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    block_size = kv_cache.shape[2]
    x = cache_x(kv_cache.dtype)
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    tok = torch.nonzero(valid).flatten()
    if tok.numel() == 0:
        return
    slots = slots[tok]
    blk, off = slots // block_size, slots % block_size
    k = _quantize_for_cache(key[:n][tok], kv_cache.dtype, k_scale)
    v = _quantize_for_cache(value[:n][tok], kv_cache.dtype, v_scale)
    t = tok.numel()
    kv = k_view(kv_cache, num_kv_heads)
    kv[blk, :, :, off, :] = k.reshape(t, num_kv_heads, head_size // x, x)
    vv = v_view(kv_cache, num_kv_heads, interleaved_v)
    if interleaved_v:
        vv[blk, :, off // x, :, off % x] = v
    else:
        vv[blk, :, :, off] = v


# --- rotary embedding ------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x ``[T, H, D]`` in float64; cos/sin ``[T, rot/2]``. Rotates the first ``rot`` channels."""
    rot = cos.shape[-1] * 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    xr = x[..., :rot]
    if is_neox:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # GPT-J: pairs (2i, 2i+1)
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, x[..., rot:]), dim=-1)


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cs = cos_sin_cache[positions.to(torch.int64)].to(_ACC)
    half = cs.shape[-1] // 2
    return cs[:, :half], cs[:, half:]


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate ``query`` ``[T, Hq * head_size]`` (or ``[T, Hq, head_size]``) and ``key`` in place.

    ``cos_sin_cache`` ``[max_position, rot_dim]``: cos in the first half, sin in the second;
    ``rot_dim <= head_size`` (partial rotary leaves the remaining channels unchanged).
    """
    cos, sin = _cos_sin(positions, cos_sin_cache)
    for t in (query, key):
        if t is None:
            continue
        x = _heads(t, head_size)
        x.copy_(_rotate(x.to(_ACC), cos, sin, is_neox).to(t.dtype))


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
) -> None:
    """RoPE on ``query``/``key`` in place, then write the rotated key and ``value`` to the cache."""
    head_size = value.shape[-1]
    rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    num_kv_heads = kv_cache.shape[3] // head_size
    reshape_and_cache(
        key.view(key.shape[0], num_kv_heads, head_size),
        value.view(value.shape[0], num_kv_heads, head_size),
        kv_cache, slot_mapping, k_scale, v_scale, interleaved_v,
    )


def _rotate_per_token(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """``x * cos + rotate(x) * sin`` channel for channel, x ``[T, H, D]`` and cos/sin
    ``[T, rot]`` float64: the first ``rot`` channels rotate (``rotate_half`` for NeoX,
    ``rotate_every_two`` for GPT-J), whatever the values of cos/sin; the rest pass through."""
    rot = cos.shape[-1]
    xr = x[..., :rot]
    if is_neox:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
        turned = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        turned = torch.stack((-x2, x1), dim=-1).flatten(-2)
    out = xr * cos[:, None, :] + turned * sin[:, None, :]
    return torch.cat((out, x[..., rot:]), dim=-1)


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
) -> None:
    """RoPE with the caller's per-token cos/sin on ``query``/``key`` in place, then the
    rotated key and ``value`` into the cache.

    query ``[T, Hq, D]`` or ``[T, Hq * D]``, key likewise with Hkv heads, value ``[T, Hkv, D]``
    (any strides); cos, sin ``[T, rot_dim]``
    (any strides, ``rot_dim <= D`` even): token t's channel d becomes
    ``x[d] * cos[t, d] + rotate(x)[d] * sin[t, d]`` (transformers' ``apply_rotary_pos_emb``
    for NeoX, with cos/sin as the model computed them). The first ``slot_mapping.numel()``
    tokens are cached (entries < 0 skipped); an empty ``slot_mapping`` only rotates.
    """
    c, s, d = cos.to(_ACC), sin.to(_ACC), value.shape[-1]
    for t in (query, key):
        x = _heads(t, d)
        x.copy_(_rotate_per_token(x.to(_ACC), c, s, is_neox).to(t.dtype))
    reshape_and_cache(_heads(key, d), value, kv_cache, slot_mapping, k_scale, v_scale, interleaved_v)


def rms_norm_heads_rounded(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """transformers' per-head RMSNorm (``Qwen3RMSNorm``): statistics of ``x`` (float64 here),
    the normalized value rounded to ``dtype`` (its ``.to(input_dtype)``), then times
    ``weight``. Float64 out; the rounding is part of the function, not an artefact."""
    var = x.pow(2).mean(dim=-1, keepdim=True)
    return (x * torch.rsqrt(var + eps)).to(dtype).to(_ACC) * weight.to(_ACC)


def rms_norm_heads_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Gemma's per-head RMSNorm (``Gemma3RMSNorm``): statistics of ``x`` (float64 here), times
    ``1 + weight``, the result rounded to ``dtype`` (its ``.type_as(x)``). Float64 out."""
    var = x.pow(2).mean(dim=-1, keepdim=True)
    return (x * torch.rsqrt(var + eps) * (1 + weight.to(_ACC))).to(dtype).to(_ACC)


def rms_norm_heads_gemma4(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Gemma4's per-head RMSNorm (``Gemma4RMSNorm`` with its scale): statistics of ``x``
    (float64 here; the model's ``pow(mean + eps, -0.5)`` is the same function as ``rsqrt``),
    times ``weight`` (not ``1 + weight``), the result rounded to ``dtype`` (its ``.type_as(x)``).
    Float64 out."""
    var = x.pow(2).mean(dim=-1, keepdim=True)
    return (x * torch.rsqrt(var + eps) * weight.to(_ACC)).to(dtype).to(_ACC)


def qk_norm_rope_cos_sin_and_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
    gemma_norm: bool = False,
    norm_after_rope: bool = False,
    gemma4_norm: bool = False,
) -> None:
    """Per-head RMSNorm (``rms_norm_heads_rounded``; ``gemma_norm``: ``rms_norm_heads_gemma``;
    ``gemma4_norm``: ``rms_norm_heads_gemma4``)
    then RoPE with per-token cos/sin on ``query``/``key`` in place, then the key and ``value``
    into the cache. ``norm_after_rope`` (Hunyuan): RoPE first, rounded to the model dtype,
    then the norm of the rotated heads, rounded.

    Shapes as ``rope_cos_sin_and_cache``; q_weight, k_weight ``[D]`` in the model dtype.
    Norm and rotation run in float64 between the roundings the model's order defines.
    """
    c, s, d = cos.to(_ACC), sin.to(_ACC), value.shape[-1]
    norm = rms_norm_heads_gemma if gemma_norm else rms_norm_heads_gemma4 if gemma4_norm else rms_norm_heads_rounded
    for t, w in ((query, q_weight), (key, k_weight)):
        x = _heads(t, d)
        if norm_after_rope:
            rotated = _rotate_per_token(x.to(_ACC), c, s, is_neox).to(t.dtype).to(_ACC)
            x.copy_(norm(rotated, w, eps, t.dtype).to(t.dtype))
        else:
            x.copy_(_rotate_per_token(norm(x.to(_ACC), w, eps, t.dtype), c, s, is_neox).to(t.dtype))
    reshape_and_cache(_heads(key, d), value, kv_cache, slot_mapping, k_scale, v_scale, interleaved_v)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm over the last dim, float64 in and out."""
    var = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight.to(_ACC)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Split ``qkv`` ``[T, (Hq + 2 Hkv) * D]``, RMSNorm q and k per head, RoPE them, cache k/v.

    q and k (in ``qkv.dtype``) are written into the caller's ``q_out [T, Hq, D]`` /
    ``k_out [T, Hkv, D]`` (any strides), or into fresh tensors when those are None. Returns
    ``(q, k, v)``: q and k are ``q_out``/``k_out`` when given; v is a fresh ``[T, Hkv, D]``
    copy of the V slice when ``return_kv``, else None (the caller can view it in ``qkv``).
    """
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    q = rms_norm_heads(q.reshape(t, num_heads, head_size).to(_ACC), q_weight, eps)
    k = rms_norm_heads(k.reshape(t, num_kv_heads, head_size).to(_ACC), k_weight, eps)
    cos, sin = _cos_sin(positions, cos_sin_cache)
    q = _rotate(q, cos, sin, is_neox).to(qkv.dtype)
    k = _rotate(k, cos, sin, is_neox).to(qkv.dtype)
    v = v.reshape(t, num_kv_heads, head_size)
    reshape_and_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale, interleaved_v)
    if q_out is not None:
        q = q_out.copy_(q)
    if k_out is not None:
        k = k_out.copy_(k)
    return q, k, (v.clone() if return_kv else None)


# --- attention -------------------------------------------------------------------------------


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_start_pos: int,
    scale: float,
    causal: bool,
    sliding_window: int,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float,
    window_both_sides: bool = False,
) -> torch.Tensor:
    """Exact attention of one sequence in float64.

    q ``[Lq, Hq, D]`` at positions ``q_start_pos + i``; k, v ``[Lk, Hkv, D]`` at positions
    ``0 .. Lk-1``. Order as in the backend: scale, soft cap, ALiBi, mask, softmax (with the
    sink as an extra zero-value logit). Returns ``[Lq, Hq, D]`` float64.

    The sliding window keeps keys with ``q - k < sliding_window``: one-sided, as the seed's
    ``(W-1, 0)`` for decoder layers (keys after the query stay visible when not causal).
    ``window_both_sides`` (encoder layers, the seed's ``(W-1, W-1)``) also drops keys with
    ``k - q >= sliding_window``.

    Non-finite inputs propagate as in float64 SDPA over the keys each row sees: a NaN query
    gives NaN for its row and head, a NaN or +inf logit of a visible key a NaN row, a NaN /
    +-inf value NaN / +-inf in its channel. A key a row does not see has no effect on it. A
    row whose logits are all -inf (no visible key) outputs 0. (The Triton prefill, verify
    and encoder kernels also turn NaN the channel of a non-finite value in the rows of a row
    block that mask its key: ``kernels/triton/attention_common._attn_update``.)
    """
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if logits_soft_cap > 0:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    qpos = torch.arange(lq, dtype=torch.int64, device=q.device)[:, None] + q_start_pos
    kpos = torch.arange(lk, dtype=torch.int64, device=q.device)[None, :]
    if alibi_slopes is not None:
        s = s + alibi_slopes.to(_ACC)[:, None, None] * (kpos - qpos).to(_ACC)
    keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        keep &= kpos <= qpos
    if sliding_window > 0:
        keep &= (qpos - kpos) < sliding_window
        if window_both_sides:
            keep &= (kpos - qpos) < sliding_window
    s = s.masked_fill(~keep, float("-inf"))
    # A row whose logits are all -inf (no visible key, or only keys of logit -inf) attends
    # to nothing and outputs 0, as SDPA does; a NaN or +inf logit makes its row NaN.
    dead = (s == float("-inf")).all(-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(_ACC)[:, None, None].expand(hq, lq, 1)
        p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :lk]
        dead &= sink == float("-inf")
    else:
        p = torch.softmax(s, dim=-1)
    p = p.masked_fill(dead, 0.0)
    return _weighted_values(p, v, keep)


def _weighted_values(p: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``sum_k p[h, q, k] v[k, h, :]`` over the keys each row sees (``keep`` ``[Lq, Lk]``).

    A key a row does not see adds nothing to it, whatever its value: the plain product would
    add 0 * NaN = NaN (as SDPA's additive mask does). The non-finite values of the keys a row
    sees propagate as in SDPA: p * inf = inf, 0 * inf = NaN, inf - inf = NaN.
    """
    finite = torch.isfinite(v)
    if bool(finite.all()):
        return torch.einsum("hqk,khd->qhd", p, v)
    out = torch.einsum("hqk,khd->qhd", p, v.masked_fill(~finite, 0.0))
    for j in torch.nonzero(~finite.flatten(1).all(1)).flatten().tolist():  # keys with one
        term = p[:, :, j, None] * v[j][:, None, :]  # [Hq, Lq, D]
        term = term.masked_fill(~keep[None, :, j, None] | finite[j][:, None, :], 0.0)
        out += term.transpose(0, 1)
    return out


def _store_output(output: torch.Tensor, rows: slice, out: torch.Tensor, output_scale) -> None:
    if output_scale is not None:
        m = fp8_max(output.dtype)
        out = (out / output_scale.to(_ACC)).clamp(-m, m)
    output[rows] = out.to(output.dtype)


def paged_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    causal: bool,
    sliding_window: int,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float,
    interleaved_v: bool,
    output_scale: torch.Tensor | None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> None:
    """Chunked prefill + paged decode over the cache, written into ``output``.

    ``max_query_len`` / ``max_seq_len`` are host-side launch hints for GPU kernels (every
    provider takes them; the reference does not need them).

    Sequence s owns query rows ``query_start_loc[s] : query_start_loc[s+1]`` and has
    ``seq_lens[s]`` tokens in all, the last ``query_len`` of them new. Keys before the new
    tokens come from the cache through ``block_table[s]``. As in ROCM_ATTN, a sequence with
    query_len > 1 (prefix prefill) reads its new tokens from ``key``/``value``, a decode
    sequence (query_len == 1) reads everything from the cache (its token was just written).
    Rows past ``query_start_loc[-1]`` (padding) are left untouched.
    """
    num_kv_heads = key.shape[1] if key is not None else None
    head_size = query.shape[-1]
    if num_kv_heads is None:
        num_kv_heads = kv_cache.shape[3] // head_size
    block_size = kv_cache.shape[2]
    kd, vd = dense_kv(kv_cache, num_kv_heads, interleaved_v)
    kd = _dequantize_from_cache(kd, k_scale)
    vd = _dequantize_from_cache(vd, v_scale)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s in range(len(lens)):
        q0, q1 = qsl[s], qsl[s + 1]
        ql, sl = q1 - q0, lens[s]
        if ql <= 0:
            continue
        ctx = sl - ql
        nblk = math.ceil(sl / block_size)
        blocks = block_table[s, :nblk].to(torch.int64)
        k = kd[blocks].reshape(-1, num_kv_heads, head_size)[:sl].clone()
        v = vd[blocks].reshape(-1, num_kv_heads, head_size)[:sl].clone()
        if ql > 1 and key is not None:
            k[ctx:] = key[q0:q1].to(_ACC)
            v[ctx:] = value[q0:q1].to(_ACC)
        out = attend(
            query[q0:q1].to(_ACC), k, v, q_start_pos=ctx, scale=scale, causal=causal,
            sliding_window=sliding_window, alibi_slopes=alibi_slopes, sinks=sinks,
            logits_soft_cap=logits_soft_cap,
        )
        _store_output(output, slice(q0, q1), out, output_scale)


def encoder_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float,
    output_scale: torch.Tensor | None,
) -> None:
    """Attention without a cache: each sequence ``cu_seqlens[s]:cu_seqlens[s+1]`` attends to
    itself. An encoder's sliding window bounds keys on both sides: ``abs(q - k) < W``."""
    cu = cu_seqlens.tolist()
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        if b <= a:
            continue
        out = attend(
            query[a:b].to(_ACC), key[a:b].to(_ACC), value[a:b].to(_ACC), q_start_pos=0,
            scale=scale, causal=causal, sliding_window=sliding_window,
            alibi_slopes=alibi_slopes, sinks=sinks, logits_soft_cap=logits_soft_cap,
            window_both_sides=True,
        )
        _store_output(output, slice(a, b), out, output_scale)
