"""The plugin switch (``inductor_rocm_attn.compilation``), its deprecated import paths, and
Inductor's FX-graph cache across pass-flag changes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import inductor_rocm_attn as ira
from inductor_rocm_attn import compilation
from inductor_rocm_attn.forward_context import get_layer

from blocks import AttnBlock, block_inputs


class UserPass(CustomGraphPass):
    def __init__(self, tag="u1"):
        self.calls, self.tag = 0, tag

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return self.tag


@pytest.fixture
def clean_config():
    saved = inductor_config.post_grad_custom_post_pass
    yield
    compilation.disable()
    inductor_config.post_grad_custom_post_pass = saved


def test_enable_wraps_and_disable_restores_user_pass(clean_config):
    user = UserPass()
    inductor_config.post_grad_custom_post_pass = user
    mgr = ira.enable()
    assert inductor_config.post_grad_custom_post_pass is mgr and mgr.user_pass is user
    assert ira.enable() is mgr  # idempotent
    mgr(torch.fx.Graph())
    assert user.calls == 1  # the user's pass still runs, after ours
    ira.disable()
    assert inductor_config.post_grad_custom_post_pass is user


def test_context_manager(clean_config):
    assert not compilation.is_enabled()
    with ira.plugin(attn_quant_fusion=False) as mgr:
        assert compilation.is_enabled() and mgr.flags["attn_quant_fusion"] is False
        assert torch._dynamo.config.specialize_float is True
    assert not compilation.is_enabled() and inductor_config.post_grad_custom_post_pass is None


def test_context_manager_flags_end_with_the_block(clean_config):
    """Inside an enabled plugin, plugin(pass=False) left the pass off after the block."""
    mgr = ira.enable(rope_kv_cache_fusion=False)
    before = dict(mgr.flags)
    with ira.plugin(rope_kv_cache_fusion=True, attn_quant_fusion=False) as inner:
        assert inner is mgr and mgr.flags["rope_kv_cache_fusion"] and not mgr.flags["attn_quant_fusion"]
    assert compilation.is_enabled() and mgr.flags == before
    with pytest.raises(TypeError, match="plugin: attn_quant_fusion must be True or False"):
        with ira.plugin(rope_kv_cache_fusion=True, attn_quant_fusion="off"):
            pass
    assert mgr.flags == before


def test_env_var_enables_at_import():
    code = ("import torch, inductor_rocm_attn; "
            "print(type(torch._inductor.config.post_grad_custom_post_pass).__name__)")
    env = dict(os.environ, ROCM_ATTN_PLUGIN="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PassManager"
    env["ROCM_ATTN_PLUGIN"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "NoneType"


def test_deprecated_import_paths_still_work():
    """``graph_capture`` and ``compile_plugin`` re-export the names of ``compilation``."""
    from inductor_rocm_attn import compile_plugin, graph_capture
    from inductor_rocm_attn.compilation import piecewise, split

    assert graph_capture.compile_piecewise is compilation.compile_piecewise is piecewise.compile_piecewise
    assert graph_capture.PiecewiseRunner is compilation.PiecewiseRunner
    assert graph_capture.RerunGraphBackend is compilation.RerunGraphBackend
    assert graph_capture.split_at_attention is split.split_at_attention
    assert graph_capture.SPLITTING_OPS == ("rocm_attn.unified_attention_with_output",)
    for name in ("enable", "disable", "plugin", "fusion_report", "is_enabled", "set_pass_flag"):
        assert getattr(compile_plugin, name) is getattr(compilation, name), name
    assert ira.enable is compilation.enable


def _qwen_block(name):
    from inductor_rocm_attn.models import qwen3_config

    torch.manual_seed(0)
    cfg = qwen3_config(num_heads=4, num_kv_heads=2, head_size=32, rope_impl="op", norm_impl="op")
    block = AttnBlock(cfg, name)
    ira.bind_kv_caches(block, 4, torch.float32)
    alloc = ira.BlockAllocator(4, 16)
    alloc.allocate(0, 6)
    md = ira.build_attention_metadata([6], [0], [alloc.block_table(0)], 16)
    positions, qkv = block_inputs(cfg, num_tokens=6)
    return block, md, positions, qkv


def _compile_and_run(block, md, positions, qkv):
    torch._dynamo.reset()
    with torch.no_grad(), ira.set_forward_context(md):
        return torch.compile(block, backend="inductor")(positions, qkv)


@pytest.mark.compile
def test_fx_graph_cache_hit_and_miss_on_flag_change(clean_config):
    import torch._inductor.utils as u

    fresh = u.fresh_cache() if hasattr(u, "fresh_cache") else u.fresh_inductor_cache()
    name = "plugin_cache.attn"
    with fresh, inductor_config.patch(fx_graph_cache=True):
        ira.enable()
        block, md, positions, qkv = _qwen_block(name)
        with torch.no_grad(), ira.set_forward_context(md):
            want = block(positions, qkv)  # eager, standard V layout
        counters.clear()
        got = _compile_and_run(block, md, positions, qkv)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        assert block.layer.attn.interleaved_v  # switched by the pass at compile time
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

        # same graph, unchanged passes: a cache hit; the passes do not run, so the new layer
        # of that name is switched by the impl's run-time guard on its first fused write
        del block
        gc.collect()
        block, md, positions, qkv = _qwen_block(name)
        counters.clear()
        got = _compile_and_run(block, md, positions, qkv)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1
        assert counters["inductor"]["fxgraph_cache_miss"] == 0
        assert get_layer(name).interleaved_v
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

        # a pass flag changes the manager's uuid: a miss, compiled with the other passes
        compilation.set_pass_flag("qk_norm_rope_kv_cache_fusion", False)
        counters.clear()
        got = _compile_and_run(block, md, positions, qkv)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        assert compilation.enable().get_pass("rope_kv_cache_fusion").matched_count == 1
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.compile
def test_pieces_compiled_without_the_plugin_keep_the_users_pass(clean_config):
    """compile_piecewise(plugin=False) leaves our passes out of the piece compiles; with the
    plugin enabled, the installed post pass is our manager wrapping the user's, and the
    pieces ran neither: the user's pass was dropped with ours, silently."""
    from inductor_rocm_attn.compilation import compile_piecewise
    from inductor_rocm_attn.models import TinyDecoder, qwen3_config

    user = UserPass("pieces_user_pass")
    inductor_config.post_grad_custom_post_pass = user
    ira.enable()
    model = TinyDecoder(qwen3_config(num_layers=1)).eval()
    ira.bind_kv_caches(model, 4, torch.float32, "cpu")
    with inductor_config.patch(force_disable_caches=True):
        runner = compile_piecewise(model, capture_sizes=[1, 2], max_model_len=32, plugin=False)
    assert not runner.stats.plugin_active
    assert user.calls == runner.stats.num_unique_compiles
