"""The Triton verify path of ``paged_attention``: sequences of 2..8 query tokens (speculative
decode verify batches) through the decode-style split-KV kernel (``paged_verify.py``),
against the float64 oracle, and the launcher's routing between decode, verify and prefill.

The verify kernel runs only when the launch knows ``max_query_len`` (``hints=True``). Without
a GPU Triton runs in its interpreter (fp16/fp32); the ``gpu`` tests run bf16 and fp8 caches
at the benchmark's shape. Checks and tolerances: ``attention_checks.py``.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from attention_checks import GPU, check_paged
from inductor_rocm_attn.kernels.triton.configs import DecodeConfig, verify_config

# the launcher module (the package re-exports its function under the same name)
pa_module = importlib.import_module("inductor_rocm_attn.kernels.triton.paged_attention")

ON_GPU = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(ON_GPU, reason="CPU matrix; the gpu tests cover CUDA")

# id, query_lens, context_lens, kwargs (every case passes the max_query_len hint)
CPU_CASES = [
    ("gqa1_bs16_fp16", [4, 3, 2], [40, 17, 0], dict(num_heads=2, num_kv_heads=2)),
    ("gqa4_bs32_fp32", [8, 2, 5], [70, 33, 1], dict(num_heads=8, num_kv_heads=2, block_size=32,
                                                    dtype=torch.float32)),
    ("gqa8_bs544_lbhnc", [3, 6], [600, 9], dict(num_heads=8, num_kv_heads=1, block_size=544,
                                                head_size=128, layout="LBHNC")),
    ("gqa4_d80_interleaved_window", [5, 4, 2], [50, 20, 3],
     dict(num_heads=8, num_kv_heads=2, head_size=80, interleaved_v=True, sliding_window=13)),
    ("gqa8_q8_alibi_softcap", [8, 7], [45, 60], dict(num_heads=8, num_kv_heads=1, alibi=True,
                                                     softcap=5.0)),
    ("gqa4_sinks_splits", [4, 2, 3], [90, 17, 40], dict(num_heads=8, num_kv_heads=2, sinks=True,
                                                        num_splits=3)),
    ("more_splits_than_tiles", [2, 8], [3, 100], dict(num_splits=5, sinks=True, alibi=True)),
    ("noncausal_window", [6, 3], [30, 12], dict(causal=False, sliding_window=7, alibi=True)),
    ("noncausal_split", [7, 2], [50, 0], dict(causal=False, num_splits=2)),
    ("padding_rows_and_empty_seq", [3, 0, 5], [12, 30, 8], dict(pad_rows=3)),
    ("fp8_e4m3_cache_split", [4, 2], [45, 20], dict(cache_dtype=torch.float8_e4m3fn, num_splits=2)),
    ("fp8_e5m2_cache_interleaved", [3, 5], [30, 25], dict(cache_dtype=torch.float8_e5m2,
                                                          interleaved_v=True, layout="LBHNC")),
    ("key_none_reads_cache", [4, 3], [20, 11], dict(key_from_cache=True, interleaved_v=True,
                                                    num_splits=2)),
    ("gqa16_q8_two_row_chunks", [8, 3], [30, 7], dict(num_heads=16, num_kv_heads=1, head_size=32)),
    ("gqa96_head_chunks_int64_index", [2, 2], [20, 5], dict(num_heads=96, num_kv_heads=1,
                                                            head_size=32,
                                                            index_dtype=torch.int64)),
    ("fp32_d256", [3, 2], [30, 20], dict(num_heads=4, num_kv_heads=2, head_size=256,
                                         dtype=torch.float32)),
    ("nan_padded_new_kv", [4, 5], [16, 33], dict(kv_pad_nan=5, sliding_window=20)),
    # mixed batches: decode (1), verify (2..8) and prefill (> 8) rows in one call
    ("mixed_decode_verify_prefill", [1, 4, 12, 2, 1], [40, 30, 5, 0, 9],
     dict(num_heads=8, num_kv_heads=2, sinks=True, alibi=True)),
    ("mixed_window_split", [9, 3, 1], [20, 40, 33], dict(sliding_window=19, num_splits=3,
                                                         interleaved_v=True)),
    # head size 512 with the verify config a GPU takes for it (32-row chunks, 8 warps)
    ("d512_gpu_config_two_row_chunks_split", [8, 3, 1], [30, 7, 20],
     dict(num_heads=8, num_kv_heads=1, head_size=512, num_splits=2,
          verify_cfg=verify_config(512, 8, 16, torch.float16, q_max=8))),
]
CPU_PARAMS = dict(argnames="query_lens,context_lens,kw", argvalues=[c[1:] for c in CPU_CASES],
                  ids=[c[0] for c in CPU_CASES])


@cpu_only
@pytest.mark.parametrize(**CPU_PARAMS)
def test_verify(query_lens, context_lens, kw):
    check_paged("triton", query_lens, context_lens, hints=True, **kw)


@cpu_only
@pytest.mark.parametrize("cfg", [DecodeConfig(16, 1, 1, "rows"), DecodeConfig(16, 1, 1, "rows3"),
                                 DecodeConfig(32, 2, 1, "rows3", k_rows=2)],
                         ids=["tile16_one_loop", "tile16_three_loops", "tile32_k_rows2"])
@pytest.mark.parametrize("query_lens,context_lens,kw", [
    ([4, 2, 8], [70, 33, 50], dict(num_heads=8, num_kv_heads=2, num_splits=2, sliding_window=40)),
    ([3, 5], [600, 20], dict(num_heads=4, num_kv_heads=1, block_size=544, sinks=True,
                             interleaved_v=True)),
    ([6, 2], [45, 17], dict(cache_dtype=torch.float8_e4m3fn, block_size=32, alibi=True)),
], ids=["splits_window", "bs544_sinks_interleaved", "fp8_bs32_alibi"])
def test_verify_configs(query_lens, context_lens, kw, cfg):
    """The GPU's 16-key tiles (K read as the page's packet rows), three loops (masked first,
    unmasked middle, masked last tile) and 2-run packet rows, over block sizes 16/32/544."""
    check_paged("triton", query_lens, context_lens, hints=True, verify_cfg=cfg, **kw)


@cpu_only
@pytest.mark.parametrize("margin", [0.0, 8.0])
def test_verify_lazy_rescale_with_peaked_logits(margin):
    """Logits 12x the usual spread: the lazy rescale must take its branch when needed."""
    check_paged("triton", [4, 7, 2], [90, 40, 50], hints=True, scale_mult=12.0, num_splits=2,
                verify_cfg=DecodeConfig(16, 1, 1, "rows3", rescale_margin=margin))


class _Launches:
    """Records the launches of the Triton kernels the launcher module calls by name."""

    def __init__(self, monkeypatch, *names):
        self.calls = {n: [] for n in names}
        for n in names:
            monkeypatch.setattr(pa_module, n, self._proxy(n, getattr(pa_module, n)))

    def _proxy(self, name, kernel):
        calls = self.calls[name]

        class _Proxy:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    calls.append(kwargs)
                    return kernel[grid](*args, **kwargs)
                return launch
        return _Proxy()


@cpu_only
@pytest.mark.parametrize("query_lens,hints,verify_max,launched", [
    ([4, 3, 2], True, None, {"_paged_verify_kernel"}),  # a verify batch: no prefill launch
    ([1, 5, 12], True, None, {"_paged_verify_kernel", "_prefix_prefill_kernel"}),  # mixed
    ([4, 3, 2], False, None, {"_prefix_prefill_kernel"}),  # no hint: the prefill kernel
    ([4, 3, 2], True, 1, {"_prefix_prefill_kernel"}),  # verify turned off
    ([1, 1], True, None, set()),  # decode only
])
def test_verify_routing(monkeypatch, query_lens, hints, verify_max, launched):
    """Which kernels run: verify for 2..8 query tokens when max_query_len is known (the
    prefill kernel then skips those sequences: SHORT_QUERY_MAX), else the prefill kernel.
    Every output row is checked against the oracle, so a skipped row would fail."""
    rec = _Launches(monkeypatch, "_paged_verify_kernel", "_prefix_prefill_kernel")
    check_paged("triton", query_lens, [30, 20, 10][: len(query_lens)], hints=hints,
                verify_max_query_len=verify_max)
    assert {n for n, c in rec.calls.items() if c} == launched
    for kw in rec.calls["_prefix_prefill_kernel"]:
        assert kw["SHORT_QUERY_MAX"] == (8 if "_paged_verify_kernel" in launched else 1)
    for kw in rec.calls["_paged_verify_kernel"]:
        assert kw["Q_MAX"] == (8 if max(query_lens) > 4 else 4)


def test_bad_verify_config_is_an_error():
    q = torch.zeros(3, 4, 64, dtype=torch.float16)
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache

    cache = allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.float16, CacheLayout.LHBNC), 4, "cpu")
    one = torch.ones(1)
    with pytest.raises(ValueError, match=r"paged_attention: verify kind 'streams'; supported"):
        pa_module.paged_attention(
            torch.empty_like(q), q, None, None, cache, torch.tensor([0, 3], dtype=torch.int32),
            torch.tensor([10], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32), 0.1,
            one, one, True, -1, None, None, 0.0, False, None, 3, 10,
            verify_cfg=DecodeConfig(32, 2, 1, "streams"))


# --- GPU ---------------------------------------------------------------------------------------

GPU_VERIFY = [
    ("gqa4_d128_bs16", dict(num_heads=32, num_kv_heads=8, head_size=128)),
    ("gqa8_d128_bs32_interleaved_window", dict(num_heads=16, num_kv_heads=2, head_size=128,
                                               block_size=32, interleaved_v=True,
                                               sliding_window=300)),
    ("gqa1_d64_bs544_sinks_softcap", dict(num_heads=8, num_kv_heads=8, head_size=64,
                                          block_size=544, sinks=True, softcap=8.0)),
    ("gqa16_d80_alibi_noncausal", dict(num_heads=16, num_kv_heads=1, head_size=80, alibi=True,
                                       causal=False)),
    ("gqa4_d128_split7_nan_pad", dict(num_heads=32, num_kv_heads=8, head_size=128, num_splits=7,
                                      kv_pad_nan=5)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kw", [c[1] for c in GPU_VERIFY], ids=[c[0] for c in GPU_VERIFY])
def test_triton_verify_gpu(kw, dtype):
    # verify (2..8), decode and a prefill in one call, long and short contexts
    check_paged("triton", [4, 1, 8, 2, 300, 3], [2000, 15, 1200, 0, 77, 700], hints=True,
                dtype=dtype, device=GPU, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_triton_verify_gpu_fp8_cache(cache_dtype, num_splits):
    check_paged("triton", [4, 2, 8], [1500, 400, 33], num_heads=32, num_kv_heads=8, head_size=128,
                dtype=torch.bfloat16, cache_dtype=cache_dtype, num_splits=num_splits, hints=True,
                device=GPU, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 4])
def test_triton_verify_gpu_fp8_output(num_splits):
    check_paged("triton", [4, 200, 3], [900, 300, 5], num_heads=16, num_kv_heads=4,
                head_size=128, dtype=torch.bfloat16, out_fp8=True, num_splits=num_splits,
                hints=True, device=GPU)
