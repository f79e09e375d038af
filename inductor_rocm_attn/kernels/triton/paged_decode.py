"""Every decode kernel of ``paged_attention`` (query_len == 1) and the split reduction.

A decode program owns one (sequence, KV head, KV split): all GQA query heads of the KV
head in one ``[BLOCK_H, HEAD]`` tile, so each K/V byte is read once. With more than one
split (flash-decoding) each program covers a slice of the context and stores partial
(acc, max, sum) rows, which the last split program to finish merges (``_merge_if_last_split``,
up to ``configs.LAST_SPLIT_MAX_SPLITS`` splits) or ``_decode_reduce_kernel`` does. The kinds
(``configs.DECODE_KINDS``):

**Rows** (``_paged_decode_kernel``, kinds "rows"/"rows3", the default): the prefill loop
(``attention_common._paged_inner``) over ``[BLOCK_H, TILE_N]`` score tiles; one masked loop
or masked first / unmasked middle / masked last tile.

**Keys-major** (``_keys_inner``, kinds "keys"/"keys3" of ``_paged_decode_kernel``): the
same online softmax with the products transposed, ``S^T = K Q^T`` and ``O^T += V^T P^T``;
the query heads are the dots' N dimension and both cache tiles are first operands, read in
their page's memory order. K goes 16 channels a dot (``_keys_scores``): the rows kernel's
``[HEAD, TILE_N]`` K gather puts a warp's lanes on 16 packets 256 bytes apart (one sector of
16 lines per instruction); a ``[TILE_N, 16]`` chunk puts them on consecutive packets and
still feeds its dot straight from (swizzled) shared memory, which a ``[TILE_N, HEAD/X, X]``
load reshaped to ``[TILE_N, HEAD]`` does not (Triton stages it unswizzled: bank conflicts).
V^T is ``[HEAD, TILE_N]``, a standard page as it is, an interleaved one loaded as
``[HEAD, packets, X]`` and reshaped.

**Streams** (``_paged_decode_streams_kernel``, kinds "streams"/"streams3"): why not the
prefill loop with 16 query rows: a decode tile has only GQA real query rows (4 for
Llama-70B-style heads), so Triton spreads the 4 warps of a ``[16, TILE_N]`` score tile
along the key axis, and every tile's row max, row sum and P -> MMA-operand conversion cross
warps through shared memory (8 ``BAR.SYNC`` a tile in the sm_90 SASS). Here the tile is
3-D, ``[W, BLOCK_H, S]``: a batched ``tl.dot`` puts one warp on each of the W streams
(``warpsPerCTA = [W, 1, 1]``), every stream keeps its own online softmax in registers, and
the streams are merged once at the end. Stream ``w`` of tile ``t`` owns keys
``t*W*S + w*S .. + S``; ``S`` divides the largest power of two dividing the block size, so
a stream's keys are one contiguous run of one cache block and need a single block-table
entry.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import _LOG2E, _block_ids, _paged_inner, _store_rows, _tanh, _tiles, _v_packets


@triton.jit
def _paged_decode_kernel(
    # pointers
    out_ptr, part_acc_ptr, part_ml_ptr, merge_count_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    k_scale_ptr, v_scale_ptr, alibi_ptr, sinks_ptr, out_scale_ptr,
    # scalars
    sm_scale, softcap, window,
    # strides (elements)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kch, stride_vcb, stride_vch, stride_bt,
    stride_pa_s, stride_pa_h, stride_pa_k,  # part_acc [seqs, heads, splits, HEAD]
    # constexpr
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    TILE_N: tl.constexpr, SUB: tl.constexpr, NUM_SPLITS: tl.constexpr, COMPUTE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, FP8_KV: tl.constexpr, INTERLEAVED_V: tl.constexpr,
    USE_OUT_SCALE: tl.constexpr, OUT_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_LOOP: tl.constexpr, KEYS_MAJOR: tl.constexpr, RESCALE_MARGIN: tl.constexpr,
    K_ROWS: tl.constexpr, Q_POW2_SCALE: tl.constexpr = False, SPLIT_MERGE: tl.constexpr = 0,
):
    """Grid ``(num_seqs, num_kv_heads * HEAD_CHUNKS, NUM_SPLITS)``; only query_len == 1.

    q/out ``[num_tokens, num_heads, HEAD_SIZE]``; the decode token is the sequence's last,
    at position ``seq_len - 1``, and every key (its own too) is read from the cache.
    ``SPLIT_MERGE`` (``DecodeConfig.split_merge``, with more than one split): 0 = the
    partials are merged by ``_decode_reduce_kernel``; 1 = by the last split program of each
    (sequence, KV head, head chunk) to finish (``_merge_if_last_split``).
    """
    tl.static_assert(BLOCK_H >= 16 and (BLOCK_H & (BLOCK_H - 1)) == 0, "BLOCK_H: a dot's M >= 16")
    tl.static_assert(BLOCK_D >= HEAD_SIZE and (BLOCK_D & (BLOCK_D - 1)) == 0,
                     "BLOCK_D is the head size rounded up to a power of two")
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_CHUNKS
    chunk = tl.program_id(1) % HEAD_CHUNKS
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < GQA
    d_ok = offs_d < HEAD_SIZE
    heads = kv_head * GQA + offs_h
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    q_unit = 1.0
    if Q_POW2_SCALE:  # DecodeConfig.fp8_fp16_dot: q / 2^floor(log2 max|q|) is exact in fp16
        q_unit = _pow2_floor_of_max(q.to(tl.float32))
        q = q.to(tl.float32) / q_unit
    q = q.to(COMPUTE)
    q_pos = tl.zeros([BLOCK_H], tl.int32) + (seq_len - 1)

    # Keys [lo, seq_len) are visible (every key is <= the query position: causal or not).
    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    t_lo, f_lo, f_hi, t_hi = _tiles(lo, seq_len, lo, seq_len, seq_len * 0, TILE=TILE_N)
    if NUM_SPLITS > 1:  # this split's share of the tiles; clamp the unmasked middle to it
        per = (t_hi - t_lo + NUM_SPLITS - 1) // NUM_SPLITS
        s_lo = tl.minimum(t_lo + split * per, t_hi)
        s_hi = tl.minimum(s_lo + per, t_hi)
        f_lo = tl.minimum(tl.maximum(f_lo, s_lo), s_hi)
        f_hi = tl.minimum(tl.maximum(f_hi, f_lo), s_hi)
        t_lo = s_lo
        t_hi = s_hi

    sm = sm_scale * q_unit
    v_scale = 1.0
    if FP8_KV:
        sm = sm * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    slope = tl.zeros([BLOCK_H], tl.float32)
    if USE_ALIBI:
        slope += tl.load(alibi_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i = tl.zeros([BLOCK_H], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if USE_SINKS:
        if split == 0:  # the sink joins once, in split 0's partial sums
            m_i = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
            l_i += 1.0
            # V is accumulated in cache units and scaled at the end; the sink's value is 0.

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    if KEYS_MAJOR:  # products transposed: both cache tiles load in memory order (paged_decode.py)
        acc_t = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)
        q_t = _keys_q_chunks(q_ptr + q_start.to(tl.int64) * stride_qt, heads, h_ok, stride_qh,
                             COMPUTE=COMPUTE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, BLOCK_H=BLOCK_H)
        if ONE_LOOP:
            acc_t, m_i, l_i = _keys_inner(
                acc_t, m_i, l_i, q_t, q_pos, slope, sm, softcap, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, t_lo, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D,
                BLOCK_H=BLOCK_H, X=X, TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V,
                USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION)
        else:
            acc_t, m_i, l_i = _keys_inner(
                acc_t, m_i, l_i, q_t, q_pos, slope, sm, softcap, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, t_lo, f_lo, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D,
                BLOCK_H=BLOCK_H, X=X, TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V,
                USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION)
            acc_t, m_i, l_i = _keys_inner(
                acc_t, m_i, l_i, q_t, q_pos, slope, sm, softcap, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, f_lo, f_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D,
                BLOCK_H=BLOCK_H, X=X, TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V,
                USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=False, DOT_PRECISION=DOT_PRECISION)
            acc_t, m_i, l_i = _keys_inner(
                acc_t, m_i, l_i, q_t, q_pos, slope, sm, softcap, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, f_hi, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D,
                BLOCK_H=BLOCK_H, X=X, TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V,
                USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION)
        acc = tl.trans(acc_t)
    else:
        if ONE_LOOP:
            # One software pipeline over all tiles (masks everywhere): a split holds few tiles,
            # and three loops would each start their pipeline cold.
            acc, m_i, l_i = _paged_inner(
                acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, t_lo, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
                TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=False, USE_WINDOW=False,
                USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION,
                RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=True, K_ROWS=K_ROWS)
        else:  # masked first tile, unmasked middle, masked last tile
            acc, m_i, l_i = _paged_inner(
                acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, t_lo, f_lo, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
                TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=False, USE_WINDOW=False,
                USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION,
                RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=True, K_ROWS=K_ROWS)
            acc, m_i, l_i = _paged_inner(
                acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, f_lo, f_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
                TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=False, USE_WINDOW=False,
                USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=False, DOT_PRECISION=DOT_PRECISION,
                RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=True, K_ROWS=K_ROWS)
            acc, m_i, l_i = _paged_inner(
                acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, f_hi, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
                TILE_N=TILE_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=False, USE_WINDOW=False,
                USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION,
                RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=True, K_ROWS=K_ROWS)

    _store_decode(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, heads, offs_d, h_ok, d_ok,
                  seq, q_start, split, v_scale, out_scale_ptr,
                  stride_ot, stride_oh, stride_pa_s, stride_pa_h, stride_pa_k,
                  NUM_SPLITS=NUM_SPLITS, USE_OUT_SCALE=USE_OUT_SCALE, OUT_MAX=OUT_MAX)
    if NUM_SPLITS > 1 and SPLIT_MERGE == 1:
        _merge_if_last_split(out_ptr, part_acc_ptr, part_ml_ptr,
                             merge_count_ptr + seq * tl.num_programs(1) + tl.program_id(1),
                             heads, offs_d, h_ok, d_ok, seq, q_start, v_scale, out_scale_ptr,
                             stride_ot, stride_oh, stride_pa_s, stride_pa_h, stride_pa_k,
                             BLOCK_H=BLOCK_H, BLOCK_S=triton.next_power_of_2(NUM_SPLITS),
                             NUM_SPLITS=NUM_SPLITS, USE_OUT_SCALE=USE_OUT_SCALE, OUT_MAX=OUT_MAX)


@triton.jit
def _merge_if_last_split(out_ptr, part_acc_ptr, part_ml_ptr, count_ptr, heads, offs_d, h_ok, d_ok,
                         seq, q_start, v_scale, out_scale_ptr,
                         stride_ot, stride_oh, stride_pa_s, stride_pa_h, stride_pa_k,
                         BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         USE_OUT_SCALE: tl.constexpr, OUT_MAX: tl.constexpr):
    """After this program stored its split's partial rows: take a ticket on the rows'
    counter; the program that takes the last one merges every split (``_decode_reduce_kernel``'s
    formula; the sum runs split by split, so fp32 rounding may differ in the last bits) and
    sets the counter back to 0 for the next launch. The counters must be 0 when the launch
    starts."""
    # Every lane's partial stores come before the release of the ticket (one lane takes it).
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == NUM_SPLITS - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        # Partials of the other splits: read from L2 (.cg), never from this SM's L1.
        ml = (seq.to(tl.int64) * stride_pa_s // stride_pa_k + heads * NUM_SPLITS) * 2  # [BLOCK_H]
        offs_s = tl.arange(0, BLOCK_S)
        m_all = tl.load(part_ml_ptr + ml[:, None] + offs_s[None, :] * 2,
                        mask=h_ok[:, None] & (offs_s < NUM_SPLITS)[None, :], other=float("-inf"),
                        cache_modifier=".cg")
        m_max = tl.max(m_all, 1)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        acc = tl.zeros([BLOCK_H, offs_d.shape[0]], tl.float32)
        l_sum = tl.zeros([BLOCK_H], tl.float32)
        mask = h_ok[:, None] & d_ok[None, :]
        pa = (part_acc_ptr + seq.to(tl.int64) * stride_pa_s + heads[:, None] * stride_pa_h
              + offs_d[None, :])
        for s in tl.range(0, NUM_SPLITS, loop_unroll_factor=4):  # 4 splits' loads in flight
            m_s = tl.load(part_ml_ptr + ml + s * 2, mask=h_ok, other=float("-inf"),
                          cache_modifier=".cg")
            l_s = tl.load(part_ml_ptr + ml + s * 2 + 1, mask=h_ok, other=0.0, cache_modifier=".cg")
            w = tl.exp2(m_s - m_max)  # an empty split has m = -inf: weight 0
            l_sum += w * l_s
            a_s = tl.load(pa + s * stride_pa_k, mask=mask, other=0.0, cache_modifier=".cg")
            acc += a_s * w[:, None]
        _store_output_rows(out_ptr, acc, l_sum, heads, offs_d, mask, q_start, v_scale, out_scale_ptr,
                           stride_ot, stride_oh, USE_OUT_SCALE=USE_OUT_SCALE, OUT_MAX=OUT_MAX)


@triton.jit
def _store_output_rows(out_ptr, acc, l, heads, offs_d, mask, q_start, v_scale, out_scale_ptr,
                       stride_ot, stride_oh, USE_OUT_SCALE: tl.constexpr, OUT_MAX: tl.constexpr):
    """Normalise and store a decode token's ``[BLOCK_H, BLOCK_D]`` output rows."""
    out_scale = 1.0
    if USE_OUT_SCALE:
        out_scale = tl.load(out_scale_ptr)
    out_ptrs = out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    _store_rows(out_ptrs, acc, l, v_scale, out_scale, mask, USE_OUT_SCALE=USE_OUT_SCALE,
                OUT_MAX=OUT_MAX)



@triton.jit
def _pow2_floor_of_max(x):
    """2^floor(log2 m) for m the largest finite |x| (exactly, from m's exponent bits); 1.0
    when no element is finite and nonzero or m is an fp32 subnormal. Non-finite elements do
    not count: an inf or NaN in one head's query stays its own (x / unit keeps it), the other
    heads of the program keep their scale."""
    a = tl.abs(x)
    m = tl.max(tl.max(tl.where(a < float("inf"), a, 0.0), 1), 0)
    e = m.to(tl.int32, bitcast=True) & 0x7F800000
    return tl.where(e == 0, 1.0, e.to(tl.float32, bitcast=True))


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_loc_ptr, v_scale_ptr, out_scale_ptr,
    stride_ot, stride_oh, stride_pa_s, stride_pa_h, stride_pa_k,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, FP8_KV: tl.constexpr, USE_OUT_SCALE: tl.constexpr,
    OUT_MAX: tl.constexpr,
):
    """Grid ``(num_seqs, num_heads)``: merge the splits' (acc, max, sum) of one decode row."""
    tl.static_assert(BLOCK_S >= NUM_SPLITS, "one tile holds every split")
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_start != 1:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_SIZE
    row = (seq.to(tl.int64) * stride_pa_s + head * stride_pa_h) // stride_pa_k + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * stride_pa_k + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits have m = -inf: weight 0
    l_sum = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0)
    v_scale = 1.0
    if FP8_KV:
        v_scale = tl.load(v_scale_ptr)
    out = out * tl.where(l_sum > 0.0, v_scale / tl.where(l_sum > 0.0, l_sum, 1.0), 0.0)
    if USE_OUT_SCALE:
        # Saturate to the fp8 range; NaN stays NaN (the GPU's default min/max drop it).
        out = tl.clamp(out / tl.load(out_scale_ptr), -OUT_MAX, OUT_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)



@triton.jit
def _store_decode(out_ptr, part_acc_ptr, part_ml_ptr, acc, m, l, heads, offs_d, mask_h, mask_d,
                  seq, q_start, split, v_scale, out_scale_ptr,
                  stride_ot, stride_oh, stride_pa_s, stride_pa_h, stride_pa_k,
                  NUM_SPLITS: tl.constexpr, USE_OUT_SCALE: tl.constexpr, OUT_MAX: tl.constexpr):
    """Finish one program's ``[BLOCK_H, BLOCK_D]`` decode rows: with one split, normalise and
    store the output; else store the split's partial (acc, max, sum) for the merge."""
    mask = mask_h[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        _store_output_rows(out_ptr, acc, l, heads, offs_d, mask, q_start, v_scale, out_scale_ptr,
                           stride_ot, stride_oh, USE_OUT_SCALE=USE_OUT_SCALE, OUT_MAX=OUT_MAX)
    else:
        pa = (part_acc_ptr + seq.to(tl.int64) * stride_pa_s + heads[:, None] * stride_pa_h
              + split * stride_pa_k + offs_d[None, :])
        tl.store(pa, acc, mask=mask)
        pml = part_ml_ptr + ((seq.to(tl.int64) * stride_pa_s // stride_pa_k + heads * NUM_SPLITS + split) * 2)
        tl.store(pml, m, mask=mask_h)
        tl.store(pml + 1, l, mask=mask_h)



@triton.jit
def _keys_q_chunks(q_row_ptr, heads, h_ok, stride_qh, COMPUTE: tl.constexpr,
                   HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Q^T of one decode row block as a tuple of ``[16, BLOCK_H]`` channel chunks."""
    tl.static_assert(BLOCK_D % 16 == 0, "keys-major dots take 16 channels at a time")
    q_t = ()
    for c in tl.static_range(BLOCK_D // 16):
        offs_d = c * 16 + tl.arange(0, 16)
        chunk = tl.load(q_row_ptr + heads[None, :] * stride_qh + offs_d[:, None],
                        mask=h_ok[None, :] & (offs_d < HEAD_SIZE)[:, None], other=0.0)
        q_t = q_t + (chunk.to(COMPUTE),)
    return q_t


@triton.jit
def _keys_scores(q_t, k_cache_ptr, blk, run_ok, kv_head, start, stride_kcb, stride_kch,
                 COMPUTE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, X: tl.constexpr,
                 TILE_N: tl.constexpr, MASK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``K Q^T`` ``[TILE_N, BLOCK_H]`` of keys ``start ..``, 16 channels a dot: a chunk's
    ``[TILE_N, 16]`` K tile is narrow enough that a warp's lanes walk the tokens (consecutive
    16-byte packets of the page), and it feeds its dot straight from shared memory."""
    in_blk = (start + tl.arange(0, TILE_N)) % BLOCK_SIZE
    base = blk * stride_kcb + kv_head * stride_kch + in_blk * X  # [TILE_N]
    s = tl.zeros([TILE_N, BLOCK_H], tl.float32)
    for c in tl.static_range(BLOCK_D // 16):
        offs_d = c * 16 + tl.arange(0, 16)
        ptrs = k_cache_ptr + base[:, None] + ((offs_d // X) * (BLOCK_SIZE * X) + offs_d % X)[None, :]
        if MASK or BLOCK_D != HEAD_SIZE:
            k = tl.load(ptrs, mask=run_ok[:, None] & (offs_d < HEAD_SIZE)[None, :], other=0.0)
        else:
            k = tl.load(ptrs)
        s = tl.dot(k.to(COMPUTE), q_t[c], s, input_precision=DOT_PRECISION)
    return s


@triton.jit
def _keys_values(v_cache_ptr, blk, run_ok, kv_head, start, stride_vcb, stride_vch,
                 BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                 X: tl.constexpr, TILE_N: tl.constexpr, INTERLEAVED_V: tl.constexpr,
                 MASK: tl.constexpr):
    """V^T ``[BLOCK_D, TILE_N]`` of keys ``start ..`` (cache dtype), read in page order:
    standard pages are ``[HEAD, BLOCK_SIZE]`` already; interleaved ones are loaded as
    ``[HEAD, packets, X]`` and reshaped."""
    offs_n = start + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    if INTERLEAVED_V:  # V page [BLOCK_SIZE/X, HEAD, X]
        v3 = _v_packets(v_cache_ptr, blk, run_ok, kv_head, start, stride_vcb, stride_vch,
                        BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
                        TILE_N=TILE_N, MASK=MASK)
        return tl.reshape(v3, (BLOCK_D, TILE_N))
    else:  # V page [HEAD, BLOCK_SIZE]
        v_offs = (blk[None, :] * stride_vcb + kv_head * stride_vch
                  + offs_d[:, None] * BLOCK_SIZE + (offs_n % BLOCK_SIZE)[None, :])
        if MASK or BLOCK_D != HEAD_SIZE:
            return tl.load(v_cache_ptr + v_offs, mask=d_ok[:, None] & run_ok[None, :], other=0.0)
        else:
            return tl.load(v_cache_ptr + v_offs)


@triton.jit
def _keys_inner(
    acc_t, m_i, l_i, q_t, q_pos, slope, sm_scale, softcap,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, tile_lo, tile_hi, lo, hi,
    stride_kcb, stride_kch, stride_vcb, stride_vch,
    COMPUTE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, X: tl.constexpr, TILE_N: tl.constexpr,
    SUB: tl.constexpr, INTERLEAVED_V: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Keys-major online softmax over tiles ``tile_lo .. tile_hi`` of one decode row block:
    ``acc_t`` ``[BLOCK_D, BLOCK_H]``, ``q_t`` the chunks of ``_keys_q_chunks``; keys outside
    ``[lo, hi)`` are masked when ``MASK``. Block ids are loaded one tile ahead (as in
    ``_paged_inner``)."""
    last = tl.maximum(tile_hi - 1, tile_lo)
    blk, run_ok, _, _ = _block_ids(bt_row_ptr, tile_lo * TILE_N, lo, hi, BLOCK_SIZE=BLOCK_SIZE,
                                   TILE_N=TILE_N, SUB=SUB, MASK=True, K_ROWS=0)
    for t in range(tile_lo, tile_hi):
        blk_t = blk
        run_ok_t = run_ok
        blk, run_ok, _, _ = _block_ids(bt_row_ptr, tl.minimum(t + 1, last) * TILE_N, lo, hi,
                                       BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, SUB=SUB, MASK=MASK,
                                       K_ROWS=0)
        qk = _keys_scores(q_t, k_cache_ptr, blk_t, run_ok_t, kv_head, t * TILE_N,
                          stride_kcb, stride_kch, COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE,
                          HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, BLOCK_H=BLOCK_H, X=X,
                          TILE_N=TILE_N, MASK=MASK, DOT_PRECISION=DOT_PRECISION)
        v_t = _keys_values(v_cache_ptr, blk_t, run_ok_t, kv_head, t * TILE_N, stride_vcb,
                           stride_vch, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE,
                           BLOCK_D=BLOCK_D, X=X, TILE_N=TILE_N, INTERLEAVED_V=INTERLEAVED_V,
                           MASK=MASK).to(COMPUTE)
        k_pos = t * TILE_N + tl.arange(0, TILE_N)
        k_ok = (k_pos >= lo) & (k_pos < hi)
        if MASK:  # unwritten slots may hold anything (NaN): 0 * NaN would poison the sum
            v_t = tl.where(k_ok[None, :], v_t, 0.0)
        if USE_SOFTCAP:
            s = (softcap * _LOG2E) * _tanh(qk * (sm_scale / softcap))
        else:
            s = qk * (sm_scale * _LOG2E)
        if USE_ALIBI:
            s += slope[None, :] * (k_pos[:, None] - q_pos[None, :]).to(tl.float32)
        if MASK:
            s = tl.where(k_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p.to(COMPUTE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc_t, m_i, l_i


@triton.jit
def _stream_blocks(bt_row_ptr, t, lo, hi, W: tl.constexpr, S: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr):
    """First key ``[W]`` of each stream of tile ``t``, its cache block (int64) and whether
    the stream holds a visible key (only those streams touch the cache)."""
    n0 = t * (W * S) + tl.arange(0, W) * S
    ok = (n0 < hi) & (n0 + S > lo)
    blk = tl.load(bt_row_ptr + n0 // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    return n0, blk, ok


@triton.jit
def _stream_kv(k_cache_ptr, v_cache_ptr, n0, blk, ok, kv_head,
               stride_kcb, stride_kch, stride_vcb, stride_vch,
               W: tl.constexpr, S: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, X: tl.constexpr,
               INTERLEAVED_V: tl.constexpr, MASK: tl.constexpr):
    """K ``[W, BLOCK_D, S]`` and V ``[W, S, BLOCK_D]`` of one tile (cache dtype)."""
    offs_s = tl.arange(0, S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    base_in = (n0 % BLOCK_SIZE)[:, None, None]
    blk3 = blk[:, None, None]
    ok3 = ok[:, None, None]
    # K page [HEAD/X, BLOCK_SIZE, X]: X channels of a token are one 16-byte packet.
    d_k = offs_d[None, :, None]
    tok_k = base_in + offs_s[None, None, :]
    k_offs = (blk3 * stride_kcb + kv_head * stride_kch
              + (d_k // X) * (BLOCK_SIZE * X) + tok_k * X + d_k % X)
    d_v = offs_d[None, None, :]
    tok_v = base_in + offs_s[None, :, None]
    if INTERLEAVED_V:  # V page [BLOCK_SIZE/X, HEAD, X]: X tokens of a channel per packet
        v_offs = (blk3 * stride_vcb + kv_head * stride_vch
                  + (tok_v // X) * (HEAD_SIZE * X) + d_v * X + tok_v % X)
    else:  # V page [HEAD, BLOCK_SIZE]
        v_offs = blk3 * stride_vcb + kv_head * stride_vch + d_v * BLOCK_SIZE + tok_v
    if MASK or BLOCK_D != HEAD_SIZE:
        k = tl.load(k_cache_ptr + k_offs, mask=ok3 & d_ok[None, :, None], other=0.0)
        v = tl.load(v_cache_ptr + v_offs, mask=ok3 & d_ok[None, None, :], other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_offs)
        v = tl.load(v_cache_ptr + v_offs)
    return k, v


@triton.jit
def _stream_inner(
    acc, m_i, l_i, q, q_pos, slope, s_scale, softcap,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, tile_lo, tile_hi, lo, hi,
    stride_kcb, stride_kch, stride_vcb, stride_vch,
    W: tl.constexpr, S: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr, X: tl.constexpr, INTERLEAVED_V: tl.constexpr,
    COMPUTE: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax of every stream over tiles ``tile_lo .. tile_hi``; keys outside
    ``[lo, hi)`` are masked when ``MASK`` (else every key of these tiles is visible).

    The block ids of tile t+1 are loaded while tile t is processed: a block-table load in
    the iteration of the copies it addresses makes the software pipeline drain every tile.
    """
    n0, blk, ok = _stream_blocks(bt_row_ptr, tile_lo, lo, hi, W=W, S=S, BLOCK_SIZE=BLOCK_SIZE)
    for t in range(tile_lo, tile_hi):
        n0_t = n0
        blk_t = blk
        ok_t = ok
        n0, blk, ok = _stream_blocks(bt_row_ptr, t + 1, lo, hi, W=W, S=S, BLOCK_SIZE=BLOCK_SIZE)
        k, v = _stream_kv(k_cache_ptr, v_cache_ptr, n0_t, blk_t, ok_t, kv_head,
                          stride_kcb, stride_kch, stride_vcb, stride_vch, W=W, S=S,
                          BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
                          INTERLEAVED_V=INTERLEAVED_V, MASK=MASK)
        k_pos = n0_t[:, None, None] + tl.arange(0, S)[None, None, :]  # [W, 1, S]
        v = v.to(COMPUTE)
        if MASK:
            v_pos = n0_t[:, None, None] + tl.arange(0, S)[None, :, None]  # [W, S, 1]
            # unwritten slots may hold anything (NaN): 0 * NaN would poison the sum
            v = tl.where((v_pos >= lo) & (v_pos < hi), v, 0.0).to(COMPUTE)
        qk = tl.dot(q, k.to(COMPUTE), input_precision=DOT_PRECISION)  # [W, BLOCK_H, S]
        if USE_SOFTCAP:
            s = (softcap * _LOG2E) * _tanh(qk * s_scale)
        else:
            s = qk * s_scale
        if USE_ALIBI:
            s += slope[None, :, None] * (k_pos - q_pos).to(tl.float32)
        if MASK:
            s = tl.where((k_pos >= lo) & (k_pos < hi), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_decode_streams_kernel(
    # pointers
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    k_scale_ptr, v_scale_ptr, alibi_ptr, sinks_ptr, out_scale_ptr,
    # scalars
    sm_scale, softcap, window,
    # strides (elements)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kch, stride_vcb, stride_vch, stride_bt,
    stride_pa_s, stride_pa_h, stride_pa_k,  # part_acc [seqs, heads, splits, HEAD]
    # constexpr
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    W: tl.constexpr, S: tl.constexpr, NUM_SPLITS: tl.constexpr, COMPUTE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, FP8_KV: tl.constexpr, INTERLEAVED_V: tl.constexpr,
    USE_OUT_SCALE: tl.constexpr, OUT_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_LOOP: tl.constexpr,
):
    """Grid ``(num_seqs, num_kv_heads * HEAD_CHUNKS, NUM_SPLITS)``; only query_len == 1.

    Same arguments and outputs as ``_paged_decode_kernel`` (run with ``num_warps=W``): the
    decode token sits at position ``seq_len - 1`` and reads every key, its own included, from
    the cache.
    """
    tl.static_assert(BLOCK_SIZE % S == 0, "a stream's S keys sit in one cache block")
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_CHUNKS
    chunk = tl.program_id(1) % HEAD_CHUNKS
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_w = tl.arange(0, W)
    h_ok = offs_h < GQA
    d_ok = offs_d < HEAD_SIZE
    heads = kv_head * GQA + offs_h
    # Every stream multiplies the same query rows: load them once per warp.
    q_ptrs = (q_ptr + q_start.to(tl.int64) * stride_qt + heads[None, :, None] * stride_qh
              + offs_d[None, None, :] + offs_w[:, None, None] * 0)
    q = tl.load(q_ptrs, mask=h_ok[None, :, None] & d_ok[None, None, :], other=0.0).to(COMPUTE)
    q_pos = seq_len - 1

    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    t_lo = lo // (W * S)
    t_hi = (seq_len + W * S - 1) // (W * S)
    if NUM_SPLITS > 1:  # this split's share of the tiles
        per = (t_hi - t_lo + NUM_SPLITS - 1) // NUM_SPLITS
        t_lo = tl.minimum(t_lo + split * per, t_hi)
        t_hi = tl.minimum(t_lo + per, t_hi)

    sm = sm_scale
    v_scale = 1.0
    if FP8_KV:
        sm = sm_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    if USE_SOFTCAP:
        s_scale = sm / softcap
    else:
        s_scale = sm * _LOG2E
    slope = tl.zeros([BLOCK_H], tl.float32)
    if USE_ALIBI:
        slope += tl.load(alibi_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
    acc = tl.zeros([W, BLOCK_H, BLOCK_D], tl.float32)
    m_i = tl.zeros([W, BLOCK_H], tl.float32) - float("inf")
    l_i = tl.zeros([W, BLOCK_H], tl.float32)
    if USE_SINKS:
        if split == 0:  # the sink (logit `sink`, value 0) joins once: stream 0 of split 0
            sink = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
            first = (offs_w == 0)[:, None]
            m_i = tl.where(first, sink[None, :], m_i)
            l_i = tl.where(first, 1.0, l_i)

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    if ONE_LOOP:  # one software pipeline, masks everywhere
        acc, m_i, l_i = _stream_inner(
            acc, m_i, l_i, q, q_pos, slope, s_scale, softcap, k_cache_ptr, v_cache_ptr, bt_row,
            kv_head, t_lo, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
            W=W, S=S, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
            INTERLEAVED_V=INTERLEAVED_V, COMPUTE=COMPUTE, USE_ALIBI=USE_ALIBI,
            USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION)
    else:  # masked tiles at the window start and the sequence end; no masks in between
        f_lo = tl.minimum(tl.maximum((lo + W * S - 1) // (W * S), t_lo), t_hi)
        f_hi = tl.minimum(tl.maximum(seq_len // (W * S), f_lo), t_hi)
        acc, m_i, l_i = _stream_inner(
            acc, m_i, l_i, q, q_pos, slope, s_scale, softcap, k_cache_ptr, v_cache_ptr, bt_row,
            kv_head, t_lo, f_lo, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
            W=W, S=S, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
            INTERLEAVED_V=INTERLEAVED_V, COMPUTE=COMPUTE, USE_ALIBI=USE_ALIBI,
            USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION)
        acc, m_i, l_i = _stream_inner(
            acc, m_i, l_i, q, q_pos, slope, s_scale, softcap, k_cache_ptr, v_cache_ptr, bt_row,
            kv_head, f_lo, f_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
            W=W, S=S, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
            INTERLEAVED_V=INTERLEAVED_V, COMPUTE=COMPUTE, USE_ALIBI=USE_ALIBI,
            USE_SOFTCAP=USE_SOFTCAP, MASK=False, DOT_PRECISION=DOT_PRECISION)
        acc, m_i, l_i = _stream_inner(
            acc, m_i, l_i, q, q_pos, slope, s_scale, softcap, k_cache_ptr, v_cache_ptr, bt_row,
            kv_head, f_hi, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
            W=W, S=S, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
            INTERLEAVED_V=INTERLEAVED_V, COMPUTE=COMPUTE, USE_ALIBI=USE_ALIBI,
            USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION)

    # Merge the streams (the only cross-warp step).
    m = tl.max(m_i, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wgt = tl.exp2(m_i - m_safe[None, :])  # empty streams: m_i = -inf, weight 0
    l_sum = tl.sum(l_i * wgt, 0)
    out = tl.sum(acc * wgt[:, :, None], 0)
    _store_decode(out_ptr, part_acc_ptr, part_ml_ptr, out, m, l_sum, heads, offs_d, h_ok, d_ok,
                  seq, q_start, split, v_scale, out_scale_ptr,
                  stride_ot, stride_oh, stride_pa_s, stride_pa_h, stride_pa_k,
                  NUM_SPLITS=NUM_SPLITS, USE_OUT_SCALE=USE_OUT_SCALE, OUT_MAX=OUT_MAX)
