"""Hypothesis: random batch compositions through the metadata builder, allocator, reference
cache writer and reference paged attention equal the dense oracle."""

import torch
from hypothesis import given, settings, strategies as st

import inductor_rocm_attn as ira
from inductor_rocm_attn.kernels import reference as ref

from cases import oracle_attention, poison, rel_err


@st.composite
def batches(draw):
    n = draw(st.integers(1, 4))
    qlens = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    clens = draw(st.lists(st.integers(0, 70), min_size=n, max_size=n))
    block_size = draw(st.sampled_from([16, 32, 48]))
    layout = draw(st.sampled_from(["LHBNC", "LBHNC"]))
    interleaved = draw(st.booleans())
    heads = draw(st.sampled_from([(2, 2), (4, 1), (6, 2)]))
    window = draw(st.sampled_from([-1, 1, 5, 40]))
    causal = draw(st.booleans())  # a decoder's window stays one-sided when not causal
    seed = draw(st.integers(0, 2**16))
    return qlens, clens, block_size, layout, interleaved, heads, window, causal, seed


@settings(max_examples=40, deadline=None)
@given(batches())
def test_random_batches(b):
    qlens, clens, block_size, layout, interleaved, (hq, hkv), window, causal, seed = b
    g = torch.Generator().manual_seed(seed)
    d = 32
    alloc = ira.BlockAllocator(64, block_size, shuffle_seed=seed)
    spec = ira.KVCacheSpec(block_size, hkv, d, torch.float32, ira.CacheLayout(layout))
    cache = poison(ira.allocate_kv_cache(spec, 64))
    ks, vs = torch.ones(1), torch.ones(1)
    full_k, full_v = [], []
    for s, (ql, cl) in enumerate(zip(qlens, clens)):
        full_k.append(torch.randn(ql + cl, hkv, d, generator=g))
        full_v.append(torch.randn(ql + cl, hkv, d, generator=g))
        if cl:  # an earlier step cached the context
            alloc.allocate(s, cl)
            md = ira.build_attention_metadata([cl], [0], [alloc.block_table(s)], block_size)
            ref.reshape_and_cache(full_k[s][:cl], full_v[s][:cl], cache, md.slot_mapping, ks, vs, interleaved)
    tables = [alloc.allocate(s, ql) for s, ql in enumerate(qlens)]
    md = ira.build_attention_metadata(qlens, clens, tables, block_size)
    key = torch.cat([k[c:] for k, c in zip(full_k, clens)])
    value = torch.cat([v[c:] for v, c in zip(full_v, clens)])
    torch.ops.rocm_attn.reshape_and_cache(key, value, cache, md.slot_mapping, ks, vs, interleaved)
    q = torch.randn(key.shape[0], hq, d, generator=g)
    out = poison(torch.empty_like(q))
    torch.ops.rocm_attn.paged_attention(out, q, key, value, cache, md.query_start_loc, md.seq_lens,
                                        md.block_table, md.max_query_len, md.max_seq_len, 0.2, ks, vs,
                                        causal, window, None, None, 0.0, interleaved, None)
    qsl = md.query_start_loc.tolist()
    want = torch.cat([oracle_attention(q[qsl[s]:qsl[s + 1]], full_k[s], full_v[s], q_start_pos=clens[s],
                                       scale=0.2, causal=causal, sliding_window=window)
                      for s in range(len(qlens))])
    assert rel_err(out, want) < 1e-6
