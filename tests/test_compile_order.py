"""The dependency token keeps the cache write before the attention read under torch.compile."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import inductor_rocm_attn as ira

from cases import oracle_attention, poison, rel_err

pytestmark = pytest.mark.compile


def test_cache_write_ordered_before_attention_in_compiled_code():
    name = "order.attn"
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name=name)
    layer.kv_cache = poison(ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 8))

    def step(q, k, v):
        out = torch.empty_like(q)
        token = torch.ops.rocm_attn.unified_kv_cache_update(k, v, name)
        torch.ops.rocm_attn.unified_attention_with_output(q, k, v, out, name, token)
        return out * 2.0

    g = torch.Generator().manual_seed(0)
    # A decode step reads its own token from the cache: if the write were reordered after
    # the read (or dropped), the poisoned (NaN) slot would be read.
    k_all, v_all = torch.randn(5, 2, 64, generator=g), torch.randn(5, 2, 64, generator=g)
    md0 = ira.build_attention_metadata([4], [0], [[3]], 16)
    with ira.set_forward_context(md0):
        step(torch.randn(4, 4, 64, generator=g), k_all[:4], v_all[:4])
    q = torch.randn(1, 4, 64, generator=g)
    md = ira.build_attention_metadata([1], [4], [[3]], 16)
    torch._dynamo.reset()
    with ira.set_forward_context(md):
        out, (code,) = run_and_get_code(torch.compile(step, backend="inductor"), q, k_all[4:], v_all[4:])
    write = code.index("rocm_attn.unified_kv_cache_update")
    read = code.index("rocm_attn.unified_attention_with_output")
    assert write < read
    ref = oracle_attention(q, k_all, v_all, q_start_pos=4, scale=0.125) * 2
    assert rel_err(out, ref) < 1e-6
