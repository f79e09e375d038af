"""Kernel-level ops check their index tensors and devices on every call, before writing
(issue 14, items 2-4): each rejected call leaves its outputs and caches byte-identical."""

import re

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



@pytest.mark.parametrize("shape", [(2, 2), (3,), (5,)])
@pytest.mark.parametrize("op", ["rotary_embedding", "rope_and_cache"])
def test_rotary_positions_of_another_token_count_are_named(op, shape):
    # a positions tensor that is not one entry per query token was reported as a bad query
    # ("query (4, 4, 64) must be [num_tokens, ...] with num_tokens = 2"), naming neither it
    # nor its shape
    c = _case()
    q, k, v = c.query.clone(), c.key.clone(), c.value.clone()
    positions = torch.zeros(shape, dtype=torch.int64)
    before = snapshot(q, k, c.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.{op}: positions must be \[num_tokens\], one entry per query "
                                         rf"token \({q.shape[0]}\), got {re.escape(str(shape))}"):
        if op == "rotary_embedding":
            torch.ops.rocm_attn.rotary_embedding(positions, q, k, D, _cos_sin(), True)
        else:
            torch.ops.rocm_attn.rope_and_cache(positions, q, k, v, c.kv_cache, c.slot_mapping, _cos_sin(), True,
                                               c.k_scale, c.v_scale, False)
    assert unchanged(before, q, k, c.kv_cache)

@pytest.mark.parametrize("op", ["rotary_embedding", "rope_and_cache", "qk_norm_rope_and_cache"])
def test_an_empty_cos_sin_table_is_named(op):
    # a table without rows holds no position: the range error read "valid: 0..-1", and a GPU
    # launch without index checks would have read outside it
    c = _case()
    t = c.query.shape[0]
    q, k, v = c.query.clone(), c.key.clone(), c.value.clone()
    qkv = torch.randn(t, (4 + 2 * 2) * D)
    q_out, k_out = torch.full((t, 4, D), 3.0), torch.full((t, 2, D), 3.0)
    positions, table = torch.zeros(t, dtype=torch.int64), _cos_sin(rows=0)
    before = snapshot(q, k, q_out, k_out, c.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.{op}: cos_sin_cache has no rows \(shape \(0, {D}\)\)"):
        if op == "rotary_embedding":
            torch.ops.rocm_attn.rotary_embedding(positions, q, k, D, table, True)
        elif op == "rope_and_cache":
            torch.ops.rocm_attn.rope_and_cache(positions, q, k, v, c.kv_cache, c.slot_mapping, table, True,
                                               c.k_scale, c.v_scale, False)
        else:
            torch.ops.rocm_attn.qk_norm_rope_and_cache(qkv, torch.ones(D), torch.ones(D), 1e-6, positions, table,
                                                       True, c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale, True,
                                                       4, 2, D, q_out, k_out)
    assert unchanged(before, q, k, q_out, k_out, c.kv_cache)


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



def test_encoder_key_head_size_must_be_the_query_s():
    """A key/value of another head size than the query: the reference failed in its einsum
    (a bare RuntimeError naming no op), the Triton kernel reads D channels of each key row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 4, D, generator=g), torch.randn(5, 2, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    with pytest.raises(ValueError, match=r"rocm_attn\.encoder_attention: query \[T, Hq, D\] and key/value "
                                         r"\[T, Hkv, D\] \(one T, one D\) expected, got \(5, 4, 64\), \(5, 2, 32\)"):
        torch.ops.rocm_attn.encoder_attention(q, k, v, torch.tensor([0, 5], dtype=torch.int32), 5, 0.125)

def test_strided_index_tensors_and_channels(monkeypatch):
    c = _case()
    every_other = torch.stack([c.slot_mapping, c.slot_mapping], 1)[:, 0]  # stride 2
    before = snapshot(c.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.reshape_and_cache: slot_mapping must have unit stride along "
                                         r"its last dim"):
        torch.ops.rocm_attn.reshape_and_cache(c.key, c.value, c.kv_cache, every_other, c.k_scale, c.v_scale, False)
    assert unchanged(before, c.kv_cache)
    key_t = c.key.transpose(1, 2).contiguous().transpose(1, 2)  # channels strided
    _attn_rejected(c, r"rocm_attn\.paged_attention: key must have unit stride along head_size", key=key_t)
    # the cache write takes strided channels (its writers read any strides) and writes what a
    # dense key/value writes
    want = c.kv_cache.clone()
    torch.ops.rocm_attn.reshape_and_cache(c.key, c.value, want, c.slot_mapping, c.k_scale, c.v_scale, False)
    torch.ops.rocm_attn.reshape_and_cache(c.key, c.value.transpose(1, 2).contiguous().transpose(1, 2),
                                          c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale, False)
    assert torch.equal(c.kv_cache.view(torch.uint8), want.view(torch.uint8))
    # ... and asks dispatch for a provider that takes strided channels (native does not)
    from inductor_rocm_attn import providers
    asked = []

    def select(op, **call):
        asked.append(call.get("features", ()))
        return real_select(op, **call)

    real_select = providers.select
    monkeypatch.setattr(providers, "select", select)
    torch.ops.rocm_attn.reshape_and_cache(c.key, c.value, want, c.slot_mapping, c.k_scale, c.v_scale, False)
    torch.ops.rocm_attn.reshape_and_cache(c.key.transpose(1, 2).contiguous().transpose(1, 2), c.value,
                                          want, c.slot_mapping, c.k_scale, c.v_scale, False)
    assert asked == [(), ("strided_channels",)]
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


def _gqa_writer_call(op, h, hkv, t=3):
    """``op`` (rope_and_cache or qk_norm_rope_and_cache) over ``h`` query heads and ``hkv`` KV
    heads, with the tensors it would write, so a test can check they stay untouched."""
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache

    g = torch.Generator().manual_seed(0)
    cache = allocate_kv_cache(KVCacheSpec(16, 2, D, torch.float32, CacheLayout.LHBNC), 4, "cpu").normal_(generator=g)
    cos_sin, one, pos, slots = torch.randn(16, D, generator=g), torch.ones(1), torch.arange(t), torch.arange(t)
    if op == "rope_and_cache":
        q, k, v = (torch.randn(t, n * D, generator=g) for n in (h, hkv, hkv))
        k, v = k.view(t, hkv, D), v.view(t, hkv, D)
        return (lambda: torch.ops.rocm_attn.rope_and_cache(pos, q, k, v, cache, slots, cos_sin, True, one, one,
                                                           False)), (q, k, cache)
    qkv = torch.randn(t, (max(h, 0) + 2 * hkv) * D, generator=g)
    q_out, k_out = torch.zeros(t, max(h, 0), D), torch.zeros(t, hkv, D)
    return (lambda: torch.ops.rocm_attn.qk_norm_rope_and_cache(
        qkv, torch.ones(D), torch.ones(D), 1e-6, pos, cos_sin, True, cache, slots, one, one, False, h, hkv, D,
        q_out, k_out)), (q_out, k_out, cache)


@pytest.mark.parametrize("op", ["rope_and_cache", "qk_norm_rope_and_cache"])
@pytest.mark.parametrize("h, hkv, match", [
    (3, 2, "num_heads 3 is not a multiple of num_kv_heads 2"),
    (0, 2, "num_heads and num_kv_heads must be positive ints, got 0 and 2"),
])
def test_writers_refuse_query_heads_not_grouped_over_the_kv_heads(op, h, hkv, match):
    """The q/k writers took any number of query heads: 3 over 2 KV heads rotated q and wrote
    the cache (a layer of that geometry cannot exist), 0 query heads went through. Refused
    before anything is written, as paged_attention refuses them."""
    call, written = _gqa_writer_call(op, h, hkv)
    before = snapshot(*written)
    with pytest.raises(ValueError, match=rf"rocm_attn\.{op}: {match}"):
        call()
    assert unchanged(before, *written)


_BAD_SCALE_DTYPES = [torch.int32, torch.float8_e4m3fn, torch.bfloat16]


def _fp8_writer_calls(scale_name, scale):
    """Each kernel-level writer over an fp8 cache (where the scales are read), with ``scale_name``
    ('k_scale' or 'v_scale') replaced by ``scale``: (op name, call, the tensors it would write)."""
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache

    h, hkv, t = 4, 2, 3
    g = torch.Generator().manual_seed(0)
    cache = allocate_kv_cache(KVCacheSpec(16, hkv, D, torch.float8_e4m3fn, CacheLayout.LHBNC), 4, "cpu")
    cache.view(torch.uint8).fill_(0x7F)
    sc = {"k_scale": torch.ones(1), "v_scale": torch.ones(1), scale_name: scale}
    ks, vs = sc["k_scale"], sc["v_scale"]
    pos, slots, cos_sin = torch.arange(t), torch.arange(t), torch.randn(16, D, generator=g)
    q, k, v = (torch.randn(t, n, D, generator=g) for n in (h, hkv, hkv))
    cos, sin = torch.randn(t, D, generator=g), torch.randn(t, D, generator=g)
    qkv = torch.randn(t, (h + 2 * hkv) * D, generator=g)
    q_out, k_out, w = torch.zeros(t, h, D), torch.zeros(t, hkv, D), torch.ones(D)
    ops = torch.ops.rocm_attn
    return [
        ("reshape_and_cache", lambda: ops.reshape_and_cache(k, v, cache, slots, ks, vs, False), (cache,)),
        ("rope_and_cache", lambda: ops.rope_and_cache(pos, q, k, v, cache, slots, cos_sin, True, ks, vs, False),
         (q, k, cache)),
        ("qk_norm_rope_and_cache", lambda: ops.qk_norm_rope_and_cache(
            qkv, w, w, 1e-6, pos, cos_sin, True, cache, slots, ks, vs, False, h, hkv, D, q_out, k_out),
         (q_out, k_out, cache)),
        ("rope_cos_sin_and_cache", lambda: ops.rope_cos_sin_and_cache(q, k, v, cos, sin, True, cache, slots, ks, vs,
                                                                      False), (q, k, cache)),
        ("qk_norm_rope_cos_sin_and_cache", lambda: ops.qk_norm_rope_cos_sin_and_cache(
            q, k, v, w, w, 1e-6, cos, sin, True, cache, slots, ks, vs, False), (q, k, cache)),
    ]


@pytest.mark.parametrize("dtype", _BAD_SCALE_DTYPES)
@pytest.mark.parametrize("scale_name", ["k_scale", "v_scale"])
def test_writers_refuse_a_scale_that_is_not_float32(scale_name, dtype):
    """A per-tensor scale is a float32 tensor: an int32 or fp8 scale was read by value (the
    native kernels read it through a float pointer), a bf16 one rounded. Refused by every
    writer, before anything is written."""
    for op, call, written in _fp8_writer_calls(scale_name, torch.full((1,), 2.0).to(dtype)):
        before = snapshot(*written)
        with pytest.raises(ValueError, match=rf"rocm_attn\.{op}: {scale_name} must be a float32 tensor \(a "
                                             rf"per-tensor scale\), got {dtype}"):
            call()
        assert unchanged(before, *written), op


@pytest.mark.parametrize("dtype", _BAD_SCALE_DTYPES)
def test_attention_and_quant_refuse_a_scale_that_is_not_float32(dtype):
    c = make_paged_case([1, 3], [20, 5], dtype=torch.float32, cache_dtype=torch.float8_e4m3fn)
    bad = torch.full((1,), 2.0).to(dtype)
    for name in ("k_scale", "v_scale"):
        _attn_rejected(c, rf"rocm_attn\.paged_attention: {name} must be a float32 tensor \(a per-tensor scale\), "
                          rf"got {dtype}", **{name: bad})
    out8 = torch.zeros(c.query.shape, dtype=torch.float8_e4m3fn)
    _attn_rejected(c, rf"rocm_attn\.paged_attention: output_scale must be a float32 tensor", output=out8,
                   output_scale=bad)
    with pytest.raises(ValueError, match=rf"rocm_attn\.static_scaled_fp8_quant: scale must be a float32 tensor \(a "
                                         rf"per-tensor scale\), got {dtype}"):
        torch.ops.rocm_attn.static_scaled_fp8_quant(torch.randn(3, 8), bad, torch.float8_e4m3fn)


# --- dtypes, head sizes and empty steps (audit 2) ----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_readers_refuse_a_cache_of_an_unsupported_dtype(dtype):
    """paged_attention and the QK-norm writer read and write the cache through its dtype: an
    int32 cache was read as values (a wrong result), a float64 one gave NaN. Only a model
    dtype or fp8 is a cache."""
    c = _case()
    cache = torch.zeros(c.kv_cache.shape, dtype=dtype).transpose(0, 1).contiguous().transpose(0, 1)
    match = rf"kv_cache dtype {dtype} is not a supported cache dtype; supported: .* or an fp8 dtype"
    _attn_rejected(c, rf"rocm_attn\.paged_attention: {match}", kv_cache=cache)
    t = c.query.shape[0]
    q_out = torch.full((t, 4, D), 3.0)
    before = snapshot(cache, q_out)
    with pytest.raises(ValueError, match=rf"rocm_attn\.qk_norm_rope_and_cache: {match}"):
        torch.ops.rocm_attn.qk_norm_rope_and_cache(
            torch.randn(t, 8 * D), torch.ones(D), torch.ones(D), 1e-6, torch.arange(t), _cos_sin(), True, cache,
            c.slot_mapping, c.k_scale, c.v_scale, False, 4, 2, D, q_out, torch.empty(t, 2, D))
    assert unchanged(before, cache, q_out)


def test_value_dtype_must_match_the_key():
    """A value of another dtype than key/query reached the kernels (a kernel templated on the
    key's dtype reads it wrong); the encoder op checked only the query's dtype."""
    c = _case()
    _attn_rejected(c, r"rocm_attn\.paged_attention: value dtype torch\.float16 != key dtype torch\.float32",
                   value=c.value.half())
    q, k, v = torch.randn(5, 4, D), torch.randn(5, 2, D), torch.randn(5, 2, D)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    for over, name in ((dict(key=k.half(), value=v.half()), "key"), (dict(value=v.half()), "value")):
        args = dict(query=q, key=k, value=v)
        args.update(over)
        with pytest.raises(ValueError, match=rf"rocm_attn\.encoder_attention: {name} dtype torch\.float16 != "
                                             r"query dtype torch\.float32"):
            torch.ops.rocm_attn.encoder_attention(args["query"], args["key"], args["value"], cu, 5, 0.125)


@pytest.mark.parametrize("op", ["rotary_embedding", "rope_and_cache"])
def test_rope_3d_heads_must_have_head_size_channels(op):
    """A [T, H, D'] query with D' a multiple of head_size was rotated as 2H heads of head_size:
    the wrong channels, silently. A 3-D tensor's last dim is its head size."""
    c = make_paged_case([2, 1], [3, 5], num_heads=2, num_kv_heads=1, head_size=128, dtype=torch.float32)
    q, k, v = c.query.clone(), c.key.clone(), c.value.clone()  # heads of 128 channels
    positions = torch.arange(q.shape[0])
    before = snapshot(q, k, c.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.{op}: query \(3, 2, 128\) must be \[num_tokens, num_heads "
                                         r"\* 64\] \(or \[num_tokens, num_heads, 64\]\)"):
        if op == "rotary_embedding":
            torch.ops.rocm_attn.rotary_embedding(positions, q, k, 64, _cos_sin(), True)
        else:  # head_size comes from value: a value cut as 64-channel heads
            torch.ops.rocm_attn.rope_and_cache(positions, q, k.view(3, 2, 64), v.view(3, 2, 64), c.kv_cache,
                                               c.slot_mapping, _cos_sin(), True, c.k_scale, c.v_scale, False)
    assert unchanged(before, q, k, c.kv_cache)


def test_rope_tables_and_norm_weights_must_be_float():
    """An integer cos/sin table or RMSNorm weight was read as numbers (a wrong rotation or norm)."""
    c = _case()
    t = c.query.shape[0]
    q, k = c.query.clone(), c.key.clone()
    before = snapshot(q, k, c.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.rotary_embedding: cos_sin_cache must be a float32, "
                                         r"bfloat16, float16 or float64 tensor, got torch\.int32"):
        torch.ops.rocm_attn.rotary_embedding(torch.arange(t), q, k, D, torch.ones(32, D, dtype=torch.int32), True)
    qkv = torch.randn(t, 8 * D)
    q_out = torch.full((t, 4, D), 3.0)
    for weight, table, name in ((torch.ones(D, dtype=torch.int32), _cos_sin(), "q_weight"),
                                (torch.ones(D), torch.ones(32, D, dtype=torch.int32), "cos_sin_cache")):
        with pytest.raises(ValueError, match=rf"rocm_attn\.qk_norm_rope_and_cache: {name} must be a float32, "
                                             r"bfloat16, float16 or float64 tensor, got torch\.int32"):
            torch.ops.rocm_attn.qk_norm_rope_and_cache(
                qkv, weight, torch.ones(D), 1e-6, torch.arange(t), table, True, c.kv_cache, c.slot_mapping,
                c.k_scale, c.v_scale, False, 4, 2, D, q_out, torch.empty(t, 2, D))
    w = torch.ones(D, dtype=torch.int32)
    cos = torch.randn(t, D)
    with pytest.raises(ValueError, match=r"rocm_attn\.qk_norm_rope_cos_sin_and_cache: q_weight must be a float32"):
        torch.ops.rocm_attn.qk_norm_rope_cos_sin_and_cache(q, k, c.value, w, w, 1e-6, cos, cos, True, c.kv_cache,
                                                           c.slot_mapping, c.k_scale, c.v_scale)
    assert unchanged(before, q, k, c.kv_cache, q_out)


def test_writers_of_a_step_without_tokens_do_nothing():
    """T = 0: every writer and RoPE op returns without writing (their checks indexed token 0,
    and the CPU kernels could not infer the head count of an empty tensor)."""
    c = _case()
    q, k, v = torch.empty(0, 4, D), torch.empty(0, 2, D), torch.empty(0, 2, D)
    pos, slots, cos = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), torch.empty(0, D)
    w = torch.ones(D)
    before = snapshot(c.kv_cache)
    ops = torch.ops.rocm_attn
    ops.rotary_embedding(pos, q, k, D, _cos_sin(), True)
    ops.rotary_embedding(pos, q.view(0, 4 * D), None, D, _cos_sin(), False)
    ops.rope_and_cache(pos, q, k, v, c.kv_cache, slots, _cos_sin(), True, c.k_scale, c.v_scale, False)
    ops.rope_cos_sin_and_cache(q, k, v, cos, cos, True, c.kv_cache, slots, c.k_scale, c.v_scale)
    ops.qk_norm_rope_cos_sin_and_cache(q, k, v, w, w, 1e-6, cos, cos, True, c.kv_cache, slots, c.k_scale, c.v_scale)
    assert unchanged(before, c.kv_cache)


def test_qk_norm_writer_checks_the_devices_of_cache_scales_and_outputs():
    """The QK-norm writer checked qkv, weights, positions and table together, but not the
    cache, scales and output buffers: on a GPU a host k_scale or cache reached the kernel.
    (On this CPU machine meta stands for the other device; the implementation is called
    directly, as the dispatcher would call it for CUDA tensors mixed with host ones.)"""
    from inductor_rocm_attn import ops

    c = _case()
    t = c.query.shape[0]
    q_out = torch.full((t, 4, D), 3.0)
    before = snapshot(c.kv_cache, q_out)
    for name in ("k_scale", "q_out"):
        args = dict(k_scale=c.k_scale, q_out=q_out)
        args[name] = args[name].to("meta")
        with pytest.raises(ValueError, match=rf"rocm_attn\.qk_norm_rope_and_cache: all tensors must be on one "
                                             rf"device, got .*{name} on meta"):
            ops._qk_norm_rope_and_cache(
                torch.randn(t, 8 * D), torch.ones(D), torch.ones(D), 1e-6, torch.arange(t), _cos_sin(), True,
                c.kv_cache, c.slot_mapping, args["k_scale"], c.v_scale, False, 4, 2, D, args["q_out"],
                torch.empty(t, 2, D))
    assert unchanged(before, c.kv_cache, q_out)


# --- strides, aliasing and scale shapes (audit 4) ----------------------------------------------


def test_qk_norm_writers_refuse_strided_norm_weights():
    """The Triton QK-norm kernels read weight channel d at offset d: a strided q_weight /
    k_weight (a column of a stacked [D, 2] q/k weight) gave them other channels' weights
    (measured in the interpreter: q off by up to 17, the cached K with it) while the reference
    honoured the strides. Refused on both writers, naming the fix."""
    c = _case()
    t = c.query.shape[0]
    stacked = torch.randn(D, 2)
    w = stacked[:, 0]  # stride 2
    q, k = c.query.clone(), c.key.clone()
    q_out = torch.full((t, 4, D), 3.0)
    before = snapshot(q, k, q_out, c.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.qk_norm_rope_and_cache: q_weight must be contiguous \(the "
                                         r"kernels read channel d at offset d\), got stride 2; pass "
                                         r"q_weight\.contiguous\(\)"):
        torch.ops.rocm_attn.qk_norm_rope_and_cache(
            torch.randn(t, 8 * D), w, torch.ones(D), 1e-6, torch.arange(t), _cos_sin(), True, c.kv_cache,
            c.slot_mapping, c.k_scale, c.v_scale, False, 4, 2, D, q_out, torch.empty(t, 2, D))
    cos = torch.randn(t, D)
    with pytest.raises(ValueError, match=r"rocm_attn\.qk_norm_rope_cos_sin_and_cache: k_weight must be contiguous"):
        torch.ops.rocm_attn.qk_norm_rope_cos_sin_and_cache(q, k, c.value, torch.ones(D), w, 1e-6, cos, cos, True,
                                                           c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale)
    assert unchanged(before, q, k, q_out, c.kv_cache)


def test_written_tensors_must_not_be_expanded():
    """An expanded (stride-0) output or in-place tensor: the Triton kernels wrote every row into
    the one memory row (the last won, silently); the reference raised torch's internal-overlap
    error without the op's name. Refused up front, naming the op and the tensor."""
    c = _case()
    t = c.query.shape[0]
    row = torch.full((1, 4, D), 3.0)
    before = snapshot(row, c.kv_cache)
    _attn_rejected(c, r"rocm_attn\.paged_attention: output is an expanded view \(strides \(0, 64, 1\)\): its rows "
                      r"share memory and each is written; pass a tensor of its own \(output\.clone\(\)\)",
                   output=row.expand(t, 4, D))
    with pytest.raises(ValueError, match=r"rocm_attn\.rotary_embedding: query is an expanded view"):
        torch.ops.rocm_attn.rotary_embedding(torch.arange(t), row.expand(t, 4, D), None, D, _cos_sin(), True)
    with pytest.raises(ValueError, match=r"rocm_attn\.qk_norm_rope_and_cache: q_out is an expanded view"):
        torch.ops.rocm_attn.qk_norm_rope_and_cache(
            torch.randn(t, 8 * D), torch.ones(D), torch.ones(D), 1e-6, torch.arange(t), _cos_sin(), True,
            c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale, False, 4, 2, D, row.expand(t, 4, D),
            torch.empty(t, 2, D))
    assert unchanged(before, row, c.kv_cache)


def test_written_tensor_passed_twice():
    """The same tensor as an in-place/output argument and another argument: the result depended
    on the provider's order (rotary key=query: rotated twice, the reference and Triton off by 19
    and 27; rope writers value=key: the reference cached the rotated key as V, Triton's
    rope_and_cache the unrotated one; paged output=key: Triton's row tiles overwrote keys other
    tiles still read). Refused; output=query stays allowed (each tile reads its rows first)."""
    c = make_paged_case([1, 40, 2], [20, 5, 0], num_heads=2, num_kv_heads=2, dtype=torch.float32)
    t = c.query.shape[0]
    q, k = c.query.clone(), c.key.clone()
    before = snapshot(q, k, c.kv_cache)
    ops = torch.ops.rocm_attn
    with pytest.raises(ValueError, match=r"rocm_attn\.rotary_embedding: query and key are the same memory \(the op "
                                         r"writes query while it reads key\); pass separate tensors"):
        ops.rotary_embedding(torch.arange(t), q, q, D, _cos_sin(64), True)
    with pytest.raises(ValueError, match=r"rocm_attn\.rope_and_cache: key and value are the same memory"):
        ops.rope_and_cache(torch.arange(t), q, k, k, c.kv_cache, c.slot_mapping, _cos_sin(64), True, c.k_scale,
                           c.v_scale, False)
    cos = torch.randn(t, D)
    with pytest.raises(ValueError, match=r"rocm_attn\.rope_cos_sin_and_cache: key and value are the same memory"):
        ops.rope_cos_sin_and_cache(q, k, k, cos, cos, True, c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale)
    q_out = torch.full((t, 2, D), 3.0)
    with pytest.raises(ValueError, match=r"rocm_attn\.qk_norm_rope_and_cache: q_out and k_out are the same memory"):
        ops.qk_norm_rope_and_cache(torch.randn(t, 6 * D), torch.ones(D), torch.ones(D), 1e-6, torch.arange(t),
                                   _cos_sin(64), True, c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale, False, 2, 2,
                                   D, q_out, q_out)
    assert unchanged(before, q, k, c.kv_cache)
    out = c.key.clone()
    _attn_rejected(c, r"rocm_attn\.paged_attention: output and key are the same memory", output=out, key=out)
    want = poison(torch.empty_like(c.query))
    ops.paged_attention(**_attn_args(c, output=want))
    ops.paged_attention(**_attn_args(c, output=q, query=q))  # in place over the query: allowed
    assert torch.equal(q, want)


def test_per_tensor_scales_are_0d_or_1d():
    """A one-element scale of more dims broadcast: static_scaled_fp8_quant of a [3, 8] input with
    a [1, 1, 1] scale returned a [1, 3, 8] tensor, and the reference paged_attention raised a
    bare torch IndexError on a [1, 1, 1, 1, 1] k_scale. Shape () or (1,) only."""
    with pytest.raises(ValueError, match=r"rocm_attn\.static_scaled_fp8_quant: scale must be a per-tensor scale \(1 "
                                         r"element, shape \(\) or \(1,\)\), got shape \(1, 1, 1\)"):
        torch.ops.rocm_attn.static_scaled_fp8_quant(torch.randn(3, 8), torch.ones(1, 1, 1), torch.float8_e4m3fn)
    assert torch.ops.rocm_attn.static_scaled_fp8_quant(torch.randn(3, 8), torch.tensor(2.0),
                                                       torch.float8_e4m3fn).shape == (3, 8)
    c = make_paged_case([1, 3], [20, 5], dtype=torch.float32, cache_dtype=torch.float8_e4m3fn)
    _attn_rejected(c, r"rocm_attn\.paged_attention: k_scale must be a per-tensor scale", k_scale=torch.ones(1, 1, 1, 1, 1))


@pytest.mark.parametrize("shape", [(4, 16, 128), (4, 2, 16, 128, 1)])
def test_paged_attention_cache_of_another_rank_names_the_op(shape):
    """A decode call (key None) read the head count from kv_cache.shape[3] before the cache
    was checked: a 3-D cache raised a bare IndexError; the shape error named no op."""
    c = _case()
    _attn_rejected(c, r"rocm_attn\.paged_attention: kv_cache must have logical shape", exc=ValueError,
                   key=None, value=None, kv_cache=torch.zeros(shape))


def test_paged_attention_refuses_a_value_without_its_key():
    """key None means every key and value comes from the cache: a value passed with it was
    ignored silently."""
    c = _case()
    _attn_rejected(c, r"rocm_attn\.paged_attention: value is given but key is None", key=None)


def test_sequence_hint_error_says_what_the_hint_plans():
    c = make_paged_case([1, 3], [20, 5], dtype=torch.float32)
    _attn_rejected(c, r"max_seq_len 4 is smaller than the longest sequence .*the launch plans its KV splits",
                   max_seq_len=4)


def test_qk_norm_writer_refuses_a_table_without_rotary_channels():
    """A cos_sin_cache of width 0 skipped the rotation silently (rotary_embedding refuses it)."""
    c = _case()
    t = c.query.shape[0]
    qkv = torch.randn(t, (4 + 2 * 2) * D)
    q_out, k_out = torch.full((t, 4, D), 3.0), torch.full((t, 2, D), 3.0)
    before = snapshot(q_out, k_out, c.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.qk_norm_rope_and_cache: cos_sin_cache must be \[max_position, "
                                         r"rot_dim\] with an even rot_dim in \(0, 64\], got \(64, 0\)"):
        torch.ops.rocm_attn.qk_norm_rope_and_cache(qkv, torch.ones(D), torch.ones(D), 1e-6, torch.arange(t),
                                                   torch.zeros(64, 0), True, c.kv_cache, c.slot_mapping, c.k_scale,
                                                   c.v_scale, True, 4, 2, D, q_out, k_out)
    assert unchanged(before, q_out, k_out, c.kv_cache)


def test_a_tensor_at_the_cache_s_address_is_refused():
    """The same-memory check compared a written tensor with the op's other tensors but not the
    KV cache: an output, a rotated q/k or a key starting at the cache's address was taken, and
    the op wrote the cache while it read it (or wrote the output into it)."""
    c = make_paged_case([1, 3, 2], [20, 5, 0], num_heads=2, num_kv_heads=2, dtype=torch.float32)
    t = c.query.shape[0]
    ops = torch.ops.rocm_attn
    alias = c.kv_cache.as_strided((t, 2, D), (2 * D, D, 1))  # starts where the cache starts
    assert alias.data_ptr() == c.kv_cache.data_ptr()
    same = r"(kv_cache and \w+|\w+ and kv_cache) are the same memory"
    cos = torch.randn(t, D)
    calls = {
        "reshape_and_cache": lambda: ops.reshape_and_cache(alias, c.value, c.kv_cache, c.slot_mapping, c.k_scale,
                                                           c.v_scale),
        "rope_and_cache": lambda: ops.rope_and_cache(torch.arange(t), alias, c.key.clone(), c.value, c.kv_cache,
                                                     c.slot_mapping, _cos_sin(64), True, c.k_scale, c.v_scale, False),
        "rope_cos_sin_and_cache": lambda: ops.rope_cos_sin_and_cache(c.query.clone(), c.key.clone(), alias, cos, cos,
                                                                     True, c.kv_cache, c.slot_mapping, c.k_scale,
                                                                     c.v_scale),
        "qk_norm_rope_and_cache": lambda: ops.qk_norm_rope_and_cache(
            torch.randn(t, 6 * D), torch.ones(D), torch.ones(D), 1e-6, torch.arange(t), _cos_sin(64), True,
            c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale, False, 2, 2, D, alias, torch.empty(t, 2, D)),
    }
    for name, call in calls.items():
        before = snapshot(c.kv_cache)
        with pytest.raises(ValueError, match=rf"rocm_attn\.{name}: {same}"):
            call()
        assert unchanged(before, c.kv_cache), name
    _attn_rejected(c, rf"rocm_attn\.paged_attention: {same}", output=alias)


def test_rope_and_cache_value_that_is_not_heads_is_named():
    c = _case()
    t = c.query.shape[0]
    before = snapshot(c.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.rope_and_cache: value must be \[num_tokens, num_kv_heads, "
                                         r"head_size\], got \(\)"):
        torch.ops.rocm_attn.rope_and_cache(torch.zeros(t, dtype=torch.long), c.query, c.key, torch.tensor(1.0),
                                           c.kv_cache, c.slot_mapping, torch.randn(8, D), True, c.k_scale, c.v_scale)
    assert unchanged(before, c.kv_cache)
