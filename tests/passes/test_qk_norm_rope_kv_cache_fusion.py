"""QK-norm + RoPE + KV-cache update fusion on post-grad graphs of a Qwen3-style block."""

import itertools

import pytest
import torch
from torch.testing._internal.common_utils import TestCase

from blocks import AttnBlock, block_inputs
from fx_capture import capture
from inductor_rocm_attn.forward_context import get_layer
from inductor_rocm_attn.models import qwen3_config

PASS = "qk_norm_rope_kv_cache_fusion"
_ids = itertools.count()


def _block(variant="plain", gptj_hf=False, name=None, **kw):
    cfg = qwen3_config(num_heads=4, num_kv_heads=2, head_size=32, **kw)
    return cfg, AttnBlock(cfg, name or f"qk{next(_ids)}.attn", variant, gptj_hf)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", ["op-neox", "op-gptj", "hf-neox", "hf-gptj"])
@pytest.mark.parametrize("norm_impl", ["torch", "op"])
def test_fuses_every_form(dtype, form, norm_impl):
    impl, style = form.split("-")
    eps = 1e-5 if dtype == torch.float16 else 1e-6
    cfg, block = _block(gptj_hf=(impl == "hf" and style == "gptj"), rope_impl="op" if impl == "op" else "torch",
                        is_neox=style == "neox", norm_impl=norm_impl, rms_eps=eps)
    c = capture(block.to(dtype), *block_inputs(cfg, dtype=dtype))
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert c.count("rope_kv_cache_fusion") == 0  # nothing left for the RoPE-only pass
    assert f"{eps}, in" in c.after and f"{style == 'neox'}, 4, 2, 32, '{block.layer.attn.layer_name}')" in c.after
    assert "unified_kv_cache_update(" not in c.after and "rms_norm" not in c.after
    # the fused writer emits interleaved V: the pass switched the layer at compile time
    assert get_layer(block.layer.attn.layer_name).interleaved_v
    assert c.manager.get_pass(PASS).records[0].switched_interleaved_v


@pytest.mark.parametrize("variant,why", [
    ("norm_whole_q", "q-norm output is not a [T, heads, head_size] tensor"),
    ("k_eps_differs", "differ"),
    ("cache_unrotated_k", "the cached key is not a RoPE output"),
])
@pytest.mark.parametrize("norm_impl", ["torch", "op"])
def test_does_not_fuse_non_equivalent(variant, why, norm_impl):
    cfg, block = _block(variant, norm_impl=norm_impl)
    c = capture(block, *block_inputs(cfg), rope_kv_cache_fusion=False)
    assert c.count(PASS) == 0
    assert c.after == c.before
    assert any(why in r for r in c.reasons(PASS)), c.reasons(PASS)
    assert not get_layer(block.layer.attn.layer_name).interleaved_v


@pytest.mark.parametrize("impl", ["torch", "op"])
def test_llama_block_is_not_a_qk_norm_site(impl):
    from inductor_rocm_attn.models import llama_config

    cfg = llama_config(num_heads=4, num_kv_heads=2, head_size=32, rope_impl=impl, norm_impl=impl)
    block = AttnBlock(cfg, f"qk_llama_{impl}.attn")
    c = capture(block, *block_inputs(cfg), rope_kv_cache_fusion=False)
    assert c.count(PASS) == 0 and c.after == c.before
    assert any("not a per-head RMSNorm output" in r or "not a [T, heads, head_size]" in r for r in c.reasons(PASS)), \
        c.reasons(PASS)


def test_norm_over_whole_q_still_fuses_rope_only():
    cfg, block = _block("norm_whole_q")
    c = capture(block, *block_inputs(cfg))
    assert (c.count(PASS), c.count("rope_kv_cache_fusion")) == (0, 1)
    assert not get_layer(block.layer.attn.layer_name).interleaved_v


# --- transformers' own modeling code ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fuses_transformers_qwen3_layer(dtype):
    """Qwen3's attention: separate q/k/v projections, ``Qwen3RMSNorm`` per head on the
    ``[B, T, H, D]`` views (with its casts in half precision), then the transposed RoPE with
    the model's cos/sin: one op normalizes and rotates q and k in place and writes the cache."""
    sites = pytest.importorskip("transformers_sites")
    fn, args = sites.decoder_layer("qwen3", dtype)
    c = capture(fn, *args, dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert c.count("rope_kv_cache_fusion") == 0
    assert "rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update" in c.after
    assert "aten.rsqrt" in c.before and c.after.count("aten.rsqrt") == c.before.count("aten.rsqrt") - 2
    assert "eps=1e-06" in c.after and "_query_base_index=0, _key_base_index=1" in c.after
    record = c.manager.get_pass(PASS).records[0]
    assert record.fused and record.interleaved_v  # the layer is not registered here: switched at run time
    assert "at its first fused write" in str(_report_of(record))


def _report_of(record):
    from inductor_rocm_attn.passes.report import FusionReport

    report = FusionReport()
    report.add(record)
    return report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuses_transformers_hunyuan_norm_after_rope(dtype):
    """Hunyuan rotates q/k, then normalizes each rotated head (the weight does not commute
    with the rotation): the op's norm_after_rope form, on the projections' outputs in place."""
    sites = pytest.importorskip("transformers_sites")
    fn, args = sites.decoder_layer("hunyuan", dtype)
    c = capture(fn, *args, dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert c.count("rope_kv_cache_fusion") == 0
    assert "norm_after_rope=True" in c.after and "gemma_norm" not in c.after
    assert c.after.count("aten.rsqrt") == c.before.count("aten.rsqrt") - 2
    assert "_query_base_index=0, _key_base_index=1" in c.after
    assert "after it + KV-cache update" in c.manager.get_pass(PASS).records[0].detail


def test_fuses_transformers_qwen3_with_a_dynamic_token_count():
    sites = pytest.importorskip("transformers_sites")
    fn, args = sites.decoder_layer("qwen3", torch.bfloat16)
    for a in args:
        torch._dynamo.mark_dynamic(a, 1)
    c = capture(fn, *args, dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "bfloat16[2, T, 4, 32]" in c.before


@pytest.mark.parametrize("variant,why", [
    ("norm_over_heads", "the rotated q"),  # mean over the heads axis: not the norm's pattern
    ("k_norm_eps_differs", "q-norm eps 1e-06 and k-norm eps 1e-05 differ"),
])
def test_does_not_fuse_transformers_qk_norm_variants(variant, why):
    """The QK-norm fusion misses (RoPE alone still fuses: the norm stays in the graph)."""
    sites = pytest.importorskip("transformers_sites")
    plain = sites.SiteAttention("plain", qk_norm=True)
    assert capture(plain, *sites.site_inputs("plain"), dynamic=()).count(PASS) == 1  # the site itself fuses
    c = capture(sites.SiteAttention(variant, qk_norm=True), *sites.site_inputs(variant), dynamic=())
    assert (c.count(PASS), c.count("rope_kv_cache_fusion")) == (0, 1)
    assert any(why in r for r in c.reasons(PASS)), c.reasons(PASS)
    assert c.after.count("aten.rsqrt") == c.before.count("aten.rsqrt")


def test_does_not_fuse_olmo2_norm_over_the_whole_projection():
    sites = pytest.importorskip("transformers_sites")
    fn, args = sites.decoder_layer("olmo2")
    c = capture(fn, *args, dynamic=())
    assert (c.count(PASS), c.count("rope_kv_cache_fusion")) == (0, 1)
    assert any("the rotated q is not a per-head RMSNorm output (it comes from reshape" in r
               for r in c.reasons(PASS)), c.reasons(PASS)


_SHARED = "the cached key is the key of layer 'transformers.layers.1' (KV sharing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuses_transformers_gemma4_layers(dtype):
    """Gemma4 normalizes (``Gemma4RMSNorm``: weight in fp32, rounded once) and rotates its q/k
    tokens-first ``[B, T, H, D]``: the sliding layer (head 256) and the full layer (head 512,
    V the V-norm of the key projection) each fuse into one writer with ``gemma4_norm``, the
    full layer's writer on a copy of the key projection (V reads it); the KV-shared layer
    writes layer 1's key and fuses nothing, in either pass."""
    sites = pytest.importorskip("transformers_sites")
    fn, args = sites.gemma4_attention(dtype=dtype)
    c = capture(fn, *args, dynamic=())
    assert c.count(PASS) == 2, c.reasons(PASS)
    assert c.count("rope_kv_cache_fusion") == 0
    fused = [r for r in c.manager.get_pass(PASS).records if r.fused]
    assert [r.layer_name for r in fused] == ["transformers.layers.0", "transformers.layers.1"]
    assert all("Gemma4 QK-norm (weight in fp32)" in r.detail and "tokens_first_neox" in r.detail for r in fused)
    assert "the writer takes a copy" in fused[1].detail and "copy" not in fused[0].detail
    assert c.after.count("gemma4_norm=True") == 2 and "gemma_norm" not in c.after
    assert c.after.count("aten.clone") == c.before.count("aten.clone") + 1
    assert c.after.count("rocm_attn.unified_kv_cache_update.default(") == 1  # the shared layer's plain copy
    for name in (PASS, "rope_kv_cache_fusion"):
        assert len(c.reasons(name)) == 1 and _SHARED in c.reasons(name)[0], c.reasons(name)


@pytest.mark.parametrize("variant,dtype,why", [
    # the K-norm without its weight (as the V-norm): no RMS form, so not QK-norm at all
    ("scale_free_k_norm", torch.float32, "the rotated k"),
    # the normalized value rounded before the weight: in bf16 not the function the writer computes
    ("rounded_before_weight", torch.bfloat16, "the rotated q"),
])
def test_does_not_fuse_gemma4_norm_look_alikes(variant, dtype, why):
    """Norms the Gemma4 writer does not implement stay in the graph: the QK-norm fusion misses,
    RoPE alone fuses with the cache write."""
    sites = pytest.importorskip("transformers_sites")
    c = capture(*_flat(sites.gemma4_attention((0,), dtype, variant)), dynamic=())
    assert (c.count(PASS), c.count("rope_kv_cache_fusion")) == (0, 1), c.reasons(PASS)
    assert any(why in r for r in c.reasons(PASS)), c.reasons(PASS)
    assert c.after.count("aten.pow.Tensor_Scalar(add") == c.before.count("aten.pow.Tensor_Scalar(add")


def test_rounded_before_weight_in_fp32_is_gemma4s_function_and_fuses():
    """In fp32 the rounding is a no-op: the look-alike is Gemma4's norm, and fuses as it."""
    sites = pytest.importorskip("transformers_sites")
    c = capture(*_flat(sites.gemma4_attention((0,), torch.float32, "rounded_before_weight")), dynamic=())
    assert c.count(PASS) == 1 and "gemma4_norm=True" in c.after, c.reasons(PASS)


def test_kv_shared_layer_is_not_fused_when_its_target_is_not():
    """The sharing layer is refused by the site itself: with both fusions off, every cache
    update that writes an earlier layer's key is named as a sharer (a fusion of it would
    rotate its target's key a second time)."""
    from inductor_rocm_attn.passes import matchers

    sites = pytest.importorskip("transformers_sites")
    reasons = {}

    def user_pass(graph):
        for cache in matchers.cache_updates(graph):
            reasons[cache.args[2]] = matchers.layer_site(cache)[1]

    fn, args = sites.gemma4_attention()
    capture(fn, *args, dynamic=(), user_pass=user_pass, qk_norm_rope_kv_cache_fusion=False,
            rope_kv_cache_fusion=False)
    assert reasons["transformers.layers.0"] == reasons["transformers.layers.1"] == ""
    assert _SHARED in reasons["transformers.layers.2"], reasons


def _flat(fn_args):
    fn, args = fn_args
    return (fn, *args)


class TestSnapshots(TestCase):
    def test_qwen3_op_form(self):
        cfg, block = _block(name="qwen3_op", rope_impl="op", norm_impl="op")
        c = capture(block, *block_inputs(cfg))
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.before, """\
in: T
in_1: float32[T, 256]
in_2: float32[32]
in_3: float32[32]
in_4: float32[4096, 32]
in_5: T
in_6: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  float32[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  float32[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  float32[T, 64]
reshape = aten.reshape.default(getitem, [in, 4, 32])  float32[T, 4, 32]
rms_norm = rocm_attn.rms_norm.default(reshape, in_2, 1e-06)  float32[T, 4, 32]
reshape_1 = aten.reshape.default(rms_norm, [in, 128])  float32[T, 128]
reshape_2 = aten.reshape.default(getitem_1, [in, 2, 32])  float32[T, 2, 32]
rms_norm_1 = rocm_attn.rms_norm.default(reshape_2, in_3, 1e-06)  float32[T, 2, 32]
reshape_3 = aten.reshape.default(rms_norm_1, [in, 64])  float32[T, 64]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.rotary_embedding.default, positions=in_6, head_size=32, cos_sin_cache=in_4, is_neox=True, _query_base_index=0, _key_base_index=1, _all_bases=[reshape_1, reshape_3])
getitem_3 = getitem(auto_functionalized_v2, 1)  float32[T, 128]
getitem_4 = getitem(auto_functionalized_v2, 2)  float32[T, 64]
reshape_4 = aten.reshape.default(getitem_3, [in, 4, 32])  float32[T, 4, 32]
reshape_5 = aten.reshape.default(getitem_4, [in, 2, 32])  float32[T, 2, 32]
reshape_6 = aten.reshape.default(getitem_2, [in, 2, 32])  float32[T, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_5, reshape_6, 'qwen3_op')  float32[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape_4, key=reshape_5, value=reshape_6, layer_name='qwen3_op', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_5 = getitem(auto_functionalized_v2_1, 1)  float32[T, 4, 32]
reshape_7 = aten.reshape.default(getitem_5, [in, 128])  float32[T, 128]
return (reshape_7,)""")
        self.assertExpectedInline(c.after, """\
in: T
in_1: float32[T, 256]
in_2: float32[32]
in_3: float32[32]
in_4: float32[4096, 32]
in_5: T
in_6: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 2)  float32[T, 64]
reshape = aten.reshape.default(getitem, [in, 2, 32])  float32[T, 2, 32]
unified_qk_norm_rope_and_kv_cache_update = rocm_attn.unified_qk_norm_rope_and_kv_cache_update.default(in_1, in_2, in_3, 1e-06, in_6, in_4, True, 4, 2, 32, 'qwen3_op')
getitem_1 = getitem(unified_qk_norm_rope_and_kv_cache_update, 0)  float32[T, 4, 32]
reshape_1 = aten.reshape.default(getitem_1, [-1, 128])  float32[T, 128]
reshape_2 = aten.reshape.default(reshape_1, [in, 4, 32])  float32[T, 4, 32]
getitem_2 = getitem(unified_qk_norm_rope_and_kv_cache_update, 1)  float32[T, 2, 32]
reshape_3 = aten.reshape.default(getitem_2, [-1, 64])  float32[T, 64]
reshape_4 = aten.reshape.default(reshape_3, [in, 2, 32])  float32[T, 2, 32]
getitem_3 = getitem(unified_qk_norm_rope_and_kv_cache_update, 2)  float32[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape_2, key=reshape_4, value=reshape, layer_name='qwen3_op', kv_cache_dependency=getitem_3, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_4 = getitem(auto_functionalized_v2, 1)  float32[T, 4, 32]
reshape_5 = aten.reshape.default(getitem_4, [in, 128])  float32[T, 128]
return (reshape_5,)""")

    def test_transformers_qwen3_decoder_layer(self):
        """One Qwen3 decoder layer of transformers (fp32, B=2, T=5) after the passes: the q/k
        projections' outputs, viewed as heads, normalized and rotated in place by one op that
        also writes the cache; the attention reads them; cos/sin are the model's rows."""
        sites = pytest.importorskip("transformers_sites")
        fn, args = sites.decoder_layer("qwen3")
        c = capture(fn, *args, dynamic=())
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.after, """\
in: float32[2, 5, 128]
in_1: float32[128]
in_2: float32[128, 128]
in_3: float32[32]
in_4: float32[64, 128]
in_5: float32[32]
in_6: float32[64, 128]
in_7: float32[2, 5, 32]
in_8: float32[2, 5, 32]
in_9: float32[128, 128]
in_10: float32[128]
in_11: float32[256, 128]
in_12: float32[256, 128]
in_13: float32[128, 256]
pow = aten.pow.Tensor_Scalar(in, 2)  float32[2, 5, 128]
mean = aten.mean.dim(pow, [-1], True)  float32[2, 5, 1]
add = aten.add.Tensor(mean, 1e-06)  float32[2, 5, 1]
rsqrt = aten.rsqrt.default(add)  float32[2, 5, 1]
mul = aten.mul.Tensor(in, rsqrt)  float32[2, 5, 128]
mul_1 = aten.mul.Tensor(in_1, mul)  float32[2, 5, 128]
reshape = aten.reshape.default(mul_1, [10, 128])  float32[10, 128]
permute = aten.permute.default(in_2, [1, 0])  float32[128, 128]
mm = aten.mm.default(reshape, permute)  float32[10, 128]
reshape_1 = aten.reshape.default(mm, [2, 5, 128])  float32[2, 5, 128]
reshape_2 = aten.reshape.default(reshape_1, [2, 5, -1, 32])  float32[2, 5, 4, 32]
reshape_3 = aten.reshape.default(mul_1, [10, 128])  float32[10, 128]
permute_1 = aten.permute.default(in_4, [1, 0])  float32[128, 64]
mm_1 = aten.mm.default(reshape_3, permute_1)  float32[10, 64]
reshape_4 = aten.reshape.default(mm_1, [2, 5, 64])  float32[2, 5, 64]
reshape_5 = aten.reshape.default(reshape_4, [2, 5, -1, 32])  float32[2, 5, 2, 32]
reshape_6 = aten.reshape.default(mul_1, [10, 128])  float32[10, 128]
permute_2 = aten.permute.default(in_6, [1, 0])  float32[128, 64]
mm_2 = aten.mm.default(reshape_6, permute_2)  float32[10, 64]
reshape_7 = aten.reshape.default(mm_2, [2, 5, 64])  float32[2, 5, 64]
reshape_8 = aten.reshape.default(reshape_7, [2, 5, -1, 32])  float32[2, 5, 2, 32]
reshape_9 = aten.reshape.default(reshape_8, [10, 2, 32])  float32[10, 2, 32]
reshape_10 = aten.reshape.default(reshape_2, [-1, 4, 32])  float32[10, 4, 32]
reshape_11 = aten.reshape.default(reshape_5, [-1, 2, 32])  float32[10, 2, 32]
reshape_12 = aten.reshape.default(in_7, [-1, 32])  float32[10, 32]
reshape_13 = aten.reshape.default(in_8, [-1, 32])  float32[10, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update.default, value=reshape_9, q_weight=in_3, k_weight=in_5, eps=1e-06, cos=reshape_12, sin=reshape_13, is_neox=True, layer_name='transformers.layers.0', _query_base_index=0, _key_base_index=1, _all_bases=[reshape_10, reshape_11])
getitem = getitem(auto_functionalized_v2, 0)  float32[0]
getitem_1 = getitem(auto_functionalized_v2, 1)  float32[10, 4, 32]
getitem_2 = getitem(auto_functionalized_v2, 2)  float32[10, 2, 32]
empty = aten.empty.memory_format([2, 5, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[2, 5, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=getitem_1, key=getitem_2, value=reshape_9, layer_name='transformers.layers.0', kv_cache_dependency=getitem, output_scale=None, _output_base_index=0, _output_size=(10, 4, 32), _output_stride=(128, 32, 1), _output_storage_offset=0, _all_bases=[empty])
getitem_3 = getitem(auto_functionalized_v2_1, 1)  float32[2, 5, 4, 32]
reshape_14 = aten.reshape.default(getitem_3, [2, 5, -1])  float32[2, 5, 128]
reshape_15 = aten.reshape.default(reshape_14, [10, 128])  float32[10, 128]
permute_3 = aten.permute.default(in_9, [1, 0])  float32[128, 128]
mm_3 = aten.mm.default(reshape_15, permute_3)  float32[10, 128]
reshape_16 = aten.reshape.default(mm_3, [2, 5, 128])  float32[2, 5, 128]
add_1 = aten.add.Tensor(in, reshape_16)  float32[2, 5, 128]
pow_1 = aten.pow.Tensor_Scalar(add_1, 2)  float32[2, 5, 128]
mean_1 = aten.mean.dim(pow_1, [-1], True)  float32[2, 5, 1]
add_2 = aten.add.Tensor(mean_1, 1e-06)  float32[2, 5, 1]
rsqrt_1 = aten.rsqrt.default(add_2)  float32[2, 5, 1]
mul_2 = aten.mul.Tensor(add_1, rsqrt_1)  float32[2, 5, 128]
mul_3 = aten.mul.Tensor(in_10, mul_2)  float32[2, 5, 128]
reshape_17 = aten.reshape.default(mul_3, [10, 128])  float32[10, 128]
permute_4 = aten.permute.default(in_11, [1, 0])  float32[128, 256]
mm_4 = aten.mm.default(reshape_17, permute_4)  float32[10, 256]
reshape_18 = aten.reshape.default(mm_4, [2, 5, 256])  float32[2, 5, 256]
neg = aten.neg.default(reshape_18)  float32[2, 5, 256]
exp = aten.exp.default(neg)  float32[2, 5, 256]
add_3 = aten.add.Tensor(exp, 1)  float32[2, 5, 256]
div = aten.div.Tensor(reshape_18, add_3)  float32[2, 5, 256]
reshape_19 = aten.reshape.default(mul_3, [10, 128])  float32[10, 128]
permute_5 = aten.permute.default(in_12, [1, 0])  float32[128, 256]
mm_5 = aten.mm.default(reshape_19, permute_5)  float32[10, 256]
reshape_20 = aten.reshape.default(mm_5, [2, 5, 256])  float32[2, 5, 256]
mul_4 = aten.mul.Tensor(div, reshape_20)  float32[2, 5, 256]
reshape_21 = aten.reshape.default(mul_4, [10, 256])  float32[10, 256]
permute_6 = aten.permute.default(in_13, [1, 0])  float32[256, 128]
mm_6 = aten.mm.default(reshape_21, permute_6)  float32[10, 128]
reshape_22 = aten.reshape.default(mm_6, [2, 5, 128])  float32[2, 5, 128]
add_4 = aten.add.Tensor(add_1, reshape_22)  float32[2, 5, 128]
return (add_4,)""")

    def test_transformers_gemma4_full_and_kv_shared_layers(self):
        """Gemma4's full layer (head 512, one KV head, ``attention_k_eq_v``) and the KV-shared
        layer after it (fp32, B=2, T=5): the K-norm + RoPE + cache write is one writer with
        ``gemma4_norm`` on a copy of the key projection (the V-norm reads the projection itself),
        Q normalized and rotated in place; the shared layer's cache update and attention read the
        writer's key and layer 1's V; its own query keeps its norm and RoPE."""
        sites = pytest.importorskip("transformers_sites")
        fn, args = sites.gemma4_attention((1, 2))
        c = capture(fn, *args, dynamic=())
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.after, """\
in: float32[2, 5, 128]
in_1: float32[2048, 128]
in_2: float32[512]
in_3: float32[2, 5, 512]
in_4: float32[2, 5, 512]
in_5: float32[512, 128]
in_6: float32[512]
in_7: float32[128, 2048]
in_8: float32[2048, 128]
in_9: float32[512]
in_10: float32[128, 2048]
reshape = aten.reshape.default(in, [10, 128])  float32[10, 128]
permute = aten.permute.default(in_1, [1, 0])  float32[128, 2048]
mm = aten.mm.default(reshape, permute)  float32[10, 2048]
reshape_1 = aten.reshape.default(mm, [2, 5, 2048])  float32[2, 5, 2048]
reshape_2 = aten.reshape.default(reshape_1, [2, 5, -1, 512])  float32[2, 5, 4, 512]
reshape_3 = aten.reshape.default(in, [10, 128])  float32[10, 128]
permute_1 = aten.permute.default(in_5, [1, 0])  float32[128, 512]
mm_1 = aten.mm.default(reshape_3, permute_1)  float32[10, 512]
reshape_4 = aten.reshape.default(mm_1, [2, 5, 512])  float32[2, 5, 512]
reshape_5 = aten.reshape.default(reshape_4, [2, 5, -1, 512])  float32[2, 5, 1, 512]
pow = aten.pow.Tensor_Scalar(reshape_5, 2)  float32[2, 5, 1, 512]
mean = aten.mean.dim(pow, [-1], True)  float32[2, 5, 1, 1]
add = aten.add.Tensor(mean, 1e-06)  float32[2, 5, 1, 1]
pow_1 = aten.pow.Tensor_Scalar(add, -0.5)  float32[2, 5, 1, 1]
mul = aten.mul.Tensor(reshape_5, pow_1)  float32[2, 5, 1, 512]
permute_2 = aten.permute.default(mul, [0, 2, 1, 3])  float32[2, 1, 5, 512]
permute_3 = aten.permute.default(permute_2, [0, 2, 1, 3])  float32[2, 5, 1, 512]
reshape_6 = aten.reshape.default(permute_3, [10, 1, 512])  float32[10, 1, 512]
reshape_7 = aten.reshape.default(reshape_2, [-1, 4, 512])  float32[10, 4, 512]
reshape_8 = aten.reshape.default(reshape_5, [-1, 1, 512])  float32[10, 1, 512]
clone = aten.clone.default(reshape_8)  float32[10, 1, 512]
reshape_9 = aten.reshape.default(in_3, [-1, 512])  float32[10, 512]
reshape_10 = aten.reshape.default(in_4, [-1, 512])  float32[10, 512]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update.default, value=reshape_6, q_weight=in_2, k_weight=in_6, eps=1e-06, cos=reshape_9, sin=reshape_10, is_neox=True, layer_name='transformers.layers.1', gemma4_norm=True, _query_base_index=0, _key_base_index=1, _all_bases=[reshape_7, clone])
getitem = getitem(auto_functionalized_v2, 0)  float32[0]
getitem_1 = getitem(auto_functionalized_v2, 1)  float32[10, 4, 512]
getitem_2 = getitem(auto_functionalized_v2, 2)  float32[10, 1, 512]
empty = aten.empty.memory_format([2, 5, 4, 512], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[2, 5, 4, 512]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=getitem_1, key=getitem_2, value=reshape_6, layer_name='transformers.layers.1', kv_cache_dependency=getitem, output_scale=None, _output_base_index=0, _output_size=(10, 4, 512), _output_stride=(2048, 512, 1), _output_storage_offset=0, _all_bases=[empty])
getitem_3 = getitem(auto_functionalized_v2_1, 1)  float32[2, 5, 4, 512]
reshape_11 = aten.reshape.default(getitem_3, [2, 5, -1])  float32[2, 5, 2048]
reshape_12 = aten.reshape.default(reshape_11, [10, 2048])  float32[10, 2048]
permute_4 = aten.permute.default(in_7, [1, 0])  float32[2048, 128]
mm_2 = aten.mm.default(reshape_12, permute_4)  float32[10, 128]
reshape_13 = aten.reshape.default(mm_2, [2, 5, 128])  float32[2, 5, 128]
add_1 = aten.add.Tensor(in, reshape_13)  float32[2, 5, 128]
reshape_14 = aten.reshape.default(add_1, [10, 128])  float32[10, 128]
permute_5 = aten.permute.default(in_8, [1, 0])  float32[128, 2048]
mm_3 = aten.mm.default(reshape_14, permute_5)  float32[10, 2048]
reshape_15 = aten.reshape.default(mm_3, [2, 5, 2048])  float32[2, 5, 2048]
reshape_16 = aten.reshape.default(reshape_15, [2, 5, -1, 512])  float32[2, 5, 4, 512]
pow_2 = aten.pow.Tensor_Scalar(reshape_16, 2)  float32[2, 5, 4, 512]
mean_1 = aten.mean.dim(pow_2, [-1], True)  float32[2, 5, 4, 1]
add_2 = aten.add.Tensor(mean_1, 1e-06)  float32[2, 5, 4, 1]
pow_3 = aten.pow.Tensor_Scalar(add_2, -0.5)  float32[2, 5, 4, 1]
mul_1 = aten.mul.Tensor(reshape_16, pow_3)  float32[2, 5, 4, 512]
mul_2 = aten.mul.Tensor(mul_1, in_9)  float32[2, 5, 4, 512]
unsqueeze = aten.unsqueeze.default(in_3, 2)  float32[2, 5, 1, 512]
mul_3 = aten.mul.Tensor(mul_2, unsqueeze)  float32[2, 5, 4, 512]
slice = aten.slice.Tensor(mul_2, 3, 256, 9223372036854775807)  float32[2, 5, 4, 256]
neg = aten.neg.default(slice)  float32[2, 5, 4, 256]
slice_1 = aten.slice.Tensor(mul_2, 3, 0, 256)  float32[2, 5, 4, 256]
cat = aten.cat.default([neg, slice_1], -1)  float32[2, 5, 4, 512]
unsqueeze_1 = aten.unsqueeze.default(in_4, 2)  float32[2, 5, 1, 512]
mul_4 = aten.mul.Tensor(cat, unsqueeze_1)  float32[2, 5, 4, 512]
add_3 = aten.add.Tensor(mul_3, mul_4)  float32[2, 5, 4, 512]
reshape_17 = aten.reshape.default(add_3, [10, 4, 512])  float32[10, 4, 512]
permute_6 = aten.permute.default(permute_2, [0, 2, 1, 3])  float32[2, 5, 1, 512]
reshape_18 = aten.reshape.default(permute_6, [10, 1, 512])  float32[10, 1, 512]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(getitem_2, reshape_18, 'transformers.layers.2')  float32[0]
empty_1 = aten.empty.memory_format([2, 5, 4, 512], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[2, 5, 4, 512]
auto_functionalized_v2_2 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape_17, key=getitem_2, value=reshape_18, layer_name='transformers.layers.2', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _output_size=(10, 4, 512), _output_stride=(2048, 512, 1), _output_storage_offset=0, _all_bases=[empty_1])
getitem_4 = getitem(auto_functionalized_v2_2, 1)  float32[2, 5, 4, 512]
reshape_19 = aten.reshape.default(getitem_4, [2, 5, -1])  float32[2, 5, 2048]
reshape_20 = aten.reshape.default(reshape_19, [10, 2048])  float32[10, 2048]
permute_7 = aten.permute.default(in_10, [1, 0])  float32[2048, 128]
mm_4 = aten.mm.default(reshape_20, permute_7)  float32[10, 128]
reshape_21 = aten.reshape.default(mm_4, [2, 5, 128])  float32[2, 5, 128]
add_4 = aten.add.Tensor(add_1, reshape_21)  float32[2, 5, 128]
return (add_4,)""")

    def test_qwen3_hf_form_bf16(self):
        cfg, block = _block(name="qwen3_hf")
        c = capture(block.to(torch.bfloat16), *block_inputs(cfg, dtype=torch.bfloat16))
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.before, """\
in: T
in_1: bfloat16[T, 256]
in_2: bfloat16[32]
in_3: bfloat16[32]
in_4: bfloat16[4096, 32]
in_5: T
in_6: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  bfloat16[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  bfloat16[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  bfloat16[T, 64]
index = aten.index.Tensor(in_4, [in_6])  bfloat16[T, 32]
split = aten.split.Tensor(index, 16, -1)
getitem_3 = getitem(split, 0)  bfloat16[T, 16]
getitem_4 = getitem(split, 1)  bfloat16[T, 16]
reshape = aten.reshape.default(getitem, [in, 4, 32])  bfloat16[T, 4, 32]
convert_element_type = prims.convert_element_type.default(reshape, torch.float32)  float32[T, 4, 32]
pow = aten.pow.Tensor_Scalar(convert_element_type, 2)  float32[T, 4, 32]
mean = aten.mean.dim(pow, [-1], True)  float32[T, 4, 1]
add = aten.add.Tensor(mean, 1e-06)  float32[T, 4, 1]
rsqrt = aten.rsqrt.default(add)  float32[T, 4, 1]
mul = aten.mul.Tensor(convert_element_type, rsqrt)  float32[T, 4, 32]
convert_element_type_1 = prims.convert_element_type.default(mul, torch.bfloat16)  bfloat16[T, 4, 32]
mul_1 = aten.mul.Tensor(in_2, convert_element_type_1)  bfloat16[T, 4, 32]
split_1 = aten.split.Tensor(mul_1, 16, -1)
getitem_5 = getitem(split_1, 0)  bfloat16[T, 4, 16]
getitem_6 = getitem(split_1, 1)  bfloat16[T, 4, 16]
reshape_1 = aten.reshape.default(getitem_1, [in, 2, 32])  bfloat16[T, 2, 32]
convert_element_type_2 = prims.convert_element_type.default(reshape_1, torch.float32)  float32[T, 2, 32]
pow_1 = aten.pow.Tensor_Scalar(convert_element_type_2, 2)  float32[T, 2, 32]
mean_1 = aten.mean.dim(pow_1, [-1], True)  float32[T, 2, 1]
add_1 = aten.add.Tensor(mean_1, 1e-06)  float32[T, 2, 1]
rsqrt_1 = aten.rsqrt.default(add_1)  float32[T, 2, 1]
mul_2 = aten.mul.Tensor(convert_element_type_2, rsqrt_1)  float32[T, 2, 32]
convert_element_type_3 = prims.convert_element_type.default(mul_2, torch.bfloat16)  bfloat16[T, 2, 32]
mul_3 = aten.mul.Tensor(in_3, convert_element_type_3)  bfloat16[T, 2, 32]
split_2 = aten.split.Tensor(mul_3, 16, -1)
getitem_7 = getitem(split_2, 0)  bfloat16[T, 2, 16]
getitem_8 = getitem(split_2, 1)  bfloat16[T, 2, 16]
unsqueeze = aten.unsqueeze.default(getitem_3, 1)  bfloat16[T, 1, 16]
expand = aten.expand.default(unsqueeze, [in_5, 2, 16])  bfloat16[T, 2, 16]
clone = aten.clone.default(expand, memory_format=torch.contiguous_format)  bfloat16[T, 2, 16]
reshape_2 = aten.reshape.default(clone, [in_5, 32])  bfloat16[T, 32]
unsqueeze_1 = aten.unsqueeze.default(reshape_2, 1)  bfloat16[T, 1, 32]
mul_4 = aten.mul.Tensor(mul_1, unsqueeze_1)  bfloat16[T, 4, 32]
neg = aten.neg.default(getitem_6)  bfloat16[T, 4, 16]
cat = aten.cat.default([neg, getitem_5], -1)  bfloat16[T, 4, 32]
unsqueeze_2 = aten.unsqueeze.default(getitem_4, 1)  bfloat16[T, 1, 16]
expand_1 = aten.expand.default(unsqueeze_2, [in_5, 2, 16])  bfloat16[T, 2, 16]
clone_1 = aten.clone.default(expand_1, memory_format=torch.contiguous_format)  bfloat16[T, 2, 16]
reshape_3 = aten.reshape.default(clone_1, [in_5, 32])  bfloat16[T, 32]
unsqueeze_3 = aten.unsqueeze.default(reshape_3, 1)  bfloat16[T, 1, 32]
mul_5 = aten.mul.Tensor(cat, unsqueeze_3)  bfloat16[T, 4, 32]
add_2 = aten.add.Tensor(mul_4, mul_5)  bfloat16[T, 4, 32]
mul_6 = aten.mul.Tensor(mul_3, unsqueeze_1)  bfloat16[T, 2, 32]
neg_1 = aten.neg.default(getitem_8)  bfloat16[T, 2, 16]
cat_1 = aten.cat.default([neg_1, getitem_7], -1)  bfloat16[T, 2, 32]
mul_7 = aten.mul.Tensor(cat_1, unsqueeze_3)  bfloat16[T, 2, 32]
add_3 = aten.add.Tensor(mul_6, mul_7)  bfloat16[T, 2, 32]
reshape_4 = aten.reshape.default(getitem_2, [in, 2, 32])  bfloat16[T, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(add_3, reshape_4, 'qwen3_hf')  bfloat16[0]
empty = aten.empty.memory_format([in_5, 4, 32], dtype=torch.bfloat16, layout=torch.strided, device=cpu, pin_memory=False)  bfloat16[T, 4, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=add_2, key=add_3, value=reshape_4, layer_name='qwen3_hf', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_9 = getitem(auto_functionalized_v2, 1)  bfloat16[T, 4, 32]
reshape_5 = aten.reshape.default(getitem_9, [in, 128])  bfloat16[T, 128]
return (reshape_5,)""")
        self.assertExpectedInline(c.after, """\
in: T
in_1: bfloat16[T, 256]
in_2: bfloat16[32]
in_3: bfloat16[32]
in_4: bfloat16[4096, 32]
in_5: T
in_6: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 2)  bfloat16[T, 64]
reshape = aten.reshape.default(getitem, [in, 2, 32])  bfloat16[T, 2, 32]
unified_qk_norm_rope_and_kv_cache_update = rocm_attn.unified_qk_norm_rope_and_kv_cache_update.default(in_1, in_2, in_3, 1e-06, in_6, in_4, True, 4, 2, 32, 'qwen3_hf')
getitem_1 = getitem(unified_qk_norm_rope_and_kv_cache_update, 0)  bfloat16[T, 4, 32]
getitem_2 = getitem(unified_qk_norm_rope_and_kv_cache_update, 1)  bfloat16[T, 2, 32]
getitem_3 = getitem(unified_qk_norm_rope_and_kv_cache_update, 2)  bfloat16[0]
empty = aten.empty.memory_format([in_5, 4, 32], dtype=torch.bfloat16, layout=torch.strided, device=cpu, pin_memory=False)  bfloat16[T, 4, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=getitem_1, key=getitem_2, value=reshape, layer_name='qwen3_hf', kv_cache_dependency=getitem_3, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_4 = getitem(auto_functionalized_v2, 1)  bfloat16[T, 4, 32]
reshape_1 = aten.reshape.default(getitem_4, [in, 128])  bfloat16[T, 128]
return (reshape_1,)""")

    def test_negative_norm_over_whole_q(self):
        cfg, block = _block("norm_whole_q", name="qwen3_whole_q", norm_impl="op", rope_impl="op")
        c = capture(block, *block_inputs(cfg), rope_kv_cache_fusion=False)
        self.assertEqual(c.count(PASS), 0)
        self.assertExpectedInline(c.after, """\
in: T
in_1: float32[T, 256]
in_2: float32[128]
in_3: float32[32]
in_4: float32[4096, 32]
in_5: T
in_6: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  float32[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  float32[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  float32[T, 64]
rms_norm = rocm_attn.rms_norm.default(getitem, in_2, 1e-06)  float32[T, 128]
reshape = aten.reshape.default(getitem_1, [in, 2, 32])  float32[T, 2, 32]
rms_norm_1 = rocm_attn.rms_norm.default(reshape, in_3, 1e-06)  float32[T, 2, 32]
reshape_1 = aten.reshape.default(rms_norm_1, [in, 64])  float32[T, 64]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.rotary_embedding.default, positions=in_6, head_size=32, cos_sin_cache=in_4, is_neox=True, _query_base_index=0, _key_base_index=1, _all_bases=[rms_norm, reshape_1])
getitem_3 = getitem(auto_functionalized_v2, 1)  float32[T, 128]
getitem_4 = getitem(auto_functionalized_v2, 2)  float32[T, 64]
reshape_2 = aten.reshape.default(getitem_3, [in, 4, 32])  float32[T, 4, 32]
reshape_3 = aten.reshape.default(getitem_4, [in, 2, 32])  float32[T, 2, 32]
reshape_4 = aten.reshape.default(getitem_2, [in, 2, 32])  float32[T, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_3, reshape_4, 'qwen3_whole_q')  float32[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape_2, key=reshape_3, value=reshape_4, layer_name='qwen3_whole_q', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_5 = getitem(auto_functionalized_v2_1, 1)  float32[T, 4, 32]
reshape_5 = aten.reshape.default(getitem_5, [in, 128])  float32[T, 128]
return (reshape_5,)""")


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_fuses_with_static_token_count(num_tokens):
    cfg, block = _block()
    c = capture(block.to(torch.bfloat16), *block_inputs(cfg, num_tokens, torch.bfloat16), dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)


@pytest.mark.compile
@pytest.mark.parametrize("norm", ["rms_norm_hf", "rms_norm_gemma", "rms_norm_gemma4"])
def test_qk_viewing_a_scaled_fused_qkv_matches_eager(norm):
    """q, k and v views of one pointwise result (a scaled ``[B, T, W]`` fused projection, split
    in three): the writer normalizes and rotates copies of q and k (before, Inductor wrote the
    view bases in place and the K cache and the output were wrong or NaN)."""
    from test_rope_kv_cache_fusion import _attend, _fused_once_matches_eager

    from inductor_rocm_attn.passes import forms

    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 256, generator=g) / 8
    q_weight, k_weight = torch.randn(32, generator=g) * 0.2 + 1, torch.randn(32, generator=g) * 0.2 + 1
    rms = getattr(forms, norm)

    def build(name):
        def fn(hidden, cos, sin):
            t = hidden.shape[0]
            qkv = (hidden.unsqueeze(0) @ w) * 1.5
            q, k, v = (x.view(1, t, -1, 32) for x in qkv.split([128, 64, 64], dim=-1))
            q, k = rms(q, q_weight, 1e-6), rms(k, k_weight, 1e-6)
            q_rot, k_rot = (forms.rope_neox_transformers(x, cos, sin).reshape(t, -1, 32) for x in (q, k))
            return _attend(q_rot, k_rot, v.reshape(t, 2, 32), name)
        return fn

    _fused_once_matches_eager(build, g, PASS)
