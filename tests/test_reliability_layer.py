"""The layer path checks every call, before anything is written (issue 14, items 2-4 and 6).

Each test runs a valid first step, then a bad second step (the same call signature, so a
check made only on a signature's first call would miss it), and asserts a clear error and a
KV cache byte-identical to before the call.
"""

import contextlib
import dataclasses
import re
import warnings

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn.layout import cache_layout_of

from reliability_steps import BS, D, H, HKV, NUM_BLOCKS, qkv, run_layer_ops, snapshot, stepped_layer, unchanged


def _rejected(s, md, match, exc=(ValueError, IndexError)):
    """Run the next step with ``md`` through ``Attention.forward``: it must raise and write nothing."""
    before = snapshot(s.layer.kv_cache)
    q, k, v = qkv(s.num_tokens, s.g)
    with pytest.raises(exc, match=match), ira.set_forward_context(md):
        s.layer(q, k, v)
    assert unchanged(before, s.layer.kv_cache), "a rejected call wrote the cache"


def _replace(md, **fields):
    return dataclasses.replace(md, **fields)


def test_valid_second_step_runs():
    s = stepped_layer()
    q, k, v = qkv(s.num_tokens, s.g)
    with ira.set_forward_context(s.md):
        out = s.layer(q, k, v)
    assert out.shape == (s.num_tokens, H * D) and torch.isfinite(out).all()


def test_slot_outside_the_cache_on_a_later_step():
    s = stepped_layer()
    bad = NUM_BLOCKS * BS + 5
    s.md.slot_mapping[1] = bad
    _rejected(s, s.md, rf"rocm_attn\.unified_kv_cache_update: slot_mapping entry {bad} .*outside the cache "
                       rf"\({NUM_BLOCKS} blocks x {BS} = {NUM_BLOCKS * BS} slots")


def test_negative_block_id_is_an_error_not_a_wrap_around():
    s = stepped_layer()
    s.md.block_table[0, 0] = -1  # sequence 'a' (a decode) reads block 0 of its table
    _rejected(s, s.md, r"rocm_attn\.unified_kv_cache_update: block_table\[0, 0\] = -1 is outside the cache "
                       rf"\(valid block ids: 0\.\.{NUM_BLOCKS - 1}\)")


def test_block_id_past_the_cache():
    s = stepped_layer()
    s.md.block_table[1, 0] = NUM_BLOCKS
    _rejected(s, s.md, rf"block_table\[1, 0\] = {NUM_BLOCKS} is outside the cache")


def test_seq_lens_shorter_than_the_query_is_rejected_before_the_write():
    s = stepped_layer()
    s.md.seq_lens[1] = 2  # 'b' has 3 new tokens
    _rejected(s, s.md, r"rocm_attn\.unified_kv_cache_update: seq_lens\[1\] = 2 is smaller than that "
                       r"sequence's query length 3")


def test_query_start_loc_not_monotonic():
    s = stepped_layer()
    s.md.query_start_loc.copy_(torch.tensor([0, 4, 1, 6]))
    _rejected(s, s.md, r"rocm_attn\.unified_kv_cache_update: query_start_loc must start at 0 and never "
                       r"decrease, got \[0, 4, 1, 6\]")


def test_query_start_loc_past_the_tokens():
    s = stepped_layer()
    s.md.query_start_loc[-1] = s.num_tokens + 3
    _rejected(s, s.md, r"rocm_attn\.unified_kv_cache_update: query_start_loc\[-1\] = 9 runs past the 6 query "
                       r"tokens")


def test_slot_mapping_must_follow_the_block_table():
    # A slot inside the cache but in another sequence's block: the write would overwrite
    # that sequence's token.
    s = stepped_layer()
    other = s.tables[0][0] * BS + 3  # a token of 'a'
    s.md.slot_mapping[4] = other  # the first token of 'c'
    _rejected(s, s.md, rf"slot_mapping\[4\] = {other} but token 4 \(sequence 2, position 0\) belongs in slot "
                       rf"{s.tables[2][0] * BS}")


def test_metadata_for_another_block_size():
    s = stepped_layer()
    md = ira.build_attention_metadata(s.query_lens, s.context_lens, [t + t for t in s.tables], 32)
    _rejected(s, md, r"rocm_attn\.unified_kv_cache_update: metadata built for block_size 32, but the "
                     r"layer's KV cache has block_size 16; build the step's metadata with block_size=16")


@pytest.mark.parametrize("hint", ["max_query_len", "max_seq_len"])
def test_launch_hints_below_the_actual_lengths(hint):
    s = stepped_layer()
    actual = getattr(s.md, hint)
    _rejected(s, _replace(s.md, **{hint: actual - 1}),
              rf"rocm_attn\.unified_kv_cache_update: {hint} {actual - 1} is smaller than .*{actual}")


def test_num_actual_tokens_must_match_the_sequences():
    s = stepped_layer()
    _rejected(s, _replace(s.md, num_actual_tokens=4), r"num_actual_tokens 4 != query_start_loc\[-1\] = 6")


def test_metadata_on_another_device_than_the_cache():
    s = stepped_layer()
    md = ira.build_attention_metadata(s.query_lens, s.context_lens, s.tables, BS, "meta")
    _rejected(s, md, r"rocm_attn\.unified_kv_cache_update: metadata tensor query_start_loc is on meta but the "
                     r"KV cache is on cpu")


@pytest.mark.parametrize("which", ["query", "value"])
def test_query_or_value_on_another_device_than_the_key(which):
    s = stepped_layer()
    before = snapshot(s.layer.kv_cache)
    q, k, v = qkv(s.num_tokens, s.g)
    if which == "query":
        q = q.to("meta")
    else:
        v = v.to("meta")
    with pytest.raises(ValueError, match=rf"Attention 'rel\.\d+': {which} is on meta but key is on cpu"), \
            ira.set_forward_context(s.md):
        s.layer(q, k, v)
    assert unchanged(before, s.layer.kv_cache)


def test_query_dtype_differs_from_key():
    s = stepped_layer()
    before = snapshot(s.layer.kv_cache)
    q, k, v = qkv(s.num_tokens, s.g)
    with pytest.raises(ValueError, match=r"query dtype torch.float16 != key dtype torch.float32"), \
            ira.set_forward_context(s.md):
        s.layer(q.half(), k, v)
    assert unchanged(before, s.layer.kv_cache)


def test_query_width_mismatch_is_clear():
    s = stepped_layer()
    q, k, v = qkv(s.num_tokens, s.g)
    with pytest.raises(ValueError, match=rf"query must be \[num_tokens, {H} \* {D}\] or \[num_tokens, {H}, {D}\], "
                                         r"got \(6, 200\)"), ira.set_forward_context(s.md):
        s.layer(q[:, :200], k, v)


@pytest.mark.parametrize("shape", ["transposed", "heads_as_rows", "flat"])
def test_key_value_with_the_right_numel_but_other_rows_are_rejected(shape):
    """A key/value whose element count matches [T, Hkv * D] but whose rows are not the tokens
    ([Hkv * D, T], [T * Hkv, D], 1-D) was viewed as [T, Hkv, D] and cached as garbage."""
    s = stepped_layer()
    t = s.num_tokens
    q, k, v = qkv(t, s.g)
    bad = {"transposed": lambda x: x.T.contiguous(), "heads_as_rows": lambda x: x.reshape(t * HKV, D),
           "flat": lambda x: x.reshape(-1)}[shape]
    before = snapshot(s.layer.kv_cache)
    with pytest.raises(ValueError, match=rf"Attention 'rel\.\d+': key and value must be \[{t} \(the query's "
                                         rf"tokens\), {HKV} \* {D}\]"), ira.set_forward_context(s.md):
        s.layer(q, bad(k), bad(v))
    assert unchanged(before, s.layer.kv_cache)
    # The layer-level ops, called directly, refuse them too.
    out = torch.full((t, H, D), 7.0)
    before = snapshot(out, s.layer.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_kv_cache_update: key must be \[num_tokens, {HKV} "
                                         rf"\* {D}\]"), ira.set_forward_context(s.md):
        torch.ops.rocm_attn.unified_kv_cache_update(bad(k), bad(v), s.layer.layer_name)
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_attention_with_output: query must be "
                                         rf"\[num_tokens, {H} \* {D}\]"), ira.set_forward_context(s.md):
        torch.ops.rocm_attn.unified_attention_with_output(q.T.contiguous(), k.view(t, HKV, D), v.view(t, HKV, D),
                                                          out.view(t, H * D), s.layer.layer_name, None)
    assert unchanged(before, out, s.layer.kv_cache)


def test_layer_without_a_bound_cache():
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name="rel.unbound")
    md = ira.build_attention_metadata([3], [0], [[0]], BS)
    with pytest.raises(RuntimeError, match=r"rocm_attn\.unified_kv_cache_update: layer 'rel\.unbound' has no KV "
                                           r"cache bound: call inductor_rocm_attn\.bind_kv_caches\(model, "
                                           r"num_blocks, dtype, device\)"), ira.set_forward_context(md):
        layer(*qkv(3, torch.Generator().manual_seed(0)))



@pytest.mark.parametrize("value", [None, [0.0], "cache"])
def test_a_kv_cache_that_is_not_a_tensor_is_refused_when_assigned(value):
    # taken, then every call of the layer failed with "'NoneType' object has no attribute 'shape'"
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"rel.not_a_tensor.{type(value).__name__}")
    bound = layer.kv_cache
    with pytest.raises(TypeError, match=rf"Attention 'rel\.not_a_tensor\.\w+': kv_cache must be a tensor \(a cache "
                                        rf"from bind_kv_caches or allocate_kv_cache\), got {type(value).__name__}"):
        layer.kv_cache = value
    assert layer.kv_cache is bound


def test_a_bound_cache_of_another_rank_is_named_as_such():
    # a cache of another rank was reported as no cache at all ("has no KV cache bound")
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name="rel.rank3")
    layer.kv_cache = torch.zeros(NUM_BLOCKS, 2, BS * HKV * D)
    before = snapshot(layer.kv_cache)
    md = ira.build_attention_metadata([3], [0], [[0]], BS)
    with pytest.raises(ValueError, match=r"rocm_attn\.unified_kv_cache_update: layer 'rel\.rank3' has a KV cache of "
                                         r"shape \(8, 2, 2048\); a cache has the logical shape \[num_blocks, 2, "
                                         r"block_size, num_kv_heads \* head_size\]"), ira.set_forward_context(md):
        layer(*qkv(3, torch.Generator().manual_seed(0)))
    assert unchanged(before, layer.kv_cache)

def test_each_layer_op_checks_the_metadata_alone():
    # Called by hand, the attention op (no cache update before it) checks the step too, and
    # leaves its output untouched.
    s = stepped_layer()
    s.md.seq_lens[2] = 1
    q, k, v = qkv(s.num_tokens, s.g)
    out = torch.full((s.num_tokens, H, D), 7.0)
    before = snapshot(out, s.layer.kv_cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.unified_attention_with_output: seq_lens\[2\] = 1"), \
            ira.set_forward_context(s.md):
        torch.ops.rocm_attn.unified_attention_with_output(q.view(-1, H, D), k.view(-1, HKV, D),
                                                          v.view(-1, HKV, D), out, s.layer.layer_name, None)
    assert unchanged(before, out, s.layer.kv_cache)


def test_bad_metadata_through_both_ops_leaves_cache_and_output():
    s = stepped_layer()
    s.md.block_table[2, 0] = 99
    q, k, v = qkv(s.num_tokens, s.g)
    out = torch.full((s.num_tokens, H, D), 7.0)
    before = snapshot(out, s.layer.kv_cache)
    with pytest.raises(IndexError, match=r"block_table\[2, 0\] = 99"):
        run_layer_ops(s.layer, s.md, q, k, v, out)
    assert unchanged(before, out, s.layer.kv_cache)


# --- profiling run: deliberate, never an accident -------------------------------------------


def test_layer_outside_a_forward_context_is_an_error():
    s = stepped_layer()
    before = snapshot(s.layer.kv_cache)
    with pytest.raises(RuntimeError, match=r"rocm_attn\.unified_kv_cache_update \(layer 'rel\.\d+'\): called "
                                           r"outside a forward context.*set_forward_context\(metadata\).*"
                                           r"profiling_run\(\)"):
        s.layer(*qkv(3, s.g))
    assert unchanged(before, s.layer.kv_cache)


def test_metadata_none_needs_profiling_true():
    with pytest.raises(ValueError, match=r"set_forward_context: attn_metadata is None.*profiling=True"):
        with ira.set_forward_context(None):
            pass
    md = ira.build_attention_metadata([1], [0], [[0]], BS)
    with pytest.raises(ValueError, match="profiling=True with metadata"):
        with ira.set_forward_context(md, profiling=True):
            pass
    with pytest.raises(TypeError, match=r"set_forward_context: attn_metadata must be an AttentionMetadata"):
        with ira.set_forward_context({"slot_mapping": None}):
            pass


@pytest.mark.parametrize("enter", ["profiling_run", "set_forward_context"])
def test_profiling_run_is_deliberate_and_writes_nothing(enter):
    s = stepped_layer()
    before = snapshot(s.layer.kv_cache)
    ctx = ira.profiling_run() if enter == "profiling_run" else ira.set_forward_context(None, profiling=True)
    with ctx as fc:
        assert fc.profiling and fc.attn_metadata is None
        out = s.layer(*qkv(5, s.g))
    assert torch.count_nonzero(out) == 0
    assert unchanged(before, s.layer.kv_cache)


@pytest.mark.parametrize("shape", [(99, 1, 1), (5, H, D + 1), (4, H * D)])
def test_profiling_run_output_of_another_shape_is_refused(shape):
    """The op's profiling run zero-fills ``output``: one that is not the query's shape is
    refused (it was zero-filled whatever its shape), and is left as it was."""
    s = stepped_layer()
    q, k, v = (x.view(5, -1, D) for x in qkv(5, s.g))
    output = torch.full(shape, 7.0)
    with ira.profiling_run(), pytest.raises(ValueError, match=r"rocm_attn\.unified_attention_with_output: "
                                                              r"(query and output must be|output must be)"):
        torch.ops.rocm_attn.unified_attention_with_output(q, k, v, output, s.layer.layer_name)
    assert (output == 7.0).all()


def test_a_field_set_anew_is_checked_again():
    # The step's checks are memoized on the metadata object; assigning a field drops them.
    s = stepped_layer()
    q, k, v = qkv(s.num_tokens, s.g)
    with ira.set_forward_context(s.md):
        s.layer(q, k, v)
    bad = s.md.slot_mapping.clone()
    bad[0] = NUM_BLOCKS * BS
    s.md.slot_mapping = bad
    _rejected(s, s.md, rf"slot_mapping entry {NUM_BLOCKS * BS} \(token 0\) is outside the cache")


def test_builder_plan_is_checked_without_reading_tensors(monkeypatch):
    # What a GPU step relies on (the index tensors are not read there): the builder's bounds.
    from inductor_rocm_attn import step_checks

    monkeypatch.setattr(step_checks, "index_checks_on", lambda device: False)
    s = stepped_layer()
    small = ira.Attention(H, D, num_kv_heads=HKV, layer_name="rel.small_cache")
    ira.bind_kv_caches(small, 2, torch.float32)  # the step uses block ids up to 7
    q, k, v = qkv(s.num_tokens, s.g)
    before = snapshot(small.kv_cache)
    max_block = max(b for t in s.tables for b in t)
    with pytest.raises(IndexError, match=rf"rocm_attn\.unified_kv_cache_update: the step uses block id {max_block} "
                                         r"but the KV cache has 2 blocks"), ira.set_forward_context(s.md):
        small(q, k, v)
    assert unchanged(before, small.kv_cache)
    for hint in ("max_query_len", "max_seq_len"):
        _rejected(s, _replace(s.md, **{hint: 1}), rf"{hint} 1 is smaller than the longest")
    _rejected(s, _replace(s.md, num_actual_tokens=5), r"num_actual_tokens 5 != query_start_loc\[-1\] = 6")
    # Swapped index tensors are not taken on the builder's word (checked with the opt-in only).
    assert not step_checks._plan_holds(_replace(s.md, slot_mapping=s.md.slot_mapping.clone()))


# --- what a call skips because another check of the same step or call made it ---------------


def test_strided_query_channels_are_rejected_before_the_write():
    # Attention.forward checks the query's channel stride itself, so the attention op after
    # the cache update can skip it; the cache is then untouched.
    s = stepped_layer()
    before = snapshot(s.layer.kv_cache)
    q, k, v = qkv(s.num_tokens, s.g)
    q = torch.stack([q.view(-1, H, D)] * 2, dim=-1)[..., 0]  # [T, H, D] with channel stride 2
    with pytest.raises(ValueError, match=r"Attention 'rel\.\d+': query must have unit stride along head_size"), \
            ira.set_forward_context(s.md):
        s.layer(q, k, v)
    assert unchanged(before, s.layer.kv_cache)


def test_direct_attention_call_after_a_forward_checks_its_output(monkeypatch):
    # What Attention.forward hands its attention op is taken by that op alone: the ops
    # called by hand afterwards check the query and output again.
    from inductor_rocm_attn import step_checks

    s = stepped_layer()
    q, k, v = qkv(s.num_tokens, s.g)
    calls = []
    check = step_checks.check_layer_query
    monkeypatch.setattr(step_checks, "check_layer_query", lambda *a: calls.append(a) or check(*a))
    with ira.set_forward_context(s.md):
        s.layer(q, k, v)
    assert not calls, "the attention of Attention.forward checked again what forward checked"
    assert s.layer.impl._forward_made is None and s.layer.impl._just_written is None
    for out, match in ((torch.full((s.num_tokens, H, D + 1), 7.0), r"query and output must be \[num_tokens, "
                        rf"num_heads, head_size\] = \[{s.num_tokens}, {H}, {D}\]"),
                       (torch.full((s.num_tokens, H, 2 * D), 7.0)[..., ::2], "output must have unit stride")):
        before = snapshot(out)
        with pytest.raises(ValueError, match=rf"rocm_attn\.unified_attention_with_output: {match}"):
            run_layer_ops(s.layer, s.md, q, k, v, out)
        assert unchanged(before, out)
    assert len(calls) == 2


def test_builder_tensors_swapped_for_views_are_checked_in_full(monkeypatch):
    # The layers skip the per-tensor checks for the builder's own tensor objects only: a view
    # at the same address (which the builder's bounds still cover) is checked in full.
    from inductor_rocm_attn import step_checks

    monkeypatch.setattr(step_checks, "index_checks_on", lambda device: False)
    s = stepped_layer()
    assert step_checks._builder_tensors(s.md, s.md.plan)
    md = _replace(s.md, block_table=s.md.block_table.view(torch.float32))
    assert step_checks._plan_holds(md) and not step_checks._builder_tensors(md, md.plan)
    _rejected(s, md, r"rocm_attn\.unified_kv_cache_update: metadata block_table has dtype torch\.float32")
    _rejected(s, _replace(s.md, slot_mapping=s.md.slot_mapping[:2]),
              r"metadata slot_mapping and positions must be 1-D with one entry per token, got \(2,\) and \(6,\)")
    _rejected(s, _replace(s.md, max_seq_len="32"), r"metadata max_seq_len must be an int >= 0, got '32'")


def test_builder_checks_the_tensors_it_hands_the_layers():
    # The layer-independent checks of the index tensors run once, in the builder: buffers
    # replaced by hand are rejected there.
    buffers = ira.MetadataBuffers(4, 16, 4, "cpu")
    buffers.slot_mapping = torch.full((32,), -1, dtype=torch.int64)[::2]
    with pytest.raises(ValueError, match=r"build_attention_metadata: slot_mapping must have unit stride"):
        ira.build_attention_metadata([2], [0], [[0]], BS, buffers=buffers)


def test_fused_rope_layer_op_checks_query_rows_against_key_on_every_call():
    # The fused RoPE + cache-write layer op compared the query's token count with itself: after
    # a first call of a signature (the full check), a query with more rows than key/value
    # reached the kernel (which reads key rows past the end).
    s = stepped_layer()
    t = s.num_tokens
    cos_sin = torch.randn(64, D, generator=s.g)
    q, k, v = (x.view(t, -1, D) for x in qkv(t, s.g))

    def rope(query, positions):
        with ira.set_forward_context(s.md):
            torch.ops.rocm_attn.unified_rope_and_kv_cache_update(positions, query, k.clone(), v, cos_sin, True,
                                                                 s.layer.layer_name)

    rope(q.clone(), s.md.positions)  # the signature's first call: validated in full
    big = torch.randn(t + 1, H, D, generator=s.g)
    positions = torch.cat([s.md.positions, s.md.positions[-1:]])
    before = snapshot(big, s.layer.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_rope_and_kv_cache_update: query "
                                         rf"\(\({t + 1}, {H}, {D}\), .*must match key \(\({t}, {HKV}, {D}\)"):
        rope(big, positions)
    assert unchanged(before, big, s.layer.kv_cache)


_ROPE_TABLE_CASES = {
    "positions float": (lambda p, cs: (p.float(), cs), r"positions has dtype torch\.float32"),
    "positions 2-D": (lambda p, cs: (p[:, None], cs), r"positions must be \[num_tokens\]"),
    "cos_sin_cache int": (lambda p, cs: (p, cs.int()), r"cos_sin_cache must be a float32, .* got torch\.int32"),
    "cos_sin_cache strided": (lambda p, cs: (p, torch.cat([cs, cs], 1)[:, ::2]),
                              r"cos_sin_cache must have unit stride along its last dim"),
}


@pytest.mark.parametrize("case", list(_ROPE_TABLE_CASES))
def test_fused_rope_layer_op_checks_positions_and_table_on_every_call(case):
    # positions' and cos_sin_cache's dtype and layout were checked on a signature's first call
    # only: a later call read float positions or int table entries as they were.
    s = stepped_layer()
    t = s.num_tokens
    cos_sin = torch.randn(64, D, generator=s.g)
    q, k, v = (x.view(t, -1, D) for x in qkv(t, s.g))

    def rope(positions, table):
        with ira.set_forward_context(s.md):
            torch.ops.rocm_attn.unified_rope_and_kv_cache_update(positions, q, k, v, table, True,
                                                                 s.layer.layer_name)

    rope(s.md.positions, cos_sin)  # the signature's first call: validated in full
    bad, match = _ROPE_TABLE_CASES[case]
    before = snapshot(q, k, s.layer.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_rope_and_kv_cache_update: {match}"):
        rope(*bad(s.md.positions, cos_sin))
    assert unchanged(before, q, k, s.layer.kv_cache)


_NORM_CASES = {
    "q_weight [1]": (dict(q_weight=torch.ones(1)), r"q_weight must be \[head_size\] = \[64\], got \(1,\)"),
    "k_weight [2D]": (dict(k_weight=torch.ones(2 * D)), r"k_weight must be \[head_size\] = \[64\], got \(128,\)"),
    "q_weight int": (dict(q_weight=torch.ones(D, dtype=torch.int64)), r"q_weight must be a float32"),
    "k_weight strided": (dict(k_weight=torch.ones(2 * D)[::2]), r"k_weight must be contiguous"),
    "eps negative": (dict(eps=-1e-6), r"eps must be a finite number >= 0, got -1e-06"),
    "eps nan": (dict(eps=float("nan")), r"eps must be a finite number >= 0, got nan"),
}


def _qk_norm_call(variant, s, args):
    t, name = s.num_tokens, s.layer.layer_name
    with ira.set_forward_context(s.md):
        if variant == "qkv":
            torch.ops.rocm_attn.unified_qk_norm_rope_and_kv_cache_update(
                args["qkv"], args["q_weight"], args["k_weight"], args["eps"], s.md.positions, args["cos_sin"], True,
                H, HKV, D, name)
        else:
            torch.ops.rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update(
                args["q"], args["k"], args["v"], args["q_weight"], args["k_weight"], args["eps"], args["cos"][:t],
                args["sin"][:t], True, name)


@pytest.mark.parametrize("variant", ["qkv", "cos_sin"])
@pytest.mark.parametrize("case", list(_NORM_CASES))
@pytest.mark.parametrize("first", [True, False], ids=["first_call", "later_call"])
def test_fused_qk_norm_layer_ops_check_weights_and_eps_on_every_call(variant, case, first):
    # The QK-norm weights were checked on a signature's first call only (a [1] weight then
    # broadcast silently, an int one was used as it was), eps never (a negative one turns rows
    # NaN); and the first call switched the layer to interleaved V, converting its cache,
    # before any of these checks. The error names the layer op called (not its kernel op).
    s = stepped_layer()
    t = s.num_tokens
    q, k, v = (x.view(t, -1, D) for x in qkv(t, s.g))
    args = dict(qkv=torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], 1), q=q, k=k, v=v,
                q_weight=torch.ones(D), k_weight=torch.ones(D), eps=1e-6, cos_sin=torch.randn(64, D, generator=s.g),
                cos=torch.randn(t, D, generator=s.g), sin=torch.randn(t, D, generator=s.g))
    if not first:
        _qk_norm_call(variant, s, args)  # the signature's first call: validated in full, the layer switched
    bad, match = _NORM_CASES[case]
    was_interleaved = s.layer.interleaved_v
    before = snapshot(q, k, s.layer.kv_cache)
    op = "qk_norm_rope" if variant == "qkv" else "qk_norm_rope_cos_sin"
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_{op}_and_kv_cache_update: {match}"):
        _qk_norm_call(variant, s, {**args, **bad})
    assert unchanged(before, q, k, s.layer.kv_cache) and s.layer.interleaved_v == was_interleaved


def test_qk_norm_layer_op_head_counts_must_be_the_layers():
    # The fake kernel shapes q/k from these arguments, the real op from the layer's own.
    s = stepped_layer()
    t = s.num_tokens
    before = snapshot(s.layer.kv_cache)
    with pytest.raises(ValueError, match=rf"num_heads, num_kv_heads, head_size = {2 * H}, {HKV}, {D} but layer "
                                         rf"'rel\.\d+' has {H}, {HKV}, {D}"), ira.set_forward_context(s.md):
        torch.ops.rocm_attn.unified_qk_norm_rope_and_kv_cache_update(
            torch.randn(t, (H + 2 * HKV) * D), torch.ones(D), torch.ones(D), 1e-6, s.md.positions,
            torch.randn(64, D), True, 2 * H, HKV, D, s.layer.layer_name)
    assert unchanged(before, s.layer.kv_cache) and not s.layer.interleaved_v


@pytest.mark.parametrize("kv_cache_dtype,cache_dtype", [("auto", torch.float8_e4m3fn), ("fp8", torch.float32)])
def test_cache_dtype_must_agree_with_the_layers_kv_cache_dtype(kv_cache_dtype, cache_dtype):
    """A cache assigned by hand whose fp8-ness disagrees with the layer's ``kv_cache_dtype``:
    an fp8 layer's scales would be ignored on a 16/32-bit cache, and an fp8 cache read with an
    "auto" layer's scale of 1. Refused at the first call, nothing written."""
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"rel.dtype_{kv_cache_dtype}",
                          kv_cache_dtype=kv_cache_dtype)
    spec = ira.KVCacheSpec(BS, HKV, D, cache_dtype, ira.CacheLayout.LHBNC)
    layer.kv_cache = ira.allocate_kv_cache(spec, NUM_BLOCKS)
    before = snapshot(layer.kv_cache)
    md = ira.build_attention_metadata([3], [0], [[0]], BS)
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{kv_cache_dtype}' but its KV cache is "
                                         rf"{str(cache_dtype)}"), ira.set_forward_context(md):
        layer(*qkv(3, torch.Generator().manual_seed(0)))
    assert unchanged(before, layer.kv_cache)


@pytest.mark.parametrize("target_kv_heads,target_head_size", [(1, D), (1, 2 * D)])
def test_kv_sharing_layer_refuses_a_target_of_another_geometry(target_kv_heads, target_head_size):
    """Layers built and given caches by hand (bind_kv_caches checks this): the sharing layer read
    its target's cache with the head count the cache's width implies, so fewer KV heads ran as
    another GQA ratio and a wider head size as twice the heads, silently."""
    target = ira.Attention(H, target_head_size, num_kv_heads=target_kv_heads,
                           layer_name=f"rel.geo_target{target_head_size}")
    target.kv_cache = ira.allocate_kv_cache(target.kv_cache_spec(torch.float32), NUM_BLOCKS)
    sharer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"rel.geo_sharer{target_head_size}",
                           kv_sharing_target_layer_name=target.layer_name)
    g = torch.Generator().manual_seed(0)
    md = ira.build_attention_metadata([3], [0], [[0]], BS)
    with ira.set_forward_context(md):
        target(torch.randn(3, H * target_head_size, generator=g),
               *(torch.randn(3, target_kv_heads * target_head_size, generator=g) for _ in range(2)))
    before = snapshot(target.kv_cache)
    with pytest.raises(ValueError, match=rf"shares the KV cache of 'rel\.geo_target{target_head_size}', which holds "
                                         rf"{target_kv_heads} KV heads of {target_head_size}"), \
            ira.set_forward_context(md):
        sharer(*qkv(3, g))
    assert unchanged(before, target.kv_cache)


@pytest.mark.parametrize("scale, match", [
    (torch.tensor([0.0]), r"output_scale must be a positive finite number, got 0\.0"),
    (torch.tensor([float("nan")]), r"output_scale must be a positive finite number, got nan"),
    (torch.tensor([0.5], dtype=torch.bfloat16), r"output_scale must be a float32 tensor \(a per-tensor scale\), got "
                                                r"torch\.bfloat16"),
    (torch.tensor([0.5, 0.5]), r"output_scale must be a per-tensor scale \(1 element, shape \(\) or \(1,\)\), got "
                               r"shape \(2,\)"),
])
def test_attention_op_checks_output_scale_on_every_call(scale, match):
    # The layer-level attention checked output_scale on a signature's first call only: a later
    # zero scale saturated every output to fp8_max, a NaN one gave NaN, two elements a bare
    # broadcast error from the kernel.
    s = stepped_layer()
    t = s.num_tokens
    q, k, v = (x.view(t, -1, D) for x in qkv(t, s.g))

    def attend(output_scale, out):
        with ira.set_forward_context(s.md):
            torch.ops.rocm_attn.unified_attention_with_output(q, k, v, out, s.layer.layer_name, None, output_scale)

    attend(torch.tensor([0.5]), torch.zeros(t, H, D, dtype=torch.float8_e4m3fn))  # the signature's first call
    out = torch.full((t, H, D), 3.0).to(torch.float8_e4m3fn)
    before = snapshot(out, s.layer.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_attention_with_output: {match}"):
        attend(scale, out)
    assert unchanged(before, out, s.layer.kv_cache)


@pytest.mark.parametrize("scale, match", [
    (torch.tensor([0.0]), r"output_scale must be a positive finite number, got 0\.0"),
    (torch.tensor([0.5, 0.5]), r"output_scale must be a per-tensor scale \(1 element, shape \(\) or \(1,\)\), got "
                               r"shape \(2,\)"),
    (torch.tensor([0.5]), r"output_scale \(fused fp8 output quant\) needs an fp8 output, got torch\.float32"),
])
def test_encoder_attention_op_names_itself_for_a_bad_output_scale(scale, match):
    """An encoder layer's attention quantized its output with the kernel-level quant op, whose
    refusal of the scale named rocm_attn.static_scaled_fp8_quant, after the encoder kernel ran."""
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name="rel.encoder_scale", attn_type="encoder_only")
    md = ira.build_attention_metadata([3], [0], [[0]], BS)
    q, k, v = (x.view(3, -1, D) for x in qkv(3, torch.Generator().manual_seed(0)))
    out = torch.full((3, H, D), 3.0).to(torch.float32 if scale.numel() == 1 and scale.item() == 0.5
                                        else torch.float8_e4m3fn)
    before = snapshot(out)
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_attention_with_output: {match}"), \
            ira.set_forward_context(md):
        torch.ops.rocm_attn.unified_attention_with_output(q, k, v, out, layer.layer_name, None, scale)
    assert unchanged(before, out)


def test_layer_op_names_itself_when_no_provider_takes_the_call(monkeypatch):
    """A provider refusal named the kernel op (rocm_attn.paged_attention) the layer op called."""
    from inductor_rocm_attn import providers

    def refuse(op, **call):
        raise NotImplementedError(f"rocm_attn.{op}: no provider supports this call (test)")

    s = stepped_layer()
    monkeypatch.setattr(providers, "select", refuse)
    s.layer.impl._kernels.clear()  # the kernels its first step resolved
    q, k, v = qkv(s.num_tokens, s.g)
    out = torch.empty(s.num_tokens, H, D)
    with pytest.raises(NotImplementedError, match=r"^rocm_attn\.unified_kv_cache_update: rocm_attn\.reshape_and_cache: "
                                                  r"no provider supports this call \(test\)$"):
        run_layer_ops(s.layer, s.md, q, k, v, out)
    with pytest.raises(NotImplementedError, match=r"^rocm_attn\.unified_attention_with_output: "
                                                  r"rocm_attn\.paged_attention: no provider supports this call"), \
            ira.set_forward_context(s.md):
        torch.ops.rocm_attn.unified_attention_with_output(q.view(-1, H, D), k.view(-1, HKV, D), v.view(-1, HKV, D),
                                                          out, s.layer.layer_name, None)


@pytest.mark.parametrize("case", ["expanded", "key's memory"])
def test_attention_op_refuses_an_output_it_cannot_write_alone(case):
    # The layer-level attention never compared its output with what it reads (the kernel-level
    # paged_attention does): a key slice of the output's buffer was overwritten while a prefill
    # read it, and an expanded output made its rows share memory (a bare torch error on CPU, the
    # last row's write winning on a GPU).
    s = stepped_layer()
    t = s.num_tokens
    q, k, v = (x.view(t, -1, D) for x in qkv(t, s.g))
    if case == "expanded":
        out, key, match = torch.zeros(1, H, D).expand(t, H, D), k, r"output is an expanded view"
    else:
        out = torch.randn(t, H + HKV, D, generator=s.g)[:, :H]
        key, match = out[:, :HKV], r"output and key are the same memory"
    before = snapshot(out, key, s.layer.kv_cache)
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_attention_with_output: {match}"), \
            ira.set_forward_context(s.md):
        torch.ops.rocm_attn.unified_attention_with_output(q, key, v, out, s.layer.layer_name, None)
    assert unchanged(before, out, key, s.layer.kv_cache)


@pytest.mark.parametrize("layout", ["LHBNC", "LBHNC"])
@pytest.mark.parametrize("decode", [True, False])
def test_attention_op_refuses_an_output_at_the_cache_s_address(layout, decode):
    # The layer-level attention compared a caller's output with key/value only (the kernel-level
    # paged_attention compares it with the cache too): an output starting where the cache starts
    # was taken, and the step's attention rows were written over cached keys.
    s = stepped_layer(layout=layout)
    md = ira.build_attention_metadata([1] * 3, [21, 8, 2], s.tables, BS) if decode else s.md
    t = md.num_actual_tokens
    q, k, v = (x.view(t, -1, D) for x in qkv(t, s.g))
    cache = s.layer.kv_cache
    out = cache.as_strided((t, H, D), (H * D, D, 1))  # starts at the cache's address
    assert out.data_ptr() == cache.data_ptr()
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"rocm_attn\.unified_attention_with_output: output and kv_cache are the same "
                                         r"memory"), ira.set_forward_context(md):
        torch.ops.rocm_attn.unified_attention_with_output(q, k, v, out, s.layer.layer_name, None)
    assert unchanged(before, cache)


@pytest.mark.parametrize("op", ["cos_sin_cache", "cos_sin"])
@pytest.mark.parametrize("case", ["key is query", "value is key", "expanded query"])
def test_fused_rope_layer_ops_refuse_aliased_or_expanded_rotated_tensors(op, case):
    # The fused RoPE layer ops never compared the q/k they rotate in place with each other or with
    # the value they cache (their kernel-level ops do): key = query was rotated twice, value = key
    # cached the rotated key as the value.
    layer = ira.Attention(HKV, D, num_kv_heads=HKV, layer_name=f"rel.mha_{op}_{case.replace(' ', '_')}")
    ira.bind_kv_caches(layer, NUM_BLOCKS, torch.float32, poison=True)
    md = ira.build_attention_metadata([3], [0], [[0]], BS)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, HKV, D, generator=g) for _ in range(3))
    q, k, v, match = {"key is query": (q, q, v, "query and key are the same memory"),
                      "value is key": (q, k, k, "key and value are the same memory"),
                      "expanded query": (q[:1].expand(3, HKV, D), k, v, "query is an expanded view")}[case]
    before = snapshot(q, k, v, layer.kv_cache)
    with pytest.raises(ValueError, match=match), ira.set_forward_context(md):
        if op == "cos_sin_cache":
            torch.ops.rocm_attn.unified_rope_and_kv_cache_update(md.positions, q, k, v, torch.randn(8, D, generator=g),
                                                                 True, layer.layer_name)
        else:
            torch.ops.rocm_attn.unified_rope_cos_sin_and_kv_cache_update(
                q, k, v, torch.randn(3, D, generator=g), torch.randn(3, D, generator=g), True, layer.layer_name)
    assert unchanged(before, q, k, v, layer.kv_cache)


def test_model_dtype_conversion_keeps_the_fp8_scales_fp32():
    """model.half() / .to(bfloat16) converted the layer's k/v scale buffers too: a 1e-8 scale
    flushed to 0 in fp16 (every cached value then inf), others rounded."""
    import inductor_rocm_attn as ira

    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name="scales.0", block_size=16, kv_cache_dtype="fp8",
                          k_scale=1e-8, v_scale=0.0123, register=False)
    model = torch.nn.Sequential(layer)
    for convert in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.to("meta")):
        convert(model)
        for name, want in (("_k_scale", 1e-8), ("_v_scale", 0.0123)):
            got = getattr(layer, name)
            assert got.dtype == torch.float32, (name, got.dtype)
            if got.device.type != "meta":
                assert got.item() == torch.tensor(want, dtype=torch.float32).item()


def test_a_positive_infinite_sink_is_refused():
    """sinks=+inf was accepted, and every output row of that head was NaN (inf - inf)."""
    import inductor_rocm_attn as ira

    with pytest.raises(ValueError, match=r"sinks must not be \+inf"):
        ira.Attention(2, 64, num_kv_heads=1, layer_name="sinks.0", block_size=16, register=False,
                      sinks=[0.5, float("inf")])
    ira.Attention(2, 64, num_kv_heads=1, layer_name="sinks.1", block_size=16, register=False,
                  sinks=[0.5, float("-inf")])


@pytest.mark.parametrize("configured, cache_dtype", [("float16", torch.bfloat16), ("bfloat16", torch.float16),
                                                     ("fp8_e4m3", torch.float8_e5m2)])
def test_a_cache_of_another_dtype_than_the_layer_names_is_refused(configured, cache_dtype):
    """A layer configured for one cache dtype ran on a hand-assigned cache of another: the
    kernels read the cache's own dtype, so the configured precision was silently not used.
    (An fp8 layer's kv_cache_spec with a device string also raised a bare AttributeError.)"""
    import dataclasses

    import inductor_rocm_attn as ira
    from inductor_rocm_attn.layout import allocate_kv_cache

    layer = ira.Attention(2, 64, num_kv_heads=1, layer_name=f"cachedtype.{configured}", block_size=16,
                          kv_cache_dtype=configured, register=False)
    spec = dataclasses.replace(layer.kv_cache_spec(torch.float32, "cpu"), dtype=cache_dtype)
    cache = allocate_kv_cache(spec, 4, "cpu")
    cache.view(torch.uint8).copy_(torch.randint(0, 100, cache.view(torch.uint8).shape, dtype=torch.uint8))
    layer.kv_cache = cache
    md = ira.build_attention_metadata([3], [0], [[0]], 16, "cpu")
    q, k, v = torch.randn(3, 128), torch.randn(3, 64), torch.randn(3, 64)
    before = cache.clone()
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{configured}' but its KV cache is {cache_dtype}"):
        with ira.set_forward_context(md, layers={layer.layer_name: layer}):
            layer(q, k, v)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_an_encoder_step_with_cached_context_is_refused():
    """An encoder layer has no cache and attends within the step's tokens: metadata with
    context tokens was computed without that context, silently."""
    import dataclasses

    import inductor_rocm_attn as ira

    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name="enc_ctx.0", attn_type="encoder_only", register=False)
    q, k, v = torch.randn(3, 256), torch.randn(3, 128), torch.randn(3, 128)
    md = ira.build_attention_metadata([1, 2], [4, 0], [[0], [1]], 16)
    for step in (md, dataclasses.replace(md, plan=None)):  # from the plan, and read from the tensors
        with pytest.raises(ValueError, match=r"encoder layer's step has 4 cached context tokens"):
            with ira.set_forward_context(step, layers={layer.layer_name: layer}):
                layer(q, k, v)
    with ira.set_forward_context(ira.build_attention_metadata([1, 2], [0, 0], [[0], [1]], 16),
                                 layers={layer.layer_name: layer}):
        layer(q, k, v)


@pytest.mark.parametrize("value, match", [
    (torch.tensor([2], dtype=torch.int32), r"k_scale must be a float32 tensor \(a per-tensor scale\), got "
                                           r"torch\.int32"),
    (torch.tensor([2.0], dtype=torch.bfloat16), r"k_scale must be a float32 tensor \(a per-tensor scale\), got "
                                                r"torch\.bfloat16"),
    (torch.tensor([0.0]), r"k_scale must be a positive finite number, got 0\.0"),
])
def test_layer_scale_buffers_stay_float32_per_tensor_scales(value, match):
    """Every layer path reads ``_k_scale`` / ``_v_scale`` as they are, checked once per call
    signature: a buffer replaced after the first call (an int32 tensor) was read by value. A
    replacement is checked when it is assigned; the layer keeps the scale it had."""
    s = stepped_layer(kv_cache_dtype="fp8")
    layer = s.layer
    with pytest.raises(ValueError, match=rf"Attention '{re.escape(layer.layer_name)}': {match}"):
        layer._k_scale = value
    assert layer._k_scale.dtype == torch.float32 and float(layer._k_scale) == 1.0
    layer._v_scale = torch.tensor([0.5])  # a float32 one-element scale is taken
    assert float(layer._v_scale) == 0.5


def test_a_cache_rebound_at_the_same_address_with_another_geometry_is_checked_again():
    """A layer resolves its kernels once per call signature, which holds the cache's address:
    a cache of another head split assigned at the address of the old one (here a view of the
    same storage; a freed cache's address is reused alike) skipped the geometry check and ran
    the kernels on it. Binding a cache makes every layer check its next call in full, the
    layers that share the cache too."""
    s = stepped_layer("rebound")
    reader = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"{s.layer.layer_name}.reader",
                           kv_sharing_target_layer_name=s.layer.layer_name)
    q, k, v = qkv(s.num_tokens, s.g)
    with ira.set_forward_context(s.md):
        s.layer(q, k, v)
        reader(q, k, v)
    kv = s.layer.kv_cache
    # 4 blocks of 2 * HKV KV heads (LHBNC: the K group of all blocks, then the V group), at kv's address
    page = BS * 2 * HKV * D
    other = kv.as_strided((NUM_BLOCKS // 2, 2, BS, 2 * HKV * D), (page, NUM_BLOCKS // 2 * page, 2 * HKV * D, 1))
    assert other.data_ptr() == kv.data_ptr() and cache_layout_of(other) == ira.CacheLayout.LHBNC
    s.layer.kv_cache = other
    md = ira.build_attention_metadata([2], [0], [[0]], BS)
    before = snapshot(kv)
    q, k, v = qkv(2, s.g)
    match = rf"kv_cache last dim {2 * HKV * D} != num_kv_heads \* head_size = {HKV} \* {D}"
    for layer in (s.layer, reader):
        with pytest.raises(ValueError, match=r"rocm_attn\.unified_(kv_cache_update|attention_with_output): " + match), \
                ira.set_forward_context(md):
            layer(q, k, v)
        assert unchanged(before, kv)


@pytest.mark.parametrize("extra", [1, 4])
def test_more_tokens_than_the_metadata_plans_are_refused(extra):
    """q/k/v with more rows than the step's metadata has tokens (real and padding) were taken:
    the rows past its tokens were left as torch.empty made them and returned as output. Padding
    a step is the metadata's to say (build_attention_metadata(..., num_padded_tokens=...))."""
    s = stepped_layer()
    before = snapshot(s.layer.kv_cache)
    q, k, v = qkv(s.num_tokens + extra, s.g)
    with pytest.raises(ValueError, match=rf"rocm_attn\.unified_kv_cache_update: the step's metadata plans "
                                         rf"{s.num_tokens} tokens \({s.num_tokens} real, 0 padding\) but the layer "
                                         rf"was given {s.num_tokens + extra}.*num_padded_tokens="), \
            ira.set_forward_context(s.md):
        s.layer(q, k, v)
    assert unchanged(before, s.layer.kv_cache)
    # the attention op alone (a layer without a cache update: KV sharing, a hand-written forward)
    out = torch.empty(s.num_tokens + extra, H, D)
    with pytest.raises(ValueError, match=r"rocm_attn\.unified_attention_with_output: the step's metadata plans"), \
            ira.set_forward_context(s.md):
        torch.ops.rocm_attn.unified_attention_with_output(q.view(-1, H, D), k.view(-1, HKV, D), v.view(-1, HKV, D),
                                                          out, s.layer.layer_name)
    # a step padded by its metadata runs, and its real rows are the unpadded step's
    md = ira.build_attention_metadata(s.query_lens, s.context_lens, s.tables, BS,
                                      num_padded_tokens=s.num_tokens + extra)
    with ira.set_forward_context(md):
        padded = s.layer(q, k, v)
    assert torch.isfinite(padded[: s.num_tokens]).all()


@pytest.mark.parametrize("fused", [False, True])
def test_kv_sharing_layer_run_before_its_target_in_a_step_is_refused(fused):
    """A model whose forward calls the sharing layer before its target (bind_kv_caches checks
    the module order, not the forward's) read slots the target had not written yet: NaN on a
    poisoned cache, a previous step's keys on a real one, silently. ``fused``: the target
    writes through a fused RoPE writer."""
    target = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"rel.order_target{fused}")
    sharer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"rel.order_sharer{fused}",
                           kv_sharing_target_layer_name=target.layer_name)
    ira.bind_kv_caches(torch.nn.ModuleList([target, sharer]), NUM_BLOCKS, torch.float32, poison=True)
    g = torch.Generator().manual_seed(0)

    def write(md):
        q, k, v = qkv(3, g)
        if fused:
            torch.ops.rocm_attn.unified_rope_and_kv_cache_update(md.positions, q.view(3, H, D), k.view(3, HKV, D),
                                                                 v.view(3, HKV, D), torch.randn(64, D, generator=g),
                                                                 True, target.layer_name)
        else:
            target(q, k, v)

    first = ira.build_attention_metadata([3], [0], [[0]], BS)
    with ira.set_forward_context(first):
        write(first)
        assert torch.isfinite(sharer(*qkv(3, g))).all()  # the target's order: it wrote this step's tokens
    second = ira.build_attention_metadata([3], [3], [[0]], BS)
    with pytest.raises(RuntimeError, match=rf"rocm_attn\.unified_attention_with_output: this layer reads the KV cache "
                                           rf"of 'rel\.order_target{fused}', which has not written this step's tokens"), \
            ira.set_forward_context(second):
        sharer(*qkv(3, g))
    with ira.set_forward_context(second):
        write(second)
        assert torch.isfinite(sharer(*qkv(3, g))).all()


def _layer_step(name):
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=name, block_size=BS)
    ira.bind_kv_caches(layer, NUM_BLOCKS, torch.float32)
    md = ira.build_attention_metadata([3], [0], [[1]], BS)
    q, k, v = (torch.randn(3, n * D, requires_grad=True) for n in (H, HKV, HKV))
    return layer, md, q, k, v


def test_a_kernel_without_backward_warns_when_a_gradient_is_expected(monkeypatch):
    """Only the PyTorch reference passes a gradient through the ops; with another provider a
    forward with grad mode on and inputs that require grad warns (once per call signature)."""
    from inductor_rocm_attn import providers

    real = providers.select
    monkeypatch.setattr(providers, "select", lambda op, **call: ("triton", real(op, **call)[1]))
    layer, md, q, k, v = _layer_step("grad_warn.0")
    with pytest.warns(UserWarning, match=r"rocm_attn\.\w+: the 'triton' kernels have no backward; no gradient "
                                         r"flows through this attention"), ira.set_forward_context(md):
        layer(q, k, v)
    layer, md, q, k, v = _layer_step("grad_warn.1")
    with torch.no_grad(), ira.set_forward_context(md), warnings_as_errors():
        layer(q, k, v)  # inference: no warning


def test_the_reference_passes_the_gradient_without_a_warning():
    layer, md, q, k, v = _layer_step("grad_ref.0")
    with ira.set_forward_context(md), warnings_as_errors():
        out = layer(q, k, v)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


@contextlib.contextmanager
def warnings_as_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _meta(t):
    return t.to("meta")


@pytest.mark.parametrize("op", ["kv_update", "attention", "rope", "rope_cos_sin", "qk_norm_rope",
                                "qk_norm_rope_cos_sin", "rms_norm", "fp8_quant"])
def test_layer_ops_refuse_one_argument_on_the_meta_device(op):
    """One tensor on the meta device sends a real call to the op's fake kernel, which must
    refuse the mix (as the kernel-level fakes do) instead of returning without writing the
    cache, rotating q / k or writing the output (``rms_norm`` / the fp8 quant: uninitialized
    memory)."""
    R = torch.ops.rocm_attn
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name="meta_mix", block_size=BS)
    ira.bind_kv_caches(torch.nn.ModuleDict({"a": layer}), num_blocks=4, dtype=torch.float32)
    md = ira.build_attention_metadata([3], [0], [[0]], BS)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, h, D, generator=g) for h in (H, HKV, HKV))
    cos, sin = torch.randn(3, D, generator=g), torch.randn(3, D, generator=g)
    w = torch.ones(D)
    out = torch.full((3, H, D), float("nan"))
    calls = {
        "kv_update": ("unified_kv_cache_update", lambda: R.unified_kv_cache_update(k, _meta(v), "meta_mix")),
        "attention": ("unified_attention_with_output",
                      lambda: R.unified_attention_with_output(_meta(q), k, v, out, "meta_mix")),
        "rope": ("unified_rope_and_kv_cache_update",
                 lambda: R.unified_rope_and_kv_cache_update(torch.arange(3), q, k, v, _meta(torch.randn(32, D)),
                                                            True, "meta_mix")),
        "rope_cos_sin": ("unified_rope_cos_sin_and_kv_cache_update",
                         lambda: R.unified_rope_cos_sin_and_kv_cache_update(q, k, v, _meta(cos), sin, True,
                                                                            "meta_mix")),
        "qk_norm_rope": ("unified_qk_norm_rope_and_kv_cache_update",
                         lambda: R.unified_qk_norm_rope_and_kv_cache_update(
                             torch.cat([q, k, v], 1).reshape(3, -1), _meta(w), w, 1e-6, torch.arange(3),
                             torch.randn(32, D), True, H, HKV, D, "meta_mix")),
        "qk_norm_rope_cos_sin": ("unified_qk_norm_rope_cos_sin_and_kv_cache_update",
                                 lambda: R.unified_qk_norm_rope_cos_sin_and_kv_cache_update(
                                     q, k, v, w, _meta(w), 1e-6, cos, sin, True, "meta_mix")),
        "rms_norm": ("rms_norm", lambda: R.rms_norm(q, _meta(w), 1e-6)),
        "fp8_quant": ("static_scaled_fp8_quant",
                      lambda: R.static_scaled_fp8_quant(q, _meta(torch.ones(1)), torch.float8_e4m3fn)),
    }
    name, call = calls[op]
    before = snapshot(layer.kv_cache, q, k, out)
    with ira.set_forward_context(md), pytest.raises(
            ValueError, match=rf"rocm_attn\.{name}: all tensors must be on one device, got .* on meta"):
        call()
    assert unchanged(before, layer.kv_cache, q, k, out), "a refused call wrote"


def test_cache_update_of_a_layer_without_a_cache_checks_its_key_and_value():
    """A KV-sharing layer writes nothing, but a key / value that is not its heads is still a
    caller's mistake: refused by name, as the fused writers refuse it on such a layer."""
    target = ira.Attention(H, D, num_kv_heads=HKV, layer_name="nocache_target", block_size=BS)
    shared = ira.Attention(H, D, num_kv_heads=HKV, layer_name="nocache_shared", block_size=BS,
                           kv_sharing_target_layer_name="nocache_target")
    ira.bind_kv_caches(torch.nn.ModuleList([target, shared]), 4, torch.float32)
    before = snapshot(target.kv_cache)
    with ira.set_forward_context(ira.build_attention_metadata([3], [0], [[0]], BS)):
        torch.ops.rocm_attn.unified_kv_cache_update(torch.randn(3, HKV, D), torch.randn(3, HKV, D), "nocache_shared")
        with pytest.raises(ValueError, match=r"rocm_attn\.unified_kv_cache_update: key and value must be \[num_tokens, "
                                             rf"num_kv_heads, head_size\] = \[3, {HKV}, {D}\], got \(3, 7, 5\)"):
            torch.ops.rocm_attn.unified_kv_cache_update(torch.randn(3, 7, 5), torch.randn(3, 7, 5), "nocache_shared")
        with pytest.raises(ValueError, match=r"rocm_attn\.unified_kv_cache_update: value must be \[num_tokens, "):
            torch.ops.rocm_attn.unified_kv_cache_update(torch.randn(3, HKV, D), torch.randn(9), "nocache_shared")
    assert unchanged(before, target.kv_cache)


def test_metadata_block_size_of_another_type_is_named():
    s = stepped_layer()
    md = _replace(s.md, block_size=str(BS))
    _rejected(s, md, rf"metadata built for block_size '{BS}' \(a str\), but the layer's KV cache has block_size {BS}")


@pytest.mark.parametrize("name, bad", [("sinks", float("inf")), ("sinks", float("nan")),
                                       ("alibi_slopes", float("nan"))])
def test_per_head_tensors_changed_in_place_are_checked_again(name, bad):
    """Sinks / ALiBi slopes are the caller's tensors (a model's parameter, loaded after the
    layer was built): values refused at construction are refused when they arrive in place
    later, before the step's cache update writes."""
    per_head = torch.zeros(H) if name == "sinks" else torch.full((H,), 0.5)
    s = stepped_layer(f"per_head_{name}", **{name: per_head})
    getattr(s.layer.impl, name).fill_(bad)
    _rejected(s, s.md, rf"{name} must (not hold NaN or \+inf|be finite)")
