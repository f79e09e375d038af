"""The backend's query surface under the seed's names, each answer checked against the
capability table (the providers' records), and the seed's construction/call-time checks:
ENCODER_DECODER and fp8 KV caches on encoder layers rejected when a layer is built, an fp8
query with ``q_scale != 1`` rejected when it arrives.
"""

from __future__ import annotations

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import capabilities, providers
from inductor_rocm_attn.backend import RocmAttentionBackend as B
from inductor_rocm_attn.capabilities import FP8_STATIC_TENSOR_SYM, AttentionType, MultipleOf, QuantKey
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec

from cases import make_paged_case, poison

TRITON, REFERENCE = providers.get("triton").caps, providers.get("reference").caps
# The providers that serve every configuration: the GPU default and the CPU implementation.
GENERAL = (TRITON, REFERENCE)


def test_names_dtypes_and_geometry():
    assert B.get_name() == "ROCM_ATTN"
    assert B.get_impl_cls() is ira.RocmAttentionImpl
    assert B.forward_includes_kv_cache_update is False
    for caps in GENERAL:
        assert B.supported_dtypes == list(caps.model_dtypes)
        assert B.supported_kv_cache_dtypes == list(caps.kv_cache_dtypes)
        assert caps.block_sizes is None  # any multiple of 16 ...
        assert tuple(B.supported_kv_cache_layouts()) == caps.layouts
    assert B.get_supported_head_sizes() == list(TRITON.head_sizes)
    assert REFERENCE.head_sizes == capabilities.HEAD_SIZES
    assert B.get_supported_kernel_block_sizes() == [MultipleOf(16)]  # ... as the seed answers
    rule = B.get_supported_kernel_block_sizes()[0]
    assert [n for n in (8, 16, 24, 32, 544, 784, 1056, 0, -16) if n in rule] == [16, 32, 544, 784, 1056]
    for name, p in providers.REGISTRY.items():  # a provider with a block-size list stays inside the rule
        assert p.caps.block_sizes is None or all(b in rule for b in p.caps.block_sizes), name
    for d in B.supported_kv_cache_dtypes:
        capabilities.check_kv_cache_dtype(d)


def _on_every_attention_path(feature: str) -> bool:
    return all(feature in caps.features and {"paged_attention", "encoder_attention"} <= set(caps.ops)
               for caps in GENERAL)


def test_feature_answers_match_the_table():
    assert B.supports_sink() is _on_every_attention_path("sinks") is True
    assert "beyond the seed" in B.supports_sink.__doc__  # the seed answers False
    assert B.supports_sliding_window() is _on_every_attention_path("sliding_window") is True
    assert B.supports_non_causal() is _on_every_attention_path("non_causal") is True
    assert _on_every_attention_path("logits_soft_cap")
    assert "applied" in ira.RocmAttentionImpl.__doc__ and "ignores it" in ira.RocmAttentionImpl.__doc__
    assert B.supports_mm_prefix() is False and B.supports_kv_connector() is False
    assert B.fused_rope_kvcache_supported() is all("rope_and_cache" in c.ops for c in GENERAL) is True
    assert B.fused_qk_norm_rope_kvcache_supported() is all("qk_norm_rope_and_cache" in c.ops for c in GENERAL)


@pytest.mark.parametrize("attn_type,ok", [
    (AttentionType.DECODER, True), ("decoder", True), ("encoder", True), ("encoder_only", True),
    (AttentionType.ENCODER_DECODER, False), ("encoder_decoder", False), ("sideways", False),
])
def test_supports_attn_type(attn_type, ok):
    assert B.supports_attn_type(attn_type) is ok
    try:  # the answer is whether a layer of that type can be built
        ira.RocmAttentionImpl(4, 64, 0.1, attn_type=attn_type)
        built = True
    except (NotImplementedError, ValueError):
        built = False
    assert built is ok


def test_fused_output_quant_key():
    assert all("output_scale" in c.features for c in GENERAL)
    assert B.fused_output_quant_supported(FP8_STATIC_TENSOR_SYM)
    assert B.fused_output_quant_supported(QuantKey(torch.float8_e5m2))
    for key in (QuantKey(torch.float8_e4m3fn, static=False), QuantKey(torch.float8_e4m3fn, per_tensor=False),
                QuantKey(torch.float8_e4m3fn, symmetric=False), QuantKey(torch.bfloat16), QuantKey(torch.int8)):
        assert not B.fused_output_quant_supported(key), key
    impl = ira.RocmAttentionImpl(4, 64, 0.1)
    assert impl.fused_output_quant_supported(FP8_STATIC_TENSOR_SYM)


def test_customize_spec_state_content_bytes_is_one_head_slot():
    spec = B.customize_spec(KVCacheSpec(784, 8, 128, torch.bfloat16, CacheLayout.LBHNC, num_head_slots=1))
    assert spec.num_head_slots == 2
    assert spec.state_content_bytes == 8 * 128 * 2  # one token of one slot, as the seed computes it
    assert spec.page_size_bytes == 2 * 784 * spec.state_content_bytes  # a block: K page + V page
    assert B.customize_spec(spec) == spec
    with pytest.raises(ValueError, match="RocmAttentionBackend.customize_spec: block_size 24 is not supported"):
        B.customize_spec(KVCacheSpec(24, 8, 128, torch.bfloat16))


def test_impl_fusion_answers_per_layer():
    assert ira.RocmAttentionImpl(4, 64, 0.1).fused_qk_norm_rope_kvcache_supported()
    enc = ira.RocmAttentionImpl(4, 64, 0.1, attn_type="encoder")
    assert not enc.fused_rope_kvcache_supported() and not enc.fused_qk_norm_rope_kvcache_supported()


# --- construction and call-time checks -------------------------------------------------------


def test_encoder_decoder_rejected_with_the_seeds_reason():
    with pytest.raises(NotImplementedError, match=r"encoder_decoder is not supported: the prefill path assumes "
                                                  r"self-attention: it mixes the K/V passed in .* with the "
                                                  r"cached K/V.*max_query_len > 1"):
        ira.Attention(4, 64, layer_name="seed_checks.xattn", attn_type="encoder_decoder")


@pytest.mark.parametrize("attn_type", ["encoder", "encoder_only"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_on_encoder_rejected_when_built(attn_type, kv_cache_dtype):
    with pytest.raises(NotImplementedError, match=rf"kv_cache_dtype '{kv_cache_dtype}' on a {attn_type} layer is "
                                                  r"not supported: quantization is not supported for encoder "
                                                  r"attention"):
        ira.RocmAttentionImpl(4, 64, 0.1, attn_type=attn_type, kv_cache_dtype=kv_cache_dtype)
    ira.RocmAttentionImpl(4, 64, 0.1, attn_type=attn_type, kv_cache_dtype="bfloat16")  # not quantized: fine
    ira.RocmAttentionImpl(4, 64, 0.1, kv_cache_dtype=kv_cache_dtype)  # a decoder layer: fine


def test_fp8_query_with_q_scale_rejected_when_it_arrives():
    c = make_paged_case([3, 1], [2, 9], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32,
                        cache_dtype=torch.float8_e4m3fn, seed=2)
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name="seed_checks.qscale", kv_cache_dtype="fp8",
                          q_scale=0.5)  # accepted when built
    layer.kv_cache = c.kv_cache
    md = ira.build_attention_metadata([3, 1], [2, 9], [c.block_table[0].tolist(), c.block_table[1].tolist()], 16)
    out = poison(torch.empty_like(c.query))
    layer.impl.forward(layer, c.query, c.key, c.value, c.kv_cache, md, out)  # a full-precision query: fine
    assert not out.isnan().any()
    q8 = c.query.to(torch.float8_e4m3fn)
    out = poison(torch.empty_like(c.query))
    with pytest.raises(NotImplementedError, match=r"unified_attention_with_output: a q_scale of 0.5 with an fp8 "
                                                  r"query \(torch.float8_e4m3fn\) is not supported"):
        layer.impl.forward(layer, q8, c.key, c.value, c.kv_cache, md, out)
    assert out.isnan().all()  # rejected before anything was written
    enc = ira.Attention(4, 64, num_kv_heads=2, layer_name="seed_checks.qscale_enc", attn_type="encoder",
                        q_scale=0.5)
    enc_md = ira.build_attention_metadata([3, 1], [0, 0], [[0], [1]], 16)  # an encoder step: no context
    with pytest.raises(NotImplementedError, match="a q_scale of 0.5 with an fp8 query"):
        enc.impl.forward(enc, q8, c.key, c.value, enc.kv_cache, enc_md, out)


@pytest.mark.parametrize("hip", [None, "6.4.0"])
def test_supported_head_sizes_are_what_a_gpu_call_of_this_build_is_served_at(monkeypatch, hip):
    # On ROCm the Triton provider stops at 256 (head size 512's configs need more shared
    # memory than AMD's LDS), so the backend must not offer 512 there: dispatch would refuse it.
    monkeypatch.setattr(torch.version, "hip", hip)
    answer = B.get_supported_head_sizes()
    assert answer == list(providers.triton_head_sizes(hip=bool(hip)))
    assert (512 in answer) is (hip is None)
