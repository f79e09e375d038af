"""Seed behaviours that reach the kernels: ``causal`` per step from the metadata, and
attention pages inside a hybrid attention/Mamba cache (a block stride larger than K+V).

Both run on the reference (the CPU provider) and on the Triton kernels, in Triton's
interpreter without a GPU (fp16/fp32 there). Outputs are poisoned first and compared with
the independent float64 oracle of ``cases``; caches are compared with what the reference
writes into a plain LBHNC cache, and every byte of a hybrid block outside the two
attention pages must keep its poison.
"""

from __future__ import annotations

import random

import pytest
import torch

import cases
import inductor_rocm_attn as ira
from inductor_rocm_attn import providers
from inductor_rocm_attn.kernels import reference as ref
from inductor_rocm_attn.layout import (
    CacheLayout, KVCacheSpec, allocate_kv_cache, cache_layout_of, convert_v_layout_, dense_kv,
)

pytest.importorskip("triton")

if not torch.cuda.is_available():
    # Triton 3.6's interpreter turns scalars into 1-element numpy arrays, and NumPy >= 2.3
    # refuses int() of those (a loop over a loaded bound fails): __index__ reads the element.
    import triton.runtime.interpreter as _interp

    if not getattr(_interp, "_rocm_attn_index_fix", False):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._rocm_attn_index_fix = True

from inductor_rocm_attn.kernels import triton as tk  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = {"reference": ref, "triton": tk}
H, HKV, D, BS = 4, 2, 32, 16


def _seed() -> int:
    return random.randrange(1 << 30)


def _dtype_device(provider):
    """The reference in fp32 on CPU tensors; Triton in fp16 on the GPU, or in its interpreter."""
    return (torch.float32, "cpu") if provider == "reference" else (torch.float16, DEVICE)


# --- causal per step -----------------------------------------------------------------------


def _pin_provider(monkeypatch, name):
    """Make the impl's cached resolve pick ``name``'s kernels (Triton runs on CPU tensors in
    its interpreter; select() itself never picks it for CPU tensors)."""
    real = providers.select

    def select(op, **kw):
        _, fn = real(op, **kw)
        return name, getattr(KERNELS[name], op) if name == "triton" else fn

    monkeypatch.setattr(providers, "select", select)


@pytest.mark.parametrize("provider", ["reference", "triton"])
@pytest.mark.parametrize("layer_causal", [None, False])
def test_causal_comes_from_the_step_when_set(monkeypatch, provider, layer_causal):
    """A decoder layer (causal by default, or built non-causal) follows ``metadata.causal``
    when the step sets it and its own value when the step leaves it None. Window-free: the
    sliding-window rule of a non-causal decoder step waits for a kernel change."""
    _pin_provider(monkeypatch, provider)
    dtype, dev = _dtype_device(provider)
    seed = _seed()
    c = cases.make_paged_case([5, 1, 7], [3, 20, 0], num_heads=H, num_kv_heads=HKV, head_size=D,
                              dtype=dtype, layout="LBHNC", seed=seed, device=dev)
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"seed_causal.{provider}.{layer_causal}",
                          causal=layer_causal).to(dev)
    layer.kv_cache = c.kv_cache
    own = layer.impl.causal
    for step_causal in (None, not own, own, None):
        md = ira.AttentionMetadata(
            num_actual_tokens=c.query.shape[0], max_query_len=c.max_query_len,
            query_start_loc=c.query_start_loc, max_seq_len=c.max_seq_len, seq_lens=c.seq_lens,
            block_table=c.block_table, slot_mapping=c.slot_mapping, positions=torch.zeros_like(c.slot_mapping),
            causal=step_causal, block_size=c.kv_cache.shape[2])
        out = cases.poison(torch.empty_like(c.query))
        layer.impl.forward(layer, c.query, c.key, c.value, c.kv_cache, md, out)
        want = own if step_causal is None else step_causal
        exp = cases.dense_oracle(c, scale=D ** -0.5, causal=want)
        other = cases.dense_oracle(c, scale=D ** -0.5, causal=not want)
        assert cases.rel_err(out, exp) < TOL[dtype], (provider, step_causal, seed)
        assert cases.rel_err(out, other) > 10 * TOL[dtype]  # the flag changes the prefill rows
    # one resolved kernel per causality, reused across steps, from the provider under test
    # (..., causal, interleaved_v, the step has a query longer than one token)
    assert sorted(sig[-3] for sig in layer.impl._kernels) == [False, True]
    assert set(layer.impl._kernels.values()) == {KERNELS[provider].paged_attention}


def test_builder_records_the_step_causality():
    md = ira.build_attention_metadata([2], [0], [[0]], BS)
    assert md.causal is None
    md = ira.build_attention_metadata([2], [0], [[0]], BS, causal=False)
    assert md.causal is False


def test_encoder_layer_keeps_its_own_causality():
    """As in the seed, the step's flag is read on the decoder path only."""
    g = torch.Generator().manual_seed(3)
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name="seed_causal.encoder", attn_type="encoder")
    q, k, v = (torch.randn(6, n, D, generator=g) for n in (H, HKV, HKV))
    md = ira.build_attention_metadata([6], [0], [[0]], BS, causal=True)
    out = cases.poison(torch.empty_like(q))
    layer.impl.forward(layer, q, k, v, layer.kv_cache, md, out)
    exp = cases.oracle_attention(q, k, v, q_start_pos=0, scale=D ** -0.5, causal=False)
    assert cases.rel_err(out, exp) < 1e-6


# --- hybrid caches -------------------------------------------------------------------------


def _hybrid(num_blocks, dtype, *, stride_pages=3, offset_pages=1, device="cpu"):
    """``(logical cache, backing buffer)``: each block is ``stride_pages`` pages, the K page at
    ``offset_pages`` and the V page right after it; the other pages hold other (Mamba) state."""
    page = BS * HKV * D
    buf = torch.empty(num_blocks * stride_pages * page + page, dtype=dtype, device=device)
    cases.poison(buf)
    cache = buf.as_strided((num_blocks, 2, BS, HKV * D), (stride_pages * page, page, HKV * D, 1),
                           offset_pages * page)
    return cache, buf


def _outside_pages_untouched(buf, num_blocks, stride_pages=3, offset_pages=1):
    page = BS * HKV * D
    mask = torch.ones(buf.numel(), dtype=torch.bool)
    for b in range(num_blocks):
        start = b * stride_pages * page + offset_pages * page
        mask[start: start + 2 * page] = False
    outside = buf.view(torch.uint8).view(-1, buf.element_size())[mask.to(buf.device)]
    return bool((outside == 0xFF).all())


@pytest.mark.parametrize("stride_pages,offset_pages", [(3, 1), (3, 0), (5, 2)])
def test_layout_accepts_a_hybrid_block_stride(stride_pages, offset_pages):
    cache, _ = _hybrid(4, torch.float16, stride_pages=stride_pages, offset_pages=offset_pages)
    assert cache_layout_of(cache) is CacheLayout.LBHNC
    page = BS * HKV * D
    overlapping = cache.as_strided(cache.shape, (page + 8, page, HKV * D, 1))
    with pytest.raises(ValueError, match=r"match neither LHBNC nor LBHNC.*a block stride >= 2048"):
        cache_layout_of(overlapping)


def _writer_inputs(t, dtype, g, num_blocks):
    k, v = (torch.randn(t, HKV, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(t, H, D, generator=g).to(dtype)
    qkv = torch.randn(t, (H + 2 * HKV) * D, generator=g).to(dtype)
    w = (torch.rand(2, D, generator=g) + 0.5).to(dtype)
    slots = torch.randperm(num_blocks * BS, generator=g)[:t]
    slots[1] = -1  # a padding token writes nothing
    positions = torch.randint(0, 64, (t,), generator=g)
    cos_sin = torch.randn(64, D, generator=g).to(dtype)
    one = torch.ones(1)
    return q, k, v, qkv, w, slots, positions, cos_sin, one


@pytest.mark.parametrize("provider", ["reference", "triton"])
@pytest.mark.parametrize("op", ["reshape_and_cache", "rope_and_cache", "qk_norm_rope_and_cache"])
@pytest.mark.parametrize("interleaved_v", [False, True])
def test_writers_fill_only_the_attention_pages_of_a_hybrid_block(provider, op, interleaved_v):
    dtype, dev = _dtype_device(provider)
    nb, t = 6, 20
    g = torch.Generator().manual_seed(_seed())
    q, k, v, qkv, w, slots, positions, cos_sin, one = (x.to(dev) for x in _writer_inputs(t, dtype, g, nb))
    hybrid, buf = _hybrid(nb, dtype, device=dev)
    plain = cases.poison(allocate_kv_cache(KVCacheSpec(BS, HKV, D, dtype, CacheLayout.LBHNC), nb, dev))
    kernels = KERNELS[provider]
    for cache, fns in ((hybrid, kernels), (plain, ref)):
        if op == "reshape_and_cache":
            fns.reshape_and_cache(k, v, cache, slots, one, one, interleaved_v)
        elif op == "rope_and_cache":
            fns.rope_and_cache(positions, q.clone(), k.clone(), v, cache, slots, cos_sin, True, one, one,
                               interleaved_v)
        else:
            fns.qk_norm_rope_and_cache(qkv, w[0], w[1], 1e-6, positions, cos_sin, False, cache, slots, one,
                                       one, interleaved_v, H, HKV, D)
    assert _outside_pages_untouched(buf, nb)
    written = slots[slots >= 0].cpu()
    for got, want in zip(dense_kv(hybrid, HKV, interleaved_v), dense_kv(plain, HKV, interleaved_v)):
        got, want = got.cpu().flatten(0, 1)[written].double(), want.cpu().flatten(0, 1)[written].double()
        assert cases.rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("provider", ["reference", "triton"])
@pytest.mark.parametrize("interleaved_v", [False, True])
def test_attention_reads_a_hybrid_cache(provider, interleaved_v):
    dtype, dev = _dtype_device(provider)
    seed = _seed()
    c = cases.make_paged_case([6, 1, 1], [10, 17, 3], num_heads=H, num_kv_heads=HKV, head_size=D,
                              dtype=dtype, layout="LBHNC", interleaved_v=interleaved_v, seed=seed, device=dev)
    nb = c.kv_cache.shape[0]
    hybrid, buf = _hybrid(nb, dtype, device=dev)
    hybrid.copy_(c.kv_cache)  # page by page: the interiors keep their element order
    out = cases.poison(torch.empty_like(c.query))
    KERNELS[provider].paged_attention(out, c.query, c.key, c.value, hybrid, c.query_start_loc, c.seq_lens,
                                      c.block_table, D ** -0.5, c.k_scale, c.v_scale, True, -1, None, None,
                                      0.0, interleaved_v, None)
    assert cases.rel_err(out, cases.dense_oracle(c, scale=D ** -0.5)) < TOL[dtype], seed
    assert _outside_pages_untouched(buf, nb)


def test_layer_on_a_hybrid_cache_and_its_v_conversion():
    """The layer's own paths (cache update, attention, the in-place V switch) on a hybrid cache."""
    g = torch.Generator().manual_seed(7)
    nb = 4
    hybrid, buf = _hybrid(nb, torch.float32)
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name="seed_hybrid.layer", cache_layout="LBHNC")
    layer.kv_cache = hybrid
    q, k, v = (torch.randn(9, n, D, generator=g) for n in (H, HKV, HKV))
    md = ira.build_attention_metadata([9], [0], [[2, 0]], BS)
    out = cases.poison(torch.empty_like(q))
    with ira.set_forward_context(md):
        torch.ops.rocm_attn.unified_kv_cache_update(k, v, layer.layer_name)
        layer.set_interleaved_v_cache(True)
        torch.ops.rocm_attn.unified_attention_with_output(q, k, v, out, layer.layer_name)
    assert cases.rel_err(out, cases.oracle_attention(q, k, v, q_start_pos=0, scale=D ** -0.5)) < 1e-6
    kd, vd = dense_kv(hybrid, HKV, interleaved_v=True)
    assert torch.equal(kd[2, :9], k) and torch.equal(vd[2, :9], v)
    assert _outside_pages_untouched(buf, nb)
    convert_v_layout_(hybrid, HKV, to_interleaved=False)
    assert torch.equal(dense_kv(hybrid, HKV, interleaved_v=False)[1][2, :9], v)
    assert _outside_pages_untouched(buf, nb)
