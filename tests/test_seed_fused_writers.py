"""Fused writers keep the seed's data flow.

- ``qk_norm_rope_and_cache`` writes q and k into buffers the caller provides (``q_out`` /
  ``k_out``) and copies v out only when asked (``return_kv``);
- the fused RoPE layer op rotates q and k in place (its schema declares the mutation): the
  pass emits it functionalized and Inductor's reinplacing runs it on q and k themselves, so
  the output code holds no copy of them (checked on the code ``run_and_get_code`` returns);
- the AITER provider takes no QK-norm op it cannot do with one kernel writing our cache.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import inductor_rocm_attn as ira
from inductor_rocm_attn import providers
from inductor_rocm_attn.kernels import reference as ref
from inductor_rocm_attn.models import DecoderLayer, llama_config

from cases import poison

H, HKV, D = 4, 2, 64
rocm = torch.ops.rocm_attn


def _qk_norm_inputs(t, g, dtype=torch.float32):
    qkv = torch.randn(t, (H + 2 * HKV) * D, generator=g).to(dtype)
    w = (torch.rand(2, D, generator=g) + 0.5).to(dtype)
    positions = torch.randint(0, 64, (t,), generator=g)
    cos_sin = torch.randn(64, D, generator=g).to(dtype)
    return qkv, w, positions, cos_sin


def _cache(nb=6, dtype=torch.float32):
    spec = ira.KVCacheSpec(16, HKV, D, dtype, ira.CacheLayout.LBHNC)
    return poison(ira.allocate_kv_cache(spec, nb))


def test_reference_writes_into_the_callers_buffers():
    g = torch.Generator().manual_seed(0)
    qkv, w, positions, cos_sin = _qk_norm_inputs(7, g)
    slots, one = torch.randperm(96, generator=g)[:7], torch.ones(1)
    args = (qkv, w[0], w[1], 1e-6, positions, cos_sin, True)
    fresh_cache, out_cache = _cache(), _cache()
    q0, k0, v0 = ref.qk_norm_rope_and_cache(*args, fresh_cache, slots, one, one, True, H, HKV, D)
    q_out, k_out = poison(torch.empty(7, H, D)), poison(torch.empty(7, HKV, D))
    q, k, v = ref.qk_norm_rope_and_cache(*args, out_cache, slots, one, one, True, H, HKV, D, q_out, k_out, False)
    assert q is q_out and k is k_out and v is None
    assert torch.equal(q_out, q0) and torch.equal(k_out, k0)
    assert torch.equal(out_cache.view(torch.uint8), fresh_cache.view(torch.uint8))
    assert torch.equal(v0, qkv[:, (H + HKV) * D:].view(7, HKV, D)) and v0.data_ptr() != qkv.data_ptr()


def test_kernel_level_op_fills_q_out_and_k_out():
    g = torch.Generator().manual_seed(1)
    qkv, w, positions, cos_sin = _qk_norm_inputs(5, g)
    slots, one = torch.randperm(96, generator=g)[:5], torch.ones(1)
    want_cache = _cache()
    want_q, want_k, _ = ref.qk_norm_rope_and_cache(qkv, w[0], w[1], 1e-6, positions, cos_sin, False, want_cache,
                                                   slots, one, one, True, H, HKV, D)
    cache = _cache()
    q_out, k_out = poison(torch.empty(5, H, D)), poison(torch.empty(5, HKV, D))
    rocm.qk_norm_rope_and_cache(qkv, w[0], w[1], 1e-6, positions, cos_sin, False, cache, slots, one, one, True,
                                H, HKV, D, q_out, k_out)
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    with pytest.raises(ValueError, match=r"rocm_attn.qk_norm_rope_and_cache: q_out must be \[num_tokens, "
                                         r"num_heads, head_size\] = \[5, 4, 64\]"):
        rocm.qk_norm_rope_and_cache(qkv, w[0], w[1], 1e-6, positions, cos_sin, False, cache, slots, one, one,
                                    True, H, HKV, D, torch.empty(5, H * D), k_out)


def test_impl_writes_into_the_callers_buffers():
    g = torch.Generator().manual_seed(2)
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name="seed_writers.impl", cache_layout="LBHNC")
    layer.kv_cache = _cache()
    md = ira.build_attention_metadata([5], [3], [[4, 1]], 16)
    qkv, w, positions, cos_sin = _qk_norm_inputs(5, g)
    q_out, k_out = poison(torch.empty(5, H, D)), poison(torch.empty(5, HKV, D))
    q, k = layer.impl.do_qk_norm_rope_kvcache_update(layer, qkv, w[0], w[1], 1e-6, positions, cos_sin, True,
                                                     layer.kv_cache, md, q_out, k_out)
    assert q is q_out and k is k_out and not q.isnan().any() and not k.isnan().any()
    q2, k2 = layer.impl.do_qk_norm_rope_kvcache_update(layer, qkv, w[0], w[1], 1e-6, positions, cos_sin, True,
                                                       layer.kv_cache, md)
    assert torch.equal(q2, q) and torch.equal(k2, k)


def test_layer_rope_op_rotates_in_place():
    g = torch.Generator().manual_seed(4)
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name="seed_writers.rope")
    layer.kv_cache = _cache()
    md = ira.build_attention_metadata([6], [0], [[2]], 16)
    q, k, v = (torch.randn(6, n * D, generator=g) for n in (H, HKV, HKV))
    cos_sin = torch.randn(64, D, generator=g)
    wq, wk = q.clone(), k.clone()
    ref.rotary_embedding(md.positions, wq, wk, D, cos_sin, False)
    ptrs = q.data_ptr(), k.data_ptr()
    with ira.set_forward_context(md):
        token = rocm.unified_rope_and_kv_cache_update(md.positions, q, k, v.view(6, HKV, D), cos_sin, False,
                                                      layer.layer_name)
    assert token.numel() == 0 and (q.data_ptr(), k.data_ptr()) == ptrs
    assert torch.equal(q, wq) and torch.equal(k, wk)
    assert torch.equal(ira.layout.dense_kv(layer.kv_cache, HKV, False)[0][2, :6], wk.view(6, HKV, D))
    schema = str(rocm.unified_rope_and_kv_cache_update.default._schema)
    assert "Tensor(a!) query, Tensor(b!) key" in schema and schema.endswith("-> Tensor")


class _Block(torch.nn.Module):
    """One Llama decoder layer's attention, from the hidden state: q/k/v from one fused
    projection (``qkv``) or three (``separate``), HF-form RoPE, our Attention."""

    def __init__(self, name: str, projections: str):
        super().__init__()
        self.cfg = llama_config(num_heads=H, num_kv_heads=HKV, head_size=D, hidden_size=128,
                                intermediate_size=128)
        self.layer = DecoderLayer(self.cfg, name)
        self.projections = projections
        self.q_proj = torch.nn.Linear(128, H * D, bias=False)
        self.k_proj = torch.nn.Linear(128, HKV * D, bias=False)
        self.v_proj = torch.nn.Linear(128, HKV * D, bias=False)

    def forward(self, positions, hidden):
        if self.projections == "qkv":
            q, k, v = self.layer.qkv(positions, hidden)
        else:
            q, k = self.layer.rotary(positions, self.q_proj(hidden), self.k_proj(hidden))
            v = self.v_proj(hidden)
        return self.layer.attn(q, k, v)


@pytest.mark.compile
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("projections", ["qkv", "separate"])
def test_compiled_rope_writer_leaves_no_copy_of_q_or_k(projections, device):
    torch.manual_seed(0)
    block = _Block(f"seed_writers.{projections}.{device}.attn", projections).to(device)
    ira.bind_kv_caches(block, 4, torch.float32, device)
    md = ira.build_attention_metadata([7], [0], [[1]], 16, device)
    hidden, positions = torch.randn(7, 128, device=device), md.positions
    import torch._inductor.utils as inductor_utils

    fresh_cache = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    torch._dynamo.reset()
    report = ira.fusion_report()
    report.clear()
    with torch.no_grad(), ira.set_forward_context(md):
        want = block(positions, hidden)
        with ira.plugin(), fresh_cache():
            got, code = run_and_get_code(torch.compile(block, backend="inductor"), positions, hidden)
    code = "\n".join(code)
    assert [r.pass_name for r in report.records if r.fused] == ["rope_kv_cache_fusion"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # q and k are rotated in the buffers the projection wrote: no clone, no copy of them.
    FileCheck().check_not("clone").check_not("copy_").check("extern_kernels.mm(").check_not("clone") \
        .check("rocm_attn.unified_rope_and_kv_cache_update.default(").check_not("clone").check_not("copy_") \
        .check("rocm_attn.unified_attention_with_output.default(").run(code)
    mm_out = re.findall(r"extern_kernels\.mm\([^\n]*out=(buf\d+)\)", code)
    call = re.search(r"unified_rope_and_kv_cache_update\.default\(\w+, reinterpret_tensor\((buf\d+),[^\n]*?"
                     r"reinterpret_tensor\((buf\d+),", code)
    assert call, code
    q_buf, k_buf = call.groups()
    assert q_buf in mm_out and k_buf in mm_out  # the projections' own output buffers
    assert (q_buf == k_buf) == (projections == "qkv")


def test_aiter_takes_no_qk_norm_writer():
    record = providers.get("aiter")
    assert "qk_norm_rope_and_cache" not in record.caps.ops
    aiter_kernels = importlib.import_module(record.module)
    assert not hasattr(aiter_kernels, "qk_norm_rope_and_cache")
    with pytest.raises(NotImplementedError, match="provider aiter has no qk_norm_rope_and_cache kernel"):
        record.load("qk_norm_rope_and_cache")
