"""Checks of the attention kernels (paged_attention, encoder_attention) of any provider.

Every check draws fresh random inputs, poisons the output with NaN first and compares with
``cases.dense_oracle`` / ``cases.oracle_attention`` (independent float64 attention) by
relative norm. Tolerances: fp32 1e-5, fp16 3e-3, bf16 1e-2 (the output rounding alone is
~2.5e-4 / 2e-3 of the norm); fp8 caches compare with the oracle over the rounded cache
values, same tolerances (bf16 2e-2); fused fp8 output quant (GPU only: the interpreter's
fp32->fp8 cast is wrong when rounding carries into the exponent): every element within one
e4m3 step (+3% of its row's rms) of exact / output_scale.

``provider`` is a registered provider's name: the check resolves its kernel through
``providers_under_test.kernel`` (skipping where it is not testable). The Triton launch
knobs (``num_splits``, ``decode_cfg``/``prefill_cfg`` and their ``*_changes``) apply to
the ``triton`` provider only; other providers run the same case without them.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import cases
import providers_under_test as put
from inductor_rocm_attn.layout import fp8_max

if put.INTERPRETER:
    # Triton 3.6's interpreter turns scalars into 1-element numpy arrays, and NumPy >= 2.3
    # refuses int() of those: a loop with a loaded bound (range(lo, hi)) then fails. Make
    # __index__ read the element (interpreter only; compiled kernels are unaffected).
    import triton.runtime.interpreter as _interp

    if not getattr(_interp, "_rocm_attn_index_fix", False):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._rocm_attn_index_fix = True

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
GPU = "cuda"


def seed() -> int:
    return random.randrange(1 << 30)


def _features(num_heads, *, alibi=False, sinks=False, device="cpu", g=None):
    slopes = (torch.rand(num_heads, generator=g) * 0.5).to(device) if alibi else None
    sink = (torch.randn(num_heads, generator=g) * 2).to(device) if sinks else None
    return slopes, sink


def feature_names(*, causal=True, sliding_window=-1, alibi=False, sinks=False, softcap=0.0,
                  out_fp8=False, prefill=False) -> tuple[str, ...]:
    """The capability-table features a case uses (``capabilities.FEATURES``). ``prefill``: the
    call may hold a sequence with query_len > 1 (as the op says when ``max_query_len`` is
    not given as 1)."""
    return tuple(name for name, used in (
        ("sliding_window", sliding_window is not None and sliding_window > 0), ("alibi", alibi),
        ("sinks", sinks), ("logits_soft_cap", softcap > 0), ("output_scale", out_fp8),
        ("non_causal", not causal), ("prefill", prefill)) if used)


def check_fp8_steps(got, ref, fp8_dtype, seed_):
    """Each fp8 output is within one fp8 step of the exact value / output_scale (clamped),
    plus 3% of its row's rms for the kernel's own bf16-level error before the cast (P is
    rounded to bf16 for the PV product: the bf16 output's worst element measured 1.6% of its
    row's rms over 36 runs on the H200, benchmarks/diag_decode_accuracy.py; a bound of 1% of
    the whole output's rms failed ~1 run in 4 for every decode config)."""
    m = fp8_max(fp8_dtype)
    ref = ref.clamp(-m, m)
    mant = torch.finfo(fp8_dtype).nmant if hasattr(torch.finfo(fp8_dtype), "nmant") else 3
    tiny = torch.finfo(fp8_dtype).smallest_normal
    step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(tiny))) - mant)
    bad = (got - ref).abs() > step + 0.03 * ref.pow(2).mean(-1, keepdim=True).sqrt()
    assert not bad.any(), (f"{int(bad.sum())} fp8 outputs off by more than one step (seed {seed_}); "
                           f"e.g. got {got[bad][:4].tolist()} want {ref[bad][:4].tolist()}")


def _triton_configs(c, *, num_heads, num_kv_heads, head_size, block_size, dtype, interleaved_v,
                    decode_cfg, prefill_cfg, decode_changes, prefill_changes):
    """The decode/prefill configs a Triton run passes: given ones, or the tuned defaults the
    launcher would pick, with ``*_changes`` applied (None: let the launcher pick)."""
    from inductor_rocm_attn.kernels.triton import configs

    gqa = num_heads // num_kv_heads
    if decode_changes:
        decode_cfg = dataclasses.replace(decode_cfg or configs.decode_config(
            head_size, gqa, block_size, c.kv_cache.dtype, configs.interpreting(), interleaved_v),
            **decode_changes)
    if prefill_changes:
        prefill_cfg = dataclasses.replace(prefill_cfg or configs.prefill_config(
            head_size, gqa, block_size, dtype, configs.interpreting()), **prefill_changes)
    return decode_cfg, prefill_cfg


def check_paged(provider, query_lens, context_lens, *, num_heads=4, num_kv_heads=2, head_size=64,
                block_size=16, dtype=torch.float16, cache_dtype=None, layout="LHBNC",
                interleaved_v=False, causal=True, sliding_window=-1, alibi=False, sinks=False,
                softcap=0.0, out_fp8=False, num_splits=None, device="cpu", key_from_cache=False,
                pad_rows=0, tol=None, decode_cfg=None, prefill_cfg=None, decode_changes=None,
                prefill_changes=None, expect_dense_tma=None, hints=False,
                index_dtype=torch.int32, scale_mult=1.0, kv_pad_nan=0, verify_cfg=None,
                verify_max_query_len=None):
    """Run ``provider``'s paged_attention on a fresh random case and compare with the oracle.
    ``expect_dense_tma`` (Triton): whether the new tokens' K/V go through TMA descriptors.
    ``verify_cfg`` / ``verify_max_query_len`` (Triton): the verify kernel's config and longest
    query (it runs only with ``hints``: the launch must know max_query_len)."""
    from inductor_rocm_attn.layout import CacheLayout

    fn = put.kernel(provider, "paged_attention", device=device, dtype=dtype, head_size=head_size,
                    block_size=block_size, layout=CacheLayout(layout),
                    kv_cache_dtype=put.cache_dtype_name(cache_dtype or dtype, dtype),
                    interleaved_v=interleaved_v,
                    features=feature_names(causal=causal, sliding_window=sliding_window,
                                           alibi=alibi, sinks=sinks, softcap=softcap,
                                           out_fp8=out_fp8,
                                           prefill=not hints or max(query_lens) > 1))
    seed_ = seed()
    fp8 = cache_dtype is not None and cache_dtype != dtype
    c = cases.make_paged_case(
        query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
        layout=layout, interleaved_v=interleaved_v, k_scale=0.07 if fp8 else 1.0,
        v_scale=0.05 if fp8 else 1.0, device=device, seed=seed_,
    )
    g = torch.Generator().manual_seed(seed_ + 1)
    slopes, sink = _features(num_heads, alibi=alibi, sinks=sinks, device=device, g=g)
    scale = head_size ** -0.5 * scale_mult
    key, value = c.key, c.value
    if key_from_cache:  # prefill reads its new tokens from the cache as well
        from inductor_rocm_attn.kernels import reference as ref

        ref.reshape_and_cache(key, value, c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale,
                              interleaved_v)
        if fp8:  # what is read back is the rounded value
            pytest.skip("key=None with an fp8 cache: oracle would need requantised new tokens")
        key = value = None
    if kv_pad_nan:  # key/value rows past the batch (graph padding) may hold anything
        nan = torch.full((kv_pad_nan, *key.shape[1:]), float("nan"), dtype=key.dtype, device=device)
        key, value = torch.cat([key, nan]), torch.cat([value, nan])
    if index_dtype != torch.int32:
        c.query_start_loc, c.seq_lens, c.block_table = (
            x.to(index_dtype) for x in (c.query_start_loc, c.seq_lens, c.block_table))
    t = c.query.shape[0]
    query = c.query
    if pad_rows:  # rows past query_start_loc[-1] (graph padding) must stay untouched
        query = torch.cat([query, torch.randn(pad_rows, *query.shape[1:], device=device).to(dtype)])
        if key is not None and not kv_pad_nan:
            pad = torch.randn(pad_rows, *key.shape[1:], device=device).to(dtype)
            key, value = torch.cat([key, pad]), torch.cat([value, pad])
    out_dtype = torch.float8_e4m3fn if out_fp8 else dtype
    # The output sits between guard rows: a write outside its rows (e.g. a negative row
    # index of a stray program) is caught even where it lands in no other tensor.
    guarded = cases.Guarded(query.shape, out_dtype, device)
    out = guarded.t
    out_scale = torch.tensor([0.02], device=device) if out_fp8 else None
    knobs = {}
    if provider == "triton":
        decode_cfg, prefill_cfg = _triton_configs(
            c, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            block_size=block_size, dtype=dtype, interleaved_v=interleaved_v, decode_cfg=decode_cfg,
            prefill_cfg=prefill_cfg, decode_changes=decode_changes, prefill_changes=prefill_changes)
        knobs = dict(num_splits=num_splits, decode_cfg=decode_cfg, prefill_cfg=prefill_cfg)
        if verify_cfg is not None or verify_max_query_len is not None:
            knobs.update(verify_cfg=verify_cfg, verify_max_query_len=verify_max_query_len)
    if hints:
        knobs.update(max_query_len=c.max_query_len, max_seq_len=c.max_seq_len)
    fn(out, query, key, value, c.kv_cache, c.query_start_loc, c.seq_lens, c.block_table, scale,
       c.k_scale, c.v_scale, causal, sliding_window, slopes, sink, softcap, interleaved_v,
       out_scale, **knobs)
    if expect_dense_tma is not None:
        _assert_dense_path(key, value, query, head_size, num_heads // num_kv_heads, block_size,
                           dtype, prefill_cfg, expect_dense_tma)
    guarded.assert_intact()
    if pad_rows:
        assert torch.isnan(out[t:].to(torch.float32)).all(), "padding rows were written"
    ref_out = cases.dense_oracle(c, scale=scale, causal=causal, sliding_window=sliding_window,
                                 alibi_slopes=slopes, sinks=sink, logits_soft_cap=softcap)
    got = out[:t].to(torch.float64).cpu()
    assert not torch.isnan(got).any(), f"unwritten or NaN output rows (seed {seed_})"
    if out_fp8:
        check_fp8_steps(got, ref_out / 0.02, out_dtype, seed_)
        return 0.0
    err = cases.rel_err(got, ref_out)
    assert err < (tol or TOL[dtype]), f"rel err {err:.3e} (seed {seed_})"
    return err


def _assert_dense_path(key, value, query, head_size, gqa, block_size, dtype, prefill_cfg, tma):
    """The Triton launcher's choice for the new tokens' K/V on these tensors: TMA descriptors
    (``tma``) or pointers. The same function and inputs the launcher uses."""
    from inductor_rocm_attn.kernels.triton import configs
    from inductor_rocm_attn.kernels.triton.paged_attention import dense_kv_descriptors, launch_target

    cfg = prefill_cfg or configs.prefill_config(head_size, gqa, block_size, dtype,
                                                configs.interpreting())
    descs = dense_kv_descriptors(key, value, head_size, cfg.block_n,
                                 cfg.dense_tma and launch_target(query.device).tma)
    assert (descs is not None) == tma, "the wrong K/V path was taken"


def check_encoder(provider, seq_lens, *, num_heads=4, num_kv_heads=2, head_size=80,
                  dtype=torch.float16, causal=False, sliding_window=-1, alibi=False, sinks=False,
                  softcap=0.0, out_fp8=False, device="cpu", pad_rows=0):
    """Run ``provider``'s encoder_attention on fresh random varlen sequences; compare.
    ``pad_rows`` rows past ``cu_seqlens[-1]`` (graph padding) must stay untouched."""
    fn = put.kernel(provider, "encoder_attention", device=device, dtype=dtype, head_size=head_size,
                    features=feature_names(causal=causal, sliding_window=sliding_window,
                                           alibi=alibi, sinks=sinks, softcap=softcap,
                                           out_fp8=out_fp8))
    seed_ = seed()
    g = torch.Generator().manual_seed(seed_)
    cu = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0).tolist()), dtype=torch.int32)
    t = int(cu[-1])
    q = torch.randn(t + pad_rows, num_heads, head_size, generator=g).to(dtype)
    k = torch.randn(t + pad_rows, num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(t + pad_rows, num_kv_heads, head_size, generator=g).to(dtype)
    slopes, sink = _features(num_heads, alibi=alibi, sinks=sinks, g=g)
    scale = 0.9 * head_size ** -0.5
    ref = torch.zeros(t, num_heads, head_size, dtype=torch.float64)
    for s in range(len(seq_lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            ref[a:b] = cases.oracle_attention(
                q[a:b], k[a:b], v[a:b], q_start_pos=0, scale=scale, causal=causal,
                sliding_window=sliding_window, alibi_slopes=slopes, sinks=sink,
                logits_soft_cap=softcap, encoder=True)
    out_dtype = torch.float8_e4m3fn if out_fp8 else dtype
    guarded = cases.Guarded(q.shape, out_dtype, device)  # a stray write lands in a guard
    out = guarded.t
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    out_scale = torch.tensor([0.02], device=device) if out_fp8 else None
    fn(out, dev(q), dev(k), dev(v), dev(cu), scale, causal, sliding_window, dev(slopes), dev(sink),
       softcap, out_scale)
    guarded.assert_intact()
    assert torch.isnan(out[t:].to(torch.float32)).all(), "padding rows were written"
    got = out[:t].to(torch.float64).cpu()
    assert not torch.isnan(got).any(), f"unwritten output (seed {seed_})"
    if out_fp8:
        check_fp8_steps(got, ref / 0.02, out_dtype, seed_)
        return
    err = cases.rel_err(got, ref)
    assert err < TOL[dtype], f"rel err {err:.3e} (seed {seed_})"


# --- non-finite inputs ----------------------------------------------------------------------


def sdpa_visible(q, k, v, *, q_start_pos, scale, causal=True, sliding_window=-1, encoder=False,
                 row_block=None):
    """float64 attention of each query row over exactly the keys that row sees, with the
    non-finite results of ``torch`` SDPA run on that row alone (checked against such per-row
    SDPA calls on random non-finite cases; one batched softmax here, 30x faster); a row that
    sees none outputs 0. q ``[Lq, Hq, D]`` at positions ``q_start_pos + i``, k/v ``[Lk, Hkv, D]``.

    SDPA itself, given a boolean mask, adds -inf to masked scores: a NaN key it masks still
    turns the row NaN (NaN + -inf), and a masked non-finite value too (0 * NaN). A key a row
    does not see has no effect on it here, as in SDPA's flash kernels and the reference.

    ``row_block`` (the Triton kernels' rule, ``attention_common._attn_update``): the rows are
    processed in blocks of that many; a NaN / +-inf value of a key that some row of a block
    sees also turns NaN that channel of the block's rows that mask the key."""
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    kk = k.double().repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, Lk, D]
    vv = v.double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    kp = torch.arange(lk)
    qp = q_start_pos + torch.arange(lq)[:, None]
    vis = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        vis &= kp <= qp
    if sliding_window > 0:
        vis &= (qp - kp) < sliding_window
        if encoder:
            vis &= (kp - qp) < sliding_window
    # Scores of unseen keys become -inf by selection, not by addition: a NaN there is dropped.
    s = torch.where(vis, torch.einsum("qhd,hkd->hqk", q.double(), kk) * scale, float("-inf"))
    # A row with no key or every seen score -inf: weights 0 (SDPA's CPU kernel gives 0, and
    # NaN where a seen value is non-finite, from the loop below).
    dead = (s == float("-inf")).all(-1)  # [Hq, Lq]
    p = torch.softmax(s, -1).masked_fill(dead[..., None], 0.0)  # exactly 0 at unseen keys
    bad = ~torch.isfinite(vv)  # [Hq, Lk, D]
    out = torch.einsum("hqk,hkd->qhd", p, torch.where(bad, 0.0, vv))
    # A non-finite value reaches the rows that see its key as weight * value, as in SDPA
    # (0 * inf = NaN where a seen key's weight underflows).
    for h, j, c in bad.nonzero().tolist():
        out[:, h, c] += torch.where(vis[:, j], p[h, :, j] * vv[h, j, c], 0.0)
    if row_block:
        for b in range(0, lq, row_block):
            blk = vis[b: b + row_block]
            reached = blk.any(0)[None, :] & ~blk  # [rows, Lk]: the block sees the key, the row not
            hit = torch.einsum("rk,hkd->rhd", reached.double(), bad.double()) > 0
            out[b: b + row_block][hit] = float("nan")
    return out


def assert_same_nonfinite(got, want, tol, what):
    """NaN, +inf and -inf exactly where ``want`` has them, finite values within ``tol``."""
    got = got.detach().cpu().to(torch.float64)
    for name, f in (("NaN", torch.isnan), ("+inf", lambda x: x == float("inf")),
                    ("-inf", lambda x: x == float("-inf"))):
        g, w = f(got), f(want)
        assert torch.equal(g, w), (f"{what}: {name} at {int((g & ~w).sum())} places SDPA has none, "
                                   f"missing at {int((w & ~g).sum())} (e.g. [row, head, ch] "
                                   f"{(g ^ w).nonzero()[:3].tolist()})")
    fin = torch.isfinite(want)
    err = cases.rel_err(got[fin], want[fin])
    assert err < tol, f"{what}: finite outputs rel err {err:.3e}"


def check_paged_nonfinite(provider, query_lens, context_lens, inject, *, dtype=torch.float32,
                          num_heads=4, num_kv_heads=2, head_size=64, block_size=16, causal=True,
                          sliding_window=-1, device="cpu", **knobs):
    """paged_attention with non-finite entries put into q, or into the K/V of chosen keys
    (in the cache, or among a prefill's new tokens), against ``sdpa_visible``: NaN and
    +-inf exactly where float64 SDPA over each row's visible keys has them (Triton: plus
    the row-block rule of ``sdpa_visible``).

    ``inject``: ``(tensor, seq, pos, head, channel, value)`` with tensor "q" (pos: the
    sequence's query row) or "k"/"v" (pos: the key position in the sequence). ``knobs``:
    Triton launch knobs (``num_splits``, ``decode_cfg``, ``prefill_cfg``)."""
    from inductor_rocm_attn.kernels import reference as ref
    from inductor_rocm_attn.layout import CacheLayout

    fn = put.kernel(provider, "paged_attention", device=device, dtype=dtype, head_size=head_size,
                    block_size=block_size, layout=CacheLayout.LHBNC,
                    kv_cache_dtype=put.cache_dtype_name(dtype, dtype),
                    features=feature_names(causal=causal, sliding_window=sliding_window,
                                           prefill=True))  # no max_query_len hint: may prefill
    seed_ = seed()
    c = cases.make_paged_case(query_lens, context_lens, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_size=head_size,
                              block_size=block_size, dtype=dtype, device=device, seed=seed_)
    qsl = c.query_start_loc.tolist()
    for tensor, s, pos, head, ch, val in inject:
        ql, ctx = query_lens[s], context_lens[s]
        if tensor == "q":
            c.query[qsl[s] + pos, head, ch] = val
            continue
        full = c.k_full[s] if tensor == "k" else c.v_full[s]
        full[pos, head, ch] = val
        if ql > 1 and pos >= ctx:  # a prefill's new token: read from key/value
            (c.key if tensor == "k" else c.value)[qsl[s] + pos - ctx, head, ch] = val
        else:  # in the cache: write the token again
            slot = int(c.block_table[s, pos // block_size]) * block_size + pos % block_size
            row = dict(device=device, dtype=dtype)  # k_full / v_full stay on the CPU (float64)
            ref.reshape_and_cache(c.k_full[s][pos:pos + 1].to(**row),
                                  c.v_full[s][pos:pos + 1].to(**row), c.kv_cache,
                                  torch.tensor([slot], device=device), c.k_scale, c.v_scale, False)
    scale = 0.3 * head_size ** -0.5  # small logits: no weight underflows in fp16
    out = cases.poison(torch.empty_like(c.query))
    row_block = None
    if provider == "triton":  # the prefill row block (decode rows are blocks of one)
        from inductor_rocm_attn.kernels.triton import configs

        knobs["prefill_cfg"] = knobs.get("prefill_cfg") or configs.prefill_config(
            head_size, num_heads // num_kv_heads, block_size, dtype, configs.interpreting())
        row_block = knobs["prefill_cfg"].block_m
    else:
        knobs = {}
    fn(out, c.query, c.key, c.value, c.kv_cache, c.query_start_loc, c.seq_lens, c.block_table,
       scale, c.k_scale, c.v_scale, causal, sliding_window, None, None, 0.0, False, None, **knobs)
    want = torch.cat([sdpa_visible(c.query[qsl[s]:qsl[s + 1]].cpu(), c.k_full[s].cpu(),
                                   c.v_full[s].cpu(), q_start_pos=context_lens[s], scale=scale,
                                   causal=causal, sliding_window=sliding_window, row_block=row_block)
                      for s in range(len(query_lens))])
    assert (~torch.isfinite(want)).any() and torch.isfinite(want).any(), "the case tests nothing"
    assert_same_nonfinite(out, want, TOL[dtype], f"{provider} seed {seed_}")


def check_encoder_nonfinite(provider, seq_lens, inject, *, dtype=torch.float32, num_heads=4,
                            num_kv_heads=2, head_size=64, causal=False, sliding_window=-1,
                            device="cpu"):
    """encoder_attention with non-finite q/k/v entries (``inject``: ``(tensor, row, head,
    channel, value)``, rows of the whole batch) against ``sdpa_visible`` per sequence."""
    fn = put.kernel(provider, "encoder_attention", device=device, dtype=dtype, head_size=head_size,
                    features=feature_names(causal=causal, sliding_window=sliding_window))
    seed_ = seed()
    g = torch.Generator().manual_seed(seed_)
    cu = [0] + list(torch.tensor(seq_lens).cumsum(0).tolist())
    t = cu[-1]
    qkv = {n: torch.randn(t, h, head_size, generator=g).to(dtype)
           for n, h in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads))}
    for tensor, row, head, ch, val in inject:
        qkv[tensor][row, head, ch] = val
    scale = 0.3 * head_size ** -0.5
    out = cases.poison(torch.empty(t, num_heads, head_size, dtype=dtype, device=device))
    q, k, v = (qkv[n].to(device) for n in "qkv")
    knobs, row_block = {}, None
    if provider == "triton":  # the row block of the Triton kernel
        from inductor_rocm_attn.kernels.triton import configs

        knobs["cfg"] = configs.prefill_config(head_size, num_heads // num_kv_heads, 0, dtype,
                                              configs.interpreting())
        row_block = knobs["cfg"].block_m
    fn(out, q, k, v, torch.tensor(cu, dtype=torch.int32, device=device), scale, causal,
       sliding_window, None, None, 0.0, None, **knobs)
    want = torch.cat([sdpa_visible(qkv["q"][a:b], qkv["k"][a:b], qkv["v"][a:b], q_start_pos=0,
                                   scale=scale, causal=causal, sliding_window=sliding_window,
                                   encoder=True, row_block=row_block)
                      for a, b in zip(cu[:-1], cu[1:])])
    assert (~torch.isfinite(want)).any() and torch.isfinite(want).any(), "the case tests nothing"
    assert_same_nonfinite(out, want, TOL[dtype], f"{provider} seed {seed_}")
