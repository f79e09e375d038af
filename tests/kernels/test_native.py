"""The native (csrc) provider: its Python wrapper here, its kernels on a GPU.

CPU tests: argument checks (each bad input names the op, the parameter, the value and what
is supported, before anything runs), ``unavailable_reason()`` / ``build_state()`` paths, the
launch planning, the ``build-native`` CLI without a GPU.

GPU tests (``gpu``; they also skip when the extension cannot be built here, with the
reason): the extension is built on first use and compared with ``kernels.reference`` in
float64 on fresh random inputs, output poisoned (NaN) first: decode (tensor-core and CUDA-core
kernels) over head 64/128,
block 16/32, bf16/fp16, caches auto/fp8 e4m3/e5m2, standard/interleaved V, LHBNC/LBHNC,
GQA 1/4/8, contexts 1..5000 with and without KV splits, and the features (window, ALiBi,
soft cap, sinks); the writer bit-exact against the reference writer. Tolerances as the
Triton GPU tests: bf16 1e-2, fp16 3e-3 of the output norm; fp8 caches 2e-2 / 6e-3 (the
reference reads the same rounded cache values).
"""

from __future__ import annotations

import random

import pytest
import torch

import cases
from inductor_rocm_attn import layout
from inductor_rocm_attn.kernels import native
from inductor_rocm_attn.kernels import reference as ref

GPU = "cuda"
TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}


def _seed() -> int:
    return random.randrange(1 << 30)


# --- CPU: wrapper --------------------------------------------------------------------------


def _decode_args(**over):
    c = cases.make_paged_case([1, 1], [7, 30], num_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.bfloat16, seed=_seed())
    args = dict(output=torch.empty_like(c.query), query=c.query, key=None, value=None, kv_cache=c.kv_cache,
                query_start_loc=c.query_start_loc, seq_lens=c.seq_lens, block_table=c.block_table,
                scale=0.125, k_scale=c.k_scale, v_scale=c.v_scale, causal=True, sliding_window=-1,
                alibi_slopes=None, sinks=None, logits_soft_cap=0.0, interleaved_v=False,
                output_scale=None, max_query_len=1, max_seq_len=31)
    args.update(over)
    return args


@pytest.mark.parametrize("over,exc,match", [
    (dict(max_query_len=5), NotImplementedError, r"native paged_attention: max_query_len 5: only decode"),
    (dict(output_scale=torch.ones(1)), NotImplementedError, r"output_scale .* not supported"),
    (dict(query=torch.randn(2, 4, 80, dtype=torch.bfloat16), output=torch.empty(2, 4, 80, dtype=torch.bfloat16)),
     ValueError, r"head_size 80 is not supported; supported: \(64, 128\)"),
    # Gemma4's full-attention head size: the Triton and reference providers take it, native not
    (dict(query=torch.randn(2, 4, 512, dtype=torch.bfloat16), output=torch.empty(2, 4, 512, dtype=torch.bfloat16)),
     ValueError, r"head_size 512 is not supported; supported: \(64, 128\)"),
    (dict(query=torch.randn(2, 4, 64), output=torch.empty(2, 4, 64)), ValueError,
     r"query dtype torch.float32 is not supported"),
    (dict(output=torch.empty(2, 4, 64, dtype=torch.float16)), ValueError, r"output must match query"),
    (dict(kv_cache=torch.empty(4, 2, 24, 128, dtype=torch.bfloat16)), ValueError,
     r"block_size 24 is not supported; it must be a multiple of 16"),
    (dict(kv_cache=torch.empty(4, 2, 16, 128, dtype=torch.float32)), ValueError,
     r"kv_cache dtype torch.float32 is not supported"),
    (dict(seq_lens=torch.tensor([8, 31], dtype=torch.int16)), ValueError, r"seq_lens dtype torch.int16"),
    (dict(query_start_loc=torch.tensor([0, 1], dtype=torch.int32)), ValueError,
     r"query_start_loc has 2 entries, expected num_seqs \+ 1 = 3"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must be \[num_heads\] = \[4\], got \(3,\)"),
    (dict(k_scale=torch.ones(1, dtype=torch.float64)), ValueError, r"k_scale must be a float32 tensor"),
    (dict(kv_cache=torch.empty(4, 2, 16, 128, dtype=torch.bfloat16)[:, :, :, :96]), ValueError,
     r"kv_cache pages must be contiguous"),
])
def test_decode_argument_errors(over, exc, match):
    args = _decode_args(**over)
    out_before = args["output"].clone()
    with pytest.raises(exc, match=match):
        native.paged_attention(**args)
    assert torch.equal(args["output"].view(torch.uint8), out_before.view(torch.uint8)), "output written"


def test_decode_needs_gpu_tensors_after_the_checks():
    with pytest.raises(ValueError, match=r"native paged_attention: tensors must be on a CUDA/ROCm GPU, got cpu"):
        native.paged_attention(**_decode_args())


@pytest.mark.parametrize("over,match", [
    (dict(key=torch.randn(3, 2, 64, dtype=torch.float64)), r"key/value dtype torch.float64"),
    (dict(slot_mapping=torch.arange(3.0)), r"slot_mapping must be a 1-D int32/int64 tensor"),
    (dict(slot_mapping=torch.arange(9)), r"slot_mapping has 9 entries for 3 tokens"),
    (dict(kv_cache=torch.empty(2, 2, 16, 64, dtype=torch.bfloat16)), r"kv_cache width 64 != num_kv_heads \* head_size = 128"),
    (dict(key=torch.randn(3, 2, 128)[:, :, ::2], value=torch.randn(3, 2, 128)[:, :, ::2]),
     r"key/value channels must be contiguous"),
    (dict(variant="tile64"), r"variant 'tile64' is not supported; supported: \('scatter', 'tile8', 'tile16', 'tile32'\)"),
    (dict(variant=3), r"variant 3 is not supported"),
])
def test_write_argument_errors(over, match):
    args = dict(key=torch.randn(3, 2, 64), value=torch.randn(3, 2, 64),
                kv_cache=torch.empty(2, 2, 16, 128, dtype=torch.bfloat16), slot_mapping=torch.arange(3),
                k_scale=torch.ones(1), v_scale=torch.ones(1), interleaved_v=False)
    if "key" in over and "value" not in over:
        over["value"] = over["key"].clone()
    args.update(over)
    with pytest.raises(ValueError, match=r"native reshape_and_cache: " + match):
        native.reshape_and_cache(**args)


def test_unavailable_reason_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert native.unavailable_reason() == "no GPU: no CUDA/ROCm GPU visible to torch"
    assert native.build_state()[0] == "no_gpu"
    assert native.build_native_cli([]) == 1


def _fake_gpu(monkeypatch, tmp_path, *, compiler=True, ninja=True):
    """A machine with a GPU as far as build_state() can tell, builds under tmp_path."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native, "_arch_tag", lambda: "sm90")
    monkeypatch.setattr(native, "_compiler_path", lambda: "/usr/bin/nvcc" if compiler else None)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: ninja)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))


def test_build_state_paths(monkeypatch, tmp_path):
    _fake_gpu(monkeypatch, tmp_path, compiler=False)
    state, why = native.build_state()
    assert state == "no_toolchain" and why.startswith("no toolchain: ") and "not found" in why
    _fake_gpu(monkeypatch, tmp_path, ninja=False)
    assert native.unavailable_reason() == "no toolchain: ninja not found (pip install ninja)"
    _fake_gpu(monkeypatch, tmp_path)
    assert native.build_state()[0] == "not_built"
    assert native.unavailable_reason().startswith("not built yet")
    assert "build-native" in native.unavailable_reason()
    assert not any(tmp_path.iterdir()), "unavailable_reason() must not create files"
    name = native._build_name()
    (tmp_path / name).mkdir()
    native._failure_path(name).write_text("paged_decode.cu(12): error: identifier \"x\" is undefined\n\nlog")
    state, why = native.build_state()
    assert state == "build_failed"
    assert why.startswith('build failed: paged_decode.cu(12): error: identifier "x" is undefined')
    native._library_path(name).write_bytes(b"")
    assert native.build_state() == ("ready", None)


def test_build_name_follows_the_sources(monkeypatch, tmp_path):
    _fake_gpu(monkeypatch, tmp_path)
    a = native._build_name()
    monkeypatch.setattr(native, "_EXTRA_CUDA_CFLAGS", ("-O2",))
    assert native._build_name() != a


def test_first_error_line():
    text = ("Error building extension 'x': [1/3] nvcc ...\nFAILED: paged_decode.cuda.o\n"
            "paged_decode.cu(3): error: expected a \";\"\n1 error detected")
    assert native._first_error_line(text) == 'paged_decode.cu(3): error: expected a ";"'


def test_launch_planning():
    # one CTA per (seq, KV head) fills an H200 (132 SMs) twice: no split
    assert native.num_kv_splits(64, 8, 1, 4096, 132, 4) == 1
    # B=16: 128 CTAs -> about 4 per SM
    assert native.num_kv_splits(16, 8, 1, 4096, 132, 4) == 5
    # B=1: capped so each warp keeps two tiles, and by MAX_SPLITS
    assert native.num_kv_splits(1, 8, 1, 1024, 132, 4) == 8
    assert native.num_kv_splits(1, 8, 1, 1 << 20, 132, 4) == native.MAX_SPLITS
    assert native.num_kv_splits(1, 8, 1, 16, 132, 4) == 1
    assert native.heads_per_cta(1) == 1 and native.heads_per_cta(3) == 4 and native.heads_per_cta(12) == 8
    # 228 KB (H200): 4 warps x 3 stages; 64 KB (AMD LDS): fewer
    assert native.decode_launch_config(128, 2, 4, 227 << 10) == (4, 3)
    w, s = native.decode_launch_config(128, 2, 4, 64 << 10)
    assert native.decode_smem_bytes(128, 2, 4, w, s) <= 64 << 10


def test_wave_split_rule_and_variants():
    h200 = dict(num_sms=132, warp_size=32, sm_smem=228 << 10)
    # (4 warps, 3 stages): 98 KB a CTA, 2 per SM -> B=16 fills 264 slots with 2 splits
    assert native.ctas_per_sm(native.decode_smem_bytes(128, 2, 4, 4, 3), 4, 32, 228 << 10) == 2
    assert native.plan_splits(16, 8, 4, 4096, 128, 2, 4, 3, split_rule="wave", **h200) == 2
    assert native.plan_splits(16, 8, 4, 4096, 128, 2, 4, 3, **h200) == 5  # the default rule
    # one warp, 3 stages: 8 CTAs per SM, Triton's split counts at B=1 and 16
    assert native.ctas_per_sm(native.decode_smem_bytes(128, 2, 4, 1, 3), 1, 32, 228 << 10) == 8
    assert native.plan_splits(1, 8, 4, 4096, 128, 2, 1, 3, split_rule="wave", **h200) == 64
    assert native.plan_splits(16, 8, 4, 4096, 128, 2, 1, 3, split_rule="wave", **h200) == 8
    assert native.plan_splits(64, 8, 4, 4096, 128, 2, 1, 3, split_rule="wave", **h200) == 2
    assert native.plan_splits(64, 8, 4, 4096, 128, 2, 1, 3, split_rule="triton", **h200) == 1
    assert native.plan_splits(1, 8, 4, 16, 128, 2, 1, 3, split_rule="wave", **h200) == 1
    with pytest.raises(ValueError, match="split_rule"):
        native.plan_splits(1, 8, 4, 4096, 128, 2, 1, 3, split_rule="nope", **h200)
    import inspect
    params = inspect.signature(native.paged_attention).parameters
    assert native.DECODE_VARIANTS["default"] == {}
    for name, kw in native.DECODE_VARIANTS.items():
        assert set(kw) <= set(params), name
        assert kw.get("split_rule", "four_per_sm") in native.SPLIT_RULES, name


# An H200: 132 SMs, 227 KB of opt-in shared memory a CTA, 228 KB an SM.
H200 = dict(num_sms=132, warp_size=32, max_smem=227 << 10, sm_smem=228 << 10)


def _plan(num_seqs, num_kv_heads=8, gqa=4, max_ctx=4096, head_size=128, elem_bytes=2, **kw):
    return tuple(native.plan_decode(num_seqs, num_kv_heads, gqa, max_ctx, head_size, elem_bytes, **{**H200, **kw}))


def test_default_launch_by_grid():
    # bf16, 32/8 heads, d128, L=4096 (the H200 A/B's case): (warps, stages, splits, rule)
    assert _plan(1) == (4, 3, 32, "wave")          # 8 CTAs < 66: the 4-warp launch
    assert _plan(16) == (1, 3, 8, "wave")          # 128 CTAs >= 66: one warp, one wave
    assert _plan(64) == (1, 3, 2, "wave")
    # the threshold: grid (seqs x KV heads x head chunks) >= half the SMs
    assert _plan(33, num_kv_heads=2)[:2] == (1, 3)  # 66 CTAs
    assert _plan(65, num_kv_heads=1)[:2] == (4, 3)  # 65 CTAs
    assert _plan(8)[:2] == (4, 3)                   # 64 CTAs
    # GQA 12: 8 heads a CTA, 2 head chunks
    assert _plan(4, gqa=12)[:2] == (4, 3)           # 4 x 8 x 2 = 64
    assert _plan(5, gqa=12)[:2] == (1, 3)           # 80
    # the 4-warp launch is decode_launch_config's, the 1-warp one's splits are plan_splits' "wave"
    assert _plan(1)[:2] == native.decode_launch_config(128, 2, 4, H200["max_smem"])
    assert _plan(16)[2] == native.plan_splits(16, 8, 4, 4096, 128, 2, 1, 3, split_rule="wave", num_sms=132,
                                              warp_size=32, sm_smem=228 << 10)
    # head size 64, fp8 cache: the same choice
    assert _plan(16, head_size=64, elem_bytes=1)[:2] == (1, 3)
    assert _plan(1, head_size=64, elem_bytes=1)[:2] == (4, 3)


def test_launch_overrides():
    # num_warps or stages given: that config with the narrow-grid rule (wave)
    assert _plan(16, num_warps=4) == (4, 3, 2, "wave")
    assert _plan(16, num_warps=4, stages=3) == (4, 3, 2, "wave")
    assert _plan(16, stages=2) == (4, 2, _wave_splits(16, 4, 2), "wave")
    assert _plan(16, num_warps=1, stages=3) == (1, 3, 8, "wave")
    assert _plan(1, num_warps=1, stages=3, split_rule="wave") == (1, 3, 64, "wave")
    # split_rule / num_splits alone keep the planned warps and stages
    assert _plan(16, split_rule="four_per_sm") == (1, 3, 5, "four_per_sm")
    assert _plan(64, split_rule="triton") == (1, 3, 1, "triton")
    assert _plan(1, split_rule="wave") == (4, 3, 32, "wave")
    assert _plan(16, num_splits=3) == (1, 3, 3, "wave")
    assert _plan(1, num_splits=7) == (4, 3, 7, "wave")
    for kw in (dict(), dict(num_splits=2)):
        with pytest.raises(ValueError, match="split_rule 'nope'"):
            _plan(16, split_rule="nope", **kw)
    # the A/B variants: "w4s3" is the launch before this default on the H200, at every B
    for b in (1, 16, 64):
        old = (*native.decode_launch_config(128, 2, 4, H200["max_smem"]),
               native.num_kv_splits(b, 8, 1, 4096, 132, 4), "four_per_sm")
        assert _plan(b, **native.DECODE_VARIANTS["w4s3"]) == old
        assert _plan(b, **native.DECODE_VARIANTS["default"]) == _plan(b)
    assert _plan(1, **native.DECODE_VARIANTS["w1s3_wave"]) == (1, 3, 64, "wave")


def _wave_splits(b, warps, stages, gqa=4):
    return native.plan_splits(b, 8, gqa, 4096, 128, 2, warps, stages, split_rule="wave", num_sms=132, warp_size=32,
                              sm_smem=228 << 10)


def test_wide_grid_launch_falls_back_when_its_smem_does_not_fit():
    one_warp = native.decode_smem_bytes(128, 2, 4, 1, 3)
    small = one_warp - 1  # (1 warp, 3 stages) does not fit; (1, 2) does
    assert native.decode_smem_bytes(128, 2, 4, 1, 2) <= small
    assert _plan(16, max_smem=small) == (1, 2, _wave_splits(16, 1, 2), "wave")
    assert _plan(16, max_smem=one_warp)[:2] == (1, 3)  # exactly fits
    # 64 KB (AMD LDS): the 1-warp CTA fits, (4, 3) does not
    assert _plan(16, max_smem=64 << 10, sm_smem=64 << 10, warp_size=64)[:2] == (1, 3)
    w, s, _, rule = _plan(1, max_smem=64 << 10, sm_smem=64 << 10, warp_size=64)
    assert (w, s) == native.decode_launch_config(128, 2, 4, 64 << 10) and rule == "wave"
    # the check is per GQA tile: 8 heads a CTA need more than 4
    limit = native.decode_smem_bytes(128, 2, 4, 1, 3)
    assert native.decode_smem_bytes(128, 2, 8, 1, 3) > limit
    assert _plan(16, gqa=4, max_smem=limit)[:2] == (1, 3)
    assert _plan(16, gqa=8, max_smem=limit) == (1, 2, _wave_splits(16, 1, 2, gqa=8), "wave")


def test_paged_attention_launches_the_plan(monkeypatch):
    """paged_attention passes plan_decode's launch to the extension (no device: a fake module)."""
    calls = []

    class FakeExt:
        @staticmethod
        def paged_decode(*args):
            calls.append(args)

    monkeypatch.setattr(native, "_module", lambda: FakeExt)
    monkeypatch.setattr(native, "_check_device", lambda op, t, **others: None)
    monkeypatch.setattr(native, "_device_limits", lambda index: (132, 32, 227 << 10, True))
    monkeypatch.setattr(native, "_sm_smem", lambda index: 228 << 10)

    def launched(num_seqs, **kw):
        c = cases.make_paged_case([1] * num_seqs, [7] * num_seqs, num_heads=32, num_kv_heads=8, head_size=128,
                                  block_size=16, dtype=torch.bfloat16, seed=0)
        calls.clear()
        native.paged_attention(torch.empty_like(c.query), c.query, None, None, c.kv_cache, c.query_start_loc,
                               c.seq_lens, c.block_table, 0.1, c.k_scale, c.v_scale, True, -1, None, None, 0.0,
                               False, None, 1, 4096, **kw)
        (args,) = calls
        launched.counters = args[-1]  # the last-split merge's counters (None: the reduce kernel)
        return args[-7], args[-6], args[-5]  # num_splits, num_warps, stages

    assert launched(1) == (32, 4, 3) and launched.counters is None
    assert launched(16) == (8, 1, 3)
    assert launched(64) == (2, 1, 3)
    assert launched(16, num_warps=4, stages=3) == (2, 4, 3)
    assert launched(16, split_rule="four_per_sm") == (5, 1, 3)
    assert launched(64, num_splits=4) == (4, 1, 3)
    assert launched(16, split_merge="last_split") == (8, 1, 3)
    assert launched.counters.dtype == torch.int32 and launched.counters.numel() >= 16 * 8
    assert int(launched.counters.abs().sum()) == 0
    assert launched(64, num_splits=1, split_merge="last_split") == (1, 1, 3) and launched.counters is None
    with pytest.raises(ValueError, match=r"split_merge 'both'; supported: \('reduce', 'last_split'\)"):
        launched(16, split_merge="both")


# --- GPU ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU")
    state, why = native.build_state()
    if state in ("no_toolchain", "build_failed"):
        pytest.skip(f"native extension unavailable: {why}")
    return native._module()  # builds on first use (minutes)


def _e4m3():
    return layout.cache_torch_dtype("fp8_e4m3", torch.bfloat16, torch.device(GPU))


def check_decode_gpu(context_lens, *, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=torch.bfloat16, cache=None, layout_="LHBNC", interleaved_v=False,
                     sliding_window=-1, alibi=False, sinks=False, softcap=0.0, causal=True,
                     index_dtype=torch.int32, pad_rows=0, tensor_cores=None, **plan):
    """Every native decode kernel (``tensor_cores`` None: both) against the float64 oracle."""
    seed = _seed()
    cache_dtype = {None: None, "e4m3": _e4m3(), "e5m2": torch.float8_e5m2}[cache]
    fp8 = cache_dtype is not None
    c = cases.make_paged_case([1] * len(context_lens), [n - 1 for n in context_lens], num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                              dtype=dtype, cache_dtype=cache_dtype, layout=layout_, interleaved_v=interleaved_v,
                              k_scale=0.07 if fp8 else 1.0, v_scale=0.05 if fp8 else 1.0, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    slopes = torch.rand(num_heads, generator=g) * 0.5 if alibi else None
    sink = torch.randn(num_heads, generator=g) * 2 if sinks else None
    scale = head_size ** -0.5
    dev = lambda x: None if x is None else x.to(GPU)  # noqa: E731
    # the float64 oracle runs on the GPU too (the same function; on the CPU it dominated the
    # matrix's time)
    want = torch.empty(c.query.shape, dtype=torch.float64, device=GPU)
    ref.paged_attention(want, dev(c.query), None, None, dev(c.kv_cache), dev(c.query_start_loc), dev(c.seq_lens),
                        dev(c.block_table), scale, dev(c.k_scale), dev(c.v_scale), causal, sliding_window,
                        dev(slopes), dev(sink), softcap, interleaved_v, None)
    t = c.query.shape[0]
    query = c.query
    if pad_rows:
        query = torch.cat([query, torch.randn(pad_rows, num_heads, head_size).to(dtype)])
    kernels = (True, False) if tensor_cores is None else (tensor_cores,)
    for tc in kernels:  # every kernel against the one oracle
        if tc and not native._device_limits(torch.cuda.current_device())[3]:
            continue  # the tensor-core kernel needs an NVIDIA GPU of sm_80 or newer
        out = cases.poison(torch.empty(query.shape, dtype=dtype, device=GPU))
        native.paged_attention(
            out, dev(query), None, None, dev(c.kv_cache), dev(c.query_start_loc).to(index_dtype),
            dev(c.seq_lens).to(index_dtype), dev(c.block_table).to(index_dtype), scale, dev(c.k_scale),
            dev(c.v_scale), causal, sliding_window, dev(slopes), dev(sink), softcap, interleaved_v, None,
            1, max(context_lens), tensor_cores=tc, **plan)
        got = out[:t].double()
        kind = "mma" if tc else "cuda_core"
        assert not torch.isnan(got).any(), f"{kind}: unwritten or NaN output rows (seed {seed})"
        err = cases.rel_err(got, want)
        tol = TOL[dtype] * (2 if fp8 else 1)
        assert err < tol, f"{kind}: rel err {err:.3e} (seed {seed})"
        if pad_rows:
            assert torch.isnan(out[t:].float()).all(), f"{kind}: rows past the batch were written"


GEOMETRY = [(h, b) for h in (64, 128) for b in (16, 32)]
GQA = [(8, 8), (16, 4), (16, 2)]  # (num_heads, num_kv_heads): GQA 1, 4, 8


@pytest.mark.gpu
@pytest.mark.parametrize("layout_", ["LHBNC", "LBHNC"])
@pytest.mark.parametrize("interleaved_v", [False, True], ids=["std_v", "interleaved_v"])
@pytest.mark.parametrize("cache", [None, "e4m3", "e5m2"], ids=["auto", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_size,block_size", GEOMETRY, ids=[f"d{h}_bs{b}" for h, b in GEOMETRY])
def test_decode_gpu_matrix(ext, head_size, block_size, heads, dtype, cache, interleaved_v, layout_):
    # short, mid and long contexts; 4 sequences x few KV heads -> KV splits by the heuristic
    check_decode_gpu([1, 37, 1300, 5000], num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                     block_size=block_size, dtype=dtype, cache=cache, layout_=layout_,
                     interleaved_v=interleaved_v)


FEATURES = [
    ("window", dict(sliding_window=300)),
    ("window_longer_than_context", dict(sliding_window=6000)),
    ("alibi", dict(alibi=True)),
    ("softcap", dict(softcap=8.0)),
    ("sinks", dict(sinks=True)),
    ("all_features_split7", dict(sliding_window=500, alibi=True, softcap=8.0, sinks=True, num_splits=7)),
    ("all_features_no_split", dict(sliding_window=500, alibi=True, softcap=8.0, sinks=True, num_splits=1)),
    ("non_causal_flag", dict(causal=False, sliding_window=200)),
    ("int64_index_pad_rows", dict(index_dtype=torch.int64, pad_rows=5)),
    ("gqa3_gqa12_chunks", dict(num_heads=12, num_kv_heads=1, alibi=True)),
    ("gqa5", dict(num_heads=10, num_kv_heads=2, sinks=True)),
    ("one_warp_two_stages", dict(num_warps=1, stages=2)),
    ("two_warps_four_stages_split3", dict(num_warps=2, stages=4, num_splits=3)),
    ("bs544", dict(block_size=544, num_splits=2)),
    # the splits merged by the last split CTA (native.SPLIT_MERGES), not yet the default
    ("all_features_split7_last_split", dict(sliding_window=500, alibi=True, softcap=8.0, sinks=True, num_splits=7,
                                            split_merge="last_split")),
    ("gqa12_chunks_split5_last_split", dict(num_heads=12, num_kv_heads=1, num_splits=5, split_merge="last_split")),
    ("planned_splits_last_split", dict(split_merge="last_split")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [None, "e4m3"], ids=["auto", "e4m3"])
@pytest.mark.parametrize("kw", [f[1] for f in FEATURES], ids=[f[0] for f in FEATURES])
def test_decode_gpu_features(ext, kw, cache):
    check_decode_gpu([1, 2, 700, 4000], cache=cache, **kw)


@pytest.mark.gpu
def test_decode_gpu_rejects_prefill(ext):
    with pytest.raises(NotImplementedError, match="only decode"):
        native.paged_attention(**{**_decode_args(), "max_query_len": 2})


def _write_case(num_tokens, *, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16,
                cache=None, layout_="LHBNC", prefill=False, pad=0, strided=False, unaligned_value=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache_dtype = {None: dtype, "e4m3": _e4m3(), "e5m2": torch.float8_e5m2}[cache]
    num_blocks = -(-num_tokens // block_size) + 4
    spec = layout.KVCacheSpec(block_size, num_kv_heads, head_size, cache_dtype, layout.CacheLayout(layout_))
    kv_cache = cases.poison(layout.allocate_kv_cache(spec, num_blocks))
    if strided:  # key/value as slices of a fused qkv projection
        qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_size, generator=g).to(dtype)
        key, value = qkv[:, 2 * num_kv_heads:3 * num_kv_heads], qkv[:, 3 * num_kv_heads:]
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
    if unaligned_value:  # rows 2 bytes past a 16-byte boundary (the key's are aligned): scalar loads
        value = torch.randn(num_tokens * num_kv_heads * head_size + 1, generator=g).to(dtype)[1:]
        value = value.view(num_tokens, num_kv_heads, head_size)
    if prefill:
        slots = torch.arange(num_tokens) + 2 * block_size
    else:
        slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if pad:
        slots[torch.randperm(num_tokens, generator=g)[:pad]] = -1
    return key, value, kv_cache, slots


def _to_gpu_keeping_offset(t: torch.Tensor) -> torch.Tensor:
    """A GPU copy of a contiguous view with the same storage offset (so the same alignment)."""
    flat = torch.empty(t.storage_offset() + t.numel(), dtype=t.dtype, device=GPU)
    view = flat[t.storage_offset():].view(t.shape)
    view.copy_(t)
    return view


WRITER_VARIANTS = [None, *native.WRITER_VARIANTS]  # None: the launcher's rule


@pytest.mark.gpu
@pytest.mark.parametrize("variant", WRITER_VARIANTS, ids=[v or "auto" for v in WRITER_VARIANTS])
@pytest.mark.parametrize("interleaved_v", [False, True], ids=["std_v", "interleaved_v"])
@pytest.mark.parametrize("cache", [None, "e4m3", "e5m2"], ids=["auto", "e4m3", "e5m2"])
@pytest.mark.parametrize("kw", [
    dict(num_tokens=1),
    dict(num_tokens=256, pad=7, layout_="LBHNC"),
    dict(num_tokens=3000, prefill=True, block_size=32, head_size=64, dtype=torch.float16),
    dict(num_tokens=16384, prefill=True, pad=100, index_dtype=torch.int32),
    dict(num_tokens=77, strided=True, block_size=32),
    dict(num_tokens=700, prefill=True, head_size=256, pad=5),
    dict(num_tokens=300, prefill=True, unaligned_value=True),
], ids=["t1", "t256_pad_lbhnc", "t3000_prefill_bs32_d64_fp16", "t16384_prefill_pad_int32", "t77_strided",
        "t700_prefill_d256", "t300_prefill_unaligned_value"])
def test_reshape_and_cache_gpu(ext, kw, cache, interleaved_v, variant):
    kw = dict(kw)
    index_dtype = kw.pop("index_dtype", torch.int64)
    seed = _seed()
    key, value, kv_cache, slots = _write_case(kw.pop("num_tokens"), cache=cache, seed=seed, **kw)
    fp8 = cache is not None
    ks = torch.tensor([0.07 if fp8 else 1.0])
    vs = torch.tensor([0.05 if fp8 else 1.0])
    want = kv_cache.clone()
    ref.reshape_and_cache(key, value, want, slots, ks, vs, interleaved_v)
    got = kv_cache.to(GPU)
    native.reshape_and_cache(key.to(GPU), _to_gpu_keeping_offset(value), got,
                             slots.to(index_dtype).to(GPU), ks.to(GPU), vs.to(GPU), interleaved_v, variant=variant)
    diff = got.cpu().view(torch.uint8) != want.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} cache bytes differ from the reference writer (seed {seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", WRITER_VARIANTS, ids=[v or "auto" for v in WRITER_VARIANTS])
def test_reshape_and_cache_gpu_strided_views(ext, variant):
    """Token/head strides of a fused qkv tensor kept on the GPU (no copy to contiguous)."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(40, 4 * 8, 128, generator=g).to(torch.bfloat16).to(GPU)
    key, value = qkv[:, 16:24], qkv[:, 24:]
    _, _, kv_cache, slots = _write_case(40, seed=seed)
    want = kv_cache.clone()
    ones = torch.ones(1)
    ref.reshape_and_cache(key.cpu(), value.cpu(), want, slots, ones, ones, False)
    got = kv_cache.to(GPU)
    native.reshape_and_cache(key, value, got, slots.to(GPU), ones.to(GPU), ones.to(GPU), False, variant=variant)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kv_cache", "block_table", "seq_lens", "k_scale"])
def test_decode_refuses_a_tensor_on_another_device(ext, name):
    """Every tensor the kernel reads by raw pointer must be on the query's GPU: one left on the
    CPU is refused by name before the launch (it would be an illegal address)."""
    args = {k: (v.to(GPU) if isinstance(v, torch.Tensor) and k != name else v) for k, v in _decode_args().items()}
    with pytest.raises(ValueError, match=rf"native paged_attention: {name} is on cpu, the other tensors on cuda"):
        native.paged_attention(**args)


@pytest.mark.gpu
def test_write_refuses_a_tensor_on_another_device(ext):
    key, value, kv_cache, slots = _write_case(8)
    ones = torch.ones(1)
    before = kv_cache.clone()
    with pytest.raises(ValueError, match=r"native reshape_and_cache: kv_cache is on cpu, the other tensors on cuda"):
        native.reshape_and_cache(key.to(GPU), value.to(GPU), kv_cache, slots.to(GPU), ones.to(GPU), ones.to(GPU), False)
    with pytest.raises(ValueError, match=r"native reshape_and_cache: slot_mapping is on cpu"):
        native.reshape_and_cache(key.to(GPU), value.to(GPU), kv_cache.to(GPU), slots, ones.to(GPU), ones.to(GPU), False)
    assert torch.equal(kv_cache.view(torch.uint8), before.view(torch.uint8))
