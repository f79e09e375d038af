"""Every unsupported input named in DESIGN.md raises a clear error naming op, value and what is supported."""

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import validation
from inductor_rocm_attn.layout import KVCacheSpec, allocate_kv_cache, customize_spec

from cases import make_paged_case, poison


def _attn(case, **over):
    args = dict(output=poison(torch.empty_like(case.query)), query=case.query, key=case.key,
                value=case.value, kv_cache=case.kv_cache, query_start_loc=case.query_start_loc,
                seq_lens=case.seq_lens, block_table=case.block_table,
                max_query_len=case.max_query_len, max_seq_len=case.max_seq_len, scale=0.1,
                k_scale=case.k_scale, v_scale=case.v_scale)
    args.update(over)
    torch.ops.rocm_attn.paged_attention(**args)


@pytest.mark.parametrize("block_size", [8, 24, 0, 100])
def test_block_size_not_multiple_of_16(block_size):
    with pytest.raises(ValueError, match=rf"block_size {block_size} is not supported.*multiple of 16"):
        customize_spec(block_size, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="multiple of 16"):
        ira.Attention(4, 64, layer_name=f"bad_bs_{block_size}", block_size=block_size)


@pytest.mark.parametrize("head_size", [16, 48, 100, 384, 1024])
def test_unsupported_head_size(head_size):
    with pytest.raises(ValueError, match=rf"head_size {head_size} is not supported; supported: \(32, 64"):
        ira.RocmAttentionImpl(4, head_size, 0.1)


def test_encoder_decoder_rejected_with_reason():
    with pytest.raises(NotImplementedError, match="encoder_decoder is not supported: the prefill path "
                                                  "assumes self-attention.*max_query_len > 1"):
        ira.RocmAttentionImpl(4, 64, 0.1, attn_type="encoder_decoder")


def test_unknown_attention_type():
    with pytest.raises(ValueError, match="attention type 'sideways' is unknown"):
        ira.RocmAttentionImpl(4, 64, 0.1, attn_type="sideways")


def test_output_block_scale_rejected():
    impl = ira.RocmAttentionImpl(4, 64, 0.1)
    out = torch.empty(3, 4, 64)
    with pytest.raises(NotImplementedError, match="output_block_scale"):
        impl.forward(None, out, out, out, None, None, out, output_block_scale=torch.ones(1))


def test_fp8_query_scale_accepted_at_construction():
    # Rejected only when an fp8 query arrives (tests/test_seed_checks.py).
    ira.RocmAttentionImpl(4, 64, 0.1, kv_cache_dtype="fp8", q_scale=0.5)


def test_bad_kv_cache_dtype():
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int4' is not supported; supported: \('auto'"):
        ira.RocmAttentionImpl(4, 64, 0.1, kv_cache_dtype="int4")


def test_gqa_ratio_must_divide():
    with pytest.raises(ValueError, match="num_heads 6 must be a multiple of num_kv_heads 4"):
        ira.RocmAttentionImpl(6, 64, 0.1, num_kv_heads=4)


def test_slot_mapping_outside_cache():
    case = make_paged_case([3], [5], dtype=torch.float32)
    nslots = case.kv_cache.shape[0] * case.kv_cache.shape[2]
    slots = torch.tensor([0, 1, nslots], dtype=torch.int64)
    with pytest.raises(IndexError, match=rf"reshape_and_cache: slot_mapping entry {nslots} \(token 2\) is outside the cache"):
        torch.ops.rocm_attn.reshape_and_cache(case.key, case.value, case.kv_cache, slots, case.k_scale,
                                              case.v_scale, False)


def test_slot_mapping_dtype():
    case = make_paged_case([3], [5], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"slot_mapping has dtype torch.float32; supported"):
        torch.ops.rocm_attn.reshape_and_cache(case.key, case.value, case.kv_cache, torch.zeros(3),
                                              case.k_scale, case.v_scale, False)


def test_block_table_entry_outside_cache():
    case = make_paged_case([3, 1], [5, 17], dtype=torch.float32)
    case.block_table[1, 1] = case.kv_cache.shape[0] + 3
    with pytest.raises(IndexError, match=r"paged_attention: block_table\[1, 1\] = \d+ is outside the cache"):
        _attn(case)


def test_block_table_too_narrow():
    case = make_paged_case([3], [40], dtype=torch.float32)
    with pytest.raises(ValueError, match="needs 3 blocks but block_table has 2 columns"):
        _attn(case, block_table=case.block_table[:, :2])


def test_mismatched_dtypes():
    case = make_paged_case([3], [5], dtype=torch.float32)
    with pytest.raises(ValueError, match="key dtype torch.float16 != query dtype torch.float32"):
        _attn(case, key=case.key.half(), value=case.value.half())
    with pytest.raises(ValueError, match="key dtype torch.float32 != value dtype torch.float16"):
        torch.ops.rocm_attn.reshape_and_cache(case.key, case.value.half(), case.kv_cache,
                                              case.slot_mapping, case.k_scale, case.v_scale, False)
    with pytest.raises(ValueError, match="output dtype torch.float16 != query dtype torch.float32"):
        _attn(case, output=torch.empty_like(case.query, dtype=torch.float16))


@pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), float("inf")])
def test_softmax_scale_must_be_positive(scale):
    case = make_paged_case([3], [5])
    with pytest.raises(ValueError, match=r"rocm_attn.paged_attention: scale must be a positive finite number, got"):
        _attn(case, scale=scale)
    t = case.query.shape[0]
    with pytest.raises(ValueError, match=r"rocm_attn.encoder_attention: scale must be a positive finite"):
        torch.ops.rocm_attn.encoder_attention(
            case.query, case.key, case.value, torch.tensor([0, t], dtype=torch.int32), t, scale)


def test_mismatched_devices():
    """The op itself rejects a cache on another device than the query, before writing. This
    machine has one real device, so the cache goes to "meta" and the call is sent to the
    op's device implementation (the one a CUDA call reaches) with an explicit dispatch key:
    plain dispatch would take any call with a meta tensor to the fake kernel."""
    case = make_paged_case([3, 1], [5, 9], dtype=torch.float32)
    out = poison(torch.empty_like(case.query))
    meta_cache = torch.empty_like(case.kv_cache, device="meta")
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    with pytest.raises(ValueError, match=r"rocm_attn.paged_attention: all tensors must be on one "
                                         r"device, got output on cpu, .*kv_cache on meta"):
        torch.ops.rocm_attn.paged_attention.default.redispatch(
            cpu, out, case.query, case.key, case.value, meta_cache, case.query_start_loc,
            case.seq_lens, case.block_table, case.max_query_len, case.max_seq_len, 0.1,
            case.k_scale, case.v_scale, True, -1, None, None, 0.0, False, None)
    assert out.isnan().all(), "a rejected call wrote its output"


def test_unsupported_model_dtype():
    k = torch.zeros(2, 2, 64, dtype=torch.float64)
    cache = allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.float32), 2)
    with pytest.raises(ValueError, match=r"key has dtype torch.float64; supported"):
        torch.ops.rocm_attn.reshape_and_cache(k, k, cache, torch.zeros(2, dtype=torch.int64),
                                              torch.ones(1), torch.ones(1), False)


def test_cache_shape_mismatch():
    case = make_paged_case([3], [5], dtype=torch.float32, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"kv_cache last dim 128 != num_kv_heads \* head_size = 1 \* 64"):
        torch.ops.rocm_attn.reshape_and_cache(case.key[:, :1], case.value[:, :1], case.kv_cache,
                                              case.slot_mapping, case.k_scale, case.v_scale, False)


def test_fp8_output_needs_output_scale_dtype():
    case = make_paged_case([3], [5], dtype=torch.float32)
    with pytest.raises(ValueError, match="output_scale .* needs an fp8 output"):
        _attn(case, output_scale=torch.ones(1))


def test_metadata_builder_errors():
    with pytest.raises(ValueError, match="needs 2 blocks of 16, but its block table has 1"):
        ira.build_attention_metadata([5], [20], [[3]], 16)
    with pytest.raises(ValueError, match="one entry per sequence"):
        ira.build_attention_metadata([5, 1], [20], [[3, 4]], 16)


def test_metadata_builder_refuses_a_written_block_used_twice():
    """A new token's block must appear once among the step's used blocks, or the write lands
    in another sequence's context (or the same sequence's earlier tokens). Shared prefix
    blocks that nobody writes, padding sequences and unused -1 entries are fine."""
    with pytest.raises(ValueError, match=r"build_attention_metadata: block 0 receives a new token of sequence 0 "
                                         r"\(token 0, position 3\) but is used 2 times in this step "
                                         r"\(block_tables\[0\]\[0\], block_tables\[1\]\[0\]\); a block written in a "
                                         r"step must belong to one sequence, once \(shared prefix blocks are "
                                         r"read-only\)"):
        ira.build_attention_metadata([1, 1], [3, 3], [[0], [0]], 16)
    with pytest.raises(ValueError, match=r"block 7 receives a new token of sequence 1 \(token 1, position 20\) but "
                                         r"is used 2 times in this step \(block_tables\[1\]\[0\], "
                                         r"block_tables\[1\]\[1\]\)"):
        ira.build_attention_metadata([1, 1], [3, 20], [[2], [7, 7]], 16)
    md = ira.build_attention_metadata([1, 1], [20, 20], [[0, 1], [0, 2]], 16)  # shared prefix block 0
    assert md.slot_mapping.tolist() == [20, 36]
    md = ira.build_attention_metadata([1, 1], [3, 0], [[0, -1], [0]], 16, padding=[False, True])
    assert md.slot_mapping.tolist() == [3, -1]


def test_metadata_builder_refuses_lengths_past_int32():
    # seq_lens and query_start_loc are int32: torch's overflow error named no op or sequence.
    big = 2**27  # a block size that keeps the block table short
    with pytest.raises(ValueError, match=r"build_attention_metadata: sequence 0 has 2147483649 tokens.*at most "
                                         r"2\*\*31 - 1 each \(seq_lens and query_start_loc are int32\)"):
        ira.build_attention_metadata([1], [2**31], [list(range(17))], big)


def test_duplicate_layer_name():
    keep = ira.Attention(4, 64, layer_name="dup_name")
    with pytest.raises(ValueError, match="'dup_name' is already used by a live layer"):
        ira.Attention(4, 64, layer_name="dup_name")
    del keep


def test_gpu_without_kernel_is_an_error_not_a_fallback():
    from inductor_rocm_attn import providers

    why = providers.get("native").supports("paged_attention", device="cuda", head_size=80,
                                           dtype=torch.float16, block_size=16)
    assert "head sizes (64, 128), not 80" in why
    with pytest.raises(NotImplementedError, match="no provider supports this call"):
        providers.choose("paged_attention", platform="cuda", device="cuda", head_size=64,
                         dtype=torch.float16, exclude=("triton", "aiter", "native"))


def test_partial_rotary_never_dispatches_to_aiter():
    from inductor_rocm_attn import providers

    q = dict(device="cuda", head_size=128, dtype=torch.bfloat16, block_size=16, interleaved_v=True)
    assert "partial_rotary" in providers.get("aiter").supports("rope_and_cache",
                                                               features=("partial_rotary",), **q)
    assert providers.get("triton").supports("rope_and_cache", features=("partial_rotary",), **q) is None


def test_metadata_builder_refuses_non_bool_padding_and_non_int_block_ids():
    """padding=["no"] marked a real sequence as padding (a truthy string); None in an unused
    block-table entry raised torch's "Could not infer dtype of NoneType" naming no op."""
    with pytest.raises(TypeError, match=r"build_attention_metadata: padding\[0\] must be a bool, got str 'no'"):
        ira.build_attention_metadata([1], [0], [[0]], 16, padding=["no"])
    with pytest.raises(TypeError, match=r"build_attention_metadata: block_tables must hold integer block ids"):
        ira.build_attention_metadata([1], [0], [[0, None]], 16)
    ira.build_attention_metadata([1, 1], [0, 0], [[0], [1]], 16, padding=[False, torch.tensor(True)])


def test_metadata_builder_takes_numpy_bools_as_padding_flags():
    """numpy 2 names its bool type ``bool`` (numpy 1: ``bool_``): padding=[np.True_] was refused
    as "must be a bool, got bool np.True_"; a numpy integer still is."""
    np = pytest.importorskip("numpy")
    md = ira.build_attention_metadata([1, 2], [0, 0], [[0], [1]], 16, padding=[np.False_, np.True_])
    assert md.slot_mapping.tolist() == [0, -1, -1]
    with pytest.raises(TypeError, match=r"build_attention_metadata: padding\[0\] must be a bool, got int64 np.int64\(1\)"):
        ira.build_attention_metadata([1], [0], [[0]], 16, padding=[np.int64(1)])
