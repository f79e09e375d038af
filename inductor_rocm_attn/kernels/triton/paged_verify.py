"""The verify kernel of ``paged_attention``: sequences of 2..Q_MAX query tokens through the
decode-style split-KV path, and its split reduction.

Speculative decoding (EAGLE, MTP) verifies a few draft tokens per sequence each step: a
sequence has ``q_len`` new tokens at positions ``ctx_len .. seq_len - 1`` (``ctx_len =
seq_len - q_len``), causal among themselves. The prefill kernel would give each query head
its own program and 128-row tile, reading the context once per query head; here, as in
decode (``paged_decode.py``), one program owns one (sequence, KV head, row chunk, KV split)
and its rows are the (query token, GQA head) pairs of the KV head, row ``r`` = token
``r // GQA``, head ``r % GQA``: every K/V byte is read once per KV head, and 4 tokens x GQA 4
fill the 16-row tile that a decode program pads its 4 GQA rows to.

The cached context is split over programs (flash-decoding; ``_verify_reduce_kernel`` merges
the splits). The new tokens' keys come from ``key``/``value`` (unquantised), as in the
prefill kernel, in one masked tile of the last split; with ``key`` None everything comes
from the cache. Sequences of another length return at once (the decode and prefill kernels
own them). The launcher is ``paged_attention.py``, the config ``configs.verify_config``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import _LOG2E, _dense_inner, _paged_inner, _plan, _store_rows, _tiles


@triton.jit
def _verify_context(
    acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
    kv_head, t_lo, f_lo, f_hi, t_hi, lo, hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
    COMPUTE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr, X: tl.constexpr, TILE_N: tl.constexpr, SUB: tl.constexpr,
    INTERLEAVED_V: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RESCALE_MARGIN: tl.constexpr, K_ROWS: tl.constexpr, ONE_LOOP: tl.constexpr,
):
    """Cache tiles ``t_lo .. t_hi`` of one split: one masked loop, or masked ``[t_lo, f_lo)``,
    unmasked ``[f_lo, f_hi)`` (every row sees every key), masked ``[f_hi, t_hi)``."""
    if ONE_LOOP:
        acc, m_i, l_i = _paged_inner(
            acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
            kv_head, t_lo, t_hi, lo, hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
            COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
            TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=CAUSAL,
            USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True,
            DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=True,
            K_ROWS=K_ROWS)
    else:
        acc, m_i, l_i = _paged_inner(
            acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
            kv_head, t_lo, f_lo, lo, hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
            COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
            TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=CAUSAL,
            USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True,
            DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=True,
            K_ROWS=K_ROWS)
        acc, m_i, l_i = _paged_inner(
            acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
            kv_head, f_lo, f_hi, lo, hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
            COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
            TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=CAUSAL,
            USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=False,
            DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=True,
            K_ROWS=K_ROWS)
        acc, m_i, l_i = _paged_inner(
            acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
            kv_head, f_hi, t_hi, lo, hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
            COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
            TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=CAUSAL,
            USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True,
            DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=True,
            K_ROWS=K_ROWS)
    return acc, m_i, l_i


@triton.jit
def _paged_verify_kernel(
    # pointers
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    k_scale_ptr, v_scale_ptr, alibi_ptr, sinks_ptr, out_scale_ptr,
    # scalars
    sm_scale, softcap, window,
    # strides (elements)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kch, stride_vcb, stride_vch, stride_bt,
    stride_ps, stride_pi,  # partial rows [seqs, Q_MAX, heads, NUM_SPLITS]: per seq, per token
    # constexpr
    GQA: tl.constexpr, Q_MAX: tl.constexpr, BLOCK_R: tl.constexpr, ROW_CHUNKS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    TILE_N: tl.constexpr, SUB: tl.constexpr, NEW_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    COMPUTE: tl.constexpr, HAS_NEW_KV: tl.constexpr, CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, FP8_KV: tl.constexpr, INTERLEAVED_V: tl.constexpr,
    USE_OUT_SCALE: tl.constexpr, OUT_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_LOOP: tl.constexpr, RESCALE_MARGIN: tl.constexpr, K_ROWS: tl.constexpr,
):
    """Grid ``(num_seqs, num_kv_heads * ROW_CHUNKS, NUM_SPLITS)``; only 2 <= query_len <= Q_MAX.

    q/out ``[num_tokens, num_heads, HEAD_SIZE]``, k/v ``[num_tokens, num_kv_heads, HEAD_SIZE]``
    (``HAS_NEW_KV``), caches as ``layout.k_view`` / ``layout.v_view``. With one split the
    output is stored here; else each split stores its partial (acc in model units, max, sum)
    and ``_verify_reduce_kernel`` merges them.
    """
    tl.static_assert(BLOCK_R >= 16 and (BLOCK_R & (BLOCK_R - 1)) == 0, "BLOCK_R: a dot's M >= 16")
    tl.static_assert(NEW_N >= Q_MAX and NEW_N >= 16, "the new tokens fit one tile")
    tl.static_assert(BLOCK_D >= HEAD_SIZE and (BLOCK_D & (BLOCK_D - 1)) == 0,
                     "BLOCK_D is the head size rounded up to a power of two")
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // ROW_CHUNKS
    r0 = (tl.program_id(1) % ROW_CHUNKS) * BLOCK_R
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len < 2 or q_len > Q_MAX or r0 >= q_len * GQA:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_r = r0 + tl.arange(0, BLOCK_R)
    tok = offs_r // GQA
    heads = kv_head * GQA + offs_r % GQA
    r_ok = tok < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)
    q_pos = ctx_len + tok
    p0 = ctx_len + r0 // GQA  # positions of this chunk's tokens: [p0, p1)
    p1 = ctx_len + tl.minimum(q_len, (r0 + BLOCK_R - 1) // GQA + 1)

    sm = sm_scale
    v_scale = 1.0
    if FP8_KV:
        sm = sm_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    slope = tl.zeros([BLOCK_R], tl.float32)
    if USE_ALIBI:
        slope += tl.load(alibi_ptr + heads, mask=r_ok, other=0.0).to(tl.float32) * _LOG2E
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    m_i = tl.zeros([BLOCK_R], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], tl.float32)
    if USE_SINKS:
        if split == 0:  # the sink (logit `sink`, value 0) joins once, in split 0's sums
            m_i = tl.load(sinks_ptr + heads, mask=r_ok, other=0.0).to(tl.float32) * _LOG2E
            l_i += 1.0

    # 1) the cached context (the whole sequence when key is None), split over programs.
    if HAS_NEW_KV:
        cache_hi = ctx_len
    else:
        cache_hi = seq_len
    zero = seq_len * 0
    lo, hi, f_lo, f_hi = _plan(zero, cache_hi, p0, p1, window, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW)
    t_lo, f_lo, f_hi, t_hi = _tiles(lo, hi, f_lo, f_hi, zero, TILE=TILE_N)
    if NUM_SPLITS > 1:  # this split's share of the tiles; clamp the unmasked middle to it
        per = (t_hi - t_lo + NUM_SPLITS - 1) // NUM_SPLITS
        s_lo = tl.minimum(t_lo + split * per, t_hi)
        s_hi = tl.minimum(s_lo + per, t_hi)
        f_lo = tl.minimum(tl.maximum(f_lo, s_lo), s_hi)
        f_hi = tl.minimum(tl.maximum(f_hi, f_lo), s_hi)
        t_lo = s_lo
        t_hi = s_hi
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = _verify_context(
        acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
        kv_head, t_lo, f_lo, f_hi, t_hi, lo, hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
        COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
        TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
        USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, DOT_PRECISION=DOT_PRECISION,
        RESCALE_MARGIN=RESCALE_MARGIN, K_ROWS=K_ROWS, ONE_LOOP=ONE_LOOP)
    if FP8_KV:  # the cache part was accumulated from V / v_scale units: to model units
        acc = acc * v_scale

    # 2) the new tokens from key/value (at most Q_MAX keys: one masked tile), last split.
    if HAS_NEW_KV:
        if split == NUM_SPLITS - 1:
            n_lo, n_hi, n_flo, n_fhi = _plan(ctx_len, seq_len, p0, p1, window, CAUSAL=CAUSAL,
                                             USE_WINDOW=USE_WINDOW)
            u_lo, u_flo, u_fhi, u_hi = _tiles(n_lo, n_hi, n_flo, n_fhi, ctx_len, TILE=NEW_N)
            k_base = k_ptr + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
            v_base = v_ptr + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
            acc, m_i, l_i = _dense_inner(
                acc, m_i, l_i, q, q_pos, slope, sm_scale, softcap, window, k_base, v_base,
                stride_kt, stride_vt, ctx_len, u_lo, u_hi, n_lo, n_hi, 0, 0,
                COMPUTE=COMPUTE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, BLOCK_N=NEW_N,
                CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI,
                USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION,
                RESCALE_MARGIN=RESCALE_MARGIN, TMA=False)

    mask = r_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out_scale = 1.0
        if USE_OUT_SCALE:
            out_scale = tl.load(out_scale_ptr)
        out_ptrs = out_ptr + row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        _store_rows(out_ptrs, acc, l_i, 1.0, out_scale, mask, USE_OUT_SCALE=USE_OUT_SCALE,
                    OUT_MAX=OUT_MAX)
    else:
        prow = seq.to(tl.int64) * stride_ps + tok * stride_pi + heads * NUM_SPLITS + split
        tl.store(part_acc_ptr + prow[:, None] * HEAD_SIZE + offs_d[None, :], acc, mask=mask)
        tl.store(part_ml_ptr + prow * 2, m_i, mask=r_ok)
        tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=r_ok)


@triton.jit
def _verify_reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_loc_ptr, out_scale_ptr,
    stride_ot, stride_oh, stride_ps, stride_pi,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, Q_MAX: tl.constexpr, USE_OUT_SCALE: tl.constexpr,
    OUT_MAX: tl.constexpr,
):
    """Grid ``(num_seqs * Q_MAX, num_heads)``: merge the splits' (acc, max, sum) of one
    verify row (sequence, query token, head); acc is in model units."""
    tl.static_assert(BLOCK_S >= NUM_SPLITS, "one tile holds every split")
    seq = tl.program_id(0) // Q_MAX
    tok = tl.program_id(0) % Q_MAX
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len < 2 or q_len > Q_MAX or tok >= q_len:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_SIZE
    prow = seq.to(tl.int64) * stride_ps + tok * stride_pi + head * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + prow * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + prow * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + prow[:, None] * HEAD_SIZE + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits have m = -inf: weight 0
    l_sum = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0)
    out = out * tl.where(l_sum > 0.0, 1.0 / tl.where(l_sum > 0.0, l_sum, 1.0), 0.0)
    if USE_OUT_SCALE:
        out = tl.minimum(tl.maximum(out / tl.load(out_scale_ptr), -OUT_MAX), OUT_MAX)
    tl.store(out_ptr + (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)
