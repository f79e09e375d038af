"""The provider registry: one record per provider, selection, measured preferences, `info`,
and the impl's fused writers going through the same cached resolve as the other paths."""

import dataclasses
import importlib.util
import inspect
import pathlib

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import capabilities, providers, validation
from inductor_rocm_attn.__main__ import main as cli_main
from inductor_rocm_attn.capabilities import ProviderCaps
from inductor_rocm_attn.kernels import reference as ref
from inductor_rocm_attn.layout import CacheLayout

from cases import poison

REPO = pathlib.Path(__file__).resolve().parents[1]
NAMES = ("aiter", "triton", "native", "reference")
QK_NORM = dict(device="cuda", head_size=128, dtype=torch.bfloat16, block_size=16,
               layout=CacheLayout.LHBNC, kv_cache_dtype="auto", interleaved_v=True)
BOTH_USABLE = {"aiter": None, "triton": None, "native": "not built"}


# --- the records ----------------------------------------------------------------------------


def test_every_provider_has_one_record():
    assert tuple(providers.REGISTRY) == NAMES  # declaration order = default preference
    for name, p in providers.REGISTRY.items():
        assert isinstance(p, providers.Provider) and p.name == name
        assert providers.get(name) is p
        assert isinstance(p.caps, ProviderCaps)
        assert set(p.caps.ops) <= set(capabilities.OPS), name
        assert set(p.caps.features) <= set(capabilities.FEATURES), name
        assert importlib.util.find_spec(p.module) is not None, p.module
        why = p.unavailable_reason()
        assert why is None or (isinstance(why, str) and why), name
    with pytest.raises(ValueError, match=r"unknown provider 'nope'; known: \('aiter'"):
        providers.get("nope")


@pytest.mark.parametrize("name", NAMES)
def test_load_gives_a_kernel_with_the_reference_signature(name):
    p = providers.get(name)
    for op in p.caps.ops:
        fn = p.load(op)
        params = inspect.signature(fn).parameters
        if any(x.kind is inspect.Parameter.VAR_POSITIONAL for x in params.values()):
            continue  # a stub that only raises
        want = list(inspect.signature(getattr(ref, op)).parameters)
        assert list(params)[: len(want)] == want, (name, op)
    missing = next((op for op in capabilities.OPS if op not in p.caps.ops), None)
    if missing is not None:
        with pytest.raises(NotImplementedError, match=f"provider {name} has no {missing} kernel"):
            p.load(missing)


def test_supports_reads_the_record():
    native = providers.get("native")
    q = dict(device="cuda", head_size=64, dtype=torch.float16, block_size=16)
    assert native.supports("paged_attention", **q) is None
    assert native.supports("paged_attention", **{**q, "device": torch.device("cuda")}) is None
    assert "head sizes (64, 128), not 80" in native.supports("paged_attention", **{**q, "head_size": 80})
    assert "block sizes (16, 32), not 544" in native.supports("paged_attention", **{**q, "block_size": 544})
    assert native.supports("paged_attention", layout="LBHNC", interleaved_v=True, **q) is None
    assert native.supports("paged_attention", features=("sinks", "logits_soft_cap"), **q) is None
    assert "does not support prefill" in native.supports("paged_attention", features=("prefill",), **q)
    assert "does not support output_scale" in native.supports("paged_attention", features=("output_scale",), **q)
    assert native.supports("reshape_and_cache", **q) is None
    assert native.supports("rope_and_cache", **q) == "native has no rope_and_cache kernel"
    on_cpu = providers.get("triton").supports("paged_attention", **{**q, "device": "cpu"})
    assert "runs on ('cuda',), not cpu" in on_cpu
    assert providers.get("aiter").supports("rope_and_cache", **QK_NORM) is None
    # AITER's QK-norm kernel cannot write our cache: the record declares no such op.
    assert providers.get("aiter").supports("qk_norm_rope_and_cache", **QK_NORM) == (
        "aiter has no qk_norm_rope_and_cache kernel")


def test_info_lists_every_provider_with_its_reason(capsys):
    assert cli_main(["info"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name, p in providers.REGISTRY.items():
        why = p.unavailable_reason()
        status = "usable" if why is None else f"unavailable: {why}"
        assert any(line.split() and line.split()[0] == name and line.endswith(status) for line in lines), name
        assert p.module in out
    for rule in providers.PREFERENCES:
        assert f"{rule.platform}: {rule.op}," in out


def test_info_says_which_prefill_kernel_runs(monkeypatch):
    """``info``'s prefill line follows ROCM_ATTN_PREFILL_KERNEL and the Gluon prefill's
    availability here (device, module, the Triton release under "auto")."""
    from inductor_rocm_attn.__main__ import _prefill_kernel
    from inductor_rocm_attn.kernels.gluon import eligibility

    monkeypatch.delenv("ROCM_ATTN_PREFILL_KERNEL", raising=False)
    if not torch.cuda.is_available():
        assert _prefill_kernel() == ("the Triton prefill (ROCM_ATTN_PREFILL_KERNEL=auto; the Gluon prefill: "
                                     "no CUDA GPU visible to torch)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(eligibility, "unavailable_reason", lambda device_type, index: None)
    monkeypatch.setattr(eligibility, "auto_problem", lambda block_size: None)
    line = _prefill_kernel()
    assert line.startswith("the Gluon prefill where it covers the launch") and "block sizes 16/32/64/128" in line
    assert "K through registers and V by TMA for the standard V interior at blocks 16/32/64" in line
    assert "K and V through registers for the interleaved one" in line
    monkeypatch.setattr(eligibility, "auto_problem", lambda block_size: "Triton 9.9.0 (tested with 3.6.x)")
    assert _prefill_kernel() == ("the Triton prefill (ROCM_ATTN_PREFILL_KERNEL=auto; the Gluon prefill: "
                                 "Triton 9.9.0 (tested with 3.6.x))")
    monkeypatch.setenv("ROCM_ATTN_PREFILL_KERNEL", "gluon")  # any Triton release when asked for
    assert "block sizes any it covers" in _prefill_kernel()
    monkeypatch.setattr(eligibility, "unavailable_reason", lambda device_type, index: "device capability (8, 0)")
    assert _prefill_kernel().endswith("the Gluon prefill: device capability (8, 0))")
    monkeypatch.setenv("ROCM_ATTN_PREFILL_KERNEL", "triton")
    assert _prefill_kernel() == "the Triton prefill (ROCM_ATTN_PREFILL_KERNEL=triton)"
    monkeypatch.setenv("ROCM_ATTN_PREFILL_KERNEL", "fast")
    assert "ROCM_ATTN_PREFILL_KERNEL='fast' is not one of auto, gluon, triton" in _prefill_kernel()


# --- selection ------------------------------------------------------------------------------


def test_select_picks_reference_on_cpu():
    cache = ira.allocate_kv_cache(ira.KVCacheSpec(16, 2, 64, torch.float32), 4)
    for op in capabilities.OPS:
        name, fn = providers.select(op, device=torch.device("cpu"), head_size=64, dtype=torch.float32,
                                    kv_cache=cache, num_tokens=7)
        assert (name, fn) == ("reference", getattr(ref, op))


def test_no_provider_error_names_every_provider_and_why():
    # A call only GPU providers could serve, on the CPU.
    with pytest.raises(NotImplementedError) as info:
        providers.select("paged_attention", device=torch.device("cpu"), head_size=64,
                         dtype=torch.float16, exclude=("reference",))
    msg = str(info.value)
    assert msg.startswith("rocm_attn.paged_attention: no provider supports this call (")
    assert "aiter: aiter runs on ('cuda',), not cpu" in msg
    assert "native: native runs on ('cuda',), not cpu" in msg
    assert "triton: triton runs on ('cuda',), not cpu" in msg
    assert "reference: excluded by the caller" in msg
    # On a GPU the reference is never the fallback, and says so.
    with pytest.raises(NotImplementedError) as info:
        providers.choose("paged_attention", platform="cuda", device="cuda", head_size=80,
                         dtype=torch.float16, unavailable={"triton": "no triton here"})
    msg = str(info.value)
    assert "aiter: aiter has no paged_attention kernel" in msg
    assert "native: native supports head sizes (64, 128), not 80" in msg
    assert "triton: no triton here" in msg
    assert "reference: chosen only on ('cpu',), not cuda" in msg


def test_select_names_a_16_bit_cache_of_another_dtype_by_its_dtype(monkeypatch):
    # A float16 cache under a bf16 model is kv_cache_dtype "float16", not "auto": aiter
    # (bf16 or fp8 e4m3 caches only) must not be chosen for it.
    seen = {}

    def choose(op, **query):
        seen.update(query)
        return "reference"

    monkeypatch.setattr(providers, "choose", choose)
    providers._select.cache_clear()
    try:
        for model, cache_dtype, want in ((torch.bfloat16, torch.float16, "float16"),
                                         (torch.float16, torch.bfloat16, "bfloat16"),
                                         (torch.float32, torch.float16, "float16"),
                                         (torch.float16, torch.float16, "auto")):
            cache = ira.allocate_kv_cache(ira.KVCacheSpec(16, 1, 128, cache_dtype), 2)
            providers.select("rope_and_cache", device=torch.device("cpu"), head_size=128, dtype=model,
                             kv_cache=cache)
            assert seen["kv_cache_dtype"] == want, (model, cache_dtype)
    finally:
        providers._select.cache_clear()
    assert "not float16" in providers.REGISTRY["aiter"].supports(
        "rope_and_cache", device="cuda", head_size=128, dtype=torch.bfloat16, block_size=16,
        layout=CacheLayout.LHBNC, kv_cache_dtype="float16")


def test_unavailable_provider_is_passed_over_with_its_reason():
    q = dict(device="cuda", head_size=64, dtype=torch.float16, block_size=16, layout=CacheLayout.LHBNC)
    usable = {"native": None, "triton": None}
    # Triton is declared first (no measurement puts native ahead yet).
    assert providers.choose("paged_attention", platform="cuda", unavailable=usable, **q) == "triton"
    assert providers.choose("paged_attention", platform="cuda", unavailable={**usable, "triton": "no triton here"},
                            **q) == "native"
    with pytest.raises(NotImplementedError, match="triton: no triton here; .*native: not built"):
        providers.choose("paged_attention", platform="cuda",
                         unavailable={"native": "not built", "triton": "no triton here"}, **q)


def test_head_size_512_goes_to_triton_never_to_native():
    """Head size 512 (Gemma4's full-attention layers): the Triton and reference records take
    it, the native (csrc) one refuses it by name, so a GPU call goes to Triton on either
    platform, and without Triton it is refused with native's reason (never sent to native)."""
    q = dict(device="cuda", head_size=512, dtype=torch.bfloat16, block_size=16, layout=CacheLayout.LHBNC)
    assert providers.get("native").supports("paged_attention", **q) == (
        "native supports head sizes (64, 128), not 512")
    assert providers.get("triton").supports("paged_attention", **q) is None
    assert providers.get("reference").supports("paged_attention", **{**q, "device": "cpu"}) is None
    usable = {"native": None, "triton": None, "aiter": None}
    for platform in ("cuda", "rocm"):
        for op in capabilities.OPS:
            assert providers.choose(op, platform=platform, unavailable=usable, **q) == "triton", (platform, op)
    with pytest.raises(NotImplementedError, match=r"native: native supports head sizes \(64, 128\), not 512"):
        providers.choose("reshape_and_cache", platform="cuda", unavailable={**usable, "triton": "no triton here"},
                         **q)


def test_head_size_512_is_refused_by_triton_on_rocm():
    """Head size 512's Triton configs need more shared memory than AMD's LDS has: a ROCm
    build's Triton record stops at 256, so such a call is refused by dispatch with that reason
    (the reference is never a GPU fallback) rather than failing inside Triton's compiler."""
    assert providers.triton_head_sizes(hip=False) == capabilities.HEAD_SIZES
    rocm = providers.triton_head_sizes(hip=True)
    assert 512 not in rocm and rocm == tuple(d for d in capabilities.HEAD_SIZES if d <= 256)
    caps = dataclasses.replace(providers.get("triton").caps, head_sizes=rocm)
    why = capabilities.supports(caps, "paged_attention", name="triton", device="cuda", head_size=512,
                                dtype=torch.bfloat16)
    assert why == f"triton supports head sizes {rocm}, not 512"
    assert capabilities.supports(caps, "paged_attention", name="triton", device="cuda", head_size=256,
                                 dtype=torch.bfloat16) is None


@pytest.mark.parametrize("num_tokens", [1, 64, 256, 1024, 4096, 16383])
def test_qk_norm_prefers_triton_below_the_measured_crossover(num_tokens):
    assert providers.choose("qk_norm_rope_and_cache", platform="cuda", num_tokens=num_tokens,
                            unavailable=BOTH_USABLE, **QK_NORM) == "triton"


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("num_tokens", [1, 16384, 65536])
def test_qk_norm_never_goes_to_aiter(platform, num_tokens):
    # Whatever the size or platform: AITER's kernel for it cannot write our cache.
    assert providers.choose("qk_norm_rope_and_cache", platform=platform, num_tokens=num_tokens,
                            unavailable=BOTH_USABLE, **QK_NORM) == "triton"


def test_preferences_are_per_platform():
    # rope_and_cache: Triton measured faster at every size on CUDA; nothing measured on ROCm,
    # where declaration order (AITER first) stands.
    assert providers.choose("rope_and_cache", platform="rocm", num_tokens=1, unavailable=BOTH_USABLE,
                            **QK_NORM) == "aiter"
    assert providers.choose("rope_and_cache", platform="cuda", num_tokens=65536, unavailable=BOTH_USABLE,
                            **QK_NORM) == "triton"
    # A query AITER cannot serve goes to Triton whatever the preference.
    fp16 = {**QK_NORM, "dtype": torch.float16}
    assert providers.choose("rope_and_cache", platform="rocm", unavailable=BOTH_USABLE,
                            **fp16) == "triton"
    # paged_attention: Triton measured faster than native on CUDA; ROCm keeps declaration order.
    assert providers.preference_order("paged_attention", platform="cuda", num_tokens=1)[0] == "triton"
    assert providers.preference_order("paged_attention", platform="rocm", num_tokens=1) == NAMES


def test_cache_writer_goes_to_native_only_where_it_measured_faster():
    """On CUDA the native writer measured faster than Triton's from 16384 tokens on (0.93x;
    1.00-1.34x below): Triton first below, native first from there, when native is usable
    (built) and supports the call; either way Triton where native cannot serve it."""
    q = dict(device="cuda", head_size=128, dtype=torch.bfloat16, block_size=16, layout=CacheLayout.LHBNC)
    usable = {"native": None, "triton": None, "aiter": None}
    for t, want in ((1, "triton"), (16383, "triton"), (16384, "native"), (65536, "native")):
        assert providers.choose("reshape_and_cache", platform="cuda", num_tokens=t, unavailable=usable, **q) == want
    assert providers.token_bucket("reshape_and_cache", "cuda", 16383) != providers.token_bucket(
        "reshape_and_cache", "cuda", 16384)
    # Not built (or no toolchain): Triton at every size.
    not_built = {**usable, "native": "not built yet"}
    assert providers.choose("reshape_and_cache", platform="cuda", num_tokens=65536, unavailable=not_built,
                            **q) == "triton"
    # A call native does not support (head size 256, block 64): Triton.
    for other in ({"head_size": 256}, {"block_size": 64}):
        assert providers.choose("reshape_and_cache", platform="cuda", num_tokens=65536, unavailable=usable,
                                **{**q, **other}) == "triton"
    # A key/value with strided head channels (native reads them dense): Triton at every size.
    assert providers.choose("reshape_and_cache", platform="cuda", num_tokens=65536, unavailable=usable,
                            features=("strided_channels",), **q) == "triton"
    assert "strided_channels" not in providers.get("native").caps.features
    # ROCm: nothing measured, declaration order.
    assert providers.preference_order("reshape_and_cache", platform="rocm", num_tokens=65536) == NAMES


def test_preference_table_is_well_formed():
    seen = {}
    for rule in providers.PREFERENCES:
        assert rule.platform in ("cuda", "rocm", "cpu")
        assert rule.op in capabilities.OPS
        assert rule.first and set(rule.first) <= set(providers.REGISTRY)
        assert (REPO / rule.evidence).is_file(), rule.evidence
        lo, hi = rule.min_tokens, rule.max_tokens if rule.max_tokens is not None else float("inf")
        assert lo < hi
        for other_lo, other_hi in seen.get((rule.platform, rule.op), []):
            assert hi <= other_lo or lo >= other_hi, f"overlapping rules for {rule.op} on {rule.platform}"
        seen.setdefault((rule.platform, rule.op), []).append((lo, hi))


def test_token_bucket_changes_only_at_a_rule_boundary():
    b = [providers.token_bucket("qk_norm_rope_and_cache", "cuda", t) for t in (1, 4096, 16383, 16384, 10**6)]
    if providers.platform_of("cuda") == "cuda":
        assert b[0] == b[1] == b[2] != b[3] == b[4]
    buckets = {providers.token_bucket("paged_attention", d, t) for d in ("cpu", "cuda") for t in (1, 10**6)}
    assert buckets == {0}


# --- the impl's paths: one cached resolve per call signature ------------------------------------


def _count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args[0] if args else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def _qk_norm_inputs(t, g, hq=4, hkv=2, d=64, rot=64):
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    qw, kw = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    positions = torch.randint(0, 64, (t,), generator=g)
    cos_sin = torch.randn(64, rot, generator=g)
    return qkv, qw, kw, positions, cos_sin


def _layer_and_steps(name, g, t=5):
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name=name)
    layer.kv_cache = poison(ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 8))
    md = ira.build_attention_metadata([t], [3], [[5, 2]], layer.block_size)
    return layer, md


def test_qk_norm_writer_resolves_once_and_matches_the_reference(monkeypatch):
    g = torch.Generator().manual_seed(0)
    layer, md = _layer_and_steps("providers.qknorm", g)
    impl = layer.impl
    impl.set_interleaved_v_cache(True, layer.kv_cache)
    selects = _count_calls(monkeypatch, providers, "select")
    checks = _count_calls(monkeypatch, validation, "check_qk_norm_rope")
    for step in range(2):
        qkv, qw, kw, positions, cos_sin = _qk_norm_inputs(5, g)
        want_cache = layer.kv_cache.clone()
        want = ref.qk_norm_rope_and_cache(qkv, qw, kw, 1e-6, positions, cos_sin, True, want_cache,
                                          md.slot_mapping, layer._k_scale, layer._v_scale, True, 4, 2, 64)
        got = impl.do_qk_norm_rope_kvcache_update(layer, qkv, qw, kw, 1e-6, positions, cos_sin, True,
                                                  layer.kv_cache, md)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(layer.kv_cache, want_cache, rtol=0, atol=0, equal_nan=True)
    assert selects == ["qk_norm_rope_and_cache"] and len(checks) == 1  # second step: cached kernel
    assert any(sig[0] == "qk_norm_rope_and_cache" for sig in impl._kernels)


def test_qk_norm_writer_first_call_validates_in_full():
    g = torch.Generator().manual_seed(1)
    layer, md = _layer_and_steps("providers.qknorm_bad", g)
    qkv, qw, kw, positions, cos_sin = _qk_norm_inputs(5, g)
    with pytest.raises(ValueError, match=r"rocm_attn.qk_norm_rope_and_cache: q_weight must be \[head_size\]"):
        layer.impl.do_qk_norm_rope_kvcache_update(layer, qkv, qw[:32], kw, 1e-6, positions, cos_sin, True,
                                                  layer.kv_cache, md)
    with pytest.raises(ValueError, match="rocm_attn.qk_norm_rope_and_cache: num_actual_tokens 5 > the 2 tokens"):
        layer.impl.do_qk_norm_rope_kvcache_update(layer, qkv[:2], qw, kw, 1e-6, positions[:2], cos_sin, True,
                                                  layer.kv_cache, md)
    assert not layer.impl._kernels  # nothing cached for a call that failed validation


def test_rope_writer_resolves_once_and_matches_the_reference(monkeypatch):
    g = torch.Generator().manual_seed(2)
    layer, md = _layer_and_steps("providers.rope", g)
    impl = layer.impl
    selects = _count_calls(monkeypatch, providers, "select")
    for step in range(2):
        q, k, v = (torch.randn(5, n, generator=g) for n in (256, 128, 128))
        positions, cos_sin = torch.randint(0, 64, (5,), generator=g), torch.randn(64, 32, generator=g)
        wq, wk, want_cache = q.clone(), k.clone(), layer.kv_cache.clone()
        ref.rope_and_cache(positions, wq, wk.view(5, 2, 64), v.view(5, 2, 64), want_cache, md.slot_mapping,
                           cos_sin, False, layer._k_scale, layer._v_scale, False)
        impl.do_rope_and_kv_cache_update(layer, positions, q, k, v, cos_sin, False, layer.kv_cache, md)
        torch.testing.assert_close((q, k), (wq, wk), rtol=0, atol=0)
        torch.testing.assert_close(layer.kv_cache, want_cache, rtol=0, atol=0, equal_nan=True)
        # Profiling run (no metadata): rotary only, through its own cached resolve.
        wq = q.clone()
        ref.rotary_embedding(positions, wq, None, 64, cos_sin, True)
        impl.do_rope_and_kv_cache_update(layer, positions, q, None, v, cos_sin, True, layer.kv_cache, None)
        torch.testing.assert_close(q, wq, rtol=0, atol=0)
    assert selects == ["rope_and_cache", "rotary_embedding"]
    with pytest.raises(ValueError, match="rocm_attn.rope_and_cache: cos_sin_cache must be"):
        impl.do_rope_and_kv_cache_update(layer, positions, q, k, v, torch.randn(64, 66), False,
                                         layer.kv_cache, md)


def test_impl_resolves_again_in_another_token_range(monkeypatch):
    """A measured preference that changes with the token count is honoured by the cached paths."""
    monkeypatch.setitem(providers._TOKEN_BOUNDS, ("cpu", "qk_norm_rope_and_cache"), (8,))
    monkeypatch.setattr(providers, "_BOUNDS_BY_DEVICE", {})
    g = torch.Generator().manual_seed(3)
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name="providers.buckets")
    layer.kv_cache = poison(ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 8))
    selects = _count_calls(monkeypatch, providers, "select")
    for t in (3, 5, 9, 12):
        md = ira.build_attention_metadata([t], [0], [[1]], layer.block_size)
        qkv, qw, kw, positions, cos_sin = _qk_norm_inputs(t, g)
        layer.impl.do_qk_norm_rope_kvcache_update(layer, qkv, qw, kw, 1e-6, positions, cos_sin, True,
                                                  layer.kv_cache, md)
    assert len(selects) == 2  # one per token range: [0, 8) and [8, inf)


def test_decode_only_steps_dispatch_without_the_prefill_feature(monkeypatch):
    """No caller passed max_query_len to attention_features: every paged_attention call, a
    decode-only one too, asked for "prefill", so a decode-only provider (native) was never
    chosen. The layer op and the kernel-level op now ask for it only when a query is longer
    than one token."""
    from cases import make_paged_case

    seen = []
    real_select = providers.select

    def select(op, **query):
        if op == "paged_attention":
            seen.append("prefill" in query["features"])
        return real_select(op, **query)

    monkeypatch.setattr(providers, "select", select)
    decode = make_paged_case([1, 1], [20, 5], dtype=torch.float32)
    mixed = make_paged_case([1, 3], [20, 5], dtype=torch.float32)
    for case, want in ((decode, False), (mixed, True)):
        torch.ops.rocm_attn.paged_attention(
            torch.empty_like(case.query), case.query, case.key, case.value, case.kv_cache, case.query_start_loc,
            case.seq_lens, case.block_table, case.max_query_len, case.max_seq_len, 0.125, case.k_scale,
            case.v_scale)
        assert seen[-1] is want
    layer = ira.Attention(4, 64, num_kv_heads=2, layer_name="dispatch.decode", block_size=16, register=False)
    layer.kv_cache = ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 8)
    for qlens, ctx, want in (([1, 1], [3, 0], False), ([2, 1], [3, 0], True)):
        md = ira.build_attention_metadata(qlens, ctx, [[0], [1]], 16)
        t = sum(qlens)
        with ira.set_forward_context(md, layers={layer.layer_name: layer}):
            layer(torch.randn(t, 256), torch.randn(t, 128), torch.randn(t, 128))
        assert seen[-1] is want
