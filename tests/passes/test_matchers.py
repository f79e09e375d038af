"""The shared site matchers on post-grad graphs: a layer's cache update with its attention, the
RoPE that produced its key and query, and the rewiring of rotated q/k to new nodes."""

import itertools
import operator

import pytest
import torch

from blocks import AttnBlock, block_inputs
from fx_capture import capture
from inductor_rocm_attn.models import llama_config
from inductor_rocm_attn.passes import fx_utils
from inductor_rocm_attn.passes.matchers import cache_updates, column_slice, layer_site, match_rope, replace_outputs

NO_FUSIONS = dict(qk_norm_rope_kv_cache_fusion=False, rope_kv_cache_fusion=False, attn_quant_fusion=False)
_ids = itertools.count()


def _sites(variant="plain", gptj_hf=False, **kw):
    """``[(layer name, site or None, why, rope match or None, why)]`` of a Llama-style block."""
    cfg = llama_config(num_heads=4, num_kv_heads=2, head_size=32, **kw)
    block = AttnBlock(cfg, f"matchers{next(_ids)}.attn", variant, gptj_hf)
    found = []

    def inspect(graph):
        for cache in cache_updates(graph):
            site, why = layer_site(cache)
            rope, rope_why = match_rope(site) if site is not None else (None, "")
            found.append((cache.args[2], site, why, rope, rope_why))

    capture(block, *block_inputs(cfg), user_pass=inspect, **NO_FUSIONS)
    return block.layer.attn.layer_name, found


@pytest.mark.parametrize("rope_impl,gptj_hf,is_neox,form", [
    ("op", False, True, "op"), ("op", False, False, "op"),
    ("torch", False, True, "hf_neox"), ("torch", True, False, "hf_gptj"),
])
def test_site_and_rope_of_every_form(rope_impl, gptj_hf, is_neox, form):
    name, found = _sites(gptj_hf=gptj_hf, rope_impl=rope_impl, is_neox=is_neox)
    assert len(found) == 1
    layer, site, why, rope, rope_why = found[0]
    assert layer == name and site is not None and site.layer_name == name, why
    assert rope is not None, rope_why
    assert (rope.form, rope.is_neox, rope.head_size) == (form, is_neox, 32)
    assert fx_utils.strip_views(site.key) is fx_utils.strip_views(rope.k_out)


@pytest.mark.parametrize("variant,site_why,rope_why", [
    ("attn_reads_other_key", "the attention's key is not the key the cache update writes", None),
    ("cache_unrotated_k", None, "the cached key is not a RoPE output"),
    ("q_other_positions", None, "different positions"),
])
def test_near_misses_say_why(variant, site_why, rope_why):
    _, found = _sites(variant, rope_impl="torch")
    (_, site, why, rope, rwhy), = found
    if site_why:
        assert site is None and site_why in why
    else:
        assert site is not None and rope is None and rope_why in rwhy, rwhy


def test_replace_outputs_reshapes_to_the_old_shape():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    mode = torch._subclasses.FakeTensorMode()
    x.meta["val"] = mode.from_tensor(torch.randn(5, 8))
    old = fx_utils.call(g, torch.ops.aten.reshape.default, (x, [5, 2, 4]))
    user = fx_utils.call(g, torch.ops.aten.neg.default, (old,))
    new = fx_utils.call(g, torch.ops.aten.mul.Tensor, (x, x))  # [5, 8]: needs a reshape
    replace_outputs(g, [(old, new)])
    src = user.args[0]
    assert src is not old and src.target is torch.ops.aten.reshape.default and src.args[0] is new
    assert tuple(fx_utils.val(src).shape) == (5, 2, 4)


def test_column_slice_of_a_qkv_split():
    g = torch.fx.Graph()
    mode = torch._subclasses.FakeTensorMode()
    qkv = g.placeholder("qkv")
    qkv.meta["val"] = mode.from_tensor(torch.randn(5, 256))
    split = fx_utils.call(g, torch.ops.aten.split_with_sizes.default, (qkv, [128, 64, 64], -1))
    parts = [fx_utils.call(g, operator.getitem, (split, i)) for i in range(3)]
    k = fx_utils.call(g, torch.ops.aten.reshape.default, (parts[1], [5, 2, 32]))
    chunks = fx_utils.call(g, torch.ops.aten.split.Tensor, (qkv, 96, 1))  # 96, 96, 64
    last = fx_utils.call(g, operator.getitem, (chunks, 2))
    got = [(c.source, c.start, c.end) for c in map(column_slice, (parts[0], k, parts[2], last))]
    assert got == [(qkv, 0, 128), (qkv, 128, 192), (qkv, 192, 256), (qkv, 192, 256)]
    rows = fx_utils.call(g, operator.getitem, (fx_utils.call(g, torch.ops.aten.split.Tensor, (qkv, 2, 0)), 0))
    assert column_slice(rows) is None and column_slice(qkv) is None  # a row split, not a split at all
