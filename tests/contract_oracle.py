"""A float64 oracle written from the contract alone (docs/design.md: "Semantics", "KV-cache
layouts"), for tests/test_oracle_contract.py.

Nothing here imports the package's kernels or layout helpers: the cache is read and written
as the flat storage of the logical tensor, with the page offset of the design (``b * stride0
+ g * stride1``) and the interior formulas of its table (K ``(d // x) * bs * x + t * x + d % x``,
V ``d * bs + t``, interleaved V ``(t // x) * D * x + d * x + t % x``, head ``h`` at ``h * bs *
D``). fp8 rounding is done here too: the nearest value of the fp8 grid, ties to the even code.
Attention loops over (query token, head) and applies the contract's steps in its order: scale,
soft cap, ALiBi, mask, softmax with the sink, zeros for a row that sees nothing.
"""

from __future__ import annotations

import functools
import math

import torch

F64 = torch.float64
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# --- cache storage ----------------------------------------------------------------------------


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """The cache's whole storage as a 1-D tensor of its dtype (writes land in the cache)."""
    return torch.empty(0, dtype=cache.dtype).set_(cache.untyped_storage())


def _x(dtype: torch.dtype) -> int:
    return 16 // torch.empty(0, dtype=dtype).element_size()


def _index(cache, block, group, t, num_kv_heads, head_size, interleaved_v):
    """Storage index ``[Hkv, D]`` of token ``t`` of ``block`` in group 0 (K) or 1 (V)."""
    bs, x = cache.shape[2], _x(cache.dtype)
    page = cache.storage_offset() + block * cache.stride(0) + group * cache.stride(1)
    h = torch.arange(num_kv_heads)[:, None] * (bs * head_size)
    d = torch.arange(head_size)[None, :]
    if group == 0:
        inner = (d // x) * (bs * x) + t * x + d % x
    elif interleaved_v:
        inner = (t // x) * (head_size * x) + d * x + t % x
    else:
        inner = d * bs + t
    return page + h + inner


@functools.cache
def _fp8_grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-negative finite values of an fp8 dtype (float64, ascending) and their codes."""
    codes = torch.arange(128, dtype=torch.uint8)
    vals = codes.view(dtype).to(F64)
    ok = torch.isfinite(vals)
    vals, codes = vals[ok], codes[ok]
    order = vals.argsort()
    return vals[order], codes[order]


def fp8_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` (already inside +-max) to ``dtype``: nearest grid value, ties to the even code."""
    vals, codes = _fp8_grid(dtype)
    a = x.abs().flatten()
    hi = torch.searchsorted(vals, a).clamp(max=len(vals) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0))
    code = torch.where(pick_hi, codes[hi], codes[lo])
    code = code | torch.where(x.flatten() < 0, 128, 0).to(torch.uint8)  # the sign bit
    code[torch.isnan(x.flatten())] = 0xFF  # NaN in e4m3fn and e5m2
    return code.view(dtype).reshape(x.shape)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a write stores: fp8 ``clamp(x / scale, +-max)`` rounded; 16-bit: ``x`` rounded."""
    x = x.to(F64)
    if cache_dtype in FP8:
        m = torch.finfo(cache_dtype).max
        return fp8_round((x / scale).clamp(-m, m), cache_dtype)
    return x.to(cache_dtype)


def dequantize(stored: torch.Tensor, scale: float) -> torch.Tensor:
    return stored.to(F64) * (scale if stored.dtype in FP8 else 1.0)


def write(cache, key, value, slots, k_scale, v_scale, interleaved_v):
    """The contract's cache write into ``cache`` (in place): token ``i < len(slots)`` with
    ``slots[i] >= 0`` goes to block ``slot // bs``, offset ``slot % bs``; others are skipped."""
    flat, bs = _flat(cache), cache.shape[2]
    hkv, d = key.shape[1], key.shape[2]
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for group, src, sc in ((0, key, k_scale), (1, value, v_scale)):
            idx = _index(cache, slot // bs, group, slot % bs, hkv, d, interleaved_v)
            flat[idx] = quantize(src[i], cache.dtype, sc)


def read(cache, block, t, num_kv_heads, head_size, interleaved_v, k_scale, v_scale):
    """Token ``t`` of ``block`` dequantized: float64 ``([Hkv, D], [Hkv, D])``."""
    flat = _flat(cache)
    return tuple(dequantize(flat[_index(cache, block, g, t, num_kv_heads, head_size, interleaved_v)], sc)
                 for g, sc in ((0, k_scale), (1, v_scale)))


def same_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal as float64, NaN equal to NaN (so -0 == +0)."""
    a, b = a.to(F64), b.to(F64)
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


# --- attention --------------------------------------------------------------------------------


def attend_row(q, keys, values, *, q_pos, scale, causal, window, slope, sink, soft_cap):
    """One query row of one head: q ``[D]``, keys/values ``[L, D]`` at positions 0..L-1.
    Returns (output ``[D]``, the row's scale: max |v| over the visible keys, max |logit|)."""
    s = (keys @ q) * scale
    if soft_cap > 0:
        s = soft_cap * torch.tanh(s / soft_cap)
    kpos = torch.arange(keys.shape[0], dtype=F64)
    if slope is not None:
        s = s + slope * (kpos - q_pos)
    seen = torch.ones(keys.shape[0], dtype=torch.bool)
    if causal:
        seen &= kpos <= q_pos
    if window > 0:
        seen &= (q_pos - kpos) < window
    s, v = s[seen], values[seen]
    logits = s if sink is None else torch.cat([s, torch.tensor([sink], dtype=F64)])
    if len(logits) == 0 or bool((logits == -math.inf).all()):
        return torch.zeros(values.shape[1], dtype=F64), 0.0, 0.0
    m = logits.max()
    w = torch.exp(logits - m)
    p = w / w.sum()
    out = p[: len(s)] @ v  # the sink's value is zero
    vmax = float(v.abs().max()) if len(v) else 0.0
    return out, vmax, float(s.abs().max()) if len(s) else 0.0


def paged_attention(query, key, value, cache, query_start_loc, seq_lens, block_table, *, scale,
                    k_scale=1.0, v_scale=1.0, causal=True, window=-1, alibi=None, sinks=None,
                    soft_cap=0.0, interleaved_v=False):
    """The contract's paged attention, float64: ``(out [T, Hq, D], row_scale [T, Hq],
    logit_max [T, Hq])``; rows of no sequence (padding) stay NaN.

    A sequence of ``query_len`` new tokens has ``seq_len`` keys at 0..seq_len-1; its token i is
    at ``seq_len - query_len + i``. A decode (query_len 1) reads every key from the cache; a
    longer query reads its context from the cache and its new tokens from key/value (or from
    the cache when key is None).
    """
    t, hq, d = query.shape
    hkv = cache.shape[3] // d
    bs = cache.shape[2]
    out = torch.full((t, hq, d), math.nan, dtype=F64)
    row_scale = torch.zeros(t, hq, dtype=F64)
    logit_max = torch.zeros(t, hq, dtype=F64)
    qsl = query_start_loc.tolist()
    for s, sl in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[s], qsl[s + 1]
        ql = q1 - q0
        if ql == 0:
            continue
        ctx = sl - ql
        ks = torch.empty(sl, hkv, d, dtype=F64)
        vs = torch.empty(sl, hkv, d, dtype=F64)
        for j in range(sl):
            if ql > 1 and key is not None and j >= ctx:
                ks[j], vs[j] = key[q0 + j - ctx].to(F64), value[q0 + j - ctx].to(F64)
            else:
                blk = int(block_table[s, j // bs])
                ks[j], vs[j] = read(cache, blk, j % bs, hkv, d, interleaved_v, k_scale, v_scale)
        for i in range(ql):
            for h in range(hq):
                g = h // (hq // hkv)
                o, vm, lm = attend_row(
                    query[q0 + i, h].to(F64), ks[:, g], vs[:, g], q_pos=ctx + i, scale=scale,
                    causal=causal, window=window,
                    slope=None if alibi is None else float(alibi[h]),
                    sink=None if sinks is None else float(sinks[h]), soft_cap=soft_cap)
                out[q0 + i, h], row_scale[q0 + i, h], logit_max[q0 + i, h] = o, vm, lm
    return out, row_scale, logit_max


# --- RoPE and RMSNorm ---------------------------------------------------------------------------


def pairs(rot: int, is_neox: bool) -> list[tuple[int, int]]:
    """The rotated channel pairs: NeoX (i, i + rot/2), GPT-J (2i, 2i + 1)."""
    half = rot // 2
    return [(i, i + half) if is_neox else (2 * i, 2 * i + 1) for i in range(half)]


def rope_table(x, positions, cos_sin_cache, is_neox):
    """x ``[T, H, D]`` float64 rotated with the rows of ``cos_sin_cache`` ``[P, rot]`` (cos in
    the first half, sin in the second); channels past rot pass through."""
    out = x.clone()
    rot = cos_sin_cache.shape[1]
    for t, p in enumerate(positions.tolist()):
        row = cos_sin_cache[p].to(F64)
        for i, (a, b) in enumerate(pairs(rot, is_neox)):
            c, s = row[i], row[rot // 2 + i]
            out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
            out[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
    return out


def rope_rows(x, cos, sin, is_neox):
    """x ``[T, H, D]`` float64 with per-token cos/sin ``[T, rot]``: channel a of a pair (a, b)
    becomes ``x[a] cos[a] - x[b] sin[a]``, channel b ``x[b] cos[b] + x[a] sin[b]``."""
    out = x.clone()
    cos, sin = cos.to(F64), sin.to(F64)
    for a, b in pairs(cos.shape[1], is_neox):
        out[:, :, a] = x[:, :, a] * cos[:, None, a] - x[:, :, b] * sin[:, None, a]
        out[:, :, b] = x[:, :, b] * cos[:, None, b] + x[:, :, a] * sin[:, None, b]
    return out


def rms_normalized(x, eps):
    """x ``[..., D]`` float64 over its mean square (float64 statistics)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
