"""torch.library.opcheck for every rocm_attn op (schema, fake kernel, AOT dispatch)."""

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import ops

from cases import make_paged_case, poison

UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def _rope_cache(rot=64, max_pos=128):
    g = torch.Generator().manual_seed(0)
    return torch.randn(max_pos, rot, generator=g)


@pytest.fixture(scope="module")
def case():
    return make_paged_case([4, 1], [9, 20], dtype=torch.float32, num_heads=4, num_kv_heads=2, seed=4)


def kernel_level_calls(c):
    t = c.query.shape[0]
    pos = torch.randint(0, 100, (t,))
    cos_sin = _rope_cache()
    qkv = torch.randn(t, (4 + 4) * 64)
    w = torch.rand(64) + 0.5
    cos, sin = torch.randn(2, t, 64)
    return {
        "reshape_and_cache": (c.key, c.value, c.kv_cache.clone(), c.slot_mapping, c.k_scale, c.v_scale, True),
        "paged_attention": (poison(torch.empty_like(c.query)), c.query, c.key, c.value, c.kv_cache,
                            c.query_start_loc, c.seq_lens, c.block_table, c.max_query_len,
                            c.max_seq_len, 0.1, c.k_scale, c.v_scale, True, 8, torch.rand(4),
                            torch.randn(4), 5.0, False, None),
        "rotary_embedding": (pos, c.query.clone().view(t, -1), c.key.clone().view(t, -1), 64, cos_sin, True),
        "rope_and_cache": (pos, c.query.clone(), c.key.clone(), c.value, c.kv_cache.clone(), c.slot_mapping,
                           cos_sin, False, c.k_scale, c.v_scale, False),
        "qk_norm_rope_and_cache": (qkv, w, w, 1e-6, pos, cos_sin, True, c.kv_cache.clone(), c.slot_mapping,
                                   c.k_scale, c.v_scale, True, 4, 2, 64, poison(torch.empty(t, 4, 64)),
                                   poison(torch.empty(t, 2, 64))),
        "rope_cos_sin_and_cache": (c.query.clone(), c.key.clone(), c.value, cos, sin, True, c.kv_cache.clone(),
                                   c.slot_mapping, c.k_scale, c.v_scale, False),
        "qk_norm_rope_cos_sin_and_cache": (c.query.clone(), c.key.clone(), c.value, w, w, 1e-6, cos, sin, False,
                                           c.kv_cache.clone(), c.slot_mapping, c.k_scale, c.v_scale, True),
        "encoder_attention": (c.query, c.key, c.value, c.query_start_loc, 4, 0.1, False),
        "rms_norm": (torch.randn(5, 3, 64), w, 1e-5),
        "static_scaled_fp8_quant": (torch.randn(5, 64), torch.tensor([0.1]), torch.float8_e4m3fn),
    }


@pytest.mark.parametrize("name", [n for n in ops.OP_NAMES if not n.startswith("unified")])
def test_opcheck_kernel_level(case, name):
    args = kernel_level_calls(case)[name]
    torch.library.opcheck(getattr(torch.ops.rocm_attn, name).default, args, test_utils=UTILS)


def _cache_updates():
    return [n for n in ops.OP_NAMES if n.startswith("unified") and n != "unified_attention_with_output"]


@pytest.mark.parametrize("name, output_scale", [
    *((n, False) for n in ops.OP_NAMES if n.startswith("unified")),
    # the compiled graph's form when the fp8 output quant is fused into the layer's attention
    *((n, True) for n in _cache_updates()),
])
def test_opcheck_layer_level(name, output_scale):
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name=f"opcheck.{name}.{output_scale}")
    md = ira.build_attention_metadata([3, 1], [0, 17], [[5], [1, 2]], 16)
    spec = layer.kv_cache_spec(torch.float32)
    layer.kv_cache = ira.allocate_kv_cache(spec, 8).normal_()
    t = 4
    q, k, v = torch.randn(t, 4, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
    cos_sin = _rope_cache()
    cos, sin, w = torch.randn(t, 64), torch.randn(t, 64), torch.rand(64) + 0.5
    args = {
        "unified_kv_cache_update": (k, v, layer.layer_name),
        "unified_attention_with_output": (q, k, v, poison(torch.empty_like(q)), layer.layer_name, None, None),
        "unified_rope_and_kv_cache_update": (md.positions, q, k, v, cos_sin, True, layer.layer_name),
        "unified_qk_norm_rope_and_kv_cache_update": (torch.randn(t, 8 * 64), torch.rand(64), torch.rand(64),
                                                     1e-6, md.positions, cos_sin, True, 4, 2, 64,
                                                     layer.layer_name),
        "unified_rope_cos_sin_and_kv_cache_update": (q, k, v, cos, sin, True, layer.layer_name),
        "unified_qk_norm_rope_cos_sin_and_kv_cache_update": (q, k, v, w, w, 1e-6, cos, sin, True,
                                                             layer.layer_name),
    }[name]
    kwargs = dict(output_scale=torch.tensor([0.5])) if output_scale else {}
    with ira.set_forward_context(md):
        torch.library.opcheck(getattr(torch.ops.rocm_attn, name).default, args, kwargs, test_utils=UTILS)


@pytest.mark.parametrize("flags", ["gemma_norm", "norm_after_rope", "gemma4_norm"])
def test_opcheck_norm_forms(case, flags):
    """The ``gemma_norm=True``, ``norm_after_rope=True`` and ``gemma4_norm=True`` forms of both
    QK-norm writers (kernel and layer level)."""
    c = case
    flag = {flags: True}
    args = kernel_level_calls(c)["qk_norm_rope_cos_sin_and_cache"]
    torch.library.opcheck(torch.ops.rocm_attn.qk_norm_rope_cos_sin_and_cache.default, tuple(args), flag,
                          test_utils=UTILS)
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name=f"opcheck.norm_forms.{flags}")
    md = ira.build_attention_metadata([3, 1], [0, 17], [[5], [1, 2]], 16)
    layer.kv_cache = ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 8).normal_()
    t = 4
    q, k, v = torch.randn(t, 4, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
    cos, sin, w = torch.randn(t, 64), torch.randn(t, 64), 0.3 * torch.randn(64)
    with ira.set_forward_context(md):
        torch.library.opcheck(torch.ops.rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update.default,
                              (q, k, v, w, w, 1e-6, cos, sin, True, layer.layer_name), flag, test_utils=UTILS)
