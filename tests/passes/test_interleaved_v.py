"""The one function that switches a layer to interleaved V: by layer or registered name, its
cached tokens kept (converted in place)."""

import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn.layout import dense_kv
from inductor_rocm_attn.passes.interleaved_v import switch_to_interleaved_v


def _layer(name):
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name=name)
    layer.kv_cache = ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 4)
    layer.kv_cache.copy_(torch.randn(layer.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    return layer


def test_switch_by_name_keeps_cached_tokens_and_switches_back():
    layer = _layer("interleaved_v.by_name")
    k0, v0 = dense_kv(layer.kv_cache, 2, False)
    raw = layer.kv_cache.clone()
    assert switch_to_interleaved_v("interleaved_v.by_name") is True
    assert layer.interleaved_v
    assert not torch.equal(layer.kv_cache, raw)  # the V bytes moved...
    k1, v1 = dense_kv(layer.kv_cache, 2, True)
    assert torch.equal(k1, k0) and torch.equal(v1, v0)  # ...and still hold the same tokens
    assert switch_to_interleaved_v(layer, False) is False and not layer.interleaved_v
    assert torch.equal(layer.kv_cache, raw)


def test_unknown_name_is_left_to_the_run_time_guard():
    assert switch_to_interleaved_v("interleaved_v.no_such_layer") is False
