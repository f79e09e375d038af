"""KV sharing across layers (``kv_sharing_target_layer_name``).

A two-layer Qwen3-style model whose layer 1 reads layer 0's cache runs a prefill eagerly,
then mixed and decode steps compiled with the plugin (the QK-norm fusion switches layer 0 to
interleaved V at compile time, converting its cached tokens in place), then an eager step
after switching layer 0 back. Every step's logits are compared with a dense model that
computes the same thing explicitly: layer 1 attends with its own query over layer 0's
rotated keys and values. The sharing layer owns no cache, emits no cache update, and the
passes see no write of it to fuse.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import inductor_rocm_attn as ira
from inductor_rocm_attn import compilation
from inductor_rocm_attn.models import TinyDecoder, qwen3_config

BLOCK = 16
rocm = torch.ops.rocm_attn


def _sharing_model(tag: str) -> TinyDecoder:
    cfg = qwen3_config(num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=64, num_heads=4,
                       num_kv_heads=2, head_size=32, block_size=BLOCK)
    model = TinyDecoder(cfg, name=tag).eval()
    target = model.layers[0].attn.layer_name
    model.layers[1].attn = ira.Attention(cfg.num_heads, cfg.head_size, num_kv_heads=cfg.num_kv_heads,
                                         layer_name=f"{tag}.layers.1.shared_attn", block_size=BLOCK,
                                         kv_sharing_target_layer_name=target)
    return model


@torch.no_grad()
def _dense_logits(model: TinyDecoder, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a whole sequence, layer 1 attending over layer 0's K/V (explicitly)."""
    cfg = model.cfg
    saved = {}

    def sdpa(q, k, v):
        t = q.shape[0]
        qh = q.reshape(t, cfg.num_heads, cfg.head_size).transpose(0, 1).double()
        kh = k.reshape(t, cfg.num_kv_heads, cfg.head_size).transpose(0, 1).double()
        vh = v.reshape(t, cfg.num_kv_heads, cfg.head_size).transpose(0, 1).double()
        rep = cfg.num_heads // cfg.num_kv_heads
        o = F.scaled_dot_product_attention(qh, kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0),
                                           is_causal=True)
        return o.transpose(0, 1).reshape(t, -1).to(q.dtype)

    def layer0(q, k, v):
        saved["k"], saved["v"] = k, v
        return sdpa(q, k, v)

    def layer1(q, k, v):
        return sdpa(q, saved["k"], saved["v"])  # its own k/v are computed and ignored

    positions = torch.arange(ids.shape[0])
    hidden = model.embed(ids)
    for layer, attention in zip(model.layers, (layer0, layer1)):
        hidden = layer(positions, hidden, attention=attention)
    return model.lm_head(model.norm(hidden))


def test_sharing_layer_owns_no_cache_and_validates_its_target():
    model = _sharing_model("share_bind")
    caches = ira.bind_kv_caches(model, 8, torch.float32)
    target, sharer = (layer.attn for layer in model.layers)
    assert list(caches) == [target.layer_name]
    assert sharer.kv_cache.numel() == 0 and not sharer.impl.uses_kv_cache
    assert not sharer.impl.fused_rope_kvcache_supported() and target.impl.fused_rope_kvcache_supported()
    with pytest.raises(ValueError, match="only decoder layers have a KV cache to share"):
        ira.Attention(4, 32, layer_name="share_bad.enc", attn_type="encoder", kv_sharing_target_layer_name="x")
    with pytest.raises(ValueError, match="names the layer itself"):
        ira.Attention(4, 32, layer_name="share_bad.self", kv_sharing_target_layer_name="share_bad.self")
    lone = torch.nn.ModuleList([ira.Attention(4, 32, layer_name="share_bad.lone",
                                              kv_sharing_target_layer_name="share_bad.missing")])
    with pytest.raises(ValueError, match="shares the KV cache of 'share_bad.missing', which is not an "
                                         "earlier layer"):
        ira.bind_kv_caches(lone, 8, torch.float32)
    mismatch = torch.nn.ModuleList([
        ira.Attention(4, 32, num_kv_heads=2, layer_name="share_bad.t"),
        ira.Attention(4, 32, num_kv_heads=4, layer_name="share_bad.s", kv_sharing_target_layer_name="share_bad.t"),
    ])
    with pytest.raises(ValueError, match="cannot read the cache of 'share_bad.t'.*geometry differs"):
        ira.bind_kv_caches(mismatch, 8, torch.float32)


def test_sharing_layer_emits_no_cache_update():
    model = _sharing_model("share_graph")
    ira.bind_kv_caches(model, 8, torch.float32)
    md = ira.build_attention_metadata([5], [0], [[1]], BLOCK)
    ids = torch.randint(0, 64, (5,))
    q, k, v = torch.randn(5, 128), torch.randn(5, 64), torch.randn(5, 64)
    with ira.set_forward_context(md), torch.no_grad():
        ops = {layer.attn.layer_name: [n.target for n in make_fx(layer.attn)(q, k, v).graph.nodes
                                       if n.op == "call_function"] for layer in model.layers}
        torch.testing.assert_close(model(ids, md.positions), _dense_logits(model, ids), atol=1e-5, rtol=1e-5)
    target, sharer = (layer.attn.layer_name for layer in model.layers)
    assert ops[target].count(rocm.unified_kv_cache_update.default) == 1
    assert rocm.unified_kv_cache_update.default not in ops[sharer]
    assert ops[sharer].count(rocm.unified_attention_with_output.default) == 1


def test_deepcopy_of_a_sharing_model_reads_its_own_target():
    """The copy's sharing layer read the original model's target cache (its target name was
    not renamed with the copy): NaN here, another conversation's keys in real use."""
    model = _sharing_model("share_copy")
    ira.bind_kv_caches(model, 8, torch.float32, poison=True)
    clone = copy.deepcopy(model)
    target, sharer = (layer.attn for layer in clone.layers)
    assert sharer.impl.kv_sharing_target_layer_name == target.layer_name == "share_copy.layers.0.attn#copy1"
    model.layers[0].attn.kv_cache.fill_(float("nan"))  # the original's cache: never read by the copy
    ids = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(2))
    md = ira.build_attention_metadata([5], [0], [[1]], BLOCK)
    with ira.set_forward_context(md), torch.no_grad():
        got = clone(ids, md.positions)
    torch.testing.assert_close(got, _dense_logits(clone, ids), atol=1e-5, rtol=1e-5)
    assert ira.bind_kv_caches(clone, 8, torch.float32).keys() == {target.layer_name}


@pytest.mark.compile
def test_compiled_sharing_model_matches_the_explicit_model():
    torch.manual_seed(0)
    tag = "share_e2e"
    model = _sharing_model(tag)
    ira.bind_kv_caches(model, 24, torch.float32, poison=True)
    target, sharer = (layer.attn for layer in model.layers)
    alloc = ira.BlockAllocator(24, BLOCK, shuffle_seed=5)
    gen = torch.Generator().manual_seed(1)
    seqs = {s: torch.randint(0, 64, (40,), generator=gen) for s in "abc"}
    report = compilation.fusion_report()
    report.clear()
    torch._dynamo.reset()

    def step(plan, runner):
        ids, ql, cl, tables = [], [], [], []
        for s, n in plan.items():
            start = alloc.num_tokens(s)
            alloc.allocate(s, n)
            ids.append(seqs[s][start:start + n])
            ql.append(n)
            cl.append(start)
            tables.append(alloc.block_table(s))
        md = ira.build_attention_metadata(ql, cl, tables, BLOCK)
        flat, pos = torch.cat(ids), md.positions.clone()
        if runner is not model:
            torch._dynamo.mark_dynamic(flat, 0)
            torch._dynamo.mark_dynamic(pos, 0)
        with torch.no_grad(), ira.set_forward_context(md):
            got = runner(flat, pos)
        rows = torch.cat([_dense_logits(model, seqs[s][:c + n])[c:] for (s, n), c in zip(plan.items(), cl)])
        torch.testing.assert_close(got, rows, atol=1e-4, rtol=1e-4)

    import torch._inductor.utils as inductor_utils

    fresh_cache = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    with ira.plugin(), fresh_cache():  # a cache hit would skip the passes (and their report)
        compiled = torch.compile(model, backend="inductor")
        step({"a": 5, "b": 7}, model)  # eager: the standard V layout in the cache
        assert not target.interleaved_v
        step({"a": 1, "b": 6, "c": 9}, compiled)  # compiles: layer 0 switches to interleaved V
        assert target.interleaved_v
        step({"a": 1, "b": 1, "c": 1}, compiled)
    records = [r for r in report.records if r.layer_name.startswith(tag + ".")]
    # Only the target's write is a candidate (the sharing layer has none): it fuses.
    assert [(r.layer_name, r.pass_name, r.fused) for r in records if r.fused] == [
        (target.layer_name, "qk_norm_rope_kv_cache_fusion", True)]
    assert {r.layer_name for r in records} == {target.layer_name}
    assert sharer.kv_cache.numel() == 0
    target.set_interleaved_v_cache(False)  # a later switch of the target: the sharer follows
    step({"a": 1, "b": 1, "c": 1}, model)


class _Unordered(torch.nn.Module):
    """A target layer and a layer sharing its cache whose input does not depend on the
    target's output. The sharing layer's input is computed first and the target's side holds a
    wide activation, so Inductor's peak-memory reordering runs the sharing layer's attention
    (freeing its input) before the target's side, cache write included. ``rope``: the target's
    q/k are rotated by our op, so the RoPE fusion replaces its cache write by a fused writer.
    ``sharer_first``: the forward calls the sharing layer before its target."""

    H, HKV, D = 4, 2, 32

    def __init__(self, tag, rope=False, sharer_first=False, wide=100_000):
        super().__init__()
        h, hkv, d = self.H, self.HKV, self.D
        self.rope, self.sharer_first = rope, sharer_first
        self.up = torch.nn.Linear(64, wide, bias=False)
        self.qkv = torch.nn.Linear(64, (h + 2 * hkv) * d, bias=False)
        self.target = ira.Attention(h, d, num_kv_heads=hkv, layer_name=f"{tag}.target", block_size=BLOCK)
        self.sharer = ira.Attention(h, d, num_kv_heads=hkv, layer_name=f"{tag}.sharer", block_size=BLOCK,
                                    kv_sharing_target_layer_name=f"{tag}.target")
        f = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
        self.register_buffer("cos_sin", torch.cat((f.cos(), f.sin()), -1), persistent=False)

    def forward(self, x, positions, q2, k2, v2):
        h, hkv, d = self.H, self.HKV, self.D
        qs, ks, vs = q2.exp(), k2.exp(), v2.exp()  # the sharing layer's input, computed first
        if self.sharer_first:
            o2 = self.sharer(qs, ks, vs)
        wide = self.up(x)
        q, k, v = self.qkv(wide[:, :64].relu() + wide[:, 64:128]).split([h * d, hkv * d, hkv * d], -1)
        if self.rope:
            q, k = q.clone(), k.clone()
            torch.ops.rocm_attn.rotary_embedding(positions, q, k, d, self.cos_sin, True)
        o1 = self.target(q, k, v)
        if not self.sharer_first:
            o2 = self.sharer(qs, ks, vs)
        return o1 + wide.sum(), o2


def _unordered_inputs(t=5):
    g = torch.Generator().manual_seed(3)
    m = _Unordered
    return (torch.randn(t, 64, generator=g), torch.arange(t), torch.randn(t, m.H * m.D, generator=g),
            torch.randn(t, m.HKV * m.D, generator=g), torch.randn(t, m.HKV * m.D, generator=g))


@pytest.mark.compile
@pytest.mark.parametrize("rope", [False, True], ids=["cache_update", "fused_writer"])
def test_compiled_sharing_layer_reads_after_the_write_without_data_flow(rope):
    """Nothing in the graph ordered the target's cache write before the sharing layer's read:
    Inductor ran the read first, on the poisoned cache (NaN). With the plugin the sharing
    layer's attention takes the token of the target's write (``passes/kv_sharing_order.py``)."""
    from torch._inductor import config as inductor_config

    torch.manual_seed(0)
    model = _Unordered(f"share_unordered_{int(rope)}", rope=rope).eval()
    args = _unordered_inputs()
    md = ira.build_attention_metadata([5], [0], [[1]], BLOCK)
    ira.bind_kv_caches(model, 4, torch.float32, poison=True)
    with ira.set_forward_context(md), torch.no_grad():
        want = model(*args)[1]
    ira.bind_kv_caches(model, 4, torch.float32, poison=True)
    report = compilation.fusion_report()
    report.clear()
    torch._dynamo.reset()
    with ira.plugin(), inductor_config.patch(fx_graph_cache=False), ira.set_forward_context(md), torch.no_grad():
        got = torch.compile(model, backend="inductor")(*args)[1]
    torch._dynamo.reset()
    fused = [r.pass_name for r in report.records if r.layer_name == model.target.layer_name and r.fused]
    assert fused == (["rope_kv_cache_fusion"] if rope else [])
    assert not got.isnan().any(), "the sharing layer read the cache before its target wrote it"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.compile
def test_compile_refuses_a_sharing_layer_called_before_its_target():
    from torch._inductor import config as inductor_config

    model = _Unordered("share_first", sharer_first=True, wide=256).eval()
    ira.bind_kv_caches(model, 4, torch.float32, poison=True)
    md = ira.build_attention_metadata([5], [0], [[1]], BLOCK)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"layer 'share_first\.sharer' reads the KV cache of layer "
                                        r"'share_first\.target' \(kv_sharing_target_layer_name\), but the target "
                                        r"writes it only later in this graph; call 'share_first\.target' before"), \
            ira.plugin(), inductor_config.patch(fx_graph_cache=False), ira.set_forward_context(md), torch.no_grad():
        torch.compile(model, backend="inductor")(*_unordered_inputs())
    torch._dynamo.reset()


def test_ordering_pass_cache_key_follows_the_sharing_layers():
    """The edges ``kv_sharing_order`` adds depend on which layers share a cache, which the
    graph's text does not show, so Inductor's cache key (the pass's uuid) must change with them."""
    from inductor_rocm_attn.passes.kv_sharing_order import KVSharingOrderPass

    before = KVSharingOrderPass().uuid()
    target = ira.Attention(4, 32, num_kv_heads=2, layer_name="share_key.target", block_size=BLOCK)
    assert KVSharingOrderPass().uuid() == before  # a layer that owns its cache changes nothing
    sharer = ira.Attention(4, 32, num_kv_heads=2, layer_name="share_key.sharer", block_size=BLOCK,
                           kv_sharing_target_layer_name="share_key.target")
    assert KVSharingOrderPass().uuid() != before
    del sharer, target
