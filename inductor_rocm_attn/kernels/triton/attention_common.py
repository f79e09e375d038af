"""Shared ``@triton.jit`` pieces of the attention kernels (decode, prefix prefill, encoder).

- ``_attn_update``: one key tile of online softmax with scale, soft cap, ALiBi and masks,
  in log2 units (``exp2``). With ``RESCALE_MARGIN`` > 0 the running max is kept until a
  row's tile max passes it by that margin, so most tiles skip rescaling the accumulator.
- ``_block_ids`` / ``_load_paged_kv`` / ``_v_packets``: a ``[HEAD, TILE]`` K tile and a
  ``[TILE, HEAD]`` V tile read from the paged cache through the block table, for any block
  size that is a multiple of 16.
- ``_paged_inner`` / ``_dense_inner``: online softmax over tiles of the paged cache, and over
  a dense ``[tokens, heads, HEAD]`` key/value pair (pointers or TMA descriptors).
- ``_plan`` / ``_tiles``: which key tiles a row block sees, and which of them need no mask.
- ``_row_block`` (program -> sequence and row block of a varlen batch, through
  ``_find_seq``) and ``_store_rows`` (epilogue).

``TL_DTYPES`` maps the compute dtype of a launch to the ``COMPUTE`` constexpr.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _tanh(x):
    # tanh through exp2 (no libdevice: also runs in the interpreter); saturates to +-1.
    # Near 0, 1 - 2 / (e + 1) cancels to an absolute error of ~2^-24, which the soft cap
    # multiplies by the cap (cap * tanh(s / cap) would be off by ~6e-4 for a cap of 1e4).
    # Below |x| = 1/2 the odd Taylor series to x^13 instead (truncation < 1e-7 relative).
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (
        62.0 / 2835.0 + x2 * (-1382.0 / 155925.0 + x2 * (21844.0 / 6081075.0)))))))
    return tl.where(tl.abs(x) < 0.5, series, 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0))


@triton.jit
def _attn_update(
    acc, m_i, l_i,  # running state: [M, BLOCK_D] fp32, [M] (log2 units), [M]
    q, k, v,  # [M, BLOCK_D], [BLOCK_D, N], [N, BLOCK_D] in the compute dtype
    q_pos, k_pos, k_ok,  # [M] int, [N] int, [N] bool (key inside the visible range)
    slope,  # [M] ALiBi slope * log2(e)
    sm_scale, softcap, window,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RESCALE_MARGIN: tl.constexpr, WINDOW_BOTH_SIDES: tl.constexpr = False,
):
    """One key tile of online softmax: scale, soft cap, ALiBi, mask, then the rescaled sums.

    The sliding window keeps ``q - k < window``; with ``WINDOW_BOTH_SIDES`` (encoder layers)
    also ``k - q < window``. A decoder's window is one-sided: keys after the query stay
    visible when it is not causal (docs/design.md, "Sliding window").

    Without soft cap and ALiBi the scores stay unscaled: the row max is taken on them and
    scaled once a row, and each ``exp2(qk * c - m)`` is one FFMA instead of a multiply
    and a subtract per score (``sm_scale`` > 0, checked by ``validation.check_softmax_scale``,
    so the max commutes with the scaling).

    Non-finite inputs (as float64 SDPA over the keys a row sees): a NaN or +inf score of a
    visible key reaches its row through its own weight ``exp2(s - m)`` = NaN, whatever the
    running max did with it. (The GPU's float max drops NaN, the interpreter's keeps it: the
    output is the same.) A masked score is -inf whatever its K. A NaN or +-inf value (V)
    enters the ``P V`` product of its tile, where a row that masks the key multiplies it by
    a weight of 0: such a row gets NaN in that channel too. So a non-finite V of a key
    reaches every row of a row block in which some row sees the key (for decode tiles, all
    rows see the same keys); an exact per-row treatment costs registers and barriers in
    every masked tile (measured in the sm_90 SASS: spills in the loops).
    """
    qk = tl.dot(q, k, input_precision=DOT_PRECISION)
    RAW: tl.constexpr = not USE_SOFTCAP and not USE_ALIBI
    c = sm_scale * _LOG2E
    if USE_SOFTCAP:
        s = (softcap * _LOG2E) * _tanh(qk * (sm_scale / softcap))
    elif RAW:
        s = qk
    else:
        s = qk * c
    if USE_ALIBI:
        s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    if MASK:
        keep = k_ok[None, :]
        if CAUSAL:
            keep = keep & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            keep = keep & ((q_pos[:, None] - k_pos[None, :]) < window)
            if WINDOW_BOTH_SIDES and not CAUSAL:
                keep = keep & ((k_pos[None, :] - q_pos[:, None]) < window)
        s = tl.where(keep, s, float("-inf"))
    if RAW:
        m_tile = tl.max(s, 1) * c
    else:
        m_tile = tl.max(s, 1)
    if RESCALE_MARGIN > 0:
        # Lazy rescale (as FlashAttention-4): keep the running max until some row's tile max
        # passes it by more than the margin (log2 units), so most tiles skip rescaling acc;
        # p then stays below 2**RESCALE_MARGIN and acc, l and m remain consistent.
        if tl.max(tl.where(m_tile > m_i + RESCALE_MARGIN, 1, 0), 0) > 0:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        # A row that has seen no visible key yet keeps m = -inf: exponentiate against 0.
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        if RAW:
            p = tl.exp2(s * c - m_use[:, None])
        else:
            p = tl.exp2(s - m_use[:, None])
        l_i += tl.sum(p, 1)
        acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return acc, m_i, l_i
    m_new = tl.maximum(m_i, m_tile)
    # A row that has seen no visible key yet keeps m = -inf: exponentiate against 0 instead.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    if RAW:
        p = tl.exp2(s * c - m_safe[:, None])
    else:
        p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _plan(src_lo, src_hi, p0, p1, window, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
          WINDOW_BOTH_SIDES: tl.constexpr = False):
    """Keys of a source ``[src_lo, src_hi)`` seen by query positions ``[p0, p1)`` (the
    window as in ``_attn_update``).

    Returns ``lo, hi`` (seen by some row) and ``full_lo, full_hi`` (seen by every row).
    """
    lo = src_lo
    hi = src_hi
    full_lo = src_lo
    full_hi = src_hi
    if CAUSAL:
        hi = tl.minimum(hi, p1)
        full_hi = tl.minimum(full_hi, p0 + 1)
    if USE_WINDOW:
        lo = tl.maximum(lo, p0 - window + 1)
        full_lo = tl.maximum(full_lo, p1 - window)
        if WINDOW_BOTH_SIDES and not CAUSAL:
            hi = tl.minimum(hi, p1 - 1 + window)
            full_hi = tl.minimum(full_hi, p0 + window)
    hi = tl.maximum(hi, lo)
    return lo, hi, full_lo, full_hi


@triton.jit
def _tiles(lo, hi, full_lo, full_hi, base, TILE: tl.constexpr):
    """Tile indices (relative to ``base``): masked ``[t_lo, f_lo)``, unmasked ``[f_lo, f_hi)``,
    masked ``[f_hi, t_hi)``."""
    t_lo = (lo - base) // TILE
    t_hi = tl.maximum((hi - base + TILE - 1) // TILE, t_lo)
    # full_lo, full_hi >= base: both bounds start from the source's first key.
    f_lo = (full_lo - base + TILE - 1) // TILE
    f_hi = (full_hi - base) // TILE
    f_lo = tl.minimum(tl.maximum(f_lo, t_lo), t_hi)
    f_hi = tl.minimum(tl.maximum(f_hi, f_lo), t_hi)
    return t_lo, f_lo, f_hi, t_hi


@triton.jit
def _block_ids(bt_row_ptr, start, lo, hi, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
               SUB: tl.constexpr, MASK: tl.constexpr, K_ROWS: tl.constexpr):
    """Cache block of each key ``start .. start+TILE_N`` (int64 ``[TILE_N]``) and whether its
    run of ``SUB`` keys is loaded at all (a run with a visible key sits in a real block).
    Also the block and validity of each run, for ``_load_paged_kv``'s packet-row K load:
    scalars when the tile is one run; ``[TILE_N // SUB]`` for several runs when
    ``K_ROWS >= 2`` (else placeholders: nothing reads them)."""
    tl.static_assert(TILE_N % SUB == 0, "a tile is whole runs of SUB keys")
    tl.static_assert(BLOCK_SIZE % SUB == 0, "a run of SUB keys sits in one cache block")
    offs_n = start + tl.arange(0, TILE_N)
    if TILE_N == SUB:  # one run: one block-table entry, a scalar load
        if MASK:
            ok_s = (start < hi) & (start + SUB > lo)
            blk_s = tl.load(bt_row_ptr + start // BLOCK_SIZE, mask=ok_s, other=0)
            run_ok = (offs_n * 0 + start < hi) & (offs_n * 0 + start + SUB > lo)
        else:
            blk_s = tl.load(bt_row_ptr + start // BLOCK_SIZE)
            ok_s = start >= 0
            run_ok = offs_n >= 0
        blk_s = blk_s.to(tl.int64)
        blk = blk_s + tl.zeros([TILE_N], tl.int64)
    else:
        if MASK:
            run = start + (tl.arange(0, TILE_N) // SUB) * SUB
            run_ok = (run < hi) & (run + SUB > lo)
            blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=run_ok, other=0)
        else:
            run_ok = offs_n >= 0
            blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE)
        blk = tl.max_constancy(blk, SUB).to(tl.int64)
        run0 = start + tl.arange(0, TILE_N // SUB) * SUB
        if K_ROWS >= 2:  # per run: the packet-row K load addresses runs, not keys
            if MASK:
                ok_s = (run0 < hi) & (run0 + SUB > lo)
                blk_s = tl.load(bt_row_ptr + run0 // BLOCK_SIZE, mask=ok_s, other=0).to(tl.int64)
            else:
                ok_s = run0 >= 0
                blk_s = tl.load(bt_row_ptr + run0 // BLOCK_SIZE).to(tl.int64)
        else:
            ok_s = run0 >= 0
            blk_s = run0.to(tl.int64) * 0
    return blk, run_ok, blk_s, ok_s


@triton.jit
def _v_packets(v_cache_ptr, blk, run_ok, kv_head, start, stride_vcb, stride_vch,
               BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
               X: tl.constexpr, TILE_N: tl.constexpr, MASK: tl.constexpr):
    """V of keys ``start .. start+TILE_N`` from interleaved pages ``[BLOCK_SIZE/X, HEAD, X]``
    as ``[BLOCK_D, TILE_N/X, X]`` (cache dtype): consecutive lanes read consecutive 16-byte
    packets (Triton gives the lanes the first dim after the contiguous one)."""
    tl.static_assert(TILE_N % X == 0 and BLOCK_SIZE % X == 0, "a V packet holds X tokens of one run")
    offs_d = tl.arange(0, BLOCK_D)
    offs_x = tl.arange(0, X)
    G: tl.constexpr = TILE_N // X
    blk_g = tl.max(tl.reshape(blk, (G, X)), axis=1)  # runs never split a packet
    ok_g = tl.max(tl.reshape(run_ok.to(tl.int32), (G, X)), axis=1) != 0
    in_g = ((start % BLOCK_SIZE) // X + tl.arange(0, G)) % (BLOCK_SIZE // X)
    v_offs = (blk_g[None, :, None] * stride_vcb + kv_head * stride_vch
              + in_g[None, :, None] * (HEAD_SIZE * X) + offs_d[:, None, None] * X
              + offs_x[None, None, :])
    if MASK or BLOCK_D != HEAD_SIZE:
        return tl.load(v_cache_ptr + v_offs, mask=(offs_d < HEAD_SIZE)[:, None, None] & ok_g[None, :, None],
                       other=0.0)
    else:
        return tl.load(v_cache_ptr + v_offs)


@triton.jit
def _load_paged_kv(
    k_cache_ptr, v_cache_ptr, blk, run_ok,  # cache interiors (K, V views); tile's block ids
    blk_s, ok_s,  # the same per run (_block_ids): scalars when the tile is one run
    kv_head, start, lo, hi,  # tile starts at token `start`; keys outside [lo, hi) are invalid
    stride_kcb, stride_kch, stride_vcb, stride_vch,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, X: tl.constexpr,
    TILE_N: tl.constexpr, SUB: tl.constexpr, INTERLEAVED_V: tl.constexpr, MASK: tl.constexpr,
    V_PACKETS: tl.constexpr, K_ROWS: tl.constexpr,
):
    """Gather keys ``start .. start+TILE_N`` of one KV head from the cache.

    The tile is runs of ``SUB`` tokens (``_block_ids``); ``SUB`` divides the block size, so
    each run sits in one block and is contiguous there. Returns K ``[BLOCK_D, TILE_N]``,
    V ``[TILE_N, BLOCK_D]`` (cache dtype; invalid V rows are not zeroed here), key
    positions ``[TILE_N]`` and their validity.
    """
    tl.static_assert(BLOCK_D >= HEAD_SIZE and (BLOCK_D & (BLOCK_D - 1)) == 0,
                     "BLOCK_D is the head size rounded up to a power of two")
    tl.static_assert(HEAD_SIZE % X == 0, "a K packet holds X channels of one token")
    tl.static_assert(K_ROWS == 0 or K_ROWS == 1 or K_ROWS == 2, "K_ROWS is a level 0, 1 or 2")
    offs_n = start + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    in_blk = offs_n % BLOCK_SIZE
    # K page [HEAD/X, BLOCK_SIZE, X]: X channels of a token are one 16-byte packet.
    if K_ROWS >= 1 and TILE_N == SUB:
        # The tile's packet rows, [HEAD/X, TILE_N*X], each TILE_N*16 contiguous bytes: a warp
        # instruction reads two whole rows, and shared memory keeps the page's order, in
        # which ldmatrix finds 8 tokens of a packet in 128 contiguous bytes (no swizzle).
        # The [HEAD, TILE] gather below puts lanes on 16 packets 256 B apart instead.
        # H200, scratch probe, B=64 L=4096: that pattern alone cost 321 vs 253 us.
        P: tl.constexpr = BLOCK_D // X
        offs_p = tl.arange(0, P)
        offs_c = (start % BLOCK_SIZE) * X + tl.arange(0, TILE_N * X)
        k_offs = (blk_s * stride_kcb + kv_head * stride_kch
                  + offs_p[:, None] * (BLOCK_SIZE * X) + offs_c[None, :])
        if MASK or BLOCK_D != HEAD_SIZE:
            k2 = tl.load(k_cache_ptr + k_offs, mask=(offs_p < HEAD_SIZE // X)[:, None] & ok_s,
                         other=0.0)
        else:
            k2 = tl.load(k_cache_ptr + k_offs)
        k = tl.reshape(tl.permute(tl.reshape(k2, (P, TILE_N, X)), (0, 2, 1)), (BLOCK_D, TILE_N))
    elif K_ROWS >= 2:
        # Several runs (blk_s, ok_s per run): [runs, HEAD/X, SUB*X], each row SUB*16 bytes.
        R: tl.constexpr = TILE_N // SUB
        P: tl.constexpr = BLOCK_D // X
        offs_p = tl.arange(0, P)
        in0 = tl.multiple_of((start + tl.arange(0, R) * SUB) % BLOCK_SIZE, SUB)
        k_offs = (blk_s[:, None, None] * stride_kcb + kv_head * stride_kch
                  + offs_p[None, :, None] * (BLOCK_SIZE * X) + in0[:, None, None] * X
                  + tl.arange(0, SUB * X)[None, None, :])
        if MASK or BLOCK_D != HEAD_SIZE:
            k3 = tl.load(k_cache_ptr + k_offs,
                         mask=ok_s[:, None, None] & (offs_p < HEAD_SIZE // X)[None, :, None],
                         other=0.0)
        else:
            k3 = tl.load(k_cache_ptr + k_offs)
        k = tl.reshape(tl.permute(tl.reshape(k3, (R, P, SUB, X)), (1, 3, 0, 2)), (BLOCK_D, TILE_N))
    else:
        k_offs = (blk[None, :] * stride_kcb + kv_head * stride_kch
                  + (offs_d // X)[:, None] * (BLOCK_SIZE * X) + in_blk[None, :] * X
                  + (offs_d % X)[:, None])
        if MASK or BLOCK_D != HEAD_SIZE:
            k = tl.load(k_cache_ptr + k_offs, mask=d_ok[:, None] & run_ok[None, :], other=0.0)
        else:
            k = tl.load(k_cache_ptr + k_offs)
    if INTERLEAVED_V and V_PACKETS:
        # V page [BLOCK_SIZE/X, HEAD, X]: X tokens of a channel per packet. Loaded as
        # [HEAD, packets, X] so that consecutive lanes read consecutive packets (Triton gives
        # the lanes the first dim after the contiguous one), then viewed as [TILE_N, HEAD].
        # H200, one warp, B=64, L=2048: 174 us; the 2-D gather (lanes 2 KB apart) 269 us.
        # Decode only: in the 8-warp prefill tile it doubles the barriers (sm_90 SASS), and
        # it has not been timed there.
        v3 = _v_packets(v_cache_ptr, blk, run_ok, kv_head, start, stride_vcb, stride_vch,
                        BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
                        TILE_N=TILE_N, MASK=MASK)
        v = tl.reshape(tl.permute(v3, (1, 2, 0)), (TILE_N, BLOCK_D))
    else:
        if INTERLEAVED_V:  # a 2-D gather: a warp's lanes on two runs 2 KB apart (bs 16)
            v_offs = (blk[:, None] * stride_vcb + kv_head * stride_vch
                      + (in_blk // X)[:, None] * (HEAD_SIZE * X) + offs_d[None, :] * X
                      + (in_blk % X)[:, None])
        else:  # V page [HEAD, BLOCK_SIZE]: a lane's packet is X tokens of one channel
            v_offs = (blk[:, None] * stride_vcb + kv_head * stride_vch
                      + offs_d[None, :] * BLOCK_SIZE + in_blk[:, None])
        if MASK or BLOCK_D != HEAD_SIZE:
            v = tl.load(v_cache_ptr + v_offs, mask=run_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_cache_ptr + v_offs)
    k_ok = (offs_n >= lo) & (offs_n < hi)
    return k, v, offs_n, k_ok


@triton.jit
def _paged_inner(
    acc, m_i, l_i, q, q_pos, slope, sm_scale, softcap, window,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, tile_lo, tile_hi, lo, hi,
    stride_kcb, stride_kch, stride_vcb, stride_vch,
    COMPUTE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr, X: tl.constexpr, TILE_N: tl.constexpr, SUB: tl.constexpr,
    INTERLEAVED_V: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr, MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, RESCALE_MARGIN: tl.constexpr, V_PACKETS: tl.constexpr,
    K_ROWS: tl.constexpr,
):
    """Online softmax over cache tiles ``tile_lo .. tile_hi`` (tile t = tokens t*TILE_N ..).

    The block ids of tile t+1 are loaded while tile t is processed: a block-table load in
    the same iteration as the K/V loads it addresses would make the software pipeline wait
    for every copy in flight (seen in the SASS as ``DEPBAR.LE SB0, 0x0``). The prefetch index
    is clamped rather than masked in unmasked loops: masking it there (sm_90, triton 3.6)
    made every wgmma of the kernel wait for its result (24 WARPGROUP waits a loop, not 3).
    """
    tl.static_assert((TILE_N & (TILE_N - 1)) == 0, "TILE_N is a power of two")
    last = tl.maximum(tile_hi - 1, tile_lo)
    # Masked: with an empty range, tile_lo may lie past the sequence's block-table entries.
    blk, run_ok, blk_s, ok_s = _block_ids(bt_row_ptr, tile_lo * TILE_N, lo, hi,
                                          BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, SUB=SUB,
                                          MASK=True, K_ROWS=K_ROWS)
    for t in range(tile_lo, tile_hi):
        blk_t = blk
        run_ok_t = run_ok
        blk_s_t = blk_s
        ok_s_t = ok_s
        blk, run_ok, blk_s, ok_s = _block_ids(bt_row_ptr, tl.minimum(t + 1, last) * TILE_N, lo,
                                              hi, BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, SUB=SUB,
                                              MASK=MASK, K_ROWS=K_ROWS)
        k, v, k_pos, k_ok = _load_paged_kv(
            k_cache_ptr, v_cache_ptr, blk_t, run_ok_t, blk_s_t, ok_s_t, kv_head, t * TILE_N, lo,
            hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
            BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X, TILE_N=TILE_N,
            SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, MASK=MASK, V_PACKETS=V_PACKETS, K_ROWS=K_ROWS)
        k = k.to(COMPUTE)
        v = v.to(COMPUTE)
        if MASK:  # unwritten slots may hold anything (NaN): 0 * NaN would poison the sum
            v = tl.where(k_ok[:, None], v, 0.0)
        acc, m_i, l_i = _attn_update(
            acc, m_i, l_i, q, k, v, q_pos, k_pos, k_ok, slope, sm_scale, softcap, window,
            CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP,
            MASK=MASK, DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=RESCALE_MARGIN)
    return acc, m_i, l_i


@triton.jit
def _dense_inner(
    acc, m_i, l_i, q, q_pos, slope, sm_scale, softcap, window,
    k_ptr, v_ptr,  # first key/value row of the sequence, at its KV head (or descriptors)
    stride_kt, stride_vt, base, tile_lo, tile_hi, lo, hi,  # key j has position base + j
    row0, col0,  # with TMA: the sequence's first row and its KV head's first column
    COMPUTE: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr, MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, RESCALE_MARGIN: tl.constexpr, TMA: tl.constexpr,
    WINDOW_BOTH_SIDES: tl.constexpr = False,
):
    """Online softmax over key tiles of a dense ``[tokens, heads, HEAD]`` key/value pair.

    With ``TMA`` k_ptr/v_ptr are tensor descriptors of ``[tokens, heads * HEAD]`` with
    ``[BLOCK_N, HEAD]`` boxes: the copy engine fetches the tile (Hopper), the warps issue
    no per-lane address math or async copies for it.
    """
    tl.static_assert((BLOCK_N & (BLOCK_N - 1)) == 0, "BLOCK_N is a power of two")
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    for t in range(tile_lo, tile_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_pos = base + offs_n
        if TMA:
            # Rows past the tensor come back as zeros; rows of the next sequence are real
            # data: masked out of the scores, and out of V (which may be padding: NaN).
            k = tl.trans(k_ptr.load([row0 + t * BLOCK_N, col0]))
            v = v_ptr.load([row0 + t * BLOCK_N, col0])
            if MASK:
                k_ok = (k_pos >= lo) & (k_pos < hi)
                v = tl.where(k_ok[:, None], v, 0.0)
            else:
                k_ok = k_pos >= 0
        else:
            k_ptrs = k_ptr + offs_n[None, :] * stride_kt + offs_d[:, None]
            v_ptrs = v_ptr + offs_n[:, None] * stride_vt + offs_d[None, :]
            if MASK:
                k_ok = (k_pos >= lo) & (k_pos < hi)
                k = tl.load(k_ptrs, mask=d_ok[:, None] & k_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            elif BLOCK_D != HEAD_SIZE:
                k_ok = k_pos >= 0
                k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                k_ok = k_pos >= 0
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
        acc, m_i, l_i = _attn_update(
            acc, m_i, l_i, q, k.to(COMPUTE), v.to(COMPUTE), q_pos, k_pos, k_ok, slope, sm_scale,
            softcap, window, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI,
            USE_SOFTCAP=USE_SOFTCAP, MASK=MASK, DOT_PRECISION=DOT_PRECISION,
            RESCALE_MARGIN=RESCALE_MARGIN, WINDOW_BOTH_SIDES=WINDOW_BOTH_SIDES)
    return acc, m_i, l_i


@triton.jit
def _find_seq(cu_ptr, num_seqs, pid, BLOCK_M: tl.constexpr):
    """Sequence s owns virtual row blocks ``cu[s] // BLOCK_M + s ..`` (at least its
    ``cdiv(len, BLOCK_M)``): the largest s whose first virtual block is <= pid."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        v = tl.load(cu_ptr + mid) // BLOCK_M + mid
        if v <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _row_block(cu_ptr, num_seqs, pid, BLOCK_M: tl.constexpr, LAST_FIRST: tl.constexpr):
    """Program ``pid`` of a varlen grid ``(num_tokens // BLOCK_M + num_seqs, ...)``: its
    sequence, the sequence's first row and length, its row block and whether that block
    holds rows of the sequence.

    Sequence s owns the virtual blocks from ``cu[s] // BLOCK_M + s`` on (``_find_seq``), one
    more than its rows need at most; programs past ``cu[-1]`` (padding rows) map onto the
    last sequence. Only blocks ``0 .. cdiv(len, BLOCK_M) - 1`` hold rows: for any other
    (padding, an empty sequence, a sequence's spare block) ``ok`` is False and the caller
    returns before its first load or store. ``LAST_FIRST`` runs a sequence's blocks last
    first; it permutes only the blocks that hold rows, so a block outside them never turns
    into a negative row index.
    """
    seq = _find_seq(cu_ptr, num_seqs, pid, BLOCK_M=BLOCK_M)
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    tile = pid - (start // BLOCK_M + seq)
    ok = (tile >= 0) & (tile * BLOCK_M < length)
    if LAST_FIRST:
        tile = (length + BLOCK_M - 1) // BLOCK_M - 1 - tile
    return seq, start, length, tile, ok


@triton.jit
def _store_rows(out_ptrs, acc, l_i, v_scale, out_scale, mask,
                USE_OUT_SCALE: tl.constexpr, OUT_MAX: tl.constexpr):
    """Normalise, dequantise V, optionally quantise to fp8, store."""
    # A row with no visible key (and no sink) outputs 0.
    inv = tl.where(l_i > 0.0, v_scale / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    out = acc * inv[:, None]
    if USE_OUT_SCALE:
        # Saturate to the fp8 range; NaN stays NaN (the GPU's default min/max drop it).
        out = tl.clamp(out / out_scale, -OUT_MAX, OUT_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask)


