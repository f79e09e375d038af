"""Removal of the stand-in attentions of a piecewise piece, on post-grad graphs of what a piece
holds after the split: RoPE, the cache update, a stand-in attention consuming the token, and a
placeholder returned in the token's place. (The piecewise runner end to end:
tests/test_graph_capture.py.)"""

import pytest
import torch
from torch import nn
from torch.testing._internal.common_utils import TestCase

from blocks import block_inputs
from fx_capture import capture
from inductor_rocm_attn.models import DecoderLayer, llama_config
from inductor_rocm_attn.passes.remove_stand_ins import TOKEN_PLACEHOLDER

PASS = "remove_stand_ins"
rocm = torch.ops.rocm_attn
SLOT = "__rocm_attn_slot0__"
CFG = llama_config(num_heads=4, num_kv_heads=2, head_size=32, rope_impl="op")


class Piece(nn.Module):
    """A piece with its stand-in; ``stand_in=False``: the placeholder alone (a broken piece)."""

    def __init__(self, stand_in=True):
        super().__init__()
        self.layer = DecoderLayer(CFG, f"stand_ins_{stand_in}.attn")
        self.stand_in = stand_in

    def forward(self, positions, qkv):
        t, d = qkv.shape[0], CFG.head_size
        q, k, v = qkv.split([4 * d, 2 * d, 2 * d], dim=-1)
        q, k = self.layer.rotary(positions, q, k)
        q, k, v = q.view(t, 4, d), k.view(t, 2, d), v.view(t, 2, d)
        out = torch.empty_like(q)
        token = rocm.unified_kv_cache_update(k, v, SLOT)
        if self.stand_in:
            rocm.unified_attention_with_output(q, k, v, out, SLOT, token)
        return q, k, v, out, TOKEN_PLACEHOLDER(k, SLOT)


def test_whole_graph_mode_leaves_stand_ins():
    c = capture(Piece(), *block_inputs(CFG))
    assert "unified_attention_with_output" in c.after and "token_placeholder" in c.after
    assert c.manager.get_pass(PASS).removed_count == 0


def test_placeholder_without_stand_in_is_an_error():
    with pytest.raises(Exception, match="holds no stand-in attention"):
        capture(Piece(stand_in=False), *block_inputs(CFG), pieces=True)


class TestSnapshots(TestCase):
    def test_removed_after_the_fusion(self):
        c = capture(Piece(), *block_inputs(CFG), pieces=True)
        self.assertEqual(c.count("rope_kv_cache_fusion"), 1)
        self.assertEqual(c.manager.get_pass(PASS).removed_count, 1)
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
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.unified_rope_and_kv_cache_update.default, positions=in_4, value=reshape, cos_sin_cache=in_2, is_neox=True, layer_name='__rocm_attn_slot0__', _query_base_index=0, _key_base_index=1, _all_bases=[clone, clone_1])
getitem_3 = getitem(auto_functionalized_v2, 0)  float32[0]
getitem_4 = getitem(auto_functionalized_v2, 1)  float32[T, 128]
reshape_1 = aten.reshape.default(getitem_4, [in, 4, 32])  float32[T, 4, 32]
getitem_5 = getitem(auto_functionalized_v2, 2)  float32[T, 64]
reshape_2 = aten.reshape.default(getitem_5, [in, 2, 32])  float32[T, 2, 32]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
return (reshape_1, reshape_2, reshape, empty, getitem_3)""")

    def test_removed_without_fusions(self):
        c = capture(Piece(), *block_inputs(CFG), pieces=True, rope_kv_cache_fusion=False)
        self.assertEqual(c.manager.get_pass(PASS).removed_count, 1)
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
auto_functionalized_v2 = auto_functionalized_v2(rocm_attn.rotary_embedding.default, positions=in_4, head_size=32, cos_sin_cache=in_2, is_neox=True, _query_base_index=0, _key_base_index=1, _all_bases=[clone, clone_1])
getitem_3 = getitem(auto_functionalized_v2, 1)  float32[T, 128]
getitem_4 = getitem(auto_functionalized_v2, 2)  float32[T, 64]
reshape = aten.reshape.default(getitem_3, [in, 4, 32])  float32[T, 4, 32]
reshape_1 = aten.reshape.default(getitem_4, [in, 2, 32])  float32[T, 2, 32]
reshape_2 = aten.reshape.default(getitem_2, [in, 2, 32])  float32[T, 2, 32]
unified_kv_cache_update = rocm_attn.unified_kv_cache_update.default(reshape_1, reshape_2, '__rocm_attn_slot0__')  float32[0]
empty = aten.empty.memory_format([in, 4, 32], dtype=torch.float32, layout=torch.strided, device=cpu, pin_memory=False)  float32[T, 4, 32]
return (reshape, reshape_1, reshape_2, empty, unified_kv_cache_update)""")
