"""The reliability checks on a GPU: tensors on another device than the cache get our error (not
Triton's "Pointer argument cannot be accessed"), metadata planned by the builder is checked
against the cache without reading it back, and the opt-in index checks of hand-built metadata."""

import dataclasses

import pytest
import torch

import inductor_rocm_attn as ira

from reliability_steps import BS, D, H, HKV, snapshot, unchanged

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _layer(name, num_blocks=8):
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"gpu_rel.{name}").to(DEV)
    ira.bind_kv_caches(layer, num_blocks, torch.float16, DEV, poison=True)
    return layer


def _qkv(t):
    g = torch.Generator().manual_seed(t)
    return [torch.randn(t, n * D, generator=g).to(DEV, torch.float16) for n in (H, HKV, HKV)]


def _rejected(layer, md, match, exc=(ValueError, IndexError)):
    q, k, v = _qkv(md.num_actual_tokens)
    before = snapshot(layer.kv_cache)
    with pytest.raises(exc, match=match), ira.set_forward_context(md):
        layer(q, k, v)
    torch.cuda.synchronize()
    assert unchanged(before, layer.kv_cache)


def test_metadata_on_the_host_with_a_gpu_cache():
    layer = _layer("host_md")
    md = ira.build_attention_metadata([3, 1], [0, 4], [[0], [1]], BS)  # device defaults to cpu
    _rejected(layer, md, r"metadata tensor query_start_loc is on cpu but the KV cache is on cuda:0")


def test_query_on_the_host_with_a_gpu_cache():
    layer = _layer("host_q")
    md = ira.build_attention_metadata([3], [0], [[0]], BS, DEV)
    q, k, v = _qkv(3)
    before = snapshot(layer.kv_cache)
    with pytest.raises(ValueError, match=r"query is on cpu but key is on cuda:0"), ira.set_forward_context(md):
        layer(q.cpu(), k, v)
    assert unchanged(before, layer.kv_cache)


def test_kernel_op_slot_mapping_on_the_host():
    layer = _layer("host_slots")
    k = torch.randn(3, HKV, D, device=DEV, dtype=torch.float16)
    before = snapshot(layer.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.reshape_and_cache: all tensors must be on one device"):
        torch.ops.rocm_attn.reshape_and_cache(k, k, layer.kv_cache, torch.tensor([0, 1, 2]), layer._k_scale,
                                              layer._v_scale, False)
    assert unchanged(before, layer.kv_cache)


def test_planned_metadata_is_checked_without_a_device_read():
    layer = _layer("plan", num_blocks=3)
    md = ira.build_attention_metadata([3, 1], [0, 40], [[0], [1, 2, 7]], BS, DEV)
    _rejected(layer, md, r"the step uses block id 7 but the KV cache has 3 blocks")
    ok = ira.build_attention_metadata([3, 1], [0, 20], [[0], [1, 2]], BS, DEV)
    for hint in ("max_query_len", "max_seq_len"):
        _rejected(layer, dataclasses.replace(ok, **{hint: 1}), rf"{hint} 1 is smaller than the longest")
    other = ira.build_attention_metadata([3, 1], [0, 20], [[0], [1, 0, 0]], 32, DEV)
    _rejected(layer, other, r"metadata built for block_size 32, but the layer's KV cache has block_size 16")


def test_hand_built_metadata_index_checks_are_opt_in(monkeypatch):
    layer = _layer("opt_in")
    md = ira.build_attention_metadata([3], [0], [[0]], BS, DEV)
    bad = dataclasses.replace(md, plan=None)
    bad.block_table[0, 0] = 99
    monkeypatch.setenv("ROCM_ATTN_CHECK_INDICES", "1")
    _rejected(layer, bad, r"block_table\[0, 0\] = 99 is outside the cache")


@pytest.mark.compile
@pytest.mark.parametrize("writer", ["kv_cache_update", "rope"])
def test_fused_output_quant_scale_value_checked_before_the_write_with_index_checks(monkeypatch, writer):
    """A compiled graph with the fp8 output quant fused into the attention reads the scale's
    value on a GPU only with ROCM_ATTN_CHECK_INDICES=1; there the layer's cache update refuses a
    bad one before it writes (the CPU runs: test_reliability_state)."""
    from blocks import WriterQuantBlock

    monkeypatch.setenv("ROCM_ATTN_CHECK_INDICES", "1")
    block = WriterQuantBlock(writer, f"gpu_rel.output_scale.{writer}").to(DEV)
    ira.bind_kv_caches(block, 4, torch.float32, DEV, poison=True)
    md = ira.build_attention_metadata([5], [0], [[2]], BS, DEV)
    x = torch.randn(5, (block.h + 2 * block.hkv) * block.d, device=DEV)
    before = snapshot(block.attn.kv_cache)
    torch._dynamo.reset()
    with torch.no_grad(), ira.set_forward_context(md), ira.plugin():
        compiled = torch.compile(block, backend="inductor")
        block.scale.fill_(0.0)
        with pytest.raises(ValueError, match=r"output_scale must be a positive finite number, got 0\.0"):
            compiled(torch.arange(5, device=DEV), x)
        torch.cuda.synchronize()
        assert unchanged(before, block.attn.kv_cache)
        block.scale.fill_(0.5)
        out = compiled(torch.arange(5, device=DEV), x)
    assert out.dtype == torch.float8_e4m3fn and torch.isfinite(out.float()).all()
