"""Random paged-attention test cases shared by reference, Triton and GPU tests.

A case holds every sequence's full K/V in dense float64 (the oracle's view) and the same
tokens written into a paged cache at random block positions through the reference writer.
Nothing is ever zero: inputs are fresh random draws and outputs are poisoned with NaN.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from inductor_rocm_attn.kernels import reference as ref
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, is_fp8_dtype


@dataclasses.dataclass
class PagedCase:
    query: torch.Tensor  # [T, Hq, D] model dtype
    key: torch.Tensor  # [T, Hkv, D] new tokens
    value: torch.Tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    k_full: list  # per sequence [L, Hkv, D] float64: what the cache + new tokens hold
    v_full: list
    query_lens: list
    context_lens: list
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    interleaved_v: bool

    @property
    def max_query_len(self):
        return max(self.query_lens)

    @property
    def max_seq_len(self):
        return max(q + c for q, c in zip(self.query_lens, self.context_lens))


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (all-ones bytes: NaN in every float and fp8 dtype)."""
    t.view(torch.uint8).fill_(0xFF)
    return t


GUARD_BYTE = 0x5A  # finite in every float dtype, unlike the NaN poison: a stray write shows


class Guarded:
    """A poisoned ``[rows, ...]`` tensor (``.t``) inside one allocation with ``guard`` rows of
    ``GUARD_BYTE`` before and after it. A kernel that writes outside the tensor's rows (a
    negative row index, a row past the end) lands in a guard; ``assert_intact`` checks every
    guard byte afterwards."""

    def __init__(self, shape, dtype, device="cpu", guard=256):
        self.guard = guard
        self.buf = torch.empty((shape[0] + 2 * guard, *shape[1:]), dtype=dtype, device=device)
        self.buf.view(torch.uint8).fill_(GUARD_BYTE)
        self.t = poison(self.buf[guard: guard + shape[0]])

    def assert_intact(self, what="output"):
        for name, g in (("before", self.buf[: self.guard]), ("after", self.buf[self.buf.shape[0] - self.guard:])):
            bad = (g.reshape(g.shape[0], -1).view(torch.uint8) != GUARD_BYTE).any(-1)
            assert not bad.any(), (f"{what}: {int(bad.sum())} guard rows {name} the tensor were "
                                   f"written (rows {bad.nonzero().flatten()[:8].tolist()} of the guard)")


def make_paged_case(
    query_lens,
    context_lens,
    *,
    num_heads=4,
    num_kv_heads=2,
    head_size=64,
    block_size=16,
    dtype=torch.float16,
    cache_dtype=None,
    layout=CacheLayout.LHBNC,
    interleaved_v=False,
    k_scale=1.0,
    v_scale=1.0,
    device="cpu",
    seed=0,
    extra_blocks=3,
) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    need = sum(math.ceil(s / block_size) for s in seq_lens)
    num_blocks = need + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for s in seq_lens:
        n = math.ceil(s / block_size)
        tables.append(perm[i: i + n])
        i += n
    width = max(len(t) for t in tables) + 1
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for s, t in enumerate(tables):
        block_table[s, : len(t)] = torch.tensor(t, dtype=torch.int32)
        block_table[s, len(t):] = num_blocks + 1000  # past the used blocks: must never be read
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, cache_dtype, CacheLayout(layout))
    kv_cache = poison(allocate_kv_cache(spec, num_blocks, "cpu"))
    ks = torch.tensor([k_scale], dtype=torch.float32)
    vs = torch.tensor([v_scale], dtype=torch.float32)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    k_full, v_full, qs, ks_new, vs_new, slots = [], [], [], [], [], []
    for s, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        L = ql + cl
        kf = rnd(L, num_kv_heads, head_size).to(dtype)
        vf = rnd(L, num_kv_heads, head_size).to(dtype)
        pos = torch.arange(L)
        slot = block_table[s, pos // block_size].to(torch.int64) * block_size + pos % block_size
        # Context tokens go to the cache now; new tokens are "this step's" K/V.
        ref.reshape_and_cache(kf[:cl], vf[:cl], kv_cache, slot[:cl], ks, vs, interleaved_v)
        if ql == 1:  # decode: the step's token was written before attention runs
            ref.reshape_and_cache(kf[cl:], vf[cl:], kv_cache, slot[cl:], ks, vs, interleaved_v)
        kd, vd = kf.to(torch.float64), vf.to(torch.float64)
        if cache_dtype != dtype:  # what the cache holds is the value rounded to its dtype
            if is_fp8_dtype(cache_dtype):
                m = torch.finfo(cache_dtype).max
                rk = (kd / k_scale).clamp(-m, m).to(cache_dtype).to(torch.float64) * k_scale
                rv = (vd / v_scale).clamp(-m, m).to(cache_dtype).to(torch.float64) * v_scale
            else:  # a 16-bit cache of the other 16-bit dtype (scales unused)
                rk, rv = kf.to(cache_dtype).to(torch.float64), vf.to(cache_dtype).to(torch.float64)
            if ql > 1:  # prefill reads its new tokens unquantized
                rk[cl:], rv[cl:] = kd[cl:], vd[cl:]
            kd, vd = rk, rv
        k_full.append(kd)
        v_full.append(vd)
        qs.append(rnd(ql, num_heads, head_size).to(dtype))
        ks_new.append(kf[cl:])
        vs_new.append(vf[cl:])
        slots.append(slot[cl:])
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    case = PagedCase(
        query=torch.cat(qs), key=torch.cat(ks_new), value=torch.cat(vs_new), kv_cache=kv_cache,
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, slot_mapping=torch.cat(slots), k_full=k_full, v_full=v_full,
        query_lens=list(query_lens), context_lens=list(context_lens), k_scale=ks, v_scale=vs,
        interleaved_v=interleaved_v,
    )
    if device != "cpu":
        for f in ("query", "key", "value", "kv_cache", "query_start_loc", "seq_lens", "block_table",
                  "slot_mapping", "k_scale", "v_scale"):
            setattr(case, f, getattr(case, f).to(device))
    return case


def oracle_attention(q, k, v, *, q_start_pos, scale, causal=True, sliding_window=-1,
                     alibi_slopes=None, sinks=None, logits_soft_cap=0.0,
                     encoder=False) -> torch.Tensor:
    """Independent float64 attention for one sequence (written apart from the reference).

    q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``; GQA by grouping query heads, the sink folded into
    the normaliser by hand. The sliding window of a decoder layer drops keys more than W-1
    before the query only; of an ``encoder`` layer, on both sides. Returns ``[Lq, Hq, D]``.
    """
    q, k, v = q.double(), k.double(), v.double()
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    qg = q.reshape(lq, hkv, hq // hkv, d)  # query head h uses kv head h // group
    logits = torch.einsum("qkgd,tkd->kgqt", qg, k).reshape(hq, lq, lk) * scale
    if logits_soft_cap:
        logits = torch.tanh(logits / logits_soft_cap) * logits_soft_cap
    qp = (q_start_pos + torch.arange(lq)).double().view(lq, 1)
    kp = torch.arange(lk).double().view(1, lk)
    if alibi_slopes is not None:
        logits = logits + alibi_slopes.double().view(hq, 1, 1) * (kp - qp)
    visible = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        visible = visible & (kp <= qp)
    if sliding_window and sliding_window > 0:
        visible = visible & ((qp - kp).abs() < sliding_window if encoder else (qp - kp) < sliding_window)
    logits = torch.where(visible, logits, torch.tensor(float("-inf"), dtype=torch.float64))
    m = logits.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.double().view(hq, 1, 1))
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(logits - m)
    denom = e.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.double().view(hq, 1, 1) - m)
    p = e / denom.clamp_min(1e-300)
    vg = v.unsqueeze(2).expand(lk, hkv, hq // hkv, d).reshape(lk, hq, d)
    return torch.einsum("hqt,thd->qhd", p, vg)


def dense_oracle(case: PagedCase, **kw) -> torch.Tensor:
    """Oracle attention over the dense per-sequence K/V of a case: ``[T, Hq, D]`` float64."""
    outs = []
    qsl = case.query_start_loc.tolist()
    kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    for s in range(len(case.query_lens)):
        q = case.query[qsl[s]: qsl[s + 1]].cpu()
        if q.shape[0] == 0:  # a sequence with no query tokens (and maybe no keys) adds no rows
            continue
        outs.append(oracle_attention(q, case.k_full[s], case.v_full[s],
                                     q_start_pos=case.context_lens[s], **kw))
    return torch.cat(outs)


def rel_err(out: torch.Tensor, ref_: torch.Tensor) -> float:
    out, ref_ = out.detach().cpu().to(torch.float64), ref_.detach().cpu().to(torch.float64)
    return float((out - ref_).norm() / ref_.norm().clamp_min(1e-30))


def row_rel_err(out: torch.Tensor, ref_: torch.Tensor) -> torch.Tensor:
    """Relative error of each ``[T, H, D]`` row (one token, one head), ``[T, H]``: a wrong row
    shows even in a batch of many right ones (``rel_err`` of the whole output would hide it).
    A row far smaller than the typical one (e.g. mostly cancelled) is measured against a
    tenth of the median row norm instead of its own."""
    out, ref_ = out.detach().cpu().to(torch.float64), ref_.detach().cpu().to(torch.float64)
    den = ref_.norm(dim=-1)
    return (out - ref_).norm(dim=-1) / torch.maximum(den, 0.1 * den.median()).clamp_min(1e-30)
