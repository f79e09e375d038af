"""The reference paged_attention (the CPU implementation of the op) against an independent
dense float64 oracle, across the feature matrix of the foundation issue."""

import itertools

import pytest
import torch

from cases import dense_oracle, make_paged_case, poison, rel_err

OP = torch.ops.rocm_attn.paged_attention

# Mixed batches: prefill from scratch, decode, chunked prefill on a cached prefix.
MIXED = ([7, 1, 1, 9, 3], [0, 20, 47, 33, 16])


def run_op(case, *, scale=0.11, causal=True, sliding_window=-1, alibi=None, sinks=None, cap=0.0,
           output_scale=None, out_dtype=None):
    out = poison(torch.empty(case.query.shape, dtype=out_dtype or case.query.dtype))
    OP(out, case.query, case.key, case.value, case.kv_cache, case.query_start_loc, case.seq_lens,
       case.block_table, case.max_query_len, case.max_seq_len, scale, case.k_scale, case.v_scale,
       causal, sliding_window, alibi, sinks, cap, case.interleaved_v, output_scale)
    return out


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_gqa_and_head_sizes(heads, head_size):
    case = make_paged_case(*MIXED, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                           dtype=torch.float32, seed=head_size + heads[1])
    out = run_op(case)
    assert not out.isnan().any()
    assert rel_err(out, dense_oracle(case, scale=0.11)) < 1e-6


@pytest.mark.parametrize("block_size,layout,interleaved",
                         list(itertools.product([16, 32, 544], ["LHBNC", "LBHNC"], [False, True])))
def test_block_sizes_layouts_v_interiors(block_size, layout, interleaved):
    ql, cl = ([5, 1, 1], [600, 30, 1100]) if block_size == 544 else MIXED
    case = make_paged_case(ql, cl, block_size=block_size, layout=layout, interleaved_v=interleaved,
                           dtype=torch.float16, seed=block_size)
    out = run_op(case)
    assert rel_err(out, dense_oracle(case, scale=0.11)) < 2e-3  # fp16 output rounding


@pytest.mark.parametrize("feature", ["window", "alibi", "sinks", "softcap", "non_causal",
                                     "non_causal_window", "all"])
def test_features(feature):
    case = make_paged_case(*MIXED, num_heads=4, num_kv_heads=2, dtype=torch.float32, seed=3)
    g = torch.Generator().manual_seed(7)
    kw = dict(causal=True, sliding_window=-1, alibi_slopes=None, sinks=None, logits_soft_cap=0.0)
    if feature in ("window", "all"):
        kw["sliding_window"] = 9
    if feature in ("alibi", "all"):
        kw["alibi_slopes"] = torch.rand(4, generator=g)
    if feature in ("sinks", "all"):
        kw["sinks"] = torch.randn(4, generator=g) * 2
    if feature in ("softcap", "all"):
        kw["logits_soft_cap"] = 3.0
    if feature.startswith("non_causal"):
        kw["causal"] = False
        kw["sliding_window"] = 6 if feature.endswith("window") else -1
    out = run_op(case, causal=kw["causal"], sliding_window=kw["sliding_window"],
                 alibi=kw["alibi_slopes"], sinks=kw["sinks"], cap=kw["logits_soft_cap"])
    ref = dense_oracle(case, scale=0.11, **kw)
    assert rel_err(out, ref) < 1e-6
    if feature != "non_causal":  # the feature changes the result (so the test can fail)
        plain = dense_oracle(case, scale=0.11)
        assert rel_err(plain, ref) > 1e-3


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fp8_cache(cache_dtype, interleaved):
    case = make_paged_case(*MIXED, dtype=torch.float32, cache_dtype=cache_dtype, k_scale=0.5,
                           v_scale=0.25, interleaved_v=interleaved, seed=11)
    out = run_op(case)
    # Exact against the values the cache holds (the case rounds them like the writer) ...
    assert rel_err(out, dense_oracle(case, scale=0.11)) < 1e-6
    # ... and within e4m3/e5m2 rounding of the unquantized tokens: relative error of one
    # element <= 2^-(mantissa bits + 1); the attention average does not amplify it.
    mant = 3 if cache_dtype == torch.float8_e4m3fn else 2
    exact = make_paged_case(*MIXED, dtype=torch.float32, seed=11)
    assert rel_err(out, dense_oracle(exact, scale=0.11)) < 2 ** -(mant + 1) * 2


def test_fp8_output_quant():
    case = make_paged_case(*MIXED, dtype=torch.float32, seed=5)
    scale = torch.tensor([0.02])
    out = run_op(case, output_scale=scale, out_dtype=torch.float8_e4m3fn)
    ref = dense_oracle(case, scale=0.11)
    want = (ref / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    # Bit-identical: both quantize a float64 result once with the same cast; the two float64
    # results differ by ~1e-16 relative, which moves a value across an fp8 rounding boundary
    # only at an exact tie (never seen with random inputs).
    assert (want.float().abs() > 0).float().mean() > 0.9, "the case must exercise the quantizer"
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_padding_rows_untouched_and_padding_slots_not_written():
    case = make_paged_case([4, 1], [10, 20], dtype=torch.float32, seed=2)
    # Two padded tokens at the end: slot -1, rows past query_start_loc[-1].
    q = torch.cat([case.query, torch.randn(2, *case.query.shape[1:])])
    out = poison(torch.empty_like(q))
    OP(out, q, torch.cat([case.key, torch.randn(2, *case.key.shape[1:])]),
       torch.cat([case.value, torch.randn(2, *case.value.shape[1:])]), case.kv_cache,
       case.query_start_loc, case.seq_lens, case.block_table, 4, 24, 0.11, case.k_scale, case.v_scale)
    assert out[-2:].isnan().all() and not out[:-2].isnan().any()
    before = case.kv_cache.clone()
    slots = torch.tensor([-1, -1, -5], dtype=torch.int64)
    torch.ops.rocm_attn.reshape_and_cache(torch.randn(3, 2, 64), torch.randn(3, 2, 64), case.kv_cache,
                                          slots, case.k_scale, case.v_scale, False)
    assert torch.equal(before.view(torch.int32), case.kv_cache.view(torch.int32))


def test_encoder_attention_matches_oracle():
    from cases import oracle_attention

    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 17, 18], dtype=torch.int32)
    q, k, v = (torch.randn(18, h, 64, generator=g) for h in (4, 2, 2))
    out = torch.ops.rocm_attn.encoder_attention(q, k, v, cu, 12, 0.125)
    ref = torch.cat([oracle_attention(q[a:b], k[a:b], v[a:b], q_start_pos=0, scale=0.125, causal=False)
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert rel_err(out, ref) < 1e-6


def _sdpa_with_mask(q, k, v, mask, scale):
    """float64 SDPA of ``q [Lq, Hq, D]`` over ``k, v [Lk, Hkv, D]`` under a boolean ``[Lq, Lk]``
    mask (GQA by repeating the KV heads)."""
    g = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.double().transpose(0, 1) for x in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _window_mask(q_pos, k_pos, w, causal, encoder):
    """The contract's table (docs/design.md, "Sliding window"), built key by key."""
    mask = torch.zeros(len(q_pos), len(k_pos), dtype=torch.bool)
    for i, qp in enumerate(q_pos):
        for j, kp in enumerate(k_pos):
            if causal:
                keep = 0 <= qp - kp < w
            elif encoder:
                keep = abs(qp - kp) < w
            else:  # decoder, not causal: one-sided, keys after the query stay visible
                keep = qp - kp < w
            mask[i, j] = keep
    return mask


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_sliding_window_rule_decoder(causal):
    """paged_attention serves decoder layers: the window drops keys W or more before the
    query, never keys after it (the seed's (W-1, 0), also when not causal)."""
    w, ctx, ql = 3, 5, 6
    case = make_paged_case([ql], [ctx], num_heads=4, num_kv_heads=2, dtype=torch.float32, seed=21)
    out = run_op(case, causal=causal, sliding_window=w)
    mask = _window_mask(range(ctx, ctx + ql), range(ctx + ql), w, causal, encoder=False)
    want = _sdpa_with_mask(case.query, case.k_full[0], case.v_full[0], mask, 0.11)
    assert rel_err(out, want) < 1e-6
    if not causal:  # the rule matters: the two-sided window gives another result
        both = _window_mask(range(ctx, ctx + ql), range(ctx + ql), w, causal, encoder=True)
        assert rel_err(want, _sdpa_with_mask(case.query, case.k_full[0], case.v_full[0], both, 0.11)) > 1e-2


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_sliding_window_rule_encoder(causal):
    """encoder_attention serves encoder layers: the window bounds keys on both sides of the
    query (the seed's (W-1, W-1)); causal drops the keys after it anyway."""
    g = torch.Generator().manual_seed(4)
    w, n = 3, 9
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (4, 2, 2))
    out = torch.ops.rocm_attn.encoder_attention(q, k, v, torch.tensor([0, n], dtype=torch.int32), n, 0.125,
                                                causal=causal, sliding_window=w)
    want = _sdpa_with_mask(q, k, v, _window_mask(range(n), range(n), w, causal, encoder=True), 0.125)
    assert rel_err(out, want) < 1e-6
    if not causal:
        one = _window_mask(range(n), range(n), w, causal, encoder=False)
        assert rel_err(want, _sdpa_with_mask(q, k, v, one, 0.125)) > 1e-2
