"""RoPE + KV-cache update fusion on post-grad graphs of a Llama-style block."""

import itertools
import re

import pytest
import torch
from torch.testing._internal.common_utils import TestCase

from blocks import AttnBlock, block_inputs
from fx_capture import capture
from inductor_rocm_attn.models import llama_config

PASS = "rope_kv_cache_fusion"
_ids = itertools.count()


def _block(variant="plain", gptj_hf=False, name=None, **kw):
    cfg = llama_config(num_heads=4, num_kv_heads=2, head_size=32, **kw)
    return cfg, AttnBlock(cfg, name or f"rope{next(_ids)}.attn", variant, gptj_hf)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", ["op-neox", "op-gptj", "hf-neox", "hf-gptj"])
def test_fuses_every_form(dtype, form):
    impl, style = form.split("-")
    cfg, block = _block(gptj_hf=(impl == "hf" and style == "gptj"),
                        rope_impl="op" if impl == "op" else "torch", is_neox=style == "neox")
    c = capture(block.to(dtype), *block_inputs(cfg, dtype=dtype))
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "unified_rope_and_kv_cache_update" in c.after and "unified_kv_cache_update(" not in c.after
    assert f"is_neox={style == 'neox'}, layer_name='{block.layer.attn.layer_name}'" in c.after


@pytest.mark.parametrize("variant,why", [
    ("cache_unrotated_k", "the cached key is not a RoPE output"),
    ("attn_reads_other_key", "the attention's key is not the key the cache update writes"),
    ("mixed_rope", "the cached key is not a RoPE output"),
    ("q_other_positions", "different positions"),
])
@pytest.mark.parametrize("rope_impl", ["torch", "op"])
def test_does_not_fuse_non_equivalent(variant, why, rope_impl):
    if variant == "mixed_rope" and rope_impl == "op":
        pytest.skip("mixed_rope is an HF-form construction")
    cfg, block = _block(variant, rope_impl=rope_impl)
    c = capture(block, *block_inputs(cfg))
    assert c.count(PASS) == 0
    assert c.after == c.before
    if not (rope_impl == "op" and variant == "q_other_positions"):
        assert any(why in r for r in c.reasons(PASS)), c.reasons(PASS)


def test_disabled_flag_leaves_graph():
    cfg, block = _block()
    c = capture(block, *block_inputs(cfg), rope_kv_cache_fusion=False)
    assert c.after == c.before and c.manager.get_pass(PASS).records == []


class TestSnapshots(TestCase):
    def test_transformers_llama_layer_with_a_dynamic_batch_and_shared_positions(self):
        """``torch.compile(dynamic=True)`` of a layer whose cos/sin ``[1, T, D]`` (position_ids
        ``[1, T]``) broadcast over a symbolic batch: the rows are expanded to the batch read
        from the key at run time (``sym_size``), not int() of the symbol (which would guard
        the batch); the fusion missed there. Batch and token count both print as T."""
        sites = pytest.importorskip("transformers_sites")
        fn, args = sites.decoder_layer("llama", shared_positions=True)
        hidden, cos, sin = args
        for a, dims in ((hidden, (0, 1)), (cos, (1,)), (sin, (1,))):
            for d in dims:
                torch._dynamo.mark_dynamic(a, d)
        c = capture(fn, *args, dynamic=())
        self.assertEqual(c.count(PASS), 1, c.reasons(PASS))
        after = "\n".join(line for line in c.after.splitlines() if "rope" in line or "sym_size" in line
                          or "expand" in line or "cos" in line)
        self.assertExpectedInline(after, """\
sym_size = aten.sym_size.int(reshape_5, 0)  T
expand = aten.expand.default(in_8, [sym_size, -1, -1])  float32[T, T, 32]
reshape_12 = aten.reshape.default(expand, [-1, 32])  float32[T*T, 32]
sym_size_1 = aten.sym_size.int(reshape_5, 0)  T
expand_1 = aten.expand.default(in_9, [sym_size_1, -1, -1])  float32[T, T, 32]
reshape_13 = aten.reshape.default(expand_1, [-1, 32])  float32[T*T, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_rope_cos_sin_and_kv_cache_update.default, value=reshape_9, cos=reshape_12, sin=reshape_13, is_neox=True, layer_name='transformers.layers.0', _query_base_index=0, _key_base_index=1, _all_bases=[reshape_10, reshape_11])""")

    def test_llama_op_form(self):
        cfg, block = _block(rope_impl="op", name="llama_op")
        c = capture(block, *block_inputs(cfg))
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.before, """\
in: T
in_1: float32[T, 256]
in_2: float32[4096, 32]
in_3: T
in_4: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  float32[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  float32[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  float32[T, 64]
clone = aten.clone.default(getitem)  float32[T, 128]
clone_1 = aten.clone.default(getitem_1)  float32[T, 64]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.rotary_embedding.default, positions=in_4, head_size=32, cos_sin_cache=in_2, is_neox=True, _query_base_index=0, _key_base_index=1, _all_bases=[clone, clone_1])
getitem_3 = getitem(auto_functionalized_v2, 1)  float32[T, 128]
getitem_4 = getitem(auto_functionalized_v2, 2)  float32[T, 64]
reshape = aten.reshape.default(getitem_3, [in, 4, 32])  float32[T, 4, 32]
reshape_1 = aten.reshape.default(getitem_4, [in, 2, 32])  float32[T, 2, 32]
reshape_2 = aten.reshape.default(getitem_2, [in, 2, 32])  float32[T, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_1, reshape_2, 'llama_op')  float32[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape, key=reshape_1, value=reshape_2, layer_name='llama_op', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_5 = getitem(auto_functionalized_v2_1, 1)  float32[T, 4, 32]
reshape_3 = aten.reshape.default(getitem_5, [in, 128])  float32[T, 128]
return (reshape_3,)""")
        self.assertExpectedInline(c.after, """\
in: T
in_1: float32[T, 256]
in_2: float32[4096, 32]
in_3: T
in_4: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  float32[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  float32[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  float32[T, 64]
clone = aten.clone.default(getitem)  float32[T, 128]
clone_1 = aten.clone.default(getitem_1)  float32[T, 64]
reshape = aten.reshape.default(getitem_2, [in, 2, 32])  float32[T, 2, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_rope_and_kv_cache_update.default, positions=in_4, value=reshape, cos_sin_cache=in_2, is_neox=True, layer_name='llama_op', _query_base_index=0, _key_base_index=1, _all_bases=[clone, clone_1])
getitem_3 = getitem(auto_functionalized_v2, 0)  float32[0]
getitem_4 = getitem(auto_functionalized_v2, 1)  float32[T, 128]
reshape_1 = aten.reshape.default(getitem_4, [in, 4, 32])  float32[T, 4, 32]
getitem_5 = getitem(auto_functionalized_v2, 2)  float32[T, 64]
reshape_2 = aten.reshape.default(getitem_5, [in, 2, 32])  float32[T, 2, 32]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape_1, key=reshape_2, value=reshape, layer_name='llama_op', kv_cache_dependency=getitem_3, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_6 = getitem(auto_functionalized_v2_1, 1)  float32[T, 4, 32]
reshape_3 = aten.reshape.default(getitem_6, [in, 128])  float32[T, 128]
return (reshape_3,)""")

    def test_llama_hf_form_bf16(self):
        cfg, block = _block(name="llama_hf")
        c = capture(block.to(torch.bfloat16), *block_inputs(cfg, dtype=torch.bfloat16))
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.before, """\
in: T
in_1: bfloat16[T, 256]
in_2: bfloat16[4096, 32]
in_3: T
in_4: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  bfloat16[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  bfloat16[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  bfloat16[T, 64]
index = aten.index.Tensor(in_2, [in_4])  bfloat16[T, 32]
split = aten.split.Tensor(index, 16, -1)
getitem_3 = getitem(split, 0)  bfloat16[T, 16]
getitem_4 = getitem(split, 1)  bfloat16[T, 16]
reshape = aten.reshape.default(getitem, [in, -1, 32])  bfloat16[T, 4, 32]
split_1 = aten.split.Tensor(reshape, 16, -1)
getitem_5 = getitem(split_1, 0)  bfloat16[T, 4, 16]
getitem_6 = getitem(split_1, 1)  bfloat16[T, 4, 16]
reshape_1 = aten.reshape.default(getitem_1, [in, -1, 32])  bfloat16[T, 2, 32]
split_2 = aten.split.Tensor(reshape_1, 16, -1)
getitem_7 = getitem(split_2, 0)  bfloat16[T, 2, 16]
getitem_8 = getitem(split_2, 1)  bfloat16[T, 2, 16]
unsqueeze = aten.unsqueeze.default(getitem_3, 1)  bfloat16[T, 1, 16]
expand = aten.expand.default(unsqueeze, [in_3, 2, 16])  bfloat16[T, 2, 16]
clone = aten.clone.default(expand, memory_format=torch.contiguous_format)  bfloat16[T, 2, 16]
reshape_2 = aten.reshape.default(clone, [in_3, 32])  bfloat16[T, 32]
unsqueeze_1 = aten.unsqueeze.default(reshape_2, 1)  bfloat16[T, 1, 32]
mul = aten.mul.Tensor(reshape, unsqueeze_1)  bfloat16[T, 4, 32]
neg = aten.neg.default(getitem_6)  bfloat16[T, 4, 16]
cat = aten.cat.default([neg, getitem_5], -1)  bfloat16[T, 4, 32]
unsqueeze_2 = aten.unsqueeze.default(getitem_4, 1)  bfloat16[T, 1, 16]
expand_1 = aten.expand.default(unsqueeze_2, [in_3, 2, 16])  bfloat16[T, 2, 16]
clone_1 = aten.clone.default(expand_1, memory_format=torch.contiguous_format)  bfloat16[T, 2, 16]
reshape_3 = aten.reshape.default(clone_1, [in_3, 32])  bfloat16[T, 32]
unsqueeze_3 = aten.unsqueeze.default(reshape_3, 1)  bfloat16[T, 1, 32]
mul_1 = aten.mul.Tensor(cat, unsqueeze_3)  bfloat16[T, 4, 32]
add = aten.add.Tensor(mul, mul_1)  bfloat16[T, 4, 32]
mul_2 = aten.mul.Tensor(reshape_1, unsqueeze_1)  bfloat16[T, 2, 32]
neg_1 = aten.neg.default(getitem_8)  bfloat16[T, 2, 16]
cat_1 = aten.cat.default([neg_1, getitem_7], -1)  bfloat16[T, 2, 32]
mul_3 = aten.mul.Tensor(cat_1, unsqueeze_3)  bfloat16[T, 2, 32]
add_1 = aten.add.Tensor(mul_2, mul_3)  bfloat16[T, 2, 32]
reshape_4 = aten.reshape.default(getitem_2, [in, 2, 32])  bfloat16[T, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(add_1, reshape_4, 'llama_hf')  bfloat16[0]
empty = aten.empty.memory_format([in_3, 4, 32], dtype=torch.bfloat16, layout=torch.strided, device=cpu, pin_memory=False)  bfloat16[T, 4, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=add, key=add_1, value=reshape_4, layer_name='llama_hf', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_9 = getitem(auto_functionalized_v2, 1)  bfloat16[T, 4, 32]
reshape_5 = aten.reshape.default(getitem_9, [in, 128])  bfloat16[T, 128]
return (reshape_5,)""")
        self.assertExpectedInline(c.after, """\
in: T
in_1: bfloat16[T, 256]
in_2: bfloat16[4096, 32]
in_3: T
in_4: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  bfloat16[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  bfloat16[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  bfloat16[T, 64]
reshape = aten.reshape.default(getitem, [in, -1, 32])  bfloat16[T, 4, 32]
reshape_1 = aten.reshape.default(getitem_1, [in, -1, 32])  bfloat16[T, 2, 32]
reshape_2 = aten.reshape.default(getitem_2, [in, 2, 32])  bfloat16[T, 2, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_rope_and_kv_cache_update.default, positions=in_4, value=reshape_2, cos_sin_cache=in_2, is_neox=True, layer_name='llama_hf', _query_base_index=0, _key_base_index=1, _all_bases=[reshape, reshape_1])
getitem_3 = getitem(auto_functionalized_v2, 0)  bfloat16[0]
getitem_4 = getitem(auto_functionalized_v2, 1)  bfloat16[T, 4, 32]
getitem_5 = getitem(auto_functionalized_v2, 2)  bfloat16[T, 2, 32]
empty = aten.empty.memory_format([in_3, 4, 32], dtype=torch.bfloat16, layout=torch.strided, device=cpu, pin_memory=False)  bfloat16[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=getitem_4, key=getitem_5, value=reshape_2, layer_name='llama_hf', kv_cache_dependency=getitem_3, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_6 = getitem(auto_functionalized_v2_1, 1)  bfloat16[T, 4, 32]
reshape_3 = aten.reshape.default(getitem_6, [in, 128])  bfloat16[T, 128]
return (reshape_3,)""")

    def test_llama_hf_form_one_base(self):
        # q and k are slices of a projection computed in the graph: that tensor is the fused
        # op's one base, and the attention reads q, k and v from the op's result
        cfg, block = _block(name="llama_one_base")
        proj = torch.nn.Linear(32, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_size, bias=False)

        def fn(positions, hidden):
            return block(positions, proj(hidden))

        positions, qkv = block_inputs(cfg)
        c = capture(fn, positions, torch.randn(qkv.shape[0], 32))
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.after, """\
in: float32[256, 32]
in_1: T
in_2: float32[T, 32]
in_3: float32[4096, 32]
in_4: T
in_5: int64[T]
permute = aten.permute.default(in, [1, 0])  float32[32, 256]
mm = aten.mm.default(in_2, permute)  float32[T, 256]
split_with_sizes = aten.split_with_sizes.default(mm, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 2)  float32[T, 64]
reshape = aten.reshape.default(getitem, [in_1, 2, 32])  float32[T, 2, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_rope_and_kv_cache_update.default, positions=in_5, value=reshape, cos_sin_cache=in_3, is_neox=True, layer_name='llama_one_base', _query_base_index=0, _query_slice_dim=1, _query_slice_start=0, _query_slice_end=128, _key_base_index=0, _key_slice_dim=1, _key_slice_start=128, _key_slice_end=192, _all_bases=[mm])
getitem_1 = getitem(auto_functionalized_v2, 0)  float32[0]
getitem_2 = getitem(auto_functionalized_v2, 1)  float32[T, 256]
slice = aten.slice.Tensor(getitem_2, 1, 0, 128)  float32[T, 128]
reshape_1 = aten.reshape.default(slice, [-1, 4, 32])  float32[T, 4, 32]
slice_1 = aten.slice.Tensor(getitem_2, 1, 128, 192)  float32[T, 64]
reshape_2 = aten.reshape.default(slice_1, [-1, 2, 32])  float32[T, 2, 32]
slice_2 = aten.slice.Tensor(getitem_2, 1, 192, 256)  float32[T, 64]
reshape_3 = aten.reshape.default(slice_2, [-1, 2, 32])  float32[T, 2, 32]
empty = aten.empty.memory_format([in_4, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape_1, key=reshape_2, value=reshape_3, layer_name='llama_one_base', kv_cache_dependency=getitem_1, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_3 = getitem(auto_functionalized_v2_1, 1)  float32[T, 4, 32]
reshape_4 = aten.reshape.default(getitem_3, [in_1, 128])  float32[T, 128]
return (reshape_4,)""")

    def test_qwen3_block_with_qk_norm_pass_off(self):
        # RoPE fuses with the cache write; the per-head norms stay as they are
        from inductor_rocm_attn.models import qwen3_config

        cfg = qwen3_config(num_heads=4, num_kv_heads=2, head_size=32, rope_impl="op", norm_impl="op")
        block = AttnBlock(cfg, "qwen3_rope_only")
        c = capture(block, *block_inputs(cfg), qk_norm_rope_kv_cache_fusion=False)
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.after, """\
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
reshape_4 = aten.reshape.default(getitem_2, [in, 2, 32])  float32[T, 2, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_rope_and_kv_cache_update.default, positions=in_6, value=reshape_4, cos_sin_cache=in_4, is_neox=True, layer_name='qwen3_rope_only', _query_base_index=0, _key_base_index=1, _all_bases=[reshape_1, reshape_3])
getitem_3 = getitem(auto_functionalized_v2, 0)  float32[0]
getitem_4 = getitem(auto_functionalized_v2, 1)  float32[T, 128]
reshape_5 = aten.reshape.default(getitem_4, [in, 4, 32])  float32[T, 4, 32]
getitem_5 = getitem(auto_functionalized_v2, 2)  float32[T, 64]
reshape_6 = aten.reshape.default(getitem_5, [in, 2, 32])  float32[T, 2, 32]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape_5, key=reshape_6, value=reshape_4, layer_name='qwen3_rope_only', kv_cache_dependency=getitem_3, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_6 = getitem(auto_functionalized_v2_1, 1)  float32[T, 4, 32]
reshape_7 = aten.reshape.default(getitem_6, [in, 128])  float32[T, 128]
return (reshape_7,)""")

    def test_negative_cache_unrotated_k(self):
        cfg, block = _block("cache_unrotated_k", name="llama_cache_unrotated_k")
        c = capture(block, *block_inputs(cfg))
        self.assertEqual(c.count(PASS), 0)
        self.assertExpectedInline(c.after, """\
in: T
in_1: float32[T, 256]
in_2: float32[4096, 32]
in_3: T
in_4: int64[T]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  float32[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  float32[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  float32[T, 64]
index = aten.index.Tensor(in_2, [in_4])  float32[T, 32]
split = aten.split.Tensor(index, 16, -1)
getitem_3 = getitem(split, 0)  float32[T, 16]
getitem_4 = getitem(split, 1)  float32[T, 16]
reshape = aten.reshape.default(getitem, [in, -1, 32])  float32[T, 4, 32]
split_1 = aten.split.Tensor(reshape, 16, -1)
getitem_5 = getitem(split_1, 0)  float32[T, 4, 16]
getitem_6 = getitem(split_1, 1)  float32[T, 4, 16]
unsqueeze = aten.unsqueeze.default(getitem_3, 1)  float32[T, 1, 16]
expand = aten.expand.default(unsqueeze, [in_3, 2, 16])  float32[T, 2, 16]
clone = aten.clone.default(expand, memory_format=torch.contiguous_format)  float32[T, 2, 16]
reshape_1 = aten.reshape.default(clone, [in_3, 32])  float32[T, 32]
unsqueeze_1 = aten.unsqueeze.default(reshape_1, 1)  float32[T, 1, 32]
mul = aten.mul.Tensor(reshape, unsqueeze_1)  float32[T, 4, 32]
neg = aten.neg.default(getitem_6)  float32[T, 4, 16]
cat = aten.cat.default([neg, getitem_5], -1)  float32[T, 4, 32]
unsqueeze_2 = aten.unsqueeze.default(getitem_4, 1)  float32[T, 1, 16]
expand_1 = aten.expand.default(unsqueeze_2, [in_3, 2, 16])  float32[T, 2, 16]
clone_1 = aten.clone.default(expand_1, memory_format=torch.contiguous_format)  float32[T, 2, 16]
reshape_2 = aten.reshape.default(clone_1, [in_3, 32])  float32[T, 32]
unsqueeze_3 = aten.unsqueeze.default(reshape_2, 1)  float32[T, 1, 32]
mul_1 = aten.mul.Tensor(cat, unsqueeze_3)  float32[T, 4, 32]
add = aten.add.Tensor(mul, mul_1)  float32[T, 4, 32]
reshape_3 = aten.reshape.default(getitem_1, [in, 2, 32])  float32[T, 2, 32]
reshape_4 = aten.reshape.default(getitem_2, [in, 2, 32])  float32[T, 2, 32]
reshape_5 = aten.reshape.default(getitem_1, [in, 2, 32])  float32[T, 2, 32]
reshape_6 = aten.reshape.default(getitem_2, [in, 2, 32])  float32[T, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_5, reshape_6, 'llama_cache_unrotated_k')  float32[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, device=cpu, pin_memory=False)  float32[T, 4, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=add, key=reshape_3, value=reshape_4, layer_name='llama_cache_unrotated_k', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_7 = getitem(auto_functionalized_v2, 1)  float32[T, 4, 32]
reshape_7 = aten.reshape.default(getitem_7, [in, 128])  float32[T, 128]
return (reshape_7,)""")


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_fuses_with_static_token_count(num_tokens):
    cfg, block = _block()
    c = capture(block.to(torch.float16), *block_inputs(cfg, num_tokens, torch.float16), dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)


# --- transformers' own modeling code ------------------------------------------------------------

TRANSFORMERS_LAYERS = [("llama", torch.float32), ("llama", torch.float16), ("llama", torch.bfloat16),
                       ("qwen2", torch.float32), ("mistral", torch.float32), ("gemma2", torch.bfloat16),
                       ("olmo2", torch.float32), ("qwen2_vl", torch.float32)]


@pytest.mark.parametrize("arch,dtype", TRANSFORMERS_LAYERS)
def test_fuses_transformers_decoder_layers(arch, dtype):
    """The RoPE of transformers' attention (q/k viewed [B, T, H, D], rotated as [B, H, T, D]
    with the model's per-token cos/sin, ``rotate_half`` sliced) fuses with the cache update,
    the cos/sin rows passed as they are. OLMo2 (its QK-norm is over the whole projection,
    not per head) fuses RoPE only; Qwen2-VL's mRoPE sections are applied inside its rotary
    embedding, so its attention is the plain formula on per-token rows: exact here."""
    sites = pytest.importorskip("transformers_sites")
    fn, args = sites.decoder_layer(arch, dtype)
    c = capture(fn, *args, dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "rocm_attn.unified_rope_cos_sin_and_kv_cache_update" in c.after
    assert "unified_kv_cache_update(" not in c.after and "aten.cat" not in c.after  # rotate_half gone
    # q and k are mutated in place (two bases: the projections' outputs viewed as heads)
    assert "_query_base_index=0, _key_base_index=1" in c.after
    # the rows the op takes are the model's cos/sin inputs, viewed per token
    assert re.search(r"cos=reshape(_\d+)?, sin=reshape(_\d+)?, is_neox=True", c.after)
    assert "cos=" in c.after and re.search(r"reshape(_\d+)? = aten.reshape.default\(in_\d+, \[-1, 32\]\)", c.after)


def test_fuses_with_a_dynamic_token_count():
    sites = pytest.importorskip("transformers_sites")
    fn, args = sites.decoder_layer("llama")
    for a in args:
        torch._dynamo.mark_dynamic(a, 1)
    c = capture(fn, *args, dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "float32[2, T, 4, 32]" in c.before  # the token count is symbolic


def test_fuses_gptj_rotation_of_per_token_rows_as_gptj():
    """GPT-J's interleaved rotation (Cohere's ``rotate_half``) of the model's per-token rows is
    the writer's ``is_neox=False`` form: the same formula channel for channel, for any rows
    (NeoX-style ``cat((f, f))`` rows here), never the NeoX one. Cohere generate against eager:
    ``tests/integrations/test_transformers_fusion.py``."""
    sites = pytest.importorskip("transformers_sites")
    block = sites.SiteAttention("gptj_rotation")
    c = capture(block, *sites.site_inputs("gptj_rotation", torch.float32), dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "is_neox=False" in c.after and "is_neox=True" not in c.after, c.after


@pytest.mark.parametrize("variant,dtype,why", [
    ("partial_rotary", torch.float32, "the cached key is not a RoPE output (transformers_neox"),
    ("k_other_positions", torch.float32, "query and key are rotated with different cos/sin"),
    ("cos_fp32", torch.bfloat16, "RoPE mixes dtypes"),
])
def test_does_not_fuse_transformers_variants(variant, dtype, why):
    """Near-misses of transformers' attention that compute another function: partial rotary
    (traced here without the slice's cat the partial forms expect), a key at other positions,
    RoPE promoted to fp32."""
    sites = pytest.importorskip("transformers_sites")
    plain = sites.SiteAttention("plain").to(dtype)
    assert capture(plain, *sites.site_inputs("plain", dtype), dynamic=()).count(PASS) == 1  # the site itself fuses
    block = sites.SiteAttention(variant).to(dtype)
    c = capture(block, *sites.site_inputs(variant, dtype), dynamic=())
    assert c.count(PASS) == 0 and c.after == c.before
    assert any(why in r for r in c.reasons(PASS)), c.reasons(PASS)


def test_fuses_partial_rotary_of_transformers_phi():
    """Phi (``partial_rotary_factor`` 0.5): the first 16 of each head's 32 channels rotate,
    the rest pass through a ``cat``; the writer takes the model's cos/sin rows of 16 and
    rotates exactly those channels (``forms.PARTIAL_COS_SIN_ROPE_FORMS``). Generation with it
    against eager: ``tests/integrations/test_transformers_fusion.py`` (Phi-3)."""
    sites = pytest.importorskip("transformers_sites")
    fn, args = sites.decoder_layer("phi")
    c = capture(fn, *args, dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "rocm_attn.unified_rope_cos_sin_and_kv_cache_update" in c.after
    assert "unified_kv_cache_update(" not in c.after and "aten.cat" not in c.after  # rotation and pass-through gone
    assert re.search(r"cos=reshape(_\d+)?, sin=reshape(_\d+)?, is_neox=True", c.after)
    assert re.search(r"reshape(_\d+)? = aten.reshape.default\(in_\d+, \[-1, 16\]\)", c.after)  # rows of 16


def test_fuses_gpt_oss_rope_with_doubled_half_width_rows():
    """GPT-OSS rotates a head's halves with cos/sin of half the head (16 of 32): the writer
    gets those rows doubled, ``cat((c, c))``, i.e. the NeoX rotation with the same angle for
    channels i and i + 16. Generation with it against eager:
    ``tests/integrations/test_transformers_fusion.py`` (GPT-OSS)."""
    sites = pytest.importorskip("transformers_sites")
    fn, args = sites.decoder_layer("gpt_oss")
    c = capture(fn, *args, dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "unified_kv_cache_update(" not in c.after
    cos_arg = re.search(r"cos=(\w+), sin=(\w+), is_neox=True", c.after)
    for arg in cos_arg.groups():
        line = next(ln for ln in c.after.splitlines() if ln.startswith(f"{arg} = "))
        rows = re.match(rf"{arg} = aten\.cat\.default\(\[(\w+), (\w+)\], -1\)", line)
        assert rows and rows.group(1) == rows.group(2), line  # the same rows twice
        src = next(ln for ln in c.after.splitlines() if ln.startswith(f"{rows.group(1)} = "))
        assert re.search(r"aten\.reshape\.default\(in_\d+, \[-1, 16\]\)", src), src  # half-width rows


def test_fuses_mrope_sections_picked_in_the_attention():
    """Sections of three position sources cut from cos/sin in the attention (Qwen2-VL's older
    form) give per-token rows; the op rotates with exactly those rows (the sections' cat)."""
    sites = pytest.importorskip("transformers_sites")
    block = sites.SiteAttention("mrope_sections")
    c = capture(block, *sites.site_inputs("mrope_sections"), dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    cos_arg = re.search(r"cos=(\w+)", c.after.split("unified_rope_cos_sin_and_kv_cache_update")[1]).group(1)
    cos_def = next(line for line in c.after.splitlines() if line.startswith(f"{cos_arg} = "))
    src = re.search(r"reshape.default\((\w+), \[-1, 32\]\)", cos_def).group(1)
    assert next(line for line in c.after.splitlines() if line.startswith(f"{src} = ")).split(" = ")[1].startswith(
        "aten.cat.default")


def test_token_major_per_token_rope_on_a_fused_qkv_is_one_base():
    """The per-token form token-major (``x [T, H, D]``, cos/sin ``[T, D]``) on slices of one
    qkv projection: the fused op mutates that one tensor (q and k as its column slices)."""
    from inductor_rocm_attn.passes import forms

    name = "rope_per_token_qkv.attn"
    w = torch.randn(256, 64)

    def block(x, cos, sin):
        t = x.shape[0]
        q, k, v = (x @ w.T).split([128, 64, 64], dim=-1)
        q = forms.rope_neox_per_token(q.reshape(t, 4, 32), cos, sin)
        k = forms.rope_neox_per_token(k.reshape(t, 2, 32), cos, sin)
        v = v.reshape(t, 2, 32)
        out = torch.empty(t, 4, 32)
        token = torch.ops.rocm_attn.unified_kv_cache_update(k, v, name)
        torch.ops.rocm_attn.unified_attention_with_output(q, k, v, out, name, token)
        return out

    c = capture(block, torch.randn(5, 64), torch.randn(5, 32), torch.randn(5, 32))
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "RoPE (per_token_neox, NeoX)" in c.manager.get_pass(PASS).records[0].detail
    assert re.search(r"_query_base_index=0, _query_slice_dim=1, _query_slice_start=0, _query_slice_end=128, "
                     r"_key_base_index=0, _key_slice_dim=1, _key_slice_start=128, _key_slice_end=192, "
                     r"_all_bases=\[mm\]", c.after), c.after


def test_cos_sin_of_one_position_row_broadcast_over_the_batch():
    """position_ids ``[1, T]`` for a batch of B rows: cos/sin ``[1, T, D]`` broadcast in the
    RoPE; the op gets them expanded to one row per token."""
    sites = pytest.importorskip("transformers_sites")
    hidden, cos, sin = sites.site_inputs("plain")
    c = capture(sites.SiteAttention("plain"), hidden, cos[:1], sin[:1], dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert re.search(r"expand = aten.expand.default\(\w+, \[2, -1, -1\]\)  float32\[2, 5, 32\]", c.after), c.after


# --- the cached value read from the q/k the fused op rotates in place ----------------------------


def _compiled_matches_eager(build, *inputs, hq=4, hkv=2, d=32):
    """``build(layer_name) -> fn(*inputs)``, run eagerly and compiled (plugin on) on two layers
    with NaN-poisoned caches: ``(max |diff| of the outputs and the written K/V, fusion records)``."""
    import inductor_rocm_attn as ira
    from inductor_rocm_attn import compilation
    from inductor_rocm_attn.layout import dense_kv

    tag = f"rope_value{next(_ids)}"
    layers = [ira.Attention(hq, d, num_kv_heads=hkv, layer_name=f"{tag}_{w}.attn") for w in ("eager", "compiled")]
    for layer in layers:
        layer.kv_cache = ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 4).fill_(float("nan"))
    t = inputs[0].shape[0]
    md = ira.build_attention_metadata([t], [0], [[2, 1]], layers[0].block_size)
    report = compilation.fusion_report()
    report.clear()
    torch._dynamo.reset()
    with torch.no_grad(), ira.set_forward_context(md):
        want = build(layers[0].layer_name)(*inputs)
        with compilation.plugin():
            got = torch.compile(build(layers[1].layer_name), backend="inductor", fullgraph=True)(*inputs)
    torch._dynamo.reset()
    diffs = [(got - want).abs().max()]
    for a, b in zip(*(dense_kv(l.kv_cache, hkv, l.interleaved_v) for l in layers)):
        rows = lambda x: x.reshape(-1, hkv, d)[md.slot_mapping]  # noqa: E731
        diffs.append((rows(a) - rows(b)).abs().max())
    return float(max(diffs)), [r for r in report.records if r.layer_name == layers[1].layer_name]


def _fused_once_matches_eager(build, g, pass_name):
    """``build``'s function of (hidden [5, 64], cos, sin) with NeoX cos/sin rows, compiled with
    the plugin: ``pass_name`` fuses its one layer and the result matches eager."""
    angles = torch.randn(1, 5, 16, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    diff, records = _compiled_matches_eager(build, torch.randn(5, 64, generator=g), cos, sin)
    assert [r.fused for r in records if r.pass_name == pass_name] == [True]
    assert diff < 1e-5


def _attend(q, k, v, name):
    out = torch.empty(q.shape[0], 4, 32)
    token = torch.ops.rocm_attn.unified_kv_cache_update(k, v, name)
    torch.ops.rocm_attn.unified_attention_with_output(q, k, v, out, name, token)
    return out


@pytest.mark.compile
@pytest.mark.parametrize("value,fuses", [
    ("v", True),  # the v slice of the fused qkv: the one-base form
    ("k", True),  # the unrotated k's columns (k = v): q and k as two bases, v never read rotated
    ("q_heads", True),  # columns of the unrotated q
    ("k * 2", False),  # computed from the unrotated k: Inductor recomputed it from the rotated k
    ("v * 2", True),  # computed from columns the op does not touch
])
def test_value_from_the_unrotated_qk_matches_eager(value, fuses):
    from inductor_rocm_attn.passes import forms

    g = torch.Generator().manual_seed(0)
    w, hidden = torch.randn(64, 256, generator=g) / 8, torch.randn(5, 64, generator=g)
    cache = torch.cat([torch.randn(64, 16, generator=g).cos(), torch.randn(64, 16, generator=g).sin()], -1)

    def build(name):
        def fn(hidden, cache, positions):
            qkv = hidden @ w
            q, k, v = (x.reshape(-1, x.shape[1] // 32, 32) for x in qkv.split([128, 64, 64], -1))
            vv = {"v": v, "k": k, "q_heads": qkv[:, :64].reshape(-1, 2, 32), "k * 2": k * 2, "v * 2": v * 2}[value]
            return _attend(forms.rope_neox_hf(q, cache, positions), forms.rope_neox_hf(k, cache, positions), vv, name)
        return fn

    diff, records = _compiled_matches_eager(build, hidden, cache, torch.arange(5))
    rope = [r for r in records if r.pass_name == PASS]
    assert [r.fused for r in rope] == [fuses], [r.detail for r in rope]
    assert diff < 1e-5
    if not fuses:
        assert "computed from the query/key the fused op rotates in place" in rope[0].detail


def test_bf16_qk_rotated_by_an_fp32_table_does_not_fuse():
    """q/k bf16, ``cos_sin_cache`` fp32: the rotation promotes to fp32 (q, k and the cached key in
    fp32); the fused op would rotate in place in bf16 (and reject the bf16 key with an fp32 v)."""
    from inductor_rocm_attn.passes import forms

    name = "rope_fp32_table.attn"

    def block(qkv, cache, positions):
        q, k, v = (x.reshape(-1, x.shape[1] // 32, 32) for x in qkv.split([128, 64, 64], -1))
        return _attend(forms.rope_neox_hf(q, cache, positions), forms.rope_neox_hf(k, cache, positions), v.float(),
                       name)

    c = capture(block, torch.randn(5, 256, dtype=torch.bfloat16), torch.randn(64, 32), torch.arange(5))
    assert c.count(PASS) == 0 and c.after == c.before
    assert any("RoPE changes dtype" in r for r in c.reasons(PASS)), c.reasons(PASS)


# --- GPT-J pairs cut from NeoX rows (GLM, Helium, Ernie 4.5) and clamped q/k (OLMo) -----------

PAIR_ROWS_SITES = [("gptj_pair_rows", torch.float32, "transformers_gptj_pair_rows", 32),
                   ("gptj_pair_rows", torch.bfloat16, "transformers_gptj_pair_rows", 32),
                   ("gptj_pair_rows_partial", torch.float32, "transformers_gptj_pair_rows_partial", 16),
                   ("gptj_pair_rows_fp32", torch.bfloat16, "transformers_gptj_pair_rows_fp32", 32),
                   ("gptj_pair_rows_fp32", torch.float32, "transformers_gptj_pair_rows", 32)]


@pytest.mark.parametrize("variant,dtype,form,width", PAIR_ROWS_SITES)
def test_fuses_gptj_pair_rows_as_gptj_with_the_repeated_rows(variant, dtype, form, width):
    """GLM's ``apply_rotary_pos_emb`` cuts GPT-J rows from the model's NeoX rows
    (``cos[..., :W/2].repeat_interleave(2)``) and rotates interleaved pairs (the first W
    channels, the rest passed through a ``cat`` for GLM's partial rotary: W = 16 of 32; with
    W = 32 the empty pass-through is gone from the graph and it is the full form; in fp32 with fp32
    rows for Ernie 4.5, whose conversions vanish in an fp32 model). The writer's
    ``is_neox=False`` with those rows, built in the graph from the model's."""
    sites = pytest.importorskip("transformers_sites")
    block = sites.SiteAttention(variant).to(dtype)
    args = sites.site_inputs(variant, dtype, d=width)  # rows of `width` channels, heads of 32
    c = capture(block, *args, dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    fused = c.manager.get_pass(PASS).records[0].detail
    assert f"({form}, GPT-J)" in fused, fused
    assert "is_neox=False" in c.after and "unified_kv_cache_update(" not in c.after
    assert re.search(rf"= aten.reshape.default\(cat(_\d+)?, \[-1, {width}\]\)", c.after), c.after


@pytest.mark.parametrize("variant,dtype,why", [
    ("pair_rows_second_half", torch.float32, "the cached key is not a RoPE output"),
    ("pair_rows_fp32_rounded_products", torch.bfloat16, "the cached key is not a RoPE output"),
    ("clip_qk_cos_term_unclamped", torch.float32, "repeated pattern differs"),
])
def test_does_not_fuse_pair_rows_and_clamp_near_misses(variant, dtype, why):
    """Near-misses of the new forms: GPT-J rows cut from the second half of the model's rows
    (another angle per pair unless the rows are ``cat((f, f))``), fp32 products each rounded to
    the model dtype before the sum (two roundings; the writer rounds once), and a clamped q
    whose ``x * cos`` term reads the projection from before the clamp (the views of the two
    are not merged: they view different tensors)."""
    sites = pytest.importorskip("transformers_sites")
    block = sites.SiteAttention(variant).to(dtype)
    c = capture(block, *sites.site_inputs(variant, dtype), dynamic=())
    assert c.count(PASS) == 0 and c.after == c.before, c.reasons(PASS)
    assert any(why in r for r in c.reasons(PASS)), c.reasons(PASS)


def test_fuses_clamped_qk_through_duplicate_views():
    """OLMo clamps its projections in place (``clip_qkv``); functionalization then re-derives
    the [B, T, H, D] views of q/k for each of their uses, so the RoPE's input is three equal
    view chains. They are merged (same view of the same tensor) and the site fuses with the
    clamped projections as the rotated bases."""
    sites = pytest.importorskip("transformers_sites")
    block = sites.SiteAttention("clip_qk")
    c = capture(block, *sites.site_inputs("clip_qk", torch.float32), dynamic=())
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "is_neox=True" in c.after and "clamp_max" in c.after


class TestPairRowsSnapshots(TestCase):
    def test_glm_partial_pair_rows_after(self):
        # the writer's rows: the model's rows of 16, their first 8 columns each twice
        sites = pytest.importorskip("transformers_sites")
        block = sites.SiteAttention("gptj_pair_rows_partial")
        c = capture(block, *sites.site_inputs("gptj_pair_rows_partial", torch.float32, d=16), dynamic=())
        self.assertEqual(c.count(PASS), 1)
        rows = [ln for ln in c.after.splitlines() if "in_1" in ln.split("=", 1)[-1] or "slice" in ln
                or "rope_cos_sin" in ln or ln.startswith(("cat", "unsqueeze"))]
        text = re.sub(r"layer_name='[^']*'", "layer_name=L", "\n".join(rows))  # the layer count varies
        self.assertExpectedInline(text, """\
in_1: float32[128, 128]
permute = aten.permute.default(in_1, [1, 0])  float32[128, 128]
slice = aten.slice.Tensor(reshape_12, 1, 0, 8)  float32[10, 8]
unsqueeze = aten.unsqueeze.default(slice, 2)  float32[10, 8, 1]
cat = aten.cat.default([unsqueeze, unsqueeze], 2)  float32[10, 8, 2]
slice_1 = aten.slice.Tensor(reshape_13, 1, 0, 8)  float32[10, 8]
unsqueeze_1 = aten.unsqueeze.default(slice_1, 2)  float32[10, 8, 1]
cat_1 = aten.cat.default([unsqueeze_1, unsqueeze_1], 2)  float32[10, 8, 2]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_rope_cos_sin_and_kv_cache_update.default, value=reshape_9, cos=reshape_14, sin=reshape_15, is_neox=False, layer_name=L, _query_base_index=0, _key_base_index=1, _all_bases=[reshape_10, reshape_11])""")


# --- a layer caching another layer's rotated key, its attention reading a key of its own -------


def _shared_key_layer_block(names):
    """Layer 0 rotates its q/k (fuses); layer 1 caches layer 0's rotated key but its attention
    reads a key of its own (``k1``, also returned): the fusion must leave ``k1`` alone."""
    from inductor_rocm_attn.passes import forms

    rocm = torch.ops.rocm_attn
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) / 8

    def fn(hidden, cache, positions):
        t = hidden.shape[0]
        q, k, v = (x.reshape(t, -1, 32) for x in (hidden @ w).split([128, 64, 64], -1))
        q_rot, k_rot = forms.rope_neox_hf(q, cache, positions), forms.rope_neox_hf(k, cache, positions)
        out0 = _attend(q_rot, k_rot, v, names[0])
        k1 = k * 0.5 + 1
        out1 = torch.empty(t, 4, 32)
        token = rocm.unified_kv_cache_update(k_rot, v, names[1])
        rocm.unified_attention_with_output(q_rot, k1, v, out1, names[1], token)
        return out0, out1, k1
    return fn


@pytest.mark.compile
def test_layer_caching_a_fused_key_keeps_its_own_attention_key():
    import inductor_rocm_attn as ira
    from inductor_rocm_attn import compilation
    from inductor_rocm_attn.layout import dense_kv

    g = torch.Generator().manual_seed(1)
    hidden, positions = torch.randn(5, 64, generator=g), torch.randperm(5, generator=g)
    cache = torch.cat([torch.randn(64, 16, generator=g).cos(), torch.randn(64, 16, generator=g).sin()], -1)
    tag = f"shared_key{next(_ids)}"
    layers = {w: [ira.Attention(4, 32, num_kv_heads=2, layer_name=f"{tag}_{w}.{i}.attn") for i in range(2)]
              for w in ("eager", "compiled")}
    for layer in (*layers["eager"], *layers["compiled"]):
        layer.kv_cache = ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 4).fill_(float("nan"))
    md = ira.build_attention_metadata([5], [0], [[2, 1]], layers["eager"][0].block_size)
    report = compilation.fusion_report()
    report.clear()
    torch._dynamo.reset()
    with torch.no_grad(), ira.set_forward_context(md):
        want = _shared_key_layer_block([l.layer_name for l in layers["eager"]])(hidden, cache, positions)
        with compilation.plugin():
            fn = _shared_key_layer_block([l.layer_name for l in layers["compiled"]])
            got = torch.compile(fn, backend="inductor", fullgraph=True)(hidden, cache, positions)
    torch._dynamo.reset()
    for name, a, b in zip(("out0", "out1", "k1"), got, want):
        assert (a - b).abs().max() < 1e-5, name
    for le, lc in zip(layers["eager"], layers["compiled"]):
        for a, b in zip(dense_kv(le.kv_cache, 2, le.interleaved_v), dense_kv(lc.kv_cache, 2, lc.interleaved_v)):
            rows = lambda x: x.reshape(-1, 2, 32)[md.slot_mapping]  # noqa: E731
            assert (rows(a) - rows(b)).abs().max() < 1e-5
    records = {r.layer_name: r for r in report.records if r.pass_name == PASS}
    assert records[layers["compiled"][0].layer_name].fused
    assert not records[layers["compiled"][1].layer_name].fused


class TestSharedKeySnapshots(TestCase):
    def test_layer_caching_a_fused_key_keeps_its_own_attention_key_after(self):
        g = torch.Generator().manual_seed(1)
        cache = torch.cat([torch.randn(64, 16, generator=g).cos(), torch.randn(64, 16, generator=g).sin()], -1)
        c = capture(_shared_key_layer_block(["snap_shared.0.attn", "snap_shared.1.attn"]),
                    torch.randn(5, 64), cache, torch.arange(5), dynamic=())
        self.assertEqual(c.count(PASS), 1)
        rows = [ln for ln in c.after.splitlines() if "rocm_attn." in ln or ln.startswith(("mul", "add", "getitem"))]
        self.assertExpectedInline("\n".join(rows), """\
getitem = getitem(split_with_sizes, 1)  float32[5, 64]
getitem_1 = getitem(split_with_sizes, 2)  float32[5, 64]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_rope_and_kv_cache_update.default, positions=in_3, value=reshape_1, cos_sin_cache=in_2, is_neox=True, layer_name='snap_shared.0.attn', _query_base_index=0, _query_slice_dim=1, _query_slice_start=0, _query_slice_end=128, _key_base_index=0, _key_slice_dim=1, _key_slice_start=128, _key_slice_end=192, _all_bases=[mm])
getitem_2 = getitem(auto_functionalized_v2, 0)  float32[0]
getitem_3 = getitem(auto_functionalized_v2, 1)  float32[5, 256]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape_2, key=reshape_3, value=reshape_4, layer_name='snap_shared.0.attn', kv_cache_dependency=getitem_2, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_4 = getitem(auto_functionalized_v2_1, 1)  float32[5, 4, 32]
mul = aten.mul.Tensor(reshape, 0.5)  float32[5, 2, 32]
add = aten.add.Tensor(mul, 1)  float32[5, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_3, reshape_4, 'snap_shared.1.attn')  float32[0]
auto_functionalized_v2_2 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape_2, key=add, value=reshape_4, layer_name='snap_shared.1.attn', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _all_bases=[empty_1])
getitem_5 = getitem(auto_functionalized_v2_2, 1)  float32[5, 4, 32]""")


# --- q/k that view storage something else reads (one `cat`, a pointwise result) ---------------


def _view_base_block(variant):
    """q (and k) views of a tensor the graph computes (not an extern kernel's output) whose
    other columns or rows something else reads: the value, or the other of q/k."""
    from inductor_rocm_attn.passes import forms

    g = torch.Generator().manual_seed(0)
    w, wk = torch.randn(64, 256, generator=g) / 8, torch.randn(64, 64, generator=g) / 8

    def build(name):
        def fn(hidden, cache, positions):
            t = hidden.shape[0]
            qkv = hidden @ w
            k, v = (hidden @ wk).reshape(t, 2, 32), qkv[:, 192:].reshape(t, 2, 32)
            if variant == "q_and_v_of_one_pointwise":
                big = qkv * 1.5
                q, v = big[:, :128].reshape(t, 4, 32), big[:, 192:].reshape(t, 2, 32)
            elif variant == "q_and_k_rows_of_one_cat":
                big = torch.cat([qkv, qkv], 0)
                q, k = big[t:, :128].reshape(t, 4, 32), big[:t, 128:192].reshape(t, 2, 32)
            elif variant == "q_and_v_of_one_cat":
                big = torch.cat([qkv, qkv], 1)
                q, v = big[:, :128].reshape(t, 4, 32), big[:, 192:256].reshape(t, 2, 32)
            return _attend(forms.rope_neox_hf(q, cache, positions), forms.rope_neox_hf(k, cache, positions), v, name)
        return fn
    return build


_VIEW_BASES = ["q_and_v_of_one_pointwise", "q_and_k_rows_of_one_cat", "q_and_v_of_one_cat"]


@pytest.mark.compile
@pytest.mark.parametrize("variant", _VIEW_BASES)
def test_qk_viewing_storage_read_elsewhere_matches_eager(variant):
    """The fused writer gets a copy of such a view (Inductor reinplaced the view base and the
    attention read NaN) and still fuses."""
    g = torch.Generator().manual_seed(2)
    cache = torch.cat([torch.randn(64, 16, generator=g).cos(), torch.randn(64, 16, generator=g).sin()], -1)
    diff, records = _compiled_matches_eager(_view_base_block(variant), torch.randn(5, 64, generator=g), cache,
                                            torch.randperm(5, generator=g))
    assert [r.fused for r in records if r.pass_name == PASS] == [True]
    assert diff < 1e-5


class TestViewBaseSnapshots(TestCase):
    def test_view_of_a_pointwise_result_read_elsewhere_is_copied(self):
        g = torch.Generator().manual_seed(2)
        cache = torch.cat([torch.randn(64, 16, generator=g).cos(), torch.randn(64, 16, generator=g).sin()], -1)
        c = capture(_view_base_block("q_and_v_of_one_pointwise")("snap_view_base.attn"), torch.randn(5, 64), cache,
                    torch.arange(5), dynamic=())
        self.assertEqual(c.count(PASS), 1)
        rows = [ln for ln in c.after.splitlines() if ln.startswith(("mul", "slice", "clone", "auto_functionalized"))]
        self.assertExpectedInline("\n".join(rows), """\
mul = aten.mul.Tensor(mm, 1.5)  float32[5, 256]
slice = aten.slice.Tensor(mul, 1, 0, 128)  float32[5, 128]
slice_1 = aten.slice.Tensor(mul, 1, 192, 9223372036854775807)  float32[5, 64]
clone = aten.clone.default(reshape)  float32[5, 4, 32]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_rope_and_kv_cache_update.default, positions=in_4, value=reshape_2, cos_sin_cache=in_3, is_neox=True, layer_name='snap_view_base.attn', _query_base_index=0, _key_base_index=1, _all_bases=[clone, reshape_1])
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=getitem_1, key=getitem_2, value=reshape_2, layer_name='snap_view_base.attn', kv_cache_dependency=getitem, output_scale=None, _output_base_index=0, _all_bases=[empty])""")


@pytest.mark.compile
def test_clamped_fused_qkv_split_in_three_dims_matches_eager():
    """DBRX's attention: the fused ``[B, T, W]`` projection clamped (``clip_qkv``), then split
    into q, k and v: q and k are two bases viewing the clamp's result, which v reads too (the
    K cache held garbage and the output was wrong before the writer got copies)."""
    from inductor_rocm_attn.passes import forms

    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) / 8

    def build(name):
        def fn(hidden, cos, sin):
            t = hidden.shape[0]
            qkv = torch.nn.functional.linear(hidden.unsqueeze(0), w.t()).clamp(min=-0.5, max=0.5)
            q, k, v = (x.view(1, t, -1, 32) for x in qkv.split([128, 64, 64], dim=2))
            q_rot, k_rot = (forms.rope_neox_transformers(x, cos, sin).reshape(t, -1, 32) for x in (q, k))
            return _attend(q_rot, k_rot, v.reshape(t, 2, 32), name)
        return fn

    _fused_once_matches_eager(build, g, PASS)
