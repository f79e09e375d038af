"""The Gluon prefix prefill (``kernels/gluon``: NVIDIA sm_90 only; the default prefill there).

CPU (no Gluon interpreter): the eligibility rules, the ``ROCM_ATTN_PREFILL_KERNEL`` /
``prefill_kernel=`` choice and the fall-back to the Triton prefill (run in the interpreter).
GPU (``gpu``, skipped off Hopper): the full ``paged_attention`` with ``prefill_kernel="gluon"``
on fresh random inputs against the float64 oracle (``cases.dense_oracle``), the output NaN-
poisoned between guard rows, the cache's unused slots and blocks NaN (``cases.poison``), and
the Gluon launch counted, so a silent fall-back to Triton fails the test. Every test name
contains ``gluon`` (``-k gluon`` selects them all). That the kernel compiles for sm_90 without
spills: ``tests/test_triton_sm90_compile.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import warnings

import pytest
import torch

import cases
from attention_checks import TOL, seed
from inductor_rocm_attn.kernels.gluon import eligibility

pa_mod = importlib.import_module("inductor_rocm_attn.kernels.triton.paged_attention")
# per-row bar of tests/test_oracle_sweep_kernels.py: a few units of the 16-bit rounding
ROW_TOL = {torch.float16: 3 * 2.0 ** -11, torch.bfloat16: 2 * 2.0 ** -8}


def _hopper() -> bool:
    return (torch.cuda.is_available() and torch.version.hip is None
            and torch.cuda.get_device_capability() == (9, 0))


def hopper_only(fn):
    """A GPU test that needs NVIDIA sm_90 (skipped elsewhere)."""
    fn = pytest.mark.skipif(not _hopper(), reason="the Gluon prefill is NVIDIA sm_90 only")(fn)
    return pytest.mark.gpu(fn)


def _ineligible(**changes):
    """``static_ineligibility`` of a covered launch with ``changes`` (a CUDA sm_90 device is
    assumed only by the checks that come after the static ones)."""
    kw = dict(device_type="cuda", device_index=0, query_dtype=torch.bfloat16, key_dtype=torch.bfloat16,
              cache_dtype=torch.bfloat16, head_size=128, block_size=16, causal=True, sliding_window=False,
              soft_cap=False, alibi=False, sinks=False, output_scale=False, interpreting=False)
    kw.update(changes)
    return eligibility.static_ineligibility(**kw)


@pytest.mark.parametrize("changes,expect", [
    (dict(interpreting=True), "TRITON_INTERPRET"),
    (dict(key_dtype=None), "no new key/value"),
    (dict(query_dtype=torch.float32, key_dtype=torch.float32, cache_dtype=torch.float32), "query dtype"),
    (dict(cache_dtype=torch.float8_e4m3fn), "not one dtype"),
    (dict(key_dtype=torch.float16), "not one dtype"),
    (dict(head_size=96), "head size 96"),
    (dict(head_size=256), "head size 256"),
    (dict(block_size=4), "block size 4"),
    (dict(block_size=48), "block size 48"),
    (dict(block_size=256), "block size 256"),
    (dict(block_size=8, head_size=64), "block size 8 at head size 64"),
    (dict(causal=False), "non-causal"),
    (dict(sliding_window=True), "sliding window"),
    (dict(soft_cap=True), "soft cap"),
    (dict(alibi=True), "ALiBi"),
    (dict(sinks=True), "sinks"),
    (dict(output_scale=True), "output scale"),
    (dict(device_type="cpu"), "not an NVIDIA GPU"),
])
def test_gluon_prefill_static_ineligibility_names_the_reason(changes, expect):
    reason = _ineligible(**changes)
    assert reason is not None and expect in reason, reason


def test_gluon_prefill_tensor_ineligibility():
    """TMA needs [tokens, heads * head_size] views with 16-byte rows: a query sliced out of a
    fused qkv row is fine, a query whose heads are not adjacent is not."""
    qkv = torch.randn(10, 4 + 2 + 2, 128, dtype=torch.bfloat16)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    out = torch.empty(10, 4, 128, dtype=torch.bfloat16)
    cache = torch.empty(4, 2, 16, 2 * 128, dtype=torch.bfloat16)
    assert eligibility.tensor_ineligibility(out, q, k, v, cache) is None
    shifted = torch.empty(4 * 2 * 16 * 256 + 1, dtype=torch.bfloat16)[1:].view(4, 2, 16, 256)
    assert "KV cache is not 16-byte aligned" in eligibility.tensor_ineligibility(out, q, k, v, shifted)
    q_t = torch.randn(4, 10, 128, dtype=torch.bfloat16).transpose(0, 1)
    assert "query is not TMA-readable" in eligibility.tensor_ineligibility(out, q_t, k, v, cache)
    odd = torch.randn(10 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(10, 2, 128)
    assert "key is not TMA-readable" in eligibility.tensor_ineligibility(out, q, odd, v, cache)
    out_t = torch.empty(10, 128, 4, dtype=torch.bfloat16).transpose(1, 2)
    assert "output channels" in eligibility.tensor_ineligibility(out_t, q, k, v, cache)


@pytest.mark.parametrize("value,ok", [("auto", True), ("triton", True), ("gluon", True), ("Gluon", False),
                                      ("", False)])
def test_gluon_prefill_env_var_is_checked_at_import(value, ok):
    """ROCM_ATTN_PREFILL_KERNEL is read once, at import; anything but auto/triton/gluon raises,
    naming the variable, the value and the choices."""
    code = ("from inductor_rocm_attn.kernels.triton import configs\n"
            "print(configs.DEFAULT_PREFILL_KERNEL)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "ROCM_ATTN_PREFILL_KERNEL": value})
    if ok:
        assert r.returncode == 0 and r.stdout.strip() == value, r.stderr[-2000:]
    else:
        assert r.returncode != 0, r.stdout
        assert "ROCM_ATTN_PREFILL_KERNEL" in r.stderr and repr(value) in r.stderr and "'gluon'" in r.stderr


def _args(c, out, *, sliding_window=-1, hints=True):
    scale = c.query.shape[2] ** -0.5
    kw = dict(max_query_len=c.max_query_len, max_seq_len=max(c.seq_lens.tolist())) if hints else {}
    return ((out, c.query, c.key, c.value, c.kv_cache, c.query_start_loc, c.seq_lens, c.block_table, scale,
             c.k_scale, c.v_scale, True, sliding_window, None, None, 0.0, c.interleaved_v, None), kw, scale)


def test_gluon_prefill_bad_keyword_refused_before_any_write():
    c = cases.make_paged_case([5, 1], [3, 4], dtype=torch.float16, seed=seed())
    out = cases.poison(torch.empty_like(c.query))
    args, kw, _ = _args(c, out)
    with pytest.raises(ValueError, match=r"paged_attention: prefill_kernel='fast'; supported: \('auto', 'triton', 'gluon'\)"):
        pa_mod.paged_attention(*args, **kw, prefill_kernel="fast")
    # a value of another kind was a ValueError; gluon with a Triton config ran the Triton prefill silently
    with pytest.raises(TypeError, match=r"paged_attention: prefill_kernel must be one of \('auto', 'triton', 'gluon'\) "
                                        r"or None, got int 1"):
        pa_mod.paged_attention(*args, **kw, prefill_kernel=1)
    cfg = pa_mod.prefill_config(c.query.shape[2], 2, c.kv_cache.shape[2], torch.float16, pa_mod.interpreting())
    with pytest.raises(ValueError, match=r"paged_attention: prefill_kernel='gluon' with a prefill_cfg, a config of the "
                                         r"Triton prefill \(which would run instead\); give one or the other"):
        pa_mod.paged_attention(*args, **kw, prefill_kernel="gluon", prefill_cfg=cfg)
    assert torch.isnan(out.float()).all()


def test_gluon_prefill_env_with_a_triton_config_warns(monkeypatch):
    """ROCM_ATTN_PREFILL_KERNEL=gluon and a prefill_cfg (a Triton config) run the Triton prefill
    with the config, as any other reason it runs, with one warning (it ran silently)."""
    monkeypatch.setattr(pa_mod, "DEFAULT_PREFILL_KERNEL", "gluon")
    monkeypatch.setattr(pa_mod, "_WARNED_REASONS", set())
    c = cases.make_paged_case([20, 1], [5, 7], dtype=torch.float16, seed=seed())
    out = cases.poison(torch.empty_like(c.query))
    args, kw, scale = _args(c, out)
    cfg = pa_mod.prefill_config(c.query.shape[2], 2, c.kv_cache.shape[2], torch.float16, pa_mod.interpreting())
    with pytest.warns(UserWarning, match=r"prefill kernel 'gluon' .* does not cover this launch \(a prefill_cfg, a "
                                         r"Triton prefill config, was given\); the Triton prefill runs it"):
        pa_mod.paged_attention(*args, **kw, prefill_cfg=cfg)
    err = cases.rel_err(out.double(), cases.dense_oracle(c, scale=scale, causal=True))
    assert err < TOL[torch.float16], err


def test_gluon_prefill_ineligible_launch_runs_triton_with_one_warning(monkeypatch):
    """prefill_kernel="gluon" where the kernel cannot run (here: the interpreter on CPU) runs
    the Triton prefill, right, and warns once per reason."""
    if not pa_mod.interpreting():
        pytest.skip("CPU interpreter case (on a GPU: test_gluon_prefill_ineligible_on_gpu_runs_triton)")
    monkeypatch.setattr(pa_mod, "_WARNED_REASONS", set())
    c = cases.make_paged_case([20, 1, 9], [5, 7, 0], dtype=torch.float16, seed=seed())
    first, second = _two_runs_warnings(c, "gluon", "prefill kernel 'gluon'")
    assert len(first) == 1 and not second, (first, second)
    assert "TRITON_INTERPRET" in first[0] and "Triton prefill runs it" in first[0]


def _two_runs_warnings(c, prefill_kernel: str, marker: str) -> list[list[str]]:
    """Two identical launches of case ``c`` on NaN-poisoned outputs, each checked against the
    float64 oracle: per launch, the warnings whose text holds ``marker``."""
    per_run = []
    for _ in range(2):
        out = cases.poison(torch.empty_like(c.query))
        args, kw, scale = _args(c, out)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pa_mod.paged_attention(*args, **kw, prefill_kernel=prefill_kernel)
        per_run.append([str(w.message) for w in caught if marker in str(w.message)])
        err = cases.rel_err(out.double().cpu(), cases.dense_oracle(c, scale=scale, causal=True))
        assert err < TOL[torch.float16], err
    return per_run


def test_gluon_prefill_default_is_auto_and_triton_never_consults_it(monkeypatch):
    """The default is "auto"; prefill_kernel="triton", and any choice under the interpreter,
    never ask about Gluon (no extra host cost), and give the right result."""
    code = ("import os; os.environ.pop('ROCM_ATTN_PREFILL_KERNEL', None)\n"
            "from inductor_rocm_attn.kernels.triton import configs\n"
            "print(configs.DEFAULT_PREFILL_KERNEL)")
    env = {k: v for k, v in os.environ.items() if k != "ROCM_ATTN_PREFILL_KERNEL"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "auto", r.stderr[-2000:]

    def asked(*a, **k):
        raise AssertionError("the Gluon eligibility was consulted")

    monkeypatch.setattr(pa_mod, "_gluon_ineligibility", asked)
    c = cases.make_paged_case([20, 1], [5, 7], dtype=torch.float16, device="cuda" if _hopper() else "cpu",
                              seed=seed())
    choices = ["triton"] + (["auto"] if pa_mod.interpreting() else [])
    for choice in choices:
        out = cases.poison(torch.empty_like(c.query))
        args, kw, scale = _args(c, out)
        pa_mod.paged_attention(*args, **kw, prefill_kernel=choice)
        err = cases.rel_err(out.double().cpu(), cases.dense_oracle(c, scale=scale, causal=True))
        assert err < TOL[torch.float16], err


def test_gluon_prefill_auto_falls_back_silently(monkeypatch):
    """"auto" takes the Gluon prefill only where it covers the launch under the Triton release
    it was tested with, and otherwise runs the Triton prefill without a warning; "gluon" takes
    it under any release and warns once per reason it cannot."""
    from inductor_rocm_attn.kernels.gluon import eligibility
    import triton

    monkeypatch.setattr(pa_mod, "_WARNED_REASONS", set())
    # the eligibility is replaced below: of the launch's tensors only the cache's block size is read
    launch = (None,) * 4 + (torch.empty(1, 2, 16, 8),) + (None,) * 7
    launch_bs8 = (None,) * 4 + (torch.empty(1, 2, 8, 8),) + (None,) * 7
    covered = lambda *a: None  # noqa: E731
    monkeypatch.setattr(pa_mod, "_gluon_ineligibility", covered)
    eligibility.auto_problem.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning from auto, whichever kernel it takes
            assert pa_mod._gluon_prefill_runs("auto", False, *launch) is triton.__version__.startswith("3.6.")
            monkeypatch.setattr(triton, "__version__", "3.6.0")
            eligibility.auto_problem.cache_clear()
            assert pa_mod._gluon_prefill_runs("auto", False, *launch) is True
            # block sizes the GPU tests have not run the kernel at: the default leaves them to Triton
            assert "block size 8" in eligibility.auto_problem(8)
            assert pa_mod._gluon_prefill_runs("auto", False, *launch_bs8) is False
            assert pa_mod._gluon_prefill_runs("gluon", False, *launch_bs8) is True
            for block_size in (16, 32, 64, 128):
                assert eligibility.auto_problem(block_size) is None
            monkeypatch.setattr(triton, "__version__", "9.9.0")
            eligibility.auto_problem.cache_clear()
            assert "Triton 9.9.0" in eligibility.auto_problem(16)
            assert pa_mod._gluon_prefill_runs("auto", False, *launch) is False
            assert pa_mod._gluon_prefill_runs("gluon", False, *launch) is True  # any release when asked
            assert pa_mod._gluon_prefill_runs("auto", True, *launch) is False  # the interpreter
            monkeypatch.setattr(pa_mod, "_gluon_ineligibility", lambda *a: "a sliding window")
            assert pa_mod._gluon_prefill_runs("auto", False, *launch) is False
        with pytest.warns(UserWarning, match=r"prefill kernel 'gluon'.*\(a sliding window\)"):
            assert pa_mod._gluon_prefill_runs("gluon", False, *launch) is False
    finally:
        eligibility.auto_problem.cache_clear()


def test_gluon_prefill_build_failure_under_auto_warns_once_and_runs_triton(monkeypatch):
    """A Gluon prefill that fails to build or launch (a ptxas or driver it was not tested with)
    under the default "auto": one warning naming the error, the Triton prefill gives the right
    result for that launch and every later one (the Gluon kernel is not tried again); asked
    for explicitly ("gluon"), the error propagates with the output untouched."""
    monkeypatch.setattr(pa_mod, "_GLUON_AUTO_FAILURE", [])
    tries = []

    def broken(*a, **k):
        tries.append(1)
        raise RuntimeError("PTXAS error: Internal Triton PTX codegen error\nptxas fatal   : setmaxnreg unsupported")

    monkeypatch.setattr(pa_mod, "_gluon_launch", lambda: broken)
    # the launch covered (the interpreter, the device and the Triton release aside)
    real_runs = pa_mod._gluon_prefill_runs
    monkeypatch.setattr(pa_mod, "_gluon_ineligibility", lambda *a: None)
    monkeypatch.setattr(pa_mod, "_gluon_auto_problem", lambda block_size: None)
    monkeypatch.setattr(pa_mod, "_gluon_prefill_runs", lambda choice, interpret, *rest: real_runs(choice, False, *rest))
    c = cases.make_paged_case([20, 1, 9], [5, 7, 0], dtype=torch.float16, device="cuda" if _hopper() else "cpu",
                              seed=seed())
    first, second = _two_runs_warnings(c, "auto", "Gluon prefill")
    assert len(first) == 1 and not second, (first, second)
    assert "failed to build or launch (RuntimeError: ptxas fatal   : setmaxnreg unsupported)" in first[0]
    assert "the Triton prefill runs this launch and every later one" in first[0]
    assert tries == [1]
    out = cases.poison(torch.empty_like(c.query))
    args, kw, scale = _args(c, out)
    with pytest.raises(RuntimeError, match="setmaxnreg unsupported"):
        pa_mod.paged_attention(*args, **kw, prefill_kernel="gluon")
    assert tries == [1, 1]
    # the decode sequence ran before the prefill was reached; the prefill rows are untouched
    rows = torch.arange(c.query.shape[0], device=out.device)
    first, second = int(c.query_start_loc[1]), int(c.query_start_loc[2])
    prefill_rows = (rows < first) | (rows >= second)
    assert torch.isnan(out[prefill_rows].float()).all()


def _prefix_prefill():
    """The Gluon kernel module (imports where Triton has Gluon; the CPU tests skip elsewhere)."""
    return pytest.importorskip("inductor_rocm_attn.kernels.gluon.prefix_prefill")


@pytest.mark.parametrize("changes,expect", [
    (dict(load_warps=2), "load_warps=2 (supported: 4, 8)"),
    (dict(load_warps=12), "load_warps=12 (supported: 4, 8)"),
    (dict(gather="rows"), "gather='rows' (supported: 'chunks', 'tile', 'tile_k', 'pages')"),
    (dict(publish="once"), "publish='once' (supported: 'separate', 'joint', 'noinc')"),
    (dict(release="early"), "release='early' (supported: 'joint', 'split')"),
    (dict(v_load="bulk"), "v_load='bulk' (supported: 'gather', 'tma', 'regs', 'regs32')"),
    (dict(v_load="regs"), "v_load='regs' with k_load='cp_async' (supported: k_load='regs' or 'regs32')"),
    (dict(v_load="tma", publish="noinc"), "v_load='tma' with publish='noinc' (supported: publish='separate')"),
    (dict(k_load="lds"), "k_load='lds' (supported: 'cp_async', 'regs', 'regs32')"),
    (dict(k_load="regs", publish="joint"), "k_load='regs' with publish='joint', release='joint' (supported: "
                                           "publish='separate', release='joint')"),
    (dict(k_load="regs", release="split"), "k_load='regs' with publish='separate', release='split'"),
    (dict(consumer_regs=236), "consumer_regs=236 (a multiple of 8 in 24..256)"),
    (dict(load_warps=8), "maxnreg=168: 16 warps x 32 x 168 registers exceed 65536"),
    (dict(load_warps=8, maxnreg=128), "consumer_regs=240 with maxnreg=128 leaves the 8 load warps 16 registers"),
    (dict(consumer_regs=248), "consumer_regs=248 with maxnreg=168 leaves the 4 load warps 8 registers"),
])
def test_gluon_prefill_config_refuses_bad_variants(changes, expect):
    """A config the kernel cannot run as asked (a load partition that is not whole warpgroups,
    a register split Triton would silently drop setmaxnreg for) is refused when it is made."""
    pp = _prefix_prefill()
    with pytest.raises(ValueError, match=r"GluonPrefillConfig: .*" + expect.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(pp.DEFAULT_CONFIG, **changes)


def test_gluon_prefill_sweep_variants_are_valid_and_default_unchanged():
    """Every named variant is a valid config; the default's fields are the kernel's defaults
    (4 load warps, the chunked gather, K and V published separately)."""
    pp = _prefix_prefill()
    assert pp.SWEEP_VARIANTS["default"] is pp.DEFAULT_CONFIG
    assert (pp.DEFAULT_CONFIG.load_warps, pp.DEFAULT_CONFIG.gather, pp.DEFAULT_CONFIG.publish) == (
        4, "chunks", "separate")
    assert pp.DEFAULT_CONFIG.load_regs() == 24
    assert pp._options(pp.DEFAULT_CONFIG) == dict(num_warps=4, maxnreg=168)
    assert pp._variant_constexprs(pp.DEFAULT_CONFIG) == dict(GATHER_TILE_K=False, GATHER_TILE_V=False,
                                                             JOINT_PUBLISH=False, NOINC_PUBLISH=False,
                                                             SPLIT_RELEASE=False, V_TMA=False)
    assert (pp.DEFAULT_CONFIG.v_load, pp.DEFAULT_CONFIG.k_load) == ("gather", "cp_async")
    for name, cfg in pp.SWEEP_VARIANTS.items():
        assert cfg.load_regs() >= 24 and (cfg.load_warps + 8) * 32 * cfg.maxnreg <= 65536, name


def test_gluon_prefill_variant_refuses_uncovered_block_size_before_any_write():
    """A variant that does not cover the launch is refused by launch() with the reason, before
    the kernel runs: 8 load warps gather K in chunks of 32 keys at head size 64, more than a
    16-token page (the tile gather covers it); V by TMA takes the standard V interior at
    blocks 16-64 only."""
    pp = _prefix_prefill()
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, k_view, v_view

    q = torch.randn(40, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(40, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    cache = allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.bfloat16, CacheLayout.LHBNC), 8, "cpu")
    out = cases.poison(torch.empty_like(q))

    def launch(variant, interleaved_v):
        pp.launch(out, q, k, v, k_view(cache, 2), v_view(cache, 2, interleaved_v),
                  torch.zeros(1, 8, dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
                  torch.tensor([0, 40], dtype=torch.int32), 0.125, interleaved_v, 8, cfg=pp.SWEEP_VARIANTS[variant])

    with pytest.raises(ValueError, match=r"Gluon prefill: load_warps=8 with gather='chunks' gathers K in chunks of "
                                         r"32 keys at head size 64, more than a block of 16"):
        launch("load8", False)
    assert torch.isnan(out.float()).all()
    pp._check_variant(pp.SWEEP_VARIANTS["load8_tile"], 64, 16)  # covered
    with pytest.raises(ValueError, match=r"v_load='tma' with interleaved V at block size 16; supported: standard V "
                                         r"at block sizes 16, 32, 64"):
        launch("v_tma", True)
    assert torch.isnan(out.float()).all()
    with pytest.raises(ValueError, match=r"v_load='tma' with standard V at block size 128"):
        pp._check_variant(pp.SWEEP_VARIANTS["v_tma"], 128, 128, False)
    pp._check_variant(pp.SWEEP_VARIANTS["v_tma"], 128, 64, False)  # covered
    with pytest.raises(ValueError, match=r"v_load='regs' with standard V; supported: interleaved V"):
        launch("kv_regs", False)
    assert torch.isnan(out.float()).all()
    pp._check_variant(pp.SWEEP_VARIANTS["kv_regs"], 128, 16, True)  # covered
    # V by TMA addresses the cache in 32-bit rows of block-size keys: a larger cache is refused
    # (launch() builds this descriptor before the kernel runs)
    huge = torch.empty((2 ** 27, 8, 128, 16), dtype=torch.bfloat16, device="meta")  # 2^37 rows of 16 keys
    with pytest.raises(ValueError, match=r"v_load='tma' addresses the V cache in 32-bit rows: 137438953472 rows "
                                         r"of 16 keys is too many \(supported: < 2147482624\)"):
        pp._v_cache_descriptor(huge, 128, 16)


def test_gluon_prefill_default_config_takes_the_register_and_tma_loads_where_the_cache_allows_them():
    """launch() without a config runs ``default_config``'s: K through registers and V by TMA for
    the standard V interior at blocks 16 / 32 / 64 with a V cache under the descriptor's 32-bit
    rows (either index dtype); K and V through registers for the interleaved V interior at block
    sizes that are multiples of 16; K and V gathered (``DEFAULT_CONFIG``) for other block
    sizes, larger caches and strides that are not whole rows."""
    pp = _prefix_prefill()

    def vc(blocks, block_size, head_size=128, kv_heads=8):
        return torch.empty((blocks, kv_heads, head_size, block_size), dtype=torch.bfloat16, device="meta")

    for bs in (16, 32, 64):
        assert pp.default_config(vc(64, bs), bs, False) is pp.K_REGS_V_TMA_CONFIG
    for bs in (16, 32, 64, 128):
        assert pp.default_config(vc(64, bs), bs, True) is pp.KV_REGS_CONFIG
        assert pp.default_config(vc(64, bs), bs, True, torch.int64) is pp.KV_REGS_CONFIG
    assert pp.default_config(vc(64, 8), 8, True) is pp.DEFAULT_CONFIG
    assert pp.default_config(vc(64, 24), 24, True) is pp.DEFAULT_CONFIG
    for bs in (8, 128, 256):
        assert pp.default_config(vc(64, bs), bs, False) is pp.DEFAULT_CONFIG
    # int64 block tables take the same configs (V by TMA narrows its rows to 32 bits)
    assert pp.default_config(vc(64, 16), 16, False, torch.int64) is pp.K_REGS_V_TMA_CONFIG
    assert (pp.KV_REGS_CONFIG.k_load, pp.KV_REGS_CONFIG.v_load) == ("regs", "regs")
    assert (pp.K_REGS_V_TMA_CONFIG.k_load, pp.K_REGS_V_TMA_CONFIG.v_load) == ("regs", "tma")
    assert (pp.DEFAULT_CONFIG.k_load, pp.DEFAULT_CONFIG.v_load) == ("cp_async", "gather")
    # the descriptor takes fewer than 2^31 - 1024 rows of 16 keys (a page's V of one head is 128
    # rows, 1024 a page over 8 KV heads): one page more than fits gathers V
    fits = (pp._ROW_PAST_DESCRIPTOR.value - 1) // (8 * 128)
    assert pp.default_config(vc(fits, 16), 16, False) is pp.K_REGS_V_TMA_CONFIG
    assert pp.default_config(vc(fits + 1, 16), 16, False) is pp.DEFAULT_CONFIG
    # a cache viewed out of a larger allocation (its block stride spans K and V, say) counts its
    # extent, as the descriptor does: half the blocks at twice the stride do not fit either
    kv = torch.empty((fits // 2 + 1, 2, 8, 128, 16), dtype=torch.bfloat16, device="meta")
    assert pp.default_config(kv[:, 1], 16, False) is pp.DEFAULT_CONFIG
    assert pp.default_config(kv[: fits // 4, 1], 16, False) is pp.K_REGS_V_TMA_CONFIG
    # block strides that are not whole rows of keys cannot be addressed by row
    odd = torch.empty((64 * 8 * 128 * 16 + 64 * 8,), dtype=torch.bfloat16, device="meta")
    assert pp.default_config(odd.as_strided((64, 8, 128, 16), (8 * 128 * 16 + 8, 128 * 16, 16, 1)), 16,
                             False) is pp.DEFAULT_CONFIG


def test_gluon_prefill_launch_without_a_config_runs_default_configs_choice(monkeypatch):
    """launch() with no config launches ``default_config``'s variant (its constexprs reach the
    kernel): K through registers and V by TMA for standard V, K and V through registers for
    interleaved V, at either index dtype (the kernel call intercepted: no GPU)."""
    pp = _prefix_prefill()
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, k_view, v_view

    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(kw)

    monkeypatch.setattr(pp, "_gluon_prefix_prefill_kernel", Kernel())
    q = torch.randn(40, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(40, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    cache = allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.bfloat16, CacheLayout.LHBNC), 8, "cpu")
    for interleaved_v, index_dtype, want in ((False, torch.int32, pp.K_REGS_V_TMA_CONFIG),
                                             (True, torch.int32, pp.KV_REGS_CONFIG),
                                             (True, torch.int64, pp.KV_REGS_CONFIG),
                                             (False, torch.int64, pp.K_REGS_V_TMA_CONFIG)):
        pp.launch(torch.empty_like(q), q, k, v, k_view(cache, 2), v_view(cache, 2, interleaved_v),
                  torch.zeros(1, 8, dtype=index_dtype), torch.tensor([40], dtype=index_dtype),
                  torch.tensor([0, 40], dtype=index_dtype), 0.125, interleaved_v, 8)
        got = {name: launched[-1][name] for name in pp._variant_constexprs(want)}
        assert got == pp._variant_constexprs(want), (interleaved_v, index_dtype)
        assert launched[-1]["CONSUMER_REGS"] == want.consumer_regs


# --- GPU --------------------------------------------------------------------------------------

def _run_gluon(monkeypatch, query_lens, context_lens, *, num_heads=8, num_kv_heads=2, head_size=128,
               block_size=16, dtype=torch.bfloat16, layout="LHBNC", interleaved_v=False, hints=True,
               pad_rows=0, index_dtype=torch.int32, cfg=None):
    """One fresh random case through ``paged_attention(prefill_kernel="gluon")``: the Gluon
    launch must happen (counted) and the result match the float64 oracle. ``cfg``: the
    launch's ``GluonPrefillConfig`` (default: the kernel's)."""
    seed_ = seed()
    c = cases.make_paged_case(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_size=head_size, block_size=block_size, dtype=dtype, layout=layout,
                              interleaved_v=interleaved_v, device="cuda", seed=seed_)
    if index_dtype != torch.int32:
        c.query_start_loc, c.seq_lens, c.block_table = (
            x.to(index_dtype) for x in (c.query_start_loc, c.seq_lens, c.block_table))
    t = c.query.shape[0]
    if pad_rows:  # graph padding: rows past query_start_loc[-1] must stay untouched
        g = torch.Generator(device="cuda").manual_seed(seed_)
        c.query, c.key, c.value = (
            torch.cat([x, torch.randn(pad_rows, *x.shape[1:], generator=g, device="cuda").to(dtype)])
            for x in (c.query, c.key, c.value))
    guarded = cases.Guarded(c.query.shape, dtype, "cuda")
    out = guarded.t
    args, kw, scale = _args(c, out, hints=hints)
    launches = []
    real = pa_mod._gluon_launch()

    def counted(*a, **k):
        launches.append(1)
        return real(*a, **k) if cfg is None else real(*a, **k, cfg=cfg)

    monkeypatch.setattr(pa_mod, "_gluon_launch", lambda: counted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pa_mod.paged_attention(*args, **kw, prefill_kernel="gluon")
    torch.cuda.synchronize()
    fallbacks = [str(w.message) for w in caught if "prefill kernel 'gluon'" in str(w.message)]
    assert not fallbacks, fallbacks
    assert launches == [1], f"the Gluon prefill did not run (seed {seed_})"
    guarded.assert_intact()
    if pad_rows:
        assert torch.isnan(out[t:].float()).all(), f"padding rows were written (seed {seed_})"
    got = out[:t].double().cpu()
    assert not torch.isnan(got).any(), (f"unwritten or NaN rows (seed {seed_}): "
                                        f"{torch.isnan(got).any(-1).any(-1).nonzero().flatten()[:10].tolist()}")
    ref = cases.dense_oracle(c, scale=scale, causal=True)
    err = cases.rel_err(got, ref)
    assert err < TOL[dtype], f"rel err {err:.3e} (seed {seed_})"
    rows = cases.row_rel_err(got, ref)  # every (token, head) row, at the oracle sweeps' bar
    worst = divmod(int(rows.argmax()), rows.shape[1])
    assert rows.max() < ROW_TOL[dtype], f"row (token, head) {worst} rel err {rows.max():.3e} (seed {seed_})"


@hopper_only
@pytest.mark.parametrize("ctx,qlen", [(0, 200), (1, 384), (15, 200), (16, 384), (17, 200), (127, 129),
                                      (128, 384), (300, 200), (4100, 384)])
def test_gluon_prefill_cached_prefix_lengths(monkeypatch, ctx, qlen):
    """No prefix, and prefixes ending inside a page, on a page edge and on a key-tile edge,
    with new-token counts that end inside a row block or on its edge."""
    _run_gluon(monkeypatch, [qlen], [ctx])


@hopper_only
@pytest.mark.parametrize("hints", [True, False], ids=["verify", "no_hints"])
def test_gluon_prefill_mixed_batch(monkeypatch, hints):
    """Decode (1), verify-sized (2..8, the verify kernel's with hints, else the prefill's) and
    long sequences in one launch, query lengths 1..300 (none a multiple of 128 but one),
    contexts from none to several pages; graph-padding rows past the batch."""
    _run_gluon(monkeypatch, [1, 300, 2, 129, 5, 1, 128, 37, 8, 255],
               [40, 17, 3, 0, 100, 0, 260, 1, 16, 33], hints=hints, pad_rows=70)


@hopper_only
@pytest.mark.parametrize("dtype,interleaved_v,block_size,layout,gqa,head_size,index_dtype", [
    (torch.float16, False, 16, "LHBNC", 4, 128, torch.int32),
    (torch.float16, True, 32, "LBHNC", 8, 128, torch.int32),
    (torch.bfloat16, True, 16, "LBHNC", 1, 128, torch.int64),
    (torch.bfloat16, False, 32, "LBHNC", 8, 128, torch.int32),
    (torch.float16, False, 32, "LHBNC", 1, 128, torch.int32),
    (torch.bfloat16, True, 16, "LHBNC", 4, 128, torch.int32),
    (torch.bfloat16, False, 16, "LHBNC", 4, 64, torch.int32),
    (torch.float16, True, 32, "LBHNC", 8, 64, torch.int32),
    # block sizes 64 / 128 (in the default's eligibility.AUTO_BLOCK_SIZES since these rows ran
    # under memcheck on an H100)
    (torch.bfloat16, False, 64, "LHBNC", 4, 128, torch.int32),
    (torch.float16, True, 128, "LBHNC", 8, 128, torch.int32),
    (torch.bfloat16, True, 64, "LHBNC", 4, 64, torch.int32),
    (torch.float16, False, 128, "LBHNC", 1, 64, torch.int32),
], ids=lambda v: str(v).replace("torch.", ""))
def test_gluon_prefill_variants(monkeypatch, dtype, interleaved_v, block_size, layout, gqa, head_size, index_dtype):
    """fp16/bf16, standard/interleaved V, block sizes 16-128, both cache layouts, GQA 1/4/8,
    head sizes 128/64, int32/int64 index tensors, on a varlen batch with prefixes."""
    _run_gluon(monkeypatch, [300, 1, 130, 17, 64], [137, 40, 0, 1, 300], num_heads=8, num_kv_heads=8 // gqa,
               head_size=head_size, block_size=block_size, dtype=dtype, layout=layout,
               interleaved_v=interleaved_v, index_dtype=index_dtype)


def _sweep_variant_names():
    try:
        from inductor_rocm_attn.kernels.gluon.prefix_prefill import SWEEP_VARIANTS
    except Exception:  # noqa: BLE001 - no Gluon here: the GPU tests skip anyway
        return ["default"]
    return list(SWEEP_VARIANTS)


@hopper_only
@pytest.mark.parametrize("variant", _sweep_variant_names())
@pytest.mark.parametrize("dtype,interleaved_v,block_size,layout,gqa,head_size,index_dtype", [
    (torch.bfloat16, False, 16, "LHBNC", 4, 128, torch.int32),  # the benchmark's shape
    (torch.float16, True, 32, "LBHNC", 8, 128, torch.int32),
    (torch.bfloat16, True, 16, "LHBNC", 1, 64, torch.int32),
    (torch.float16, False, 32, "LBHNC", 8, 64, torch.int32),  # standard V in the block-major layout (v_load="tma")
    (torch.bfloat16, False, 64, "LHBNC", 4, 128, torch.int64),  # V by TMA rows from an int64 block table
], ids=lambda v: str(v).replace("torch.", ""))
def test_gluon_prefill_sweep_variant(monkeypatch, variant, dtype, interleaved_v, block_size, layout, gqa, head_size,
                                     index_dtype):
    """Every context-gather variant of the GPU sweep (``SWEEP_VARIANTS``: load warps, one-op
    tile gather, joint or per-thread K/V publication, K released before V) against the float64 oracle: prefixes ending inside a
    page, on a page edge, inside a key tile and 4100 keys long (the ring wraps many times),
    decode and short sequences, new-token tails. A variant that does not cover the shape
    (``_check_variant``) is skipped."""
    from inductor_rocm_attn.kernels.gluon import prefix_prefill as pp

    cfg = pp.SWEEP_VARIANTS[variant]
    try:
        pp._check_variant(cfg, head_size, block_size, interleaved_v)
    except ValueError as e:
        pytest.skip(str(e))
    _run_gluon(monkeypatch, [300, 1, 130, 17, 64, 200], [137, 40, 0, 1, 300, 4100], num_heads=8,
               num_kv_heads=8 // gqa, head_size=head_size, block_size=block_size, dtype=dtype, layout=layout,
               interleaved_v=interleaved_v, index_dtype=index_dtype, cfg=cfg)


@hopper_only
def test_gluon_prefill_ineligible_on_gpu_runs_triton(monkeypatch):
    """A sliding window is not covered: prefill_kernel="gluon" runs the Triton prefill (one
    warning), with the right result."""
    monkeypatch.setattr(pa_mod, "_WARNED_REASONS", set())
    c = cases.make_paged_case([200, 1, 40], [60, 9, 0], num_heads=8, num_kv_heads=2, head_size=128,
                              dtype=torch.bfloat16, device="cuda", seed=seed())
    guarded = cases.Guarded(c.query.shape, torch.bfloat16, "cuda")
    args, kw, scale = _args(c, guarded.t, sliding_window=50)
    with pytest.warns(UserWarning, match=r"prefill kernel 'gluon'.*a sliding window.*Triton prefill runs it"):
        pa_mod.paged_attention(*args, **kw, prefill_kernel="gluon")
    torch.cuda.synchronize()
    guarded.assert_intact()
    err = cases.rel_err(guarded.t.double().cpu(), cases.dense_oracle(c, scale=scale, causal=True, sliding_window=50))
    assert err < TOL[torch.bfloat16], err


@hopper_only
def test_gluon_prefill_auto_takes_it_by_default_on_hopper(monkeypatch):
    """With no choice given (the default "auto", Triton 3.6) an eligible launch on sm_90 runs
    the Gluon prefill, silently, with the right result."""
    if pa_mod.DEFAULT_PREFILL_KERNEL != "auto":
        pytest.skip("ROCM_ATTN_PREFILL_KERNEL is set in this environment")
    c = cases.make_paged_case([200, 1, 40], [60, 9, 0], num_heads=8, num_kv_heads=2, head_size=128,
                              dtype=torch.bfloat16, device="cuda", seed=seed())
    launches = []
    real = pa_mod._gluon_launch()
    monkeypatch.setattr(pa_mod, "_gluon_launch", lambda: lambda *a, **k: (launches.append(1), real(*a, **k)))
    guarded = cases.Guarded(c.query.shape, torch.bfloat16, "cuda")
    args, kw, scale = _args(c, guarded.t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pa_mod.paged_attention(*args, **kw)
    torch.cuda.synchronize()
    assert launches == [1]
    guarded.assert_intact()
    err = cases.rel_err(guarded.t.double().cpu(), cases.dense_oracle(c, scale=scale, causal=True))
    assert err < TOL[torch.bfloat16], err

