"""Our mutating ops run in place in Inductor's output code: no copy of the attention output
buffer (the KV cache is not a graph value at all), fused writer before the attention."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import inductor_rocm_attn as ira

from blocks import block_inputs

pytestmark = pytest.mark.compile
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "passes"))


def _code_and_result(block, cfg, dtype=torch.float32, num_tokens=6):
    ira.bind_kv_caches(block, 4, dtype)
    alloc = ira.BlockAllocator(4, 16)
    alloc.allocate(0, num_tokens)
    md = ira.build_attention_metadata([num_tokens], [0], [alloc.block_table(0)], 16)
    positions, qkv = block_inputs(cfg, num_tokens=num_tokens, dtype=dtype)
    torch._dynamo.reset()
    with torch.no_grad(), ira.set_forward_context(md):
        want = block(positions, qkv)
        with ira.plugin():
            got, code = run_and_get_code(torch.compile(block, backend="inductor"), positions, qkv)
    return want, got, "\n".join(code)


def _top_level_args(text: str) -> list[str]:
    args, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([" and 1 or (ch in ")]" and -1 or 0)
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*args, cur.strip()]


def _check_in_place(code: str) -> str:
    assert "copy_(" not in code and ".clone(" not in code, "a buffer is copied"
    call = re.search(r"torch\.ops\.rocm_attn\.unified_attention_with_output\.default\(([^\n]*)\)", code)
    assert call, code
    args = _top_level_args(call.group(1))
    out_buf = args[3]
    # the output argument is a buffer Inductor allocated with empty_strided, passed as is
    assert re.search(rf"\b{out_buf} = empty_strided", code), (out_buf, code)
    return args


def test_fused_qk_norm_block_writes_in_place():
    from blocks import AttnBlock
    from inductor_rocm_attn.models import qwen3_config

    torch.manual_seed(0)
    cfg = qwen3_config(num_heads=4, num_kv_heads=2, head_size=32)
    block = AttnBlock(cfg, "lowering_qwen.attn")
    want, got, code = _code_and_result(block, cfg)
    _check_in_place(code)
    fused = code.index("rocm_attn.unified_qk_norm_rope_and_kv_cache_update.default(")
    assert fused < code.index("rocm_attn.unified_attention_with_output.default(")  # write before read
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_attention_fp8_quant_writes_fp8_in_place():
    from test_attn_quant_fusion import QuantBlock  # noqa: E402  (tests/passes is on sys.path)

    torch.manual_seed(0)
    block = QuantBlock("lowering_quant.attn", form="plain")
    want, got, code = _code_and_result(block, block.cfg)
    args = _check_in_place(code)
    assert re.search(rf"{args[3]} = empty_strided_\w+\([^\n]*torch\.float8_e4m3fn\)", code)
    assert len(args) == 7 and args[6] not in ("None", "output_scale=None")  # output_scale passed
    assert got.dtype == torch.float8_e4m3fn
    # one fp8 rounding either way; the fused path divides the fp32 accumulator
    torch.testing.assert_close(got.float(), want.float(), atol=0.0, rtol=0.07)
