"""Kernel-level ops check their index tensors and devices on every call, before writing
(issue 14, items 2-4): each rejected call leaves its outputs and caches byte-identical."""

import pytest
import torch

from cases import make_paged_case, poison
from reliability_steps import snapshot, unchanged

D = 64


def _attn_args(case, **over):
    args = dict(output=poison(torch.empty_like(case.query)), query=case.query, key=case.key,
                value=case.value, kv_cache=case.kv_cache, query_start_loc=case.query_start_loc,
                seq_lens=case.seq_lens, block_table=case.block_table,
                max_query_len=case.max_query_len, max_seq_len=case.max_seq_len, scale=0.125,
                k_scale=case.k_scale, v_scale=case.v_scale)
    args.update(over)
    return args


def _attn_rejected(case, match, exc=(ValueError, IndexError), **over):
    args = _attn_args(case, **over)
    before = snapshot(args["output"], case.kv_cache)
    with pytest.raises(exc, match=match):
        torch.ops.rocm_attn.paged_attention(**args)
    assert unchanged(before, args["output"], case.kv_cache)


def _case():
    return make_paged_case([1, 3, 2], [20, 5, 0], dtype=torch.float32)


def test_paged_attention_query_start_loc_not_monotonic():
    c = _case()
    _attn_rejected(c, r"rocm_attn\.paged_attention: query_start_loc must start at 0 and never decrease, got "
                      r"\[0, 4, 1, 6\]", query_start_loc=torch.tensor([0, 4, 1, 6], dtype=torch.int32))


def test_paged_attention_query_start_loc_past_the_tokens():
    c = _case()
    _attn_rejected(c, r"rocm_attn\.paged_attention: query_start_loc\[-1\] = 8 runs past the 6 query tokens",
                   query_start_loc=torch.tensor([0, 1, 4, 8], dtype=torch.int32))


def test_paged_attention_seq_lens_below_query_lens():
    c = _case()
    sl = c.seq_lens.clone()
    sl[1] = 2
    _attn_rejected(c, r"rocm_attn\.paged_attention: seq_lens\[1\] = 2 is smaller than that sequence's query "
                      r"length 3", seq_lens=sl)


def test_paged_attention_negative_block_id():
    c = _case()
    bt = c.block_table.clone()
    bt[0, 1] = -3
    _attn_rejected(c, r"rocm_attn\.paged_attention: block_table\[0, 1\] = -3 is outside the cache", block_table=bt)


@pytest.mark.parametrize("hint", ["max_query_len", "max_seq_len"])
def test_paged_attention_launch_hints(hint):
    c = _case()
    actual = getattr(c, hint)
    _attn_rejected(c, rf"rocm_attn\.paged_attention: {hint} {actual - 1} is smaller than .*{actual}",
                   **{hint: actual - 1})


@pytest.mark.parametrize("name", ["block_table", "seq_lens", "key", "output"])
def test_paged_attention_tensor_on_another_device(name):
    # meta stands for "another device" on a CPU-only machine; a meta argument would send the
    # whole call to the fake kernel, which must refuse the mix too.
    c = _case()
    args = _attn_args(c)
    args[name] = args[name].to("meta")
    before = snapshot(c.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.paged_attention: all tensors must be on one device, got "
                                         rf".*{name} on meta"):
        torch.ops.rocm_attn.paged_attention(**args)
    assert unchanged(before, c.kv_cache)


def test_reshape_and_cache_slot_mapping_on_another_device():
    c = _case()
    before = snapshot(c.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.reshape_and_cache: all tensors must be on one device, got "
                                         r".*slot_mapping on meta"):
        torch.ops.rocm_attn.reshape_and_cache(c.key, c.value, c.kv_cache, c.slot_mapping.to("meta"),
                                              c.k_scale, c.v_scale, False)
    assert unchanged(before, c.kv_cache)


def test_reshape_and_cache_slot_outside_names_the_token():
    c = _case()
    before = snapshot(c.kv_cache)
    n = c.kv_cache.shape[0] * c.kv_cache.shape[2]
    slots = c.slot_mapping.clone()
    slots[2] = n + 1
    with pytest.raises(IndexError, match=rf"rocm_attn\.reshape_and_cache: slot_mapping entry {n + 1} \(token 2\) "
                                         rf"is outside the cache"):
        torch.ops.rocm_attn.reshape_and_cache(c.key, c.value, c.kv_cache, slots, c.k_scale, c.v_scale, False)
    assert unchanged(before, c.kv_cache)


def test_reshape_and_cache_two_tokens_one_slot():
    """Which of two tokens lands in a shared slot is undefined on a GPU: refused, naming both."""
    c = _case()
    before = snapshot(c.kv_cache)
    slots = c.slot_mapping.clone()
    slots[4] = slots[1]
    slots[3] = -1  # padding entries may repeat
    slots[5] = -1
    with pytest.raises(ValueError, match=rf"rocm_attn\.reshape_and_cache: slot_mapping\[1\] and slot_mapping\[4\] "
                                         rf"are both {int(slots[1])}; each token needs its own cache slot"):
        torch.ops.rocm_attn.reshape_and_cache(c.key, c.value, c.kv_cache, slots, c.k_scale, c.v_scale, False)
    assert unchanged(before, c.kv_cache)


# --- rotary positions ------------------------------------------------------------------------


def _cos_sin(rows=32, rot=D):
    return torch.randn(rows, rot)


@pytest.mark.parametrize("pos", [-1, 32, 1000])
def test_rotary_position_outside_the_table(pos):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4 * D, generator=g), torch.randn(3, 2 * D, generator=g)
    positions = torch.tensor([0, pos, 2])
    before = snapshot(q, k)
    with pytest.raises(IndexError, match=rf"rocm_attn\.rotary_embedding: positions entry {pos} \(token 1\) is "
                                         r"outside the cos/sin table \(valid: 0\.\.31\)"):
        torch.ops.rocm_attn.rotary_embedding(positions, q, k, D, _cos_sin(), True)
    assert unchanged(before, q, k)


def test_rope_and_cache_position_outside_the_table():
    c = _case()
    q, k, v = c.query.clone(), c.key.clone(), c.value.clone()
    positions = torch.tensor([20, 5, 6, 7, -1, 1])
    before = snapshot(q, k, c.kv_cache)
    with pytest.raises(IndexError, match=r"rocm_attn\.rope_and_cache: positions entry -1 \(token 4\)"):
        torch.ops.rocm_attn.rope_and_cache(positions, q, k, v, c.kv_cache, c.slot_mapping, _cos_sin(),
                                           True, c.k_scale, c.v_scale, False)
    assert unchanged(before, q, k, c.kv_cache)


def test_qk_norm_rope_and_cache_position_outside_the_table():
    c = _case()
    t = c.query.shape[0]
    qkv = torch.randn(t, (4 + 2 * 2) * D)
    q_out, k_out = torch.full((t, 4, D), 3.0), torch.full((t, 2, D), 3.0)
    positions = torch.tensor([20, 5, 6, 7, 40, 1])
    before = snapshot(q_out, k_out, c.kv_cache)
    with pytest.raises(IndexError, match=r"rocm_attn\.qk_norm_rope_and_cache: positions entry 40 \(token 4\)"):
        torch.ops.rocm_attn.qk_norm_rope_and_cache(qkv, torch.ones(D), torch.ones(D), 1e-6, positions, _cos_sin(),
                                                   True, c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale, True,
                                                   4, 2, D, q_out, k_out)
    assert unchanged(before, q_out, k_out, c.kv_cache)


# --- encoder attention -----------------------------------------------------------------------


@pytest.mark.parametrize("cu, match", [
    ([0, 3], r"cu_seqlens\[-1\] = 3 but query has 5 tokens: every token must belong to a sequence"),
    ([1, 5], r"cu_seqlens must start at 0 and never decrease, got \[1, 5\]"),
    ([0, 4, 2, 5], r"cu_seqlens must start at 0 and never decrease, got \[0, 4, 2, 5\]"),
    ([0, 7], r"cu_seqlens\[-1\] = 7 but query has 5 tokens"),
])
def test_encoder_cu_seqlens_must_cover_the_tokens(cu, match):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 4, D, generator=g), torch.randn(5, 2, D, generator=g), torch.randn(5, 2, D, generator=g)
    with pytest.raises(ValueError, match=rf"rocm_attn\.encoder_attention: {match}"):
        torch.ops.rocm_attn.encoder_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), 5, 0.125)


def test_encoder_max_seqlen_hint():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 4, D, generator=g), torch.randn(5, 2, D, generator=g), torch.randn(5, 2, D, generator=g)
    with pytest.raises(ValueError, match=r"rocm_attn\.encoder_attention: max_seqlen 2 is smaller than the longest "
                                         r"sequence \(3 tokens, sequence 1\)"):
        torch.ops.rocm_attn.encoder_attention(q, k, v, torch.tensor([0, 2, 5], dtype=torch.int32), 2, 0.125)


def test_strided_index_tensors_and_channels():
    c = _case()
    every_other = torch.stack([c.slot_mapping, c.slot_mapping], 1)[:, 0]  # stride 2
    before = snapshot(c.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.reshape_and_cache: slot_mapping must have unit stride along "
                                         r"its last dim"):
        torch.ops.rocm_attn.reshape_and_cache(c.key, c.value, c.kv_cache, every_other, c.k_scale, c.v_scale, False)
    assert unchanged(before, c.kv_cache)
    key_t = c.key.transpose(1, 2).contiguous().transpose(1, 2)  # channels strided
    _attn_rejected(c, r"rocm_attn\.paged_attention: key must have unit stride along head_size", key=key_t)
    table = torch.cat([c.block_table, c.block_table], 1)[:, ::2]
    _attn_rejected(c, r"rocm_attn\.paged_attention: block_table must have unit stride", block_table=table)


@pytest.mark.parametrize("over, match", [
    (dict(sliding_window=-5), r"sliding_window must be -1 or 0 \(none\) or a positive int, got -5"),
    (dict(logits_soft_cap=float("nan")), r"logits_soft_cap must be 0 \(off\) or a positive finite number, got nan"),
    (dict(logits_soft_cap=-1.0), r"logits_soft_cap must be 0 \(off\) or a positive finite number"),
    (dict(k_scale=torch.zeros(1)), r"k_scale must be a positive finite number, got 0.0"),
    (dict(v_scale=torch.full((1,), float("inf"))), r"v_scale must be a positive finite number, got inf"),
])
def test_paged_attention_scalars(over, match):
    _attn_rejected(_case(), rf"rocm_attn\.paged_attention: {match}", **over)


def test_reshape_and_cache_zero_scale():
    c = _case()
    before = snapshot(c.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.reshape_and_cache: k_scale must be a positive finite number"):
        torch.ops.rocm_attn.reshape_and_cache(c.key, c.value, c.kv_cache, c.slot_mapping, torch.zeros(1),
                                              c.v_scale, False)
    assert unchanged(before, c.kv_cache)


@pytest.mark.parametrize("name", ["sinks", "alibi_slopes"])
def test_paged_attention_per_head_tensors(name):
    """The kernels read head h of sinks / ALiBi slopes at offset h: a strided view would give
    other heads' values (measured: the Triton path's output off by 60-150%), an integer or
    fp8 tensor is not a logit. Rejected, naming the fix."""
    c = _case()
    h = c.query.shape[1]
    _attn_rejected(c, rf"rocm_attn\.paged_attention: {name} must be contiguous \(the kernels read head h at "
                      rf"offset h\), got stride 2; pass {name}\.contiguous\(\)", **{name: torch.rand(2 * h)[::2]})
    _attn_rejected(c, rf"rocm_attn\.paged_attention: {name} must be a float tensor \(float32, bfloat16, float16 "
                      rf"or float64\), got torch\.int32", exc=TypeError,
                   **{name: torch.ones(h, dtype=torch.int32)})
    _attn_rejected(c, rf"rocm_attn\.paged_attention: {name} must be \[num_heads\] = \[{h}\], got \({h + 1},\)",
                   **{name: torch.rand(h + 1)})


_HELPER_CASES = [
    ("rms_norm", lambda: torch.ops.rocm_attn.rms_norm(torch.randn(3, 8), torch.ones(7), 1e-6),
     r"rocm_attn\.rms_norm: weight must be \[hidden\] = \[8\] for input \(3, 8\), got \(7,\)"),
    ("rms_norm", lambda: torch.ops.rocm_attn.rms_norm(torch.randn(3, 8), torch.ones(8), -1.0),
     r"rocm_attn\.rms_norm: eps must be a finite number >= 0, got -1\.0"),
    ("rms_norm", lambda: torch.ops.rocm_attn.rms_norm(torch.ones(3, 8, dtype=torch.int32), torch.ones(8), 1e-6),
     r"rocm_attn\.rms_norm: input must be a float32, bfloat16, float16 or float64 tensor, got torch\.int32"),
    ("fp8_quant", lambda: torch.ops.rocm_attn.static_scaled_fp8_quant(torch.randn(3, 8), torch.ones(1), torch.bfloat16),
     r"rocm_attn\.static_scaled_fp8_quant: out_dtype must be an fp8 dtype .* got torch\.bfloat16"),
    ("fp8_quant", lambda: torch.ops.rocm_attn.static_scaled_fp8_quant(torch.randn(3, 8), torch.zeros(1),
                                                                      torch.float8_e4m3fn),
     r"rocm_attn\.static_scaled_fp8_quant: scale must be a positive finite number, got 0\.0"),
]


@pytest.mark.parametrize("i", range(len(_HELPER_CASES)), ids=[f"{c[0]}{i}" for i, c in enumerate(_HELPER_CASES)])
def test_norm_and_quant_helpers_check_their_inputs(i):
    """A NaN-producing eps, a mismatched weight, a non-fp8 target or a zero scale: refused with
    the op's name, not a silent NaN or a torch broadcasting error."""
    _, call, match = _HELPER_CASES[i]
    with pytest.raises(ValueError, match=match):
        call()


def test_qk_norm_writer_refuses_a_negative_eps():
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache

    h, hkv, t = 4, 2, 3
    cache = allocate_kv_cache(KVCacheSpec(16, hkv, D, torch.float32, CacheLayout.LHBNC), 4, "cpu").normal_()
    before = snapshot(cache)
    qkv = torch.randn(t, (h + 2 * hkv) * D)
    with pytest.raises(ValueError, match=r"rocm_attn\.qk_norm_rope_and_cache: eps must be a finite number >= 0, "
                                         r"got -1e-06"):
        torch.ops.rocm_attn.qk_norm_rope_and_cache(
            qkv, torch.ones(D), torch.ones(D), -1e-6, torch.arange(t), torch.randn(16, D), True, cache,
            torch.arange(t), torch.ones(1), torch.ones(1), False, h, hkv, D, torch.empty(t, h, D),
            torch.empty(t, hkv, D))
    assert unchanged(before, cache)
