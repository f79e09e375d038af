"""Attention + static fp8 output quant fusion on post-grad graphs."""

import itertools

import pytest
import torch
from torch import nn
from torch.testing._internal.common_utils import TestCase

import inductor_rocm_attn as ira
from blocks import AttnBlock, WriterQuantBlock, block_inputs
from fx_capture import capture
from inductor_rocm_attn.models import llama_config

PASS = "attn_quant_fusion"
FP8 = torch.float8_e4m3fn
_ids = itertools.count()


class QuantBlock(nn.Module):
    """A Llama block whose attention output is quantized to fp8 with a static scale."""

    def __init__(self, name, form="op", scale_shape=(1,), quant_input="attn"):
        super().__init__()
        self.cfg = llama_config(num_heads=4, num_kv_heads=2, head_size=32, rope_impl="op")
        self.block = AttnBlock(self.cfg, name)
        self.form, self.quant_input = form, quant_input
        self.register_buffer("scale", torch.full(scale_shape, 0.5))

    def forward(self, positions, qkv):
        o = self.block(positions, qkv)
        if self.quant_input == "attn_plus_one":
            o = o + 1
        if self.quant_input == "reshape_tokens_last":  # [T, 128] -> [4, 32 * T]: a symbolic trailing dim
            o = o.reshape(4, -1)
        if self.form == "op":
            return torch.ops.rocm_attn.static_scaled_fp8_quant(o, self.scale, FP8)
        fi = torch.finfo(FP8)
        return (o / self.scale).clamp(fi.min, fi.max).to(FP8)


def _block(name=None, dtype=torch.float32, scale_dtype=torch.float32, **kw):
    """The block in ``dtype``, its scale kept fp32 (as quantizing models keep it)."""
    b = QuantBlock(name or f"quant{next(_ids)}.attn", **kw).to(dtype)
    b.scale = b.scale.to(scale_dtype)
    return b.cfg, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", ["op", "plain"])
def test_fuses(dtype, form):
    cfg, block = _block(form=form, dtype=dtype)
    c = capture(block, *block_inputs(cfg, dtype=dtype), rope_kv_cache_fusion=False)
    assert c.count(PASS) == 1, c.reasons(PASS)
    assert "output_scale=None" not in c.after and "dtype=torch.float8_e4m3fn" in c.after
    assert "static_scaled_fp8_quant" not in c.after and "clamp" not in c.after
    assert c.after.count("unified_attention_with_output") == 1


def test_does_not_run_in_pieces():
    """Inside a piece the attention is only a stand-in (the real one runs between the pieces):
    the manager in piece mode does not run this pass."""
    cfg, block = _block(form="op")
    c = capture(block, *block_inputs(cfg), pieces=True, rope_kv_cache_fusion=False)
    assert c.count(PASS) == 0 and c.manager.get_pass(PASS).records == []
    assert c.after == c.before


@pytest.mark.parametrize("kw,why", [
    (dict(form="plain", scale_shape=()), ""),  # 0-dim scale: the division runs in bf16
    (dict(form="plain", scale_dtype=torch.bfloat16), ""),  # bf16 scale: the division runs in bf16
    (dict(form="op", quant_input="attn_plus_one"), None),
    (dict(form="plain", quant_input="attn_plus_one"), None),
    # the fused op rejects a [1, 1] output_scale (the plain quant broadcasts it fine)
    (dict(form="plain", scale_shape=(1, 1)), "shape () or (1,)"),
    # widened in the graph, Inductor dropped the bf16 rounding of a computed scale
    (dict(form="op", scale_dtype=torch.bfloat16), "shape () or (1,)"),
    # reshaping the fp8 result back specialized the dynamic token count
    (dict(form="op", quant_input="reshape_tokens_last"), "trailing dims are not static"),
])
def test_does_not_fuse_non_equivalent(kw, why):
    cfg, block = _block(dtype=torch.bfloat16, **kw)
    c = capture(block, *block_inputs(cfg, dtype=torch.bfloat16), rope_kv_cache_fusion=False)
    assert c.count(PASS) == 0
    assert c.after == c.before
    if why is not None:  # a quant-looking candidate: the report says why it did not fuse
        assert any(why in r for r in c.reasons(PASS)), c.reasons(PASS)


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


@pytest.mark.parametrize("writer", WriterQuantBlock.WRITERS)
def test_the_layer_s_cache_update_gets_the_scale(writer):
    """The layer's cache update (plain or a fused writer, a plain call or functionalized)
    takes the attention's scale and checks it before it writes; the attention alone would
    refuse a bad scale only after the step's keys were written."""
    block = WriterQuantBlock(writer, f"quant_writer{next(_ids)}.{writer}")
    c = capture(block, torch.arange(5), torch.randn(5, 256), rope_kv_cache_fusion=False)
    assert c.count(PASS) == 1, c.reasons(PASS)
    attn = _line(c.after, "auto_functionalized_v2_1 = " if "auto_functionalized_v2_1" in c.after
                 else "auto_functionalized_v2 = ")
    scale = attn.split("output_scale=")[1].split(",")[0]
    assert scale.startswith("in_"), attn
    update = next(line for line in c.after.splitlines() if "kv_cache_update.default" in line)
    assert f"output_scale={scale}," in update or f"output_scale={scale})" in update, update
    assert "output_scale=None" not in c.after


class _TokenBlock(nn.Module):
    """Layer ``a``'s cache update, an attention and a static fp8 quant of its output, with the
    attention's token or the quant's scale made in the ways ``variant`` names."""

    def __init__(self, variant):
        super().__init__()
        n = next(_ids)
        self.variant, self.names = variant, (f"token{n}.a", f"token{n}.b")
        self.layers = nn.ModuleList(ira.Attention(4, 32, num_kv_heads=2, layer_name=x) for x in self.names)
        self.register_buffer("scale", torch.full((1,), 0.5))

    def forward(self, qkv):
        t = qkv.shape[0]
        q, k, v = qkv.split([128, 64, 64], -1)
        q, k, v = q.reshape(t, 4, 32), k.reshape(t, 2, 32), v.reshape(t, 2, 32)
        a, b = self.names
        token = torch.ops.rocm_attn.unified_kv_cache_update(k, v, a)
        scale, reader = self.scale, a
        if self.variant == "not_an_update":
            token = k.new_empty(0)
        elif self.variant == "another_layer":
            reader = b
        elif self.variant == "scale_from_update":
            scale = self.scale + token.sum()
        elif self.variant == "scale_after_update":
            scale = self.scale * 2
        out = torch.empty(t, 4, 32)
        torch.ops.rocm_attn.unified_attention_with_output(q, k, v, out, reader, token)
        return torch.ops.rocm_attn.static_scaled_fp8_quant(out.reshape(t, 128), scale, FP8)


@pytest.mark.parametrize("variant, why", [
    ("not_an_update", "the attention's kv_cache_dependency does not come from a rocm_attn cache-update op"),
    ("another_layer", "the attention's kv_cache_dependency comes from the cache update of another layer"),
    ("scale_from_update", "the quant scale is computed from the results of the layer's cache update"),
])
def test_does_not_fuse_where_the_cache_update_cannot_check_the_scale(variant, why):
    c = capture(_TokenBlock(variant), torch.randn(5, 256), rope_kv_cache_fusion=False)
    assert c.count(PASS) == 0 and c.after == c.before
    assert any(why in r for r in c.reasons(PASS)), c.reasons(PASS)


def test_a_scale_computed_after_the_cache_update_moves_before_it():
    c = capture(_TokenBlock("scale_after_update"), torch.randn(5, 256), rope_kv_cache_fusion=False)
    assert c.count(PASS) == 1, c.reasons(PASS)
    lines = c.after.splitlines()
    mul = next(i for i, line in enumerate(lines) if line.startswith("mul = aten.mul.Tensor"))
    update = next(i for i, line in enumerate(lines) if "unified_kv_cache_update.default" in line)
    assert "output_scale=mul)" in lines[update] and mul < update, c.after
    before = c.before.splitlines()
    assert before.index(next(x for x in before if x.startswith("mul ="))) > next(
        i for i, line in enumerate(before) if "unified_kv_cache_update.default" in line), "not after it to begin with"


class TestSnapshots(TestCase):
    def test_op_quant(self):
        cfg, block = _block("quant_op")
        c = capture(block, *block_inputs(cfg), rope_kv_cache_fusion=False)
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.before, """\
in: T
in_1: float32[T, 256]
in_2: float32[4096, 32]
in_3: T
in_4: int64[T]
in_5: float32[1]
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
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_1, reshape_2, 'quant_op')  float32[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape, key=reshape_1, value=reshape_2, layer_name='quant_op', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_5 = getitem(auto_functionalized_v2_1, 1)  float32[T, 4, 32]
reshape_3 = aten.reshape.default(getitem_5, [in, 128])  float32[T, 128]
static_scaled_fp8_quant = rocm_attn.static_scaled_fp8_quant.default(reshape_3, in_5, torch.float8_e4m3fn)  float8_e4m3fn[T, 128]
return (static_scaled_fp8_quant,)""")
        self.assertExpectedInline(c.after, """\
in: T
in_1: float32[T, 256]
in_2: float32[4096, 32]
in_3: T
in_4: int64[T]
in_5: float32[1]
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
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_1, reshape_2, 'quant_op', output_scale=in_5)  float32[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float8_e4m3fn, layout=torch.strided, device=cpu, pin_memory=False)  float8_e4m3fn[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape, key=reshape_1, value=reshape_2, layer_name='quant_op', kv_cache_dependency=unified_kv_cache_update, output_scale=in_5, _output_base_index=0, _all_bases=[empty])
getitem_5 = getitem(auto_functionalized_v2_1, 1)  float8_e4m3fn[T, 4, 32]
reshape_3 = aten.reshape.default(getitem_5, [-1, 128])  float8_e4m3fn[T, 128]
return (reshape_3,)""")

    def test_plain_quant_bf16(self):
        cfg, block = _block("quant_plain", form="plain", dtype=torch.bfloat16)
        c = capture(block, *block_inputs(cfg, dtype=torch.bfloat16), rope_kv_cache_fusion=False)
        self.assertEqual(c.count(PASS), 1)
        self.assertExpectedInline(c.before, """\
in: T
in_1: bfloat16[T, 256]
in_2: bfloat16[4096, 32]
in_3: T
in_4: int64[T]
in_5: float32[1]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  bfloat16[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  bfloat16[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  bfloat16[T, 64]
clone = aten.clone.default(getitem)  bfloat16[T, 128]
clone_1 = aten.clone.default(getitem_1)  bfloat16[T, 64]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.rotary_embedding.default, positions=in_4, head_size=32, cos_sin_cache=in_2, is_neox=True, _query_base_index=0, _key_base_index=1, _all_bases=[clone, clone_1])
getitem_3 = getitem(auto_functionalized_v2, 1)  bfloat16[T, 128]
getitem_4 = getitem(auto_functionalized_v2, 2)  bfloat16[T, 64]
reshape = aten.reshape.default(getitem_3, [in, 4, 32])  bfloat16[T, 4, 32]
reshape_1 = aten.reshape.default(getitem_4, [in, 2, 32])  bfloat16[T, 2, 32]
reshape_2 = aten.reshape.default(getitem_2, [in, 2, 32])  bfloat16[T, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_1, reshape_2, 'quant_plain')  bfloat16[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.bfloat16, layout=torch.strided, device=cpu, pin_memory=False)  bfloat16[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape, key=reshape_1, value=reshape_2, layer_name='quant_plain', kv_cache_dependency=unified_kv_cache_update, output_scale=None, _output_base_index=0, _all_bases=[empty])
getitem_5 = getitem(auto_functionalized_v2_1, 1)  bfloat16[T, 4, 32]
reshape_3 = aten.reshape.default(getitem_5, [in, 128])  bfloat16[T, 128]
div = aten.div.Tensor(reshape_3, in_5)  float32[T, 128]
clamp_min = aten.clamp_min.default(div, -448.0)  float32[T, 128]
clamp_max = aten.clamp_max.default(clamp_min, 448.0)  float32[T, 128]
convert_element_type = prims.convert_element_type.default(clamp_max, torch.float8_e4m3fn)  float8_e4m3fn[T, 128]
return (convert_element_type,)""")
        self.assertExpectedInline(c.after, """\
in: T
in_1: bfloat16[T, 256]
in_2: bfloat16[4096, 32]
in_3: T
in_4: int64[T]
in_5: float32[1]
split_with_sizes = aten.split_with_sizes.default(in_1, [128, 64, 64], -1)
getitem = getitem(split_with_sizes, 0)  bfloat16[T, 128]
getitem_1 = getitem(split_with_sizes, 1)  bfloat16[T, 64]
getitem_2 = getitem(split_with_sizes, 2)  bfloat16[T, 64]
clone = aten.clone.default(getitem)  bfloat16[T, 128]
clone_1 = aten.clone.default(getitem_1)  bfloat16[T, 64]
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.rotary_embedding.default, positions=in_4, head_size=32, cos_sin_cache=in_2, is_neox=True, _query_base_index=0, _key_base_index=1, _all_bases=[clone, clone_1])
getitem_3 = getitem(auto_functionalized_v2, 1)  bfloat16[T, 128]
getitem_4 = getitem(auto_functionalized_v2, 2)  bfloat16[T, 64]
reshape = aten.reshape.default(getitem_3, [in, 4, 32])  bfloat16[T, 4, 32]
reshape_1 = aten.reshape.default(getitem_4, [in, 2, 32])  bfloat16[T, 2, 32]
reshape_2 = aten.reshape.default(getitem_2, [in, 2, 32])  bfloat16[T, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_1, reshape_2, 'quant_plain', output_scale=in_5)  bfloat16[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float8_e4m3fn, layout=torch.strided, device=cpu, pin_memory=False)  float8_e4m3fn[T, 4, 32]
auto_functionalized_v2_1 = auto_functionalized_v2(rocm_attn.unified_attention_with_output.default, query=reshape, key=reshape_1, value=reshape_2, layer_name='quant_plain', kv_cache_dependency=unified_kv_cache_update, output_scale=in_5, _output_base_index=0, _all_bases=[empty])
getitem_5 = getitem(auto_functionalized_v2_1, 1)  float8_e4m3fn[T, 4, 32]
reshape_3 = aten.reshape.default(getitem_5, [-1, 128])  float8_e4m3fn[T, 128]
return (reshape_3,)""")


@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_does_not_fuse_a_scale_on_another_device(monkeypatch, scale_shape):
    """The plain quant divides a GPU output by a CPU scalar (torch takes a one-element CPU
    tensor there); fused, the layer's cache update and attention would refuse that
    output_scale on every call. Shown on the CPU with the scale's graph value on another
    device (meta): the pass leaves the graph as it was."""
    from inductor_rocm_attn.passes import fx_utils

    real_val = fx_utils.val

    def val(node):  # the quant scale (the one fp32 buffer of one element) as if on another device
        v = real_val(node)
        if (node.op in ("placeholder", "get_attr") and isinstance(v, torch.Tensor) and v.dtype == torch.float32
                and all(type(d) is int for d in v.shape) and v.numel() == 1):
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        return v

    monkeypatch.setattr(fx_utils, "val", val)
    cfg, block = _block(form="plain", scale_shape=scale_shape)
    c = capture(block, *block_inputs(cfg), rope_kv_cache_fusion=False)
    assert c.count(PASS) == 0 and c.after == c.before
    assert any("the quant scale is not on the attention output's device" in r for r in c.reasons(PASS)), \
        c.reasons(PASS)
