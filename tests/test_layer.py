"""The Attention layer, forward context, metadata builder and block allocator, end to end on CPU."""

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn.models import TinyDecoder, llama_config, qwen3_config

from cases import oracle_attention, poison, rel_err


def _layer(name, **kw):
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name=name, **kw)
    return layer


def _bind(layer, num_blocks=32, dtype=torch.float32):
    layer.kv_cache = poison(ira.allocate_kv_cache(layer.kv_cache_spec(dtype), num_blocks))


def _run_steps(layer, steps, alloc, g):
    """steps: list of {seq: n_new}; returns per-step outputs and the full K/V/Q per sequence."""
    full = {}
    outs = []
    for plan in steps:
        q_, k_, v_, ql, cl, bt = [], [], [], [], [], []
        for sid, n in plan.items():
            start = alloc.num_tokens(sid)
            alloc.allocate(sid, n)
            q, k, v = torch.randn(n, 4, 64, generator=g), torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g)
            f = full.setdefault(sid, [[], [], []])
            f[0].append(q), f[1].append(k), f[2].append(v)
            q_.append(q), k_.append(k), v_.append(v)
            ql.append(n), cl.append(start), bt.append(alloc.block_table(sid))
        md = ira.build_attention_metadata(ql, cl, bt, layer.block_size)
        with ira.set_forward_context(md):
            o = layer(torch.cat(q_).view(-1, 256), torch.cat(k_).view(-1, 128), torch.cat(v_).view(-1, 128))
        outs.append((plan, o.view(-1, 4, 64)))
    return outs, {s: [torch.cat(x) for x in f] for s, f in full.items()}


def _check(outs, full, scale=0.125, causal=True):
    done = {}
    for plan, o in outs:
        row = 0
        for sid, n in plan.items():
            start = done.get(sid, 0)
            q, k, v = full[sid]
            ref = oracle_attention(q[start:start + n], k[:start + n], v[:start + n], q_start_pos=start,
                                   scale=scale, causal=causal)
            assert rel_err(o[row:row + n], ref) < 1e-6, (sid, start, n)
            row += n
            done[sid] = start + n


@pytest.mark.parametrize("layout", ["LHBNC", "LBHNC"])
def test_layer_steps_match_oracle(layout):
    layer = _layer(f"steps.{layout}", cache_layout=layout)
    _bind(layer)
    alloc = ira.BlockAllocator(32, 16, shuffle_seed=3)
    g = torch.Generator().manual_seed(0)
    outs, full = _run_steps(layer, [{"a": 20, "b": 5}, {"a": 1, "b": 17, "c": 3}, {"a": 1, "b": 1, "c": 1}],
                            alloc, g)
    _check(outs, full)


def test_switch_to_interleaved_v_keeps_cached_tokens():
    layer = _layer("switch.v")
    _bind(layer)
    alloc = ira.BlockAllocator(32, 16, shuffle_seed=5)
    g = torch.Generator().manual_seed(1)
    outs1, full1 = _run_steps(layer, [{"a": 33, "b": 7}], alloc, g)
    assert layer.set_interleaved_v_cache(True) is True
    assert layer.interleaved_v and not layer.set_interleaved_v_cache(True)
    outs2, full2 = _run_steps(layer, [{"a": 1, "b": 4}, {"a": 1, "b": 1}], alloc, g)
    merged = {s: [torch.cat([full1[s][i], full2[s][i]]) for i in range(3)] for s in full1}
    _check(outs1 + outs2, merged)


def test_profiling_run_zero_fills():
    layer = _layer("profiling")
    _bind(layer)
    q = torch.randn(6, 256)
    with ira.profiling_run():
        out = layer(q, torch.randn(6, 128), torch.randn(6, 128))
    assert torch.count_nonzero(out) == 0


def test_encoder_only_layer_has_no_cache_and_is_bidirectional():
    layer = _layer("encoder_only", attn_type="encoder_only")
    assert not layer.impl.uses_kv_cache and not layer.impl.causal
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(9, 4, 64, generator=g), torch.randn(9, 2, 64, generator=g), torch.randn(9, 2, 64, generator=g)
    md = ira.build_attention_metadata([4, 5], [0, 0], [[0], [1]], 16)
    with ira.set_forward_context(md):
        out = layer(q.view(9, -1), k.view(9, -1), v.view(9, -1)).view(9, 4, 64)
    ref = torch.cat([oracle_attention(q[a:b], k[a:b], v[a:b], q_start_pos=0, scale=0.125, causal=False)
                     for a, b in ((0, 4), (4, 9))])
    assert rel_err(out, ref) < 1e-6


def test_block_allocator():
    alloc = ira.BlockAllocator(6, 16, shuffle_seed=0)
    t = list(alloc.allocate("x", 17))
    assert len(t) == 2 and alloc.num_free_blocks == 4
    alloc.allocate("x", 15)
    assert len(alloc.block_table("x")) == 2
    alloc.allocate("y", 64)
    with pytest.raises(MemoryError, match="needs 1 more blocks, 0 free of 6"):
        alloc.allocate("z", 1)
    alloc.free("y")
    assert alloc.num_free_blocks == 4
    assert set(alloc.allocate("z", 64)).isdisjoint(alloc.block_table("x"))


def test_metadata_builder():
    md = ira.build_attention_metadata([3, 1], [16, 40], [[7, 2], [4, 1, 9]], 16, num_padded_tokens=6)
    assert md.query_start_loc.tolist() == [0, 3, 4]
    assert md.seq_lens.tolist() == [19, 41]
    assert md.positions.tolist() == [16, 17, 18, 40, 0, 0]
    assert md.slot_mapping.tolist() == [2 * 16 + 0, 2 * 16 + 1, 2 * 16 + 2, 9 * 16 + 8, -1, -1]
    assert (md.max_query_len, md.max_seq_len, md.num_decodes, md.num_prefills) == (3, 41, 1, 1)
    buffers = ira.MetadataBuffers(4, 8, 4, "cpu")
    md2 = ira.build_attention_metadata([3, 1], [16, 40], [[7, 2], [4, 1, 9]], 16, buffers=buffers)
    assert md2.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
    assert md2.block_table.tolist() == [[7, 2, 0, 0], [4, 1, 9, 0]]


@pytest.mark.parametrize("cfg", [qwen3_config(num_layers=2), llama_config(num_layers=2, cache_layout="LBHNC")],
                         ids=["qwen3", "llama"])
def test_model_paged_equals_dense(cfg):
    torch.manual_seed(0)
    model = TinyDecoder(cfg).eval()
    ira.bind_kv_caches(model, 32, torch.float32, poison=True)
    alloc = ira.BlockAllocator(32, cfg.block_size, shuffle_seed=2)
    seqs = [torch.randint(0, cfg.vocab_size, (n,)) for n in (37, 20)]
    got = [[], []]
    with torch.no_grad():
        for plan in ({0: (0, 30), 1: (0, 19)}, {0: (30, 7), 1: (19, 1)}):
            ql, cl, bt, ids = [], [], [], []
            for s, (a, n) in plan.items():
                alloc.allocate(s, n)
                ql.append(n), cl.append(a), bt.append(alloc.block_table(s)), ids.append(seqs[s][a:a + n])
            md = ira.build_attention_metadata(ql, cl, bt, cfg.block_size)
            with ira.set_forward_context(md):
                logits = model(torch.cat(ids), md.positions)
            row = 0
            for s, (a, n) in plan.items():
                got[s].append(logits[row:row + n])
                row += n
        dense = model.dense_forward(seqs)
    for s in range(2):
        assert rel_err(torch.cat(got[s]), dense[s]) < 1e-5
