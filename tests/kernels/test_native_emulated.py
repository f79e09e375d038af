"""The native (csrc) kernels on the CPU: compiled with ``RA_EMULATE`` by the host C++ compiler
and run one fiber per GPU thread (csrc/emulate/), against the float64 oracle.

This checks everything a GPU run checks except timing and the torch binding: the lane
mappings, the K swizzle, the transposed shuffle reduction, the online softmax, the warp
merge, KV splits and their reduction, every cache dtype (bf16 included: conversions are bit
exact here), both V layouts, LHBNC/LBHNC, window, ALiBi, soft cap, sinks, and the writer. It
runs with 32-lane warps (NVIDIA) and 64-lane warps (AMD CDNA). The arguments are filled the
way ``csrc/bindings.cpp`` fills them; the launch plan (splits, warps, stages) comes from
``inductor_rocm_attn.kernels.native``. Inputs are fresh random draws, outputs poisoned first.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import cases
from inductor_rocm_attn.kernels import native
from inductor_rocm_attn.kernels import reference as ref

CXX = shutil.which("g++") or shutil.which("c++")
EMU_DIR = native.CSRC_DIR / "emulate"
TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}
DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float8_e4m3fn: 3,
              torch.float8_e4m3fnuz: 4, torch.float8_e5m2: 5, torch.float8_e5m2fnuz: 6}

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++) for the CPU emulation")

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F = ctypes.c_float


class DecodeParams(ctypes.Structure):  # native_api.h
    _fields_ = [
        ("out", _P), ("out_stride_t", _I64), ("out_stride_h", _I64),
        ("query", _P), ("q_stride_t", _I64), ("q_stride_h", _I64),
        ("k_cache", _P), ("v_cache", _P), ("cache_block_stride", _I64),
        ("block_table", _P), ("block_table_stride", _I64), ("seq_lens", _P), ("query_start_loc", _P),
        ("k_scale", _P), ("v_scale", _P), ("alibi_slopes", _P), ("sinks", _P),
        ("part_acc", _P), ("part_ml", _P), ("merge_counters", _P),
        ("scale", _F), ("logits_soft_cap", _F), ("sliding_window", _I32),
        ("num_seqs", _I32), ("num_heads", _I32), ("num_kv_heads", _I32), ("head_size", _I32),
        ("block_size", _I32), ("num_splits", _I32), ("model_dtype", _I32), ("cache_dtype", _I32),
        ("block_table_is64", _I32), ("seq_lens_is64", _I32), ("query_start_loc_is64", _I32),
        ("interleaved_v", _I32),
    ]


class DecodeConfig(ctypes.Structure):
    _fields_ = [("num_warps", _I32), ("stages", _I32), ("warp_size", _I32), ("max_smem_bytes", _I32),
                ("tensor_cores", _I32)]


class CacheWriteParams(ctypes.Structure):
    _fields_ = [
        ("key", _P), ("value", _P), ("key_stride_t", _I64), ("key_stride_h", _I64),
        ("value_stride_t", _I64), ("value_stride_h", _I64),
        ("k_cache", _P), ("v_cache", _P), ("cache_block_stride", _I64),
        ("slot_mapping", _P), ("k_scale", _P), ("v_scale", _P),
        ("num_tokens", _I32), ("num_kv_heads", _I32), ("head_size", _I32), ("block_size", _I32),
        ("input_dtype", _I32), ("cache_dtype", _I32), ("slot_mapping_is64", _I32),
        ("interleaved_v", _I32), ("vector_loads", _I32), ("variant", _I32),
    ]


def _emu_sources() -> list[Path]:
    return sorted(p for p in native.CSRC_DIR.rglob("*") if p.suffix in (".h", ".cuh", ".cu", ".cpp"))


_LIBS: dict[int, ctypes.CDLL] = {}


def _emulator(warp: int) -> ctypes.CDLL:
    """Build (once per source hash, cached in the temp dir) and load the emulated kernels."""
    if warp in _LIBS:
        return _LIBS[warp]
    h = hashlib.sha256(str(warp).encode())
    for p in _emu_sources():
        h.update(p.read_bytes())
    out = Path(tempfile.gettempdir()) / f"rocm_attn_emu_{h.hexdigest()[:16]}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [CXX, "-std=c++17", "-O1", "-shared", "-fPIC", f"-DRA_EMU_WARP_SIZE={warp}",
               "-o", str(tmp), str(EMU_DIR / "emulated_kernels.cpp")]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        tmp.replace(out)
    lib = ctypes.CDLL(str(out))
    lib.ra_emu_last_error.restype = ctypes.c_char_p
    for f in ("ra_emu_sizeof_decode_params", "ra_emu_sizeof_write_params", "ra_emu_decode_smem_bytes"):
        getattr(lib, f).restype = ctypes.c_size_t
    assert lib.ra_emu_sizeof_decode_params() == ctypes.sizeof(DecodeParams)
    assert lib.ra_emu_sizeof_write_params() == ctypes.sizeof(CacheWriteParams)
    assert lib.ra_emu_warp_size() == warp
    _LIBS[warp] = lib
    return lib


def _ptr(t):
    return None if t is None else t.data_ptr()


def _cache_bases(kv_cache):
    base = kv_cache.data_ptr()
    return base, base + kv_cache.stride(1) * kv_cache.element_size(), kv_cache.stride(0)


def emulated_decode(output, query, kv_cache, query_start_loc, seq_lens, block_table, scale, k_scale,
                    v_scale, sliding_window, alibi_slopes, sinks, logits_soft_cap, interleaved_v, *,
                    warp=32, num_splits=None, num_warps=None, stages=None, split_rule=None, max_seq_len=None,
                    num_sms=8, max_smem=227 << 10, sm_smem=228 << 10, tensor_cores=False, split_merge="reduce",
                    counters=None):
    """native.paged_attention's planning (``native.plan_decode``) + the kernel, on the CPU;
    returns the launch. ``split_merge="last_split"``: the splits merged by the last split CTA,
    through ``counters`` (int32, zeroed; a fresh buffer when None)."""
    num_kv_heads = native.check_decode_args(output, query, kv_cache, query_start_loc, seq_lens,
                                            block_table, k_scale, v_scale, alibi_slopes, sinks, None, 1)
    num_seqs, (_, num_heads, head_size) = seq_lens.shape[0], query.shape
    max_ctx = max_seq_len or block_table.shape[1] * kv_cache.shape[2]
    launch = native.plan_decode(num_seqs, num_kv_heads, num_heads // num_kv_heads, max_ctx, head_size,
                                kv_cache.element_size(), num_sms=num_sms, warp_size=warp, max_smem=max_smem,
                                sm_smem=sm_smem, num_warps=num_warps, stages=stages, num_splits=num_splits,
                                split_rule=split_rule)
    num_warps, stages, num_splits = launch.num_warps, launch.stages, launch.num_splits
    part_acc = torch.full((num_seqs, num_heads, num_splits, head_size), float("nan"))
    part_ml = torch.full((num_seqs, num_heads, num_splits, 2), float("nan"))
    if split_merge == "last_split" and num_splits > 1 and counters is None:
        gt = native.heads_per_cta(num_heads // num_kv_heads)
        counters = torch.zeros(num_seqs * num_kv_heads * -(-(num_heads // num_kv_heads) // gt), dtype=torch.int32)
    elif split_merge != "last_split" or num_splits == 1:
        counters = None
    slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
    sink = None if sinks is None else sinks.float().contiguous()
    kb, vb, bstride = _cache_bases(kv_cache)
    p = DecodeParams(
        _ptr(output), output.stride(0), output.stride(1), _ptr(query), query.stride(0), query.stride(1),
        kb, vb, bstride, _ptr(block_table), block_table.stride(0), _ptr(seq_lens), _ptr(query_start_loc),
        _ptr(k_scale), _ptr(v_scale), _ptr(slopes), _ptr(sink), _ptr(part_acc), _ptr(part_ml), _ptr(counters),
        scale, logits_soft_cap, sliding_window if sliding_window > 0 else 0,
        num_seqs, num_heads, num_kv_heads, head_size, kv_cache.shape[2], num_splits,
        DTYPE_CODE[query.dtype], DTYPE_CODE[kv_cache.dtype],
        int(block_table.dtype == torch.int64), int(seq_lens.dtype == torch.int64),
        int(query_start_loc.dtype == torch.int64), int(interleaved_v))
    cfg = DecodeConfig(num_warps, stages, warp, max_smem, int(tensor_cores))
    lib = _emulator(warp)
    rc = lib.ra_emu_paged_decode(ctypes.byref(p), ctypes.byref(cfg))
    assert rc == 0, lib.ra_emu_last_error().decode()
    return launch


def emulated_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, interleaved_v, *, warp=32, variant=None):
    """native.reshape_and_cache on the CPU; ``variant`` a ``native.WRITER_VARIANTS`` name (None:
    the launcher's rule) or a raw WriterVariant code (int)."""
    code = variant if isinstance(variant, int) else 0 if variant is None else native.writer_variant_code(variant)
    native.check_write_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    kb, vb, bstride = _cache_bases(kv_cache)
    eb = key.element_size()
    aligned = all(t.data_ptr() % 16 == 0 and (t.stride(0) * eb) % 16 == 0 and (t.stride(1) * eb) % 16 == 0
                  for t in (key, value))
    p = CacheWriteParams(
        _ptr(key), _ptr(value), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kb, vb, bstride, _ptr(slot_mapping), _ptr(k_scale), _ptr(v_scale),
        slot_mapping.shape[0], key.shape[1], key.shape[2], kv_cache.shape[2],
        DTYPE_CODE[key.dtype], DTYPE_CODE[kv_cache.dtype], int(slot_mapping.dtype == torch.int64),
        int(interleaved_v), int(aligned), code)
    lib = _emulator(warp)
    rc = lib.ra_emu_reshape_and_cache(ctypes.byref(p))
    assert rc == 0, lib.ra_emu_last_error().decode()


def check_decode(context_lens, *, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                 dtype=torch.bfloat16, cache_dtype=None, layout="LHBNC", interleaved_v=False,
                 sliding_window=-1, alibi=False, sinks=False, softcap=0.0, index_dtype=torch.int32,
                 pad_rows=0, warp=32, **plan):
    seed = random.randrange(1 << 30)
    fp8 = cache_dtype is not None and cache_dtype != dtype
    c = cases.make_paged_case([1] * len(context_lens), [n - 1 for n in context_lens], num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                              dtype=dtype, cache_dtype=cache_dtype, layout=layout, interleaved_v=interleaved_v,
                              k_scale=0.07 if fp8 else 1.0, v_scale=0.05 if fp8 else 1.0, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    slopes = torch.rand(num_heads, generator=g) * 0.5 if alibi else None
    sink = torch.randn(num_heads, generator=g) * 2 if sinks else None
    scale = head_size ** -0.5
    qsl, sl, bt = (x.to(index_dtype) for x in (c.query_start_loc, c.seq_lens, c.block_table))
    t = c.query.shape[0]
    query = torch.cat([c.query, torch.randn(pad_rows, num_heads, head_size).to(dtype)]) if pad_rows else c.query
    out = cases.poison(torch.empty_like(query))
    launch = emulated_decode(out, query, c.kv_cache, qsl, sl, bt, scale, c.k_scale, c.v_scale, sliding_window,
                    slopes, sink, softcap, interleaved_v, warp=warp, **plan)
    want = cases.dense_oracle(c, scale=scale, causal=True, sliding_window=sliding_window,
                              alibi_slopes=slopes, sinks=sink, logits_soft_cap=softcap)
    got = out[:t].double()
    assert not torch.isnan(got).any(), f"unwritten or NaN output rows (seed {seed})"
    err = cases.rel_err(got, want)
    tol = TOL[dtype] * (2 if fp8 else 1)
    assert err < tol, f"rel err {err:.3e} (seed {seed})"
    if pad_rows:
        assert torch.isnan(out[t:].float()).all(), "rows past the batch were written"
    return launch


DECODE_CASES = [
    # id, context lengths, kwargs
    ("gqa1_d64_bs16_bf16", [5, 33, 70], dict(num_heads=2, num_kv_heads=2)),
    ("gqa4_d128_bs16_bf16", [1, 17, 100], dict(num_heads=8, num_kv_heads=2, head_size=128)),
    ("gqa8_d128_bs32_interleaved_fp16", [40, 3], dict(num_heads=8, num_kv_heads=1, head_size=128,
                                                      block_size=32, interleaved_v=True, dtype=torch.float16)),
    ("gqa2_d64_lbhnc_window_alibi", [50, 13, 64], dict(num_heads=4, num_kv_heads=2, layout="LBHNC",
                                                       sliding_window=19, alibi=True)),
    ("gqa4_d64_bs48_sinks_softcap", [90, 7], dict(block_size=48, num_heads=8, num_kv_heads=2,
                                                  sinks=True, softcap=4.0)),
    ("gqa12_two_head_chunks_int64", [30, 1], dict(num_heads=12, num_kv_heads=1, index_dtype=torch.int64,
                                                  alibi=True, pad_rows=3)),
    ("gqa3_splits_all_features", [150, 61, 2], dict(num_heads=6, num_kv_heads=2, num_splits=3,
                                                    sliding_window=70, alibi=True, sinks=True, softcap=6.0,
                                                    interleaved_v=True, block_size=32)),
    ("more_splits_than_tiles", [3, 40], dict(num_splits=5, num_warps=2)),
    ("one_warp_four_stages", [100, 35], dict(num_warps=1, stages=4, head_size=128, num_heads=4,
                                             num_kv_heads=1)),
    ("one_warp_three_stages_wave", [200, 90, 1], dict(num_warps=1, stages=3, split_rule="wave", head_size=128,
                                                      num_heads=8, num_kv_heads=2)),
    ("fp8_e4m3_d128", [45, 20], dict(cache_dtype=torch.float8_e4m3fn, head_size=128, num_heads=8,
                                     num_kv_heads=2, num_splits=2)),
    ("fp8_e5m2_interleaved_lbhnc", [30, 65], dict(cache_dtype=torch.float8_e5m2, interleaved_v=True,
                                                  layout="LBHNC", dtype=torch.float16)),
    ("fp8_e4m3fnuz_window", [70, 9], dict(cache_dtype=torch.float8_e4m3fnuz, sliding_window=33,
                                          head_size=128)),
    ("fp16_model_bf16_cache", [25, 50], dict(dtype=torch.float16, cache_dtype=torch.bfloat16)),
]


KERNELS = [(32, False), (64, False), (32, True)]  # (warp width, tensor cores)
# SM counts of the planned launch: with 8 SMs most cases' grids are at least half the SMs (the
# wide-grid launch: one warp, 3 stages, the wave rule), with 132 none are (4 warps).
SMS = [8, 132]


@pytest.mark.parametrize("num_sms", SMS, ids=[f"sms{n}" for n in SMS])
@pytest.mark.parametrize("warp,tensor_cores", KERNELS, ids=["warp32", "warp64", "mma"])
@pytest.mark.parametrize("context_lens,kw", [c[1:] for c in DECODE_CASES], ids=[c[0] for c in DECODE_CASES])
def test_decode_emulated(context_lens, kw, warp, tensor_cores, num_sms):
    check_decode(context_lens, warp=warp, tensor_cores=tensor_cores, num_sms=num_sms, **kw)


SPLIT_CASES = [c for c in DECODE_CASES if c[0] in ("gqa3_splits_all_features", "more_splits_than_tiles",
                                                   "one_warp_three_stages_wave", "fp8_e4m3_d128",
                                                   "gqa12_two_head_chunks_int64")]


@pytest.mark.parametrize("warp,tensor_cores", KERNELS, ids=["warp32", "warp64", "mma"])
@pytest.mark.parametrize("context_lens,kw", [c[1:] for c in SPLIT_CASES], ids=[c[0] for c in SPLIT_CASES])
def test_decode_emulated_last_split_merge(context_lens, kw, warp, tensor_cores):
    """The splits merged by the last split CTA (no second kernel): the same oracle, every
    counter back to 0 after the launch, and a second launch over the same counters."""
    counters = torch.zeros(64, dtype=torch.int32)
    kw = {"num_splits": 3, **kw}  # the cases that plan one split get 3
    for _ in range(2):
        launch = check_decode(context_lens, warp=warp, tensor_cores=tensor_cores, num_sms=8,
                              split_merge="last_split", counters=counters, **kw)
        assert int(counters.abs().sum()) == 0
    assert launch.num_splits > 1


def _case_launch(context_lens, kw, warp, num_sms):
    kw = dict(kw)
    heads, kv = kw.get("num_heads", 4), kw.get("num_kv_heads", 2)
    eb = (kw.get("cache_dtype") or kw.get("dtype") or torch.bfloat16).itemsize
    max_ctx = max(context_lens)  # the splits may differ from check_decode's (block-table width)
    plan = {k: kw[k] for k in ("num_warps", "stages", "num_splits", "split_rule") if k in kw}
    return native.plan_decode(len(context_lens), kv, heads // kv, max_ctx, kw.get("head_size", 64), eb,
                              num_sms=num_sms, warp_size=warp, max_smem=227 << 10, sm_smem=228 << 10, **plan)


def test_decode_cases_cover_both_default_launches():
    """test_decode_emulated runs the wide-grid launch (1 warp, 3 stages, wave rule, with splits)
    and the 4-warp launch, for every warp width, and check_decode runs the planned launch."""
    for warp in (32, 64):
        launches = {n: [_case_launch(c[1], c[2], warp, n) for c in DECODE_CASES] for n in SMS}
        wide = [x for x in launches[8] if x[:2] == (1, 3) and x.split_rule == "wave"]
        assert len(wide) >= 6 and any(x.num_splits > 1 for x in wide), launches[8]
        assert sum(x[:2] == (4, 3) and x.split_rule == "wave" for x in launches[132]) >= 6, launches[132]
    c = DECODE_CASES[1]
    for n, want in ((8, (1, 3, "wave")), (132, (4, 3, "wave"))):
        got = check_decode(c[1], num_sms=n, **c[2])
        assert (got.num_warps, got.stages, got.split_rule) == want


def test_smem_bytes_match_the_kernel():
    """native.decode_smem_bytes (what the launch plan checks) is the csrc launch's own size."""
    lib = _emulator(32)
    for d in native.HEAD_SIZES:
        for eb in (1, 2):
            for gt in (1, 2, 4, 8):
                for w, st in native.DECODE_CONFIGS + ((1, 3), (1, 4), (8, 2)):
                    assert lib.ra_emu_decode_smem_bytes(d, eb, gt, w, st) == native.decode_smem_bytes(d, eb, gt, w, st)


def test_wide_grid_launch_falls_back_to_what_fits():
    """A device that cannot fit the (1 warp, 3 stages) CTA: the kernel refuses it, the plan
    picks a config that fits (decode_launch_config's) and the narrow-grid rule."""
    kw = dict(head_size=128, num_heads=8, num_kv_heads=2)
    small = native.decode_smem_bytes(128, 2, 4, 1, 3) - 1
    with pytest.raises(AssertionError, match="shared memory"):
        check_decode([60, 30, 5], num_sms=8, num_warps=1, stages=3, max_smem=small, **kw)
    launch = check_decode([60, 30, 5], num_sms=8, max_smem=small, **kw)
    assert launch[:2] == native.decode_launch_config(128, 2, 4, small) == (1, 2)
    assert launch.split_rule == native.NARROW_GRID_SPLIT_RULE == "wave"


@pytest.mark.parametrize("draw", range(4))
def test_decode_emulated_random(draw):
    seed = random.randrange(1 << 30)
    r = random.Random(seed)
    kv = r.choice([1, 2])
    kw = dict(
        num_heads=kv * r.choice([1, 2, 3, 4, 5, 8, 9]), num_kv_heads=kv, head_size=r.choice([64, 128]),
        block_size=r.choice([16, 32, 64]), layout=r.choice(["LHBNC", "LBHNC"]),
        interleaved_v=r.random() < 0.5, sliding_window=r.choice([-1, -1, r.randint(1, 60)]),
        alibi=r.random() < 0.3, sinks=r.random() < 0.3, softcap=r.choice([0.0, 0.0, 5.0]),
        num_splits=r.choice([None, 1, 3]), dtype=r.choice([torch.bfloat16, torch.float16]),
        cache_dtype=r.choice([None, None, torch.float8_e4m3fn, torch.float8_e5m2]),
    )
    kw["warp"], kw["tensor_cores"] = r.choice(KERNELS)
    lens = [r.randint(1, 90) for _ in range(r.randint(1, 3))]
    try:
        check_decode(lens, **kw)
    except Exception as e:  # name the draw so it can be replayed
        raise AssertionError(f"draw seed {seed}: {lens} {kw}: {type(e).__name__}: {e}") from e


def _write_case(num_tokens, *, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16,
                cache_dtype=None, layout="LHBNC", interleaved_v=False, strided=False, contiguous_slots=False,
                slot_start=None, pad=0, index_dtype=torch.int64, unaligned_value=False, nan_payloads=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    num_blocks = math.ceil(num_tokens / block_size) + 3
    spec = __import__("inductor_rocm_attn.layout", fromlist=["KVCacheSpec"])
    kspec = spec.KVCacheSpec(block_size, num_kv_heads, head_size, cache_dtype, spec.CacheLayout(layout))
    cache = cases.poison(spec.allocate_kv_cache(kspec, num_blocks))
    if strided:  # slices of a fused qkv tensor: token stride > heads * head_size
        qkv = torch.randn(num_tokens, 3 * num_kv_heads + 1, head_size, generator=g).to(dtype)
        key, value = qkv[:, 1:1 + num_kv_heads], qkv[:, 1 + num_kv_heads:1 + 2 * num_kv_heads]
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
    if unaligned_value:  # rows that start 2 bytes past a 16-byte boundary: scalar loads
        flat = torch.randn(num_tokens * num_kv_heads * head_size + 1, generator=g).to(dtype)
        value = flat[1:].view(num_tokens, num_kv_heads, head_size)
    if nan_payloads:  # NaNs of either sign with payloads: a same-dtype write keeps their bits
        bits = torch.tensor([0x7f81, 0xffa5, 0x7fff, 0xffc1] if dtype == torch.bfloat16
                            else [0x7c01, 0xfe5a, 0x7fff, 0xfd00], dtype=torch.int32).to(torch.int16)
        for t in (key, value):
            flat = t.view(torch.int16).view(-1)
            where = torch.randperm(flat.numel(), generator=g)[:64]
            flat[where] = bits[torch.arange(64) % 4]
    if contiguous_slots:  # prefill: consecutive slots from a block start (or slot_start)
        slots = torch.arange(num_tokens) + (block_size if slot_start is None else slot_start)
    else:
        slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if pad:
        slots[torch.randperm(num_tokens, generator=g)[:pad]] = -1
    return key, value, cache, slots.to(index_dtype)


WRITE_CASES = [
    ("bf16_random_slots", dict(num_tokens=37)),
    ("fp16_prefill_bs32_interleaved", dict(num_tokens=70, block_size=32, dtype=torch.float16,
                                           interleaved_v=True, contiguous_slots=True)),
    ("bf16_prefill_std_padding_int32", dict(num_tokens=50, contiguous_slots=True, pad=5, index_dtype=torch.int32)),
    ("strided_qkv_lbhnc_d128", dict(num_tokens=21, head_size=128, strided=True, layout="LBHNC")),
    ("fp8_e4m3_prefill_interleaved", dict(num_tokens=40, cache_dtype=torch.float8_e4m3fn,
                                          contiguous_slots=True, interleaved_v=True)),
    ("fp8_e5m2_random_pad", dict(num_tokens=19, cache_dtype=torch.float8_e5m2, pad=4, head_size=128)),
    ("fp8_e4m3fnuz_bs48", dict(num_tokens=30, cache_dtype=torch.float8_e4m3fnuz, block_size=48,
                               contiguous_slots=True)),
    ("fp32_input_bf16_cache", dict(num_tokens=9, dtype=torch.float32, cache_dtype=torch.bfloat16)),
    # head_size 256: two rounds of packets per thread
    ("d256_prefill_interleaved_pad", dict(num_tokens=35, head_size=256, contiguous_slots=True, pad=3,
                                          interleaved_v=True)),
    ("fp32_input_fp8_cache_d256", dict(num_tokens=18, dtype=torch.float32, cache_dtype=torch.float8_e4m3fn,
                                       head_size=256, contiguous_slots=True)),
    ("one_token", dict(num_tokens=1, head_size=128)),
    # the key's rows are 16-byte aligned, the value's are not: both take scalar loads
    ("unaligned_value_prefill", dict(num_tokens=40, contiguous_slots=True, unaligned_value=True)),
    # consecutive slots from offsets 4 and 8 of a block: groups that straddle x-aligned offsets
    # (element stores) and, for fp8 with 8-token groups, 8-byte stores from offset 8
    ("bf16_prefill_offset4_interleaved", dict(num_tokens=45, contiguous_slots=True, slot_start=20,
                                              interleaved_v=True)),
    ("fp8_prefill_offset8_std_bs32", dict(num_tokens=61, contiguous_slots=True, slot_start=40, block_size=32,
                                          cache_dtype=torch.float8_e5m2, head_size=128)),
    ("fp8_prefill_offset8_interleaved", dict(num_tokens=29, contiguous_slots=True, slot_start=24,
                                             cache_dtype=torch.float8_e4m3fn, interleaved_v=True)),
    ("bf16_nan_payloads_random", dict(num_tokens=24, nan_payloads=True)),
    ("fp16_nan_payloads_prefill_interleaved", dict(num_tokens=33, nan_payloads=True, dtype=torch.float16,
                                                   contiguous_slots=True, interleaved_v=True)),
    # several tiles of every size, 3 KV heads, fp16 strided input
    ("fp16_prefill_3heads_strided", dict(num_tokens=100, num_kv_heads=3, dtype=torch.float16, strided=True,
                                         contiguous_slots=True, pad=9)),
]
WRITER_VARIANTS = [None, *native.WRITER_VARIANTS]  # None: the launcher's rule


@pytest.mark.parametrize("warp", [32, 64], ids=["warp32", "warp64"])
@pytest.mark.parametrize("variant", WRITER_VARIANTS, ids=[v or "auto" for v in WRITER_VARIANTS])
@pytest.mark.parametrize("num_tokens_kw", [c[1] for c in WRITE_CASES], ids=[c[0] for c in WRITE_CASES])
def test_reshape_and_cache_emulated(num_tokens_kw, variant, warp):
    kw = dict(num_tokens_kw)
    seed = random.randrange(1 << 30)
    key, value, cache, slots = _write_case(kw.pop("num_tokens"), seed=seed, **kw)
    interleaved = kw.get("interleaved_v", False)
    fp8 = cache.dtype in native._FP8_CACHE_DTYPES
    ks = torch.tensor([0.07 if fp8 else 1.0])
    vs = torch.tensor([0.05 if fp8 else 1.0])
    want = cache.clone()
    ref.reshape_and_cache(key, value, want, slots, ks, vs, interleaved)
    got = cache
    emulated_write(key, value, got, slots, ks, vs, interleaved, warp=warp, variant=variant)
    # bit-exact, poison (unwritten slots) included
    diff = (got.view(torch.uint8) != want.view(torch.uint8))
    assert not diff.any(), f"{int(diff.sum())} cache bytes differ (seed {seed})"


def test_writer_refuses_an_unknown_variant_code():
    """The launcher itself refuses a code outside WriterVariant (the Python names map onto it)
    and writes nothing."""
    assert sorted(native.WRITER_VARIANTS.values()) == [1, 2, 3, 4]
    key, value, cache, slots = _write_case(5, seed=1)
    before = cache.clone()
    for code in (5, -1):
        with pytest.raises(AssertionError, match=rf"writer variant {code} is not supported"):
            emulated_write(key, value, cache, slots, torch.ones(1), torch.ones(1), False, variant=code)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_scatter_unit_split_32_and_64_bit():
    """(token, head, packet) of a unit as divmod gives it, with the 64-bit split past 2^32 units."""
    lib = _emulator(32)
    tok, head, c = ctypes.c_int64(), ctypes.c_int(), ctypes.c_int()
    for u, ncp, heads, wide in ((0, 16, 8, 0), (12345, 12, 3, 0), ((1 << 32) - 1, 16, 8, 0), ((1 << 32) - 1, 6, 7, 1),
                                ((1 << 32) + 77, 16, 8, 1), ((3 << 34) + 12345, 24, 5, 1)):
        lib.ra_emu_split_unit(ctypes.c_uint64(u), ncp, heads, wide, ctypes.byref(tok), ctypes.byref(head),
                              ctypes.byref(c))
        pair, want_c = divmod(u, ncp)
        assert (tok.value, head.value, c.value) == (*divmod(pair, heads), want_c), (u, ncp, heads, wide)


def test_writer_tile_that_does_not_fit_shared_memory_is_refused():
    """head_size 768 at 16 bits: the 32-token V tile needs more than 48 KB, so tile32 refuses
    the call (nothing written) while tile16 and scatter write it."""
    g = torch.Generator().manual_seed(2)
    key, value = (torch.randn(20, 1, 768, generator=g).to(torch.bfloat16) for _ in range(2))
    cache = cases.poison(torch.empty(4, 2, 16, 768, dtype=torch.bfloat16))  # a contiguous LHBNC cache
    slots = torch.arange(20) + 16
    ones = torch.ones(1)
    before = cache.clone()
    with pytest.raises(AssertionError, match=r"head_size 768 is not supported by the 32-token tile: .* 49952 bytes"):
        emulated_write(key, value, cache, slots, ones, ones, False, variant="tile32")
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    want = cache.clone()
    ref.reshape_and_cache(key, value, want, slots, ones, ones, False)
    for variant in ("tile16", "scatter"):
        got = before.clone()
        emulated_write(key, value, got, slots, ones, ones, False, variant=variant)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), variant


def test_emulator_reports_launch_errors():
    lib = _emulator(32)
    p = DecodeParams()
    p.num_seqs, p.num_heads, p.num_kv_heads, p.head_size, p.block_size = 1, 2, 1, 96, 16
    p.num_splits = 1
    cfg = DecodeConfig(4, 2, 32, 1 << 20, 0)
    assert lib.ra_emu_paged_decode(ctypes.byref(p), ctypes.byref(cfg)) != 0
    assert b"head_size 96" in lib.ra_emu_last_error()
