"""The Triton provider's launch configs (``kernels/triton/configs.py``): tuned entries,
heuristics, KV split rules and the one-loop rule, checked on host shapes (no kernel runs;
tests/triton_sm90_compile.py checks that the launcher passes these choices to its launches)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from inductor_rocm_attn.kernels.triton.configs import (
    D512_PROGRAMS_PER_SM, DECODE_KINDS, LAST_SPLIT_MAX_SPLITS, MAX_SPLITS, MIN_SPLIT_TOKENS, ONE_LOOP_MAX_TILES,
    DecodeConfig, PrefillConfig, decode_config, decode_plan, num_kv_splits, prefill_config,
    reduce_num_warps, split_merge_of, verify_config, verify_rows, writer_block_t, writer_num_warps,
)


def test_decode_config_rules():
    # measured entries (bf16, d=128, block 16): one warp for GQA 4 and for GQA 2 with
    # interleaved V (its V loaded as packets)
    tuned = DecodeConfig(16, 1, 3, "rows3", one_loop_max_tiles=ONE_LOOP_MAX_TILES)
    assert decode_config(128, 4, 16, torch.bfloat16) == tuned
    assert decode_config(128, 2, 16, torch.bfloat16, interleaved_v=True) == tuned
    # one warp only where its [16, HEAD] tile fits the registers and was measured faster
    assert decode_config(64, 8, 32, torch.float16).num_warps == 1
    assert decode_config(128, 32, 16, torch.bfloat16).num_warps == 4  # 32 GQA rows
    assert decode_config(256, 4, 16, torch.bfloat16).num_warps == 4  # d = 256
    # fp8 caches: the one-warp tile too, with fp16 dots (measured 1.47-1.96x the bf16 speed)
    fp8 = decode_config(128, 4, 32, torch.float8_e4m3fn)
    assert (fp8.num_warps, fp8.kind, fp8.fp8_fp16_dot) == (1, "rows3", True)
    assert decode_config(256, 4, 16, torch.float8_e5m2).fp8_fp16_dot  # the generic config too
    assert not decode_config(128, 4, 16, torch.bfloat16).fp8_fp16_dot
    assert decode_config(128, 4, 16, torch.float32).num_warps == 4  # fp32 cache: generic
    assert decode_config(128, 4, 32, torch.bfloat16, interleaved_v=True).num_warps == 1
    for cfg in (decode_config(h, g, 16, d) for h in (64, 128, 256) for g in (1, 8, 32)
                for d in (torch.bfloat16, torch.float8_e5m2)):
        assert cfg.kind in DECODE_KINDS
    # cached: the eager path pays one lookup per call
    assert decode_config(128, 4, 16, torch.bfloat16) is decode_config(128, 4, 16, torch.bfloat16)


def test_prefill_config_rules():
    assert prefill_config(128, 4, 16, torch.bfloat16) == (
        PrefillConfig(128, 64, 8, 3) if torch.version.hip else PrefillConfig(128, 128, 8, 3))
    assert prefill_config(64, 1, 16, torch.float16) == PrefillConfig(128, 64, 4, 3)
    assert prefill_config(256, 4, 16, torch.float32) == PrefillConfig(32, 32, 4, 2)
    assert prefill_config(128, 4, 16, torch.float16, interpret=True) == PrefillConfig(16, 16, 4, 1)
    d = PrefillConfig(1, 1, 1, 1)
    assert (d.k_rows, d.context_margin, d.dense_margin, d.longest_first, d.dense_tma) == (
        2, 8.0, 0.0, True, True)


def test_bad_configs_are_errors():
    with pytest.raises(ValueError, match=r"paged_attention: decode kind 'bogus'.*streams"):
        DecodeConfig(16, 1, 1, "bogus")
    with pytest.raises(ValueError, match=r"paged_attention: decode k_rows 3; supported: 0, 1, 2"):
        DecodeConfig(16, 1, 1, "rows", k_rows=3)
    with pytest.raises(ValueError, match=r"paged_attention: prefill k_rows 5"):
        PrefillConfig(16, 16, 4, 1, k_rows=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        decode_config(128, 4, 16, torch.bfloat16).tile_n = 32


def test_num_kv_splits_from_shapes_only():
    # fills the GPU twice already: no split
    assert num_kv_splits(64, 8, 1, 4096, 132) == 1
    # one sequence: split, but never below MIN_SPLIT_TOKENS keys a split
    s = num_kv_splits(1, 8, 1, 4096, 132)
    assert 1 < s <= 4096 // MIN_SPLIT_TOKENS
    assert num_kv_splits(1, 8, 1, MIN_SPLIT_TOKENS, 132) == 1
    assert num_kv_splits(1, 1, 1, 1 << 20, 132) <= MAX_SPLITS


def test_fp8_decode_splits_until_four_programs_per_sm():
    """fp8 programs hold half the bytes in flight: B=64 x 8 KV heads (512 programs on 132
    SMs) splits in two (H200: 144 vs 174 us), B=128 does not; bf16 keeps one split at B=64."""
    def splits(b, dtype):
        cfg = decode_config(128, 4, 16, dtype)
        return decode_plan(cfg, None, num_seqs=b, num_kv_heads=8, head_chunks=1, max_ctx=4096,
                           num_sms=132)[1]

    fp8 = torch.float8_e4m3fn
    assert [splits(b, fp8) for b in (16, 64, 128)] == [8, 2, 1]
    assert [splits(b, torch.bfloat16) for b in (16, 64, 128)] == [8, 1, 1]
    with pytest.raises(ValueError, match="one_split_ctas_per_sm 0"):
        DecodeConfig(16, 1, 3, "rows3", one_split_ctas_per_sm=0)


def test_short_splits_run_the_three_loop_config_as_one_loop():
    """The tuned "rows3" runs as one masked loop when each split holds few tiles (B=1: 64
    splits), and as three loops otherwise; a config built by hand, or given splits, are
    taken as given."""
    tuned = decode_config(128, 4, 16, torch.bfloat16)
    assert tuned.kind == "rows3"
    plan = dict(num_kv_heads=8, head_chunks=1, max_ctx=4096, num_sms=132)
    assert decode_plan(tuned, None, num_seqs=1, **plan) == ("rows", 64)  # 4 tiles a split
    assert decode_plan(tuned, None, num_seqs=64, **plan) == ("rows3", 1)
    assert decode_plan(DecodeConfig(16, 1, 3, "rows3"), None, num_seqs=1, **plan) == ("rows3", 64)
    assert decode_plan(tuned, 64, num_seqs=1, **plan) == ("rows3", 64)
    assert decode_plan(dataclasses.replace(tuned, kind="keys3"), None, num_seqs=1, **plan)[0] == "keys"
    assert decode_plan(dataclasses.replace(tuned, kind="streams3"), None, num_seqs=1,
                       **plan)[0] == "streams3"


def test_split_rule_variants():
    """The split rule's fields: about ``programs_per_sm`` programs per SM, rounded down (the
    default: B=16 x 8 KV heads on 132 SMs takes 8 splits, 1024 programs, never more than
    programs_per_sm x SMs) or up (9 splits, 1152 programs)."""
    assert num_kv_splits(16, 8, 1, 4096, 132, round_down=False) == 9
    assert num_kv_splits(16, 8, 1, 4096, 132) == 8
    assert num_kv_splits(16, 8, 1, 4096, 132, programs_per_sm=4, round_down=True) == 4
    assert num_kv_splits(64, 8, 1, 4096, 132, round_down=True) == 1  # fills the GPU twice
    assert num_kv_splits(200, 1, 1, 4096, 132, programs_per_sm=1, round_down=True) == 1  # never 0
    tuned = decode_config(128, 4, 16, torch.bfloat16)
    plan = dict(num_seqs=16, num_kv_heads=8, head_chunks=1, max_ctx=4096, num_sms=132)
    assert decode_plan(tuned, None, **plan) == ("rows3", 8)
    assert decode_plan(dataclasses.replace(tuned, splits_round_down=False), None, **plan) == ("rows3", 9)
    # L=1024: 8 splits of 8 tiles run as one loop; 4 splits of 16 tiles as three loops
    short = dict(plan, max_ctx=1024)
    assert decode_plan(dataclasses.replace(tuned, splits_round_down=True), None, **short) == ("rows", 8)
    assert decode_plan(dataclasses.replace(tuned, programs_per_sm=4, splits_round_down=True),
                       None, **short) == ("rows3", 4)
    with pytest.raises(ValueError, match=r"paged_attention: decode programs_per_sm 0; supported: >= 1"):
        DecodeConfig(16, 1, 3, "rows3", programs_per_sm=0)


def test_head_size_512_splits_for_two_programs_per_sm():
    """Gemma4's full layers (32/4 heads, head 512) on 132 SMs: B=1 keeps 64 splits, B=16
    takes 4 (256 programs: one wave of 2 an SM), B=64 one (H100: 196.5 / 706.3 us against
    210.5 / 724.0 with 8 programs an SM's 16 / 4 splits); head 128 keeps its rule."""
    plan = dict(num_kv_heads=4, head_chunks=1, max_ctx=4096, num_sms=132)
    for cfg in (decode_config(512, 8, 16, torch.bfloat16), verify_config(512, 8, 16, torch.bfloat16, q_max=4)):
        assert [decode_plan(cfg, None, num_seqs=b, **plan)[1] for b in (1, 16, 64, 128)] == [64, 4, 1, 1]
    d128 = decode_config(128, 4, 16, torch.bfloat16)
    assert decode_plan(d128, None, num_seqs=16, **dict(plan, num_kv_heads=8))[1] == 8


def test_verify_config_rules():
    """Verify rows are (query token, GQA head) pairs, 16..64 a program; a warp per 16 rows
    on top of the decode config of the shape."""
    assert [verify_rows(4, q, 128) for q in (2, 4, 8)] == [16, 16, 32]
    assert verify_rows(8, 8, 128) == 64 and verify_rows(16, 8, 256) == 64 and verify_rows(1, 2, 128) == 16
    base = decode_config(128, 4, 16, torch.bfloat16)
    assert verify_config(128, 4, 16, torch.bfloat16, q_max=4) == base  # 16 rows: one warp
    assert verify_config(128, 4, 16, torch.bfloat16, q_max=8) == dataclasses.replace(base, num_warps=2)
    assert verify_config(128, 8, 16, torch.bfloat16, q_max=8).num_warps == 4
    assert verify_config(128, 4, 32, torch.float8_e4m3fn, q_max=8).num_warps == 4  # fp8: 4 already
    assert verify_config(64, 4, 16, torch.float16, interpret=True, q_max=8) == decode_config(
        64, 4, 16, torch.float16, interpret=True)


def test_head_size_512_configs():
    """Head size 512 has configs of its own, chosen so that every launch compiles for sm_90
    without spills and within shared memory (tests/triton_sm90_compile.py checks the compiled
    launches); the head sizes up to 256 keep theirs. 16-bit decode: the fastest of an H100
    sweep (16-key tiles, 4 warps); verify the same tile with 2 stages (an H100 sweep); both
    split for 2 programs an SM (an H100 split sweep)."""
    for dtype in (torch.bfloat16, torch.float16):
        assert decode_config(512, 8, 16, dtype) == DecodeConfig(
            16, 4, 3, "rows", one_loop_max_tiles=ONE_LOOP_MAX_TILES, programs_per_sm=D512_PROGRAMS_PER_SM)
        v = verify_config(512, 8, 16, dtype, q_max=8)
        assert (v.tile_n, v.num_warps, v.num_stages, v.fp8_fp16_dot) == (16, 4, 2, False)
        assert v.programs_per_sm == D512_PROGRAMS_PER_SM
        assert prefill_config(512, 8, 16, dtype) == PrefillConfig(32, 16, 4, 2)
    fp8 = decode_config(512, 8, 16, torch.float8_e4m3fn)
    assert (fp8.tile_n, fp8.num_warps, fp8.fp8_fp16_dot) == (16, 4, True)
    assert decode_config(512, 8, 16, torch.float32) == DecodeConfig(16, 8, 2, "rows", k_rows=0,
                                                                    one_loop_max_tiles=ONE_LOOP_MAX_TILES)
    fp8_verify = verify_config(512, 8, 16, torch.float8_e4m3fn, q_max=8)
    assert (fp8_verify.tile_n, fp8_verify.num_warps, fp8_verify.fp8_fp16_dot) == (16, 4, False)
    assert verify_config(512, 8, 16, torch.float32, q_max=8).num_warps == 16
    assert prefill_config(512, 8, 16, torch.float32) == PrefillConfig(16, 16, 8, 2, k_rows=0, dense_tma=False)
    # at most 32 verify rows, 8 warps for the merge of 64 splits
    assert verify_rows(8, 8, 512) == 32 and verify_rows(16, 8, 512) == 32 and verify_rows(1, 2, 512) == 16
    assert reduce_num_warps(64, 512) == 8 and reduce_num_warps(33, 512) == 8 and reduce_num_warps(32, 512) == 4
    # the other head sizes as before
    assert [reduce_num_warps(s, d) for s in (2, 64) for d in (64, 128, 256)] == [4] * 6
    assert decode_config(256, 8, 16, torch.bfloat16) == DecodeConfig(32, 4, 3, "rows",
                                                                     one_loop_max_tiles=ONE_LOOP_MAX_TILES)
    assert prefill_config(256, 8, 16, torch.bfloat16) == PrefillConfig(64, 32, 4, 2)
    assert verify_config(256, 8, 16, torch.float8_e4m3fn, q_max=8).tile_n == 64


def test_writer_tile_rules():
    assert [writer_block_t(t) for t in (1, 32, 33, 512, 513)] == [1, 1, 2, 2, 8]
    assert writer_num_warps(1, 128) == 1 and writer_num_warps(8, 128) == 4
    assert writer_num_warps(16, 256) == 8  # at most 8


def test_split_merge_rule():
    """"auto" merges in the last split program up to LAST_SPLIT_MAX_SPLITS splits (and never
    for the streams kinds, which lack it), else in the reduce kernel; given merges stand."""
    cfg = DecodeConfig(16, 1, 3, "rows3")
    assert cfg.split_merge == "auto"
    assert split_merge_of(cfg, LAST_SPLIT_MAX_SPLITS) == "last_split"
    assert split_merge_of(cfg, LAST_SPLIT_MAX_SPLITS + 1) == "reduce"
    assert split_merge_of(DecodeConfig(32, 2, 3, "streams"), 2) == "reduce"
    assert split_merge_of(DecodeConfig(16, 1, 3, "keys3", split_merge="last_split"), 64) == "last_split"
    with pytest.raises(ValueError, match=r"decode split_merge 'fused' \(default from ROCM_ATTN_SPLIT"):
        DecodeConfig(16, 1, 3, "rows3", split_merge="fused")
    with pytest.raises(ValueError, match=r"split_merge 'last_split' with kind 'streams3'"):
        DecodeConfig(64, 4, 3, "streams3", split_merge="last_split")


@pytest.mark.parametrize("value,expect", [("reduce", "reduce"), ("bogus", "ValueError")])
def test_split_merge_env_default(value, expect):
    """ROCM_ATTN_SPLIT_MERGE sets the merge of every default config; a bad value fails at
    import, naming the variable."""
    code = ("from inductor_rocm_attn.kernels.triton.configs import decode_config\n"
            "import torch\n"
            "print(decode_config(128, 4, 16, torch.bfloat16).split_merge)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "ROCM_ATTN_SPLIT_MERGE": value})
    if expect == "ValueError":
        assert r.returncode != 0 and "ROCM_ATTN_SPLIT_MERGE" in r.stderr and "'bogus'" in r.stderr
    else:
        assert r.returncode == 0 and r.stdout.strip() == expect, r.stderr
