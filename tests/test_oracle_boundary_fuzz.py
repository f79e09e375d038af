"""``paged_attention`` at the edges, against a float64 oracle of its own (written from
docs/design.md: the cache read as raw storage through the design's page-interior formulas,
attention row by row), on the reference op and the Triton launcher (interpreter, fp16/fp32).

Fixed seeds (CI replays the same draws). What these draws combine that the other suites do
not (test_oracle_sweep_kernels.py, test_paged_attention.py, attention_checks.py):

- ``output`` = ``query`` (allowed by the contract) over decode rows with forced KV splits
  merged by the last split or the reduce kernel, verify rows with splits and prefill rows in
  one launch;
- unused cache slots poisoned with +inf / -inf (not only NaN), the new tokens' slots of
  prefill/verify rows too (they read ``key``/``value``);
- block-table entries past a sequence's blocks holding the valid block ids of *other*
  sequences (and -1 / past the cache), plus extra table rows of garbage;
- the verify kernel at odd longest queries (``verify_max_query_len`` 3, 5, 6, 7) with query
  lengths at the maximum and the maximum + 1 (the switch to the prefill kernel), GQA 65 and
  80 (several head chunks; verify row chunks);
- the whole cache compared bitwise after the call (attention writes nothing there) and
  padding rows past ``query_start_loc[-1]`` left as they were.

Tolerance per element, relative to the largest |V| the row sees (the output is a convex
combination of those values): fp16 4u (u = 2^-11: the output rounded once, P rounded once
for the PV product, fp32 sums) plus the logit error (the dot products of fp16 values are
exact in fp32; their sums round at D * 2^-24 of sum |q_i k_i|); fp32 2e-5. A row that sees
no key must be exactly 0.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import attention_checks  # noqa: F401  (the Triton interpreter's index fix)
import providers_under_test as put
from inductor_rocm_attn import validation
from inductor_rocm_attn.kernels.triton.configs import DecodeConfig
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU draws (reference, Triton interpreter)")


# --- the oracle ----------------------------------------------------------------------------------

def _storage(cache):
    st = cache.untyped_storage()
    return torch.empty(0, dtype=cache.dtype).set_(st, 0, (st.nbytes() // cache.element_size(),), (1,))


def _offsets(cache, hkv, d, interleaved):
    """Storage offset of (block, group, token, head, channel), ``[nb, 2, bs, hkv, d]``."""
    nb, _, bs, _ = cache.shape
    x = 16 // cache.element_size()
    b, t = torch.arange(nb).view(nb, 1, 1, 1), torch.arange(bs).view(1, bs, 1, 1)
    h, c = torch.arange(hkv).view(1, 1, hkv, 1), torch.arange(d).view(1, 1, 1, d)
    base = cache.storage_offset() + b * cache.stride(0) + h * bs * d
    k = base + (c // x) * bs * x + t * x + c % x
    v = base + cache.stride(1) + ((t // x) * d * x + c * x + t % x if interleaved else c * bs + t)
    return torch.stack([k, v], 1)


def _attend(q, keys, vals, q_pos, *, scale, causal, window, slope, sink, cap):
    pos = torch.arange(keys.shape[0])
    s = scale * (keys @ q)
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    if slope is not None:
        s = s + slope * (pos - q_pos)
    seen = torch.ones_like(pos, dtype=torch.bool)
    if causal:
        seen &= pos <= q_pos
    if window > 0:
        seen &= q_pos - pos < window
    s, v = s[seen], vals[seen]
    if sink is not None and sink != -math.inf:
        s, v = torch.cat([s, s.new_tensor([sink])]), torch.cat([v, v.new_zeros(1, v.shape[1])])
    if s.numel() == 0:
        return torch.zeros(vals.shape[1], dtype=torch.float64), 0.0, 0.0
    p = torch.exp(s - s.max())
    mass = float((scale * keys[seen].abs() @ q.abs()).max()) if seen.any() else 0.0
    vmax = float(vals[seen].abs().max()) if seen.any() else 0.0
    return p @ v / p.sum(), vmax, mass


# --- one draw ------------------------------------------------------------------------------------

def _draw(r: random.Random) -> dict:
    dtype = r.choice([torch.float16, torch.float16, torch.float32])
    kind = r.choice(["mixed", "mixed", "verify_edge", "verify_edge", "wide_gqa"])
    bs = r.choice([16, 32])
    if kind == "wide_gqa":
        hkv, g, d = 1, r.choice([65, 80]), 32
    else:
        hkv, g, d = r.choice([1, 2]), r.choice([1, 3, 4, 7, 16]), r.choice([64, 80, 128])
    vmax = r.choice([3, 5, 6, 7]) if kind != "mixed" else None
    top = vmax or 8
    seqs = []
    for _ in range(2 if kind == "wide_gqa" else r.randint(2, 4)):
        ql = r.choice([0, 1, 1, 2, top, top + 1, r.randint(9, 16)] if kind == "mixed" else [1, 2, top, top + 1])
        seqs.append((ql, r.choice([0, 1, bs - 1, bs, bs + 1, r.randint(0, 70)])))
    splits = r.choice([None, 2, 3, 9])
    decode_cfg = r.choice([None, DecodeConfig(16, 1, 3, "rows3", split_merge="last_split"),
                           DecodeConfig(16, 2, 2, "keys3", split_merge="reduce")])
    return dict(dtype=dtype, hkv=hkv, hq=g * hkv, d=d, bs=bs, seqs=seqs, vmax=vmax, num_splits=splits,
                decode_cfg=decode_cfg, layout=r.choice(["LHBNC", "LBHNC"]), interleaved=r.random() < 0.5,
                window=r.choice([-1, -1, 1, 2, bs + 1, 5000]), alibi=r.random() < 0.3, sinks=r.random() < 0.4,
                cap=r.choice([0.0, 0.0, 4.0]), causal=r.random() < 0.8, poison=r.choice(["inf", "-inf", "nan"]),
                out_is_query=r.random() < 0.6, index_dtype=r.choice([torch.int32, torch.int64]),
                pad_rows=r.choice([0, 2]))


def _case(dw, seed):
    g = torch.Generator().manual_seed(seed)
    dt, hq, hkv, d, bs = dw["dtype"], dw["hq"], dw["hkv"], dw["d"], dw["bs"]
    lens = [q + c for q, c in dw["seqs"]]
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 2
    cache = allocate_kv_cache(KVCacheSpec(bs, hkv, d, dt, CacheLayout(dw["layout"])), nb)
    _storage(cache).fill_(float(dw["poison"]))
    r = random.Random(seed)
    perm = r.sample(range(nb), nb)
    width = max(need) + 2
    table, at = [], 0
    for n in need:  # past a sequence's blocks: other sequences' ids, -1, past the cache
        table.append(perm[at:at + n] + [r.choice([-1, nb + 1000, r.randrange(nb)]) for _ in range(width - n)])
        at += n
    table += [[r.randrange(-3, nb + 3) for _ in range(width)]]  # a row no sequence reads
    offs = _offsets(cache, hkv, d, dw["interleaved"])
    flat = _storage(cache)
    keys, vals, new_k, new_v = [], [], [], []
    for s, (ql, ctx) in enumerate(dw["seqs"]):
        k = torch.randn(lens[s], hkv, d, generator=g, dtype=torch.float64).to(dt)
        v = torch.randn(lens[s], hkv, d, generator=g, dtype=torch.float64).to(dt)
        cached = lens[s] if ql == 1 else ctx  # prefill/verify rows read their new tokens from key/value
        for t in range(cached):
            blk, slot = table[s][t // bs], t % bs
            flat[offs[blk, 0, slot].flatten()] = k[t].flatten()
            flat[offs[blk, 1, slot].flatten()] = v[t].flatten()
        keys.append(k.double()); vals.append(v.double())
        new_k.append(k[ctx:]); new_v.append(v[ctx:])
    n_real = sum(q for q, _ in dw["seqs"])
    t_all = n_real + dw["pad_rows"]
    query = torch.randn(t_all, hq, d, generator=g, dtype=torch.float64).to(dt)
    key = torch.cat(new_k + [torch.randn(dw["pad_rows"], hkv, d, generator=g).to(dt)])
    value = torch.cat(new_v + [torch.randn(dw["pad_rows"], hkv, d, generator=g).to(dt)])
    qsl = [0]
    for ql, _ in dw["seqs"]:
        qsl.append(qsl[-1] + ql)
    alibi = torch.rand(hq, generator=g) * 0.5 if dw["alibi"] else None
    sinks = torch.randn(hq, generator=g) * 2 if dw["sinks"] else None
    if sinks is not None and hq > 1:
        sinks[0] = -math.inf  # no sink for that head
    scale = 1.0 / math.sqrt(d)
    want = torch.zeros(n_real, hq, d, dtype=torch.float64)
    vmax = torch.zeros(n_real, hq, dtype=torch.float64)
    mass = torch.zeros(n_real, hq, dtype=torch.float64)
    for s, (ql, ctx) in enumerate(dw["seqs"]):
        for i in range(ql):
            for h in range(hq):
                kh = h // (hq // hkv)
                want[qsl[s] + i, h], vmax[qsl[s] + i, h], mass[qsl[s] + i, h] = _attend(
                    query[qsl[s] + i, h].double(), keys[s][:, kh], vals[s][:, kh], ctx + i, scale=scale,
                    causal=dw["causal"], window=dw["window"], slope=None if alibi is None else float(alibi[h]),
                    sink=None if sinks is None else float(sinks[h]), cap=dw["cap"])
    output = query if dw["out_is_query"] else torch.full_like(query, float("nan"))
    idx = dw["index_dtype"]
    args = dict(output=output, query=query, key=key, value=value, kv_cache=cache,
                query_start_loc=torch.tensor(qsl, dtype=idx), seq_lens=torch.tensor(lens, dtype=idx),
                block_table=torch.tensor(table, dtype=idx), max_query_len=max(q for q, _ in dw["seqs"]),
                max_seq_len=max(lens), scale=scale, k_scale=torch.ones(1), v_scale=torch.ones(1),
                causal=dw["causal"], sliding_window=dw["window"], alibi_slopes=alibi, sinks=sinks,
                logits_soft_cap=dw["cap"], interleaved_v=dw["interleaved"], output_scale=None)
    return args, want, vmax, mass, n_real


def _run(provider, args, dw):
    if provider == "reference":
        torch.ops.rocm_attn.paged_attention(**args)
        return
    from inductor_rocm_attn.kernels.triton.paged_attention import paged_attention
    a = dict(args)
    validation.check_paged_attention("test", a["output"], a["query"], a["key"], a["value"], a["kv_cache"],
                                     a["query_start_loc"], a["seq_lens"], a["block_table"], a["alibi_slopes"],
                                     a["sinks"], None, k_scale=a["k_scale"], v_scale=a["v_scale"],
                                     max_query_len=a["max_query_len"], max_seq_len=a["max_seq_len"])
    knobs = {k: dw[k] for k in ("num_splits", "decode_cfg") if dw[k] is not None}
    if dw["vmax"] is not None:
        knobs["verify_max_query_len"] = dw["vmax"]
    paged_attention(a["output"], a["query"], a["key"], a["value"], a["kv_cache"], a["query_start_loc"],
                    a["seq_lens"], a["block_table"], a["scale"], a["k_scale"], a["v_scale"], a["causal"],
                    a["sliding_window"], a["alibi_slopes"], a["sinks"], a["logits_soft_cap"], a["interleaved_v"],
                    None, a["max_query_len"], a["max_seq_len"], prefill_kernel="triton", **knobs)


SEEDS = [7100, 7101, 7102, 7104, 7107, 7108, 7110, 7112, 7113, 7115, 7118, 7121, 7125, 7128]


@pytest.mark.parametrize("provider", ["reference", "triton"])
@pytest.mark.parametrize("seed", SEEDS)
def test_paged_attention_boundaries_against_own_oracle(provider, seed):
    if provider == "triton" and not put.INTERPRETER:
        pytest.skip("Triton on CPU tensors needs its interpreter (TRITON_INTERPRET=1)")
    dw = _draw(random.Random(seed))
    args, want, vmax, mass, n = _case(dw, seed)
    cache_before = _storage(args["kv_cache"]).view(torch.uint8).clone()
    pad_before = args["output"][n:].clone()
    _run(provider, args, dw)
    got = args["output"][:n].double()
    u = 2.0 ** -11
    tol = (4 * u if dw["dtype"] == torch.float16 else 2e-5) + mass * (dw["d"] * 2.0 ** -24 + 2.0 ** -22)
    err = (got - want).abs()
    bad = torch.isnan(got) | (err > (tol * vmax)[..., None])
    where = tuple(torch.nonzero(bad)[0].tolist()) if bad.any() else None
    assert where is None, (f"seed {seed} {dw}: row {where[:2]} channel {where[2]}: got {float(got[where])} "
                           f"want {float(want[where])}")
    assert torch.equal(args["output"][n:].view(torch.uint8), pad_before.view(torch.uint8)), \
        f"seed {seed}: padding rows written"
    assert torch.equal(_storage(args["kv_cache"]).view(torch.uint8), cache_before), f"seed {seed}: cache written"


def test_oracle_reads_the_layouts_it_is_given():
    """The oracle tells the V interiors apart (a harness reading both the same way would pass
    any kernel): the same draw over a standard and an interleaved cache gives other values."""
    dw = _draw(random.Random(SEEDS[0]))
    got = []
    for interleaved in (False, True):
        args, want, *_ = _case(dict(dw, interleaved=interleaved, out_is_query=False), SEEDS[0])
        torch.ops.rocm_attn.paged_attention(**dict(args, interleaved_v=not interleaved))
        got.append((args["output"][: want.shape[0]].double() - want).abs().max())
    assert all(e > 1e-2 or torch.isnan(e) for e in got)
