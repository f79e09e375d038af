"""Property tests: random bad metadata and index tensors through the public API (layer forward
under a forward context, the layer-level ops, and the kernel-level ops). Every bad call must
raise a clear error (naming the op and the parameter, and the bad value where it is one
number) and leave the KV cache, the output and any tensor the op mutates byte-identical."""

import dataclasses
import datetime

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inductor_rocm_attn as ira

from cases import make_paged_case, poison
from reliability_steps import BS, D, H, HKV, NUM_BLOCKS, qkv, run_layer_ops, snapshot, stepped_layer, unchanged

SETTINGS = settings(max_examples=50, deadline=datetime.timedelta(seconds=10), database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ERRORS = (ValueError, IndexError, TypeError, RuntimeError)
INDEX_TENSORS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions")


def _assert_clear(err: Exception, op: str, param: str, value=None) -> None:
    msg = str(err)
    assert op in msg, (op, msg)
    assert param in msg, (param, msg)
    if value is not None:
        assert str(value) in msg, (value, msg)


# --- metadata mutations: (expected parameter in the message, the bad value or None) -----------


def _mutate(md, kind: str, data, qlens: list, num_tokens: int):
    """Apply one random mistake of ``kind`` to a copy of ``md``; returns (md, param, value)."""
    md = dataclasses.replace(md, **{n: getattr(md, n).clone() for n in INDEX_TENSORS})
    b = len(qlens)
    k = data.draw(st.integers(1, 1000), label="k")
    if kind == "slot_outside":
        i = data.draw(st.integers(0, num_tokens - 1), label="token")
        md.slot_mapping[i] = NUM_BLOCKS * BS + k - 1
        return md, "slot_mapping", NUM_BLOCKS * BS + k - 1
    if kind == "slot_in_another_block":
        i = data.draw(st.integers(0, num_tokens - 1), label="token")
        good = int(md.slot_mapping[i])
        bad = data.draw(st.integers(0, NUM_BLOCKS * BS - 1).filter(lambda x: x != good), label="slot")
        md.slot_mapping[i] = bad
        return md, "slot_mapping", bad
    if kind in ("block_negative", "block_past_cache"):
        s = data.draw(st.integers(0, b - 1), label="seq")
        used = -(-int(md.seq_lens[s]) // BS)
        j = data.draw(st.integers(0, used - 1), label="col")
        bad = -k if kind == "block_negative" else NUM_BLOCKS + k - 1
        md.block_table[s, j] = bad
        return md, "block_table", bad
    if kind == "qsl_decreasing":
        i = data.draw(st.integers(1, b - 1), label="boundary")
        md.query_start_loc[i] = int(md.query_start_loc[i + 1]) + k
        return md, "query_start_loc", None
    if kind == "qsl_past_tokens":
        md.query_start_loc[-1] = num_tokens + k
        return md, "query_start_loc", num_tokens + k
    if kind == "qsl_nonzero_start":
        md.query_start_loc[0] = data.draw(st.sampled_from([-k, k]), label="start")
        return md, "query_start_loc", None
    if kind == "seq_lens_short":
        s = data.draw(st.integers(0, b - 1), label="seq")
        bad = qlens[s] - data.draw(st.integers(1, qlens[s] + 5), label="short")
        md.seq_lens[s] = bad
        return md, "seq_lens", None
    if kind == "dtype":
        name = data.draw(st.sampled_from(INDEX_TENSORS), label="tensor")
        dtype = data.draw(st.sampled_from([torch.float32, torch.int16, torch.bool, torch.float16]), label="dtype")
        return dataclasses.replace(md, **{name: getattr(md, name).to(dtype)}), name, dtype
    if kind == "device":
        name = data.draw(st.sampled_from(INDEX_TENSORS), label="tensor")
        return dataclasses.replace(md, **{name: getattr(md, name).to("meta")}), name, "meta"
    if kind == "shape":
        name = data.draw(st.sampled_from(INDEX_TENSORS), label="tensor")
        t = getattr(md, name)
        how = data.draw(st.sampled_from(["shorter", "2-D", "flat"]), label="how")
        if how == "shorter" and t.shape[0] > 1:
            t = t[:-1]
        elif how == "2-D" and t.dim() == 1:
            t = t[None]
        else:
            t = t.reshape(-1)[: max(1, t.numel() - 1)] if t.dim() == 2 else t[:0]
        return dataclasses.replace(md, **{name: t}), name, None
    if kind == "block_size":
        bad = data.draw(st.sampled_from([32, 48, 64, 544]), label="block_size")
        return dataclasses.replace(md, block_size=bad), "block_size", bad
    if kind in ("max_query_len", "max_seq_len"):
        actual = getattr(md, kind)
        bad = data.draw(st.integers(0, actual - 1), label="hint")
        return dataclasses.replace(md, **{kind: bad}), kind, bad
    if kind == "num_actual_tokens":
        bad = data.draw(st.integers(0, num_tokens + 3).filter(lambda x: x != num_tokens), label="n")
        return dataclasses.replace(md, num_actual_tokens=bad), "num_actual_tokens", bad
    raise AssertionError(kind)


METADATA_MISTAKES = ["slot_outside", "slot_in_another_block", "block_negative", "block_past_cache",
                     "qsl_decreasing", "qsl_past_tokens", "qsl_nonzero_start", "seq_lens_short", "dtype",
                     "device", "shape", "block_size", "max_query_len", "max_seq_len", "num_actual_tokens"]


@SETTINGS
@given(kind=st.sampled_from(METADATA_MISTAKES), layout=st.sampled_from(["LHBNC", "LBHNC"]), data=st.data())
def test_layer_ops_reject_bad_metadata_before_writing(kind, layout, data):
    s = stepped_layer("prop", seed=data.draw(st.integers(0, 3), label="seed"), layout=layout)
    md, param, value = _mutate(s.md, kind, data, s.query_lens, s.num_tokens)
    q, k, v = qkv(s.num_tokens, s.g)
    out = poison(torch.empty(s.num_tokens, H, D))
    before = snapshot(out, s.layer.kv_cache)
    with pytest.raises(ERRORS) as e:
        run_layer_ops(s.layer, md, q, k, v, out)
    # The cache update runs first and must reject what the attention would.
    _assert_clear(e.value, "rocm_attn.unified_kv_cache_update", param, value)
    assert unchanged(before, out, s.layer.kv_cache), kind


@SETTINGS
@given(kind=st.sampled_from(METADATA_MISTAKES), data=st.data())
def test_attention_op_alone_rejects_bad_metadata(kind, data):
    s = stepped_layer("prop_attn")
    md, param, value = _mutate(s.md, kind, data, s.query_lens, s.num_tokens)
    q, k, v = qkv(s.num_tokens, s.g)
    out = poison(torch.empty(s.num_tokens, H, D))
    before = snapshot(out, s.layer.kv_cache)
    with pytest.raises(ERRORS) as e, ira.set_forward_context(md):
        torch.ops.rocm_attn.unified_attention_with_output(q.view(-1, H, D), k.view(-1, HKV, D), v.view(-1, HKV, D),
                                                          out, s.layer.layer_name, None)
    _assert_clear(e.value, "rocm_attn.unified_attention_with_output", param, value)
    assert unchanged(before, out, s.layer.kv_cache), kind


@SETTINGS
@given(which=st.sampled_from(["query", "key", "value"]),
       mistake=st.sampled_from(["dtype", "device", "width", "tokens"]), data=st.data())
def test_layer_forward_rejects_bad_qkv_before_writing(which, mistake, data):
    s = stepped_layer("prop_qkv")
    t = {"query": 0, "key": 1, "value": 2}[which]
    x = list(qkv(s.num_tokens, s.g))
    if mistake == "dtype":
        x[t] = x[t].to(data.draw(st.sampled_from([torch.float16, torch.float64, torch.int32]), label="dtype"))
    elif mistake == "device":
        x[t] = x[t].to("meta")
    elif mistake == "width":
        x[t] = x[t][:, : x[t].shape[1] - data.draw(st.integers(1, 63), label="cut")]
    else:
        x[t] = x[t][: s.num_tokens - data.draw(st.integers(1, s.num_tokens - 1), label="cut")]
    before = snapshot(s.layer.kv_cache)
    with pytest.raises(ERRORS) as e, ira.set_forward_context(s.md):
        s.layer(*x)
    assert "Attention 'prop_qkv." in str(e.value) or "rocm_attn." in str(e.value), str(e.value)
    assert any(n in str(e.value) for n in ("query", "key", "value", "num_actual_tokens", "slot_mapping")), str(e.value)
    assert unchanged(before, s.layer.kv_cache)


@SETTINGS
@given(bad=st.one_of(st.integers(-10_000, -1), st.integers(64, 10_000)), data=st.data())
def test_layer_rope_op_rejects_positions_outside_the_table(bad, data):
    s = stepped_layer("prop_rope")
    q, k, v = qkv(s.num_tokens, s.g)
    positions = s.md.positions.clone()
    i = data.draw(st.integers(0, s.num_tokens - 1), label="token")
    positions[i] = bad
    cos_sin = torch.randn(64, D)
    before = snapshot(q, k, s.layer.kv_cache)
    with pytest.raises(IndexError) as e, ira.set_forward_context(s.md):
        torch.ops.rocm_attn.unified_rope_and_kv_cache_update(positions, q, k, v, cos_sin, True, s.layer.layer_name)
    _assert_clear(e.value, "rocm_attn.unified_rope_and_kv_cache_update", "positions", bad)
    assert unchanged(before, q, k, s.layer.kv_cache)


# --- kernel-level ops ----------------------------------------------------------------------------


def _paged_case(data):
    qlens = data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=4), label="qlens")
    ctx = data.draw(st.lists(st.integers(0, 40), min_size=len(qlens), max_size=len(qlens)), label="ctx")
    return make_paged_case(qlens, ctx, dtype=torch.float32, seed=data.draw(st.integers(0, 9), label="seed"))


@SETTINGS
@given(kind=st.sampled_from(["qsl_decreasing", "qsl_past_tokens", "seq_lens_short", "block_negative",
                             "block_past_cache", "max_query_len", "max_seq_len", "device", "dtype"]),
       data=st.data())
def test_paged_attention_rejects_bad_indices(kind, data):
    c = _paged_case(data)
    b, t, nb = len(c.query_lens), c.query.shape[0], c.kv_cache.shape[0]
    args = dict(output=poison(torch.empty_like(c.query)), query=c.query, key=c.key, value=c.value,
                kv_cache=c.kv_cache, query_start_loc=c.query_start_loc.clone(), seq_lens=c.seq_lens.clone(),
                block_table=c.block_table.clone(), max_query_len=c.max_query_len, max_seq_len=c.max_seq_len,
                scale=0.125, k_scale=c.k_scale, v_scale=c.v_scale)
    k = data.draw(st.integers(1, 500), label="k")
    value = None
    if kind == "qsl_decreasing":
        i = data.draw(st.integers(1, b - 1), label="boundary")
        args["query_start_loc"][i] = int(args["query_start_loc"][i + 1]) + k
        param = "query_start_loc"
    elif kind == "qsl_past_tokens":
        args["query_start_loc"][-1] = t + k
        param, value = "query_start_loc", t + k
    elif kind == "seq_lens_short":
        s = data.draw(st.integers(0, b - 1), label="seq")
        args["seq_lens"][s] = c.query_lens[s] - data.draw(st.integers(1, c.query_lens[s]), label="short")
        param = "seq_lens"
    elif kind in ("block_negative", "block_past_cache"):
        s = data.draw(st.integers(0, b - 1), label="seq")
        used = -(-int(c.seq_lens[s]) // c.kv_cache.shape[2])
        j = data.draw(st.integers(0, used - 1), label="col")
        value = -k if kind == "block_negative" else nb + k - 1
        args["block_table"][s, j] = value
        param = "block_table"
    elif kind in ("max_query_len", "max_seq_len"):
        value = data.draw(st.integers(0, args[kind] - 1), label="hint")
        args[kind], param = value, kind
    else:
        param = data.draw(st.sampled_from(["query_start_loc", "seq_lens", "block_table", "key", "output"]),
                          label="tensor")
        if kind == "device":
            args[param], value = args[param].to("meta"), "meta"
        else:
            args[param] = args[param].to(torch.float64 if param in ("key", "output") else torch.float32)
    before = snapshot(args["output"], c.kv_cache)
    with pytest.raises(ERRORS) as e:
        torch.ops.rocm_attn.paged_attention(**args)
    _assert_clear(e.value, "rocm_attn.paged_attention", param, value)
    if args["output"].device.type != "meta":
        assert unchanged(before, args["output"], c.kv_cache)
    else:
        assert unchanged(before[1:], c.kv_cache)


@SETTINGS
@given(kind=st.sampled_from(["slot_outside", "device", "dtype", "too_many"]), data=st.data())
def test_reshape_and_cache_rejects_bad_slots(kind, data):
    c = _paged_case(data)
    slots = c.slot_mapping.clone()
    t = slots.shape[0]
    value = None
    if kind == "slot_outside":
        value = c.kv_cache.shape[0] * c.kv_cache.shape[2] + data.draw(st.integers(0, 999), label="k")
        slots[data.draw(st.integers(0, t - 1), label="token")] = value
    elif kind == "device":
        slots, value = slots.to("meta"), "meta"
    elif kind == "dtype":
        slots = slots.to(data.draw(st.sampled_from([torch.float32, torch.int16, torch.uint8]), label="dtype"))
    else:
        slots = torch.cat([slots, slots[:1]])
    before = snapshot(c.kv_cache)
    with pytest.raises(ERRORS) as e:
        torch.ops.rocm_attn.reshape_and_cache(c.key, c.value, c.kv_cache, slots, c.k_scale, c.v_scale, False)
    _assert_clear(e.value, "rocm_attn.reshape_and_cache", "slot_mapping", value)
    assert unchanged(before, c.kv_cache)


@SETTINGS
@given(rows=st.integers(1, 64), data=st.data())
def test_rotary_rejects_positions_outside_the_table(rows, data):
    t = data.draw(st.integers(1, 8), label="tokens")
    positions = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=t, max_size=t), label="ok"))
    bad = data.draw(st.one_of(st.integers(-5000, -1), st.integers(rows, rows + 5000)), label="bad")
    positions[data.draw(st.integers(0, t - 1), label="token")] = bad
    g = torch.Generator().manual_seed(rows)
    q, k = torch.randn(t, 4 * D, generator=g), torch.randn(t, 2 * D, generator=g)
    before = snapshot(q, k)
    with pytest.raises(IndexError) as e:
        torch.ops.rocm_attn.rotary_embedding(positions, q, k, D, torch.randn(rows, D), True)
    _assert_clear(e.value, "rocm_attn.rotary_embedding", "positions", bad)
    assert unchanged(before, q, k)


@SETTINGS
@given(lens=st.lists(st.integers(0, 6), min_size=1, max_size=4), extra=st.integers(-6, 6).filter(bool),
       data=st.data())
def test_encoder_rejects_cu_seqlens_not_covering_the_tokens(lens, extra, data):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = int(cu[-1]) + extra  # the sequences cover fewer or more tokens than the query has
    if t < 1:
        t = int(cu[-1]) + 1
    g = torch.Generator().manual_seed(t)
    q, k, v = torch.randn(t, 4, D, generator=g), torch.randn(t, 2, D, generator=g), torch.randn(t, 2, D, generator=g)
    with pytest.raises(ValueError) as e:
        torch.ops.rocm_attn.encoder_attention(q, k, v, cu, max(lens), 0.125)
    _assert_clear(e.value, "rocm_attn.encoder_attention", "cu_seqlens", int(cu[-1]))
