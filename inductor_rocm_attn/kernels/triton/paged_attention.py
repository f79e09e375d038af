"""Triton ``paged_attention``: the launcher choosing paged decode and prefix prefill.

``paged_attention`` has the signature of ``kernels.reference.paged_attention``. Per call it
launches
- a decode kernel (``paged_decode.py``) for sequences with query_len == 1: one program per
  (decode sequence, KV head, KV split), all GQA query heads of the KV head in one tile; with
  more than one split, ``_decode_reduce_kernel`` merges the splits' partial sums;
- when the launch is told ``max_query_len``, the verify kernel (``paged_verify.py``) for
  sequences with 2 <= query_len <= ``configs.VERIFY_MAX_QUERY_LEN`` (speculative-decode
  verify batches): decode-style, one program per (sequence, KV head, row chunk, KV split);
- the prefix-prefill kernel (``prefix_prefill.py``) for the longer sequences (all with
  query_len > 1 when ``max_query_len`` is not given).
Each kernel skips the others' sequences, so a mixed batch needs no host-side split. The
number of KV splits comes from host shapes only (no device sync: CUDA-graph capturable).
Configs (tiles, warps, loop kinds, knobs) come from ``configs.py``.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor  # host-side TMA descriptors

from ...layout import cache_x, fp8_max, is_fp8_dtype, k_view, v_view
# The last-split merge's ticket counters, shared with the native decode (the tests inspect
# the buffers through this module).
from ..merge_counters import _MERGE_COUNTERS, _RETIRED_COUNTERS  # noqa: F401
from ..merge_counters import merge_counters as _merge_counters
from ..gluon.eligibility import INTERPRETER_REASON as _GLUON_INTERPRETER_REASON
from ..gluon.eligibility import auto_problem as _gluon_auto_problem
from ..gluon.eligibility import prefill_kernel_for as _gluon_ineligibility
from .attention_common import TL_DTYPES
from .configs import (
    DEFAULT_PREFILL_KERNEL, PREFILL_KERNELS,
    INTERPRETER_TARGET, VERIFY_MAX_QUERY_LEN, DecodeConfig, LaunchTarget, PrefillConfig,
    decode_config, decode_plan, interpreting, prefill_config, reduce_num_warps, split_merge_of,
    verify_config, verify_rows,
)
from .paged_decode import _decode_reduce_kernel, _paged_decode_kernel, _paged_decode_streams_kernel
from .paged_verify import _paged_verify_kernel, _verify_reduce_kernel
from .prefix_prefill import _prefix_prefill_kernel

__all__ = ["paged_attention", "launch_target", "dense_kv_descriptors"]


@functools.cache
def _gpu_target(device_index: int) -> LaunchTarget:
    tma = torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9
    return LaunchTarget(torch.cuda.get_device_properties(device_index).multi_processor_count, tma)


def launch_target(device: torch.device) -> LaunchTarget:
    """The target of launches on ``device`` (``INTERPRETER_TARGET`` in the interpreter)."""
    if interpreting():
        return INTERPRETER_TARGET
    return _gpu_target(device.index or 0)


_SPLIT_MERGE_CODE = {"reduce": 0, "last_split": 1}  # _paged_decode_kernel's SPLIT_MERGE
def _pow2_part(n: int) -> int:
    return n & -n


def dense_kv_descriptors(key: torch.Tensor, value: torch.Tensor, head_size: int, block_n: int,
                         use_tma: bool):
    """TMA descriptors of key/value viewed as ``[tokens, kv_heads * head_size]`` with
    ``[block_n, head_size]`` boxes, or None where TMA cannot fetch them (then pointers)."""
    if not use_tma or triton.next_power_of_2(head_size) != head_size:
        return None
    descs = []
    for t in (key, value):
        # TMA: 16-byte aligned base and row stride, contiguous heads and channels.
        if (t.stride(2) != 1 or t.stride(1) != head_size or t.data_ptr() % 16
                or (t.stride(0) * t.element_size()) % 16 or t.shape[0] == 0):
            return None
        descs.append(TensorDescriptor(t, [t.shape[0], t.shape[1] * head_size], [t.stride(0), 1],
                                      [block_n, head_size]))
    return descs


def _compute_dtype(query: torch.Tensor, key: torch.Tensor | None, cache_dtype: torch.dtype):
    for t in (query.dtype, None if key is None else key.dtype, cache_dtype):
        if t in TL_DTYPES:
            return t
    return torch.bfloat16  # fp8 query and fp8 cache, no key: compute in bf16


def paged_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    causal: bool,
    sliding_window: int,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float,
    interleaved_v: bool,
    output_scale: torch.Tensor | None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    *,
    num_splits: int | None = None,
    decode_cfg: DecodeConfig | None = None,
    prefill_cfg: PrefillConfig | None = None,
    target: LaunchTarget | None = None,
    verify_cfg: DecodeConfig | None = None,
    verify_max_query_len: int | None = None,
    prefill_kernel: str | None = None,
) -> None:
    """Chunked prefill + paged decode over the cache (semantics: ``reference.paged_attention``).

    output/query ``[num_tokens, num_heads, head_size]``; key/value
    ``[num_tokens, num_kv_heads, head_size]`` or None; kv_cache
    ``[num_blocks, 2, block_size, num_kv_heads * head_size]`` (LHBNC or LBHNC);
    query_start_loc ``[num_seqs + 1]``, seq_lens ``[num_seqs]``, block_table
    ``[num_seqs, max_blocks]`` (int32/int64); k_scale/v_scale/output_scale ``[1]`` fp32;
    alibi_slopes/sinks ``[num_heads]``. ``max_query_len``/``max_seq_len`` (host ints, optional)
    only steer launches. What the launcher relies on: ``max_query_len`` >= the true longest
    query. With ``max_query_len <= 1`` the prefill and verify launches are skipped; with
    ``max_query_len <= verify_max_query_len`` the prefill launch is skipped and sequences of
    2..``verify_max_query_len`` query tokens run in the verify kernel. A sequence longer than
    the hint would be left unwritten (the caller, or validation on CPU, must keep the hint >=
    the true maximum; None launches every path, whose programs without rows of their kind
    return at once). ``max_seq_len`` only sets the KV split count and the one-loop choice: any
    value gives the same result (each split reads its share of the actual ``seq_lens``).
    Keyword-only (tests, benchmarks): ``num_splits`` fixes the KV splits (decode and verify);
    ``decode_cfg``/``prefill_cfg``/``verify_cfg`` replace the tuned ``configs.decode_config`` /
    ``prefill_config`` / ``verify_config``; ``target`` the queried
    ``launch_target(query.device)``; ``verify_max_query_len`` (default
    ``configs.VERIFY_MAX_QUERY_LEN``; <= 1: no verify launch) the verify kernel's longest query;
    ``prefill_kernel`` (default ``configs.DEFAULT_PREFILL_KERNEL``, from
    ``ROCM_ATTN_PREFILL_KERNEL``): ``"auto"`` (the warp-specialized Gluon prefill, NVIDIA
    sm_90, for launches it covers (``kernels/gluon/eligibility.py``) under the Triton version
    it was tested with; the Triton kernel for the others), ``"gluon"`` (the same, with one
    warning per reason a launch runs the Triton kernel, and any Triton version) or
    ``"triton"``. A given ``prefill_cfg``, a Triton config, runs the Triton kernel (with
    ``prefill_kernel="gluon"`` it is refused; with ``ROCM_ATTN_PREFILL_KERNEL=gluon`` it warns).
    """
    if prefill_kernel is not None:
        if not isinstance(prefill_kernel, str):
            raise TypeError(f"paged_attention: prefill_kernel must be one of {PREFILL_KERNELS} or None, got "
                            f"{type(prefill_kernel).__name__} {prefill_kernel!r:.40}")
        if prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"paged_attention: prefill_kernel={prefill_kernel!r}; supported: {PREFILL_KERNELS}")
        if prefill_kernel == "gluon" and prefill_cfg is not None:  # the Triton kernel's config: gluon never ran
            raise ValueError("paged_attention: prefill_kernel='gluon' with a prefill_cfg, a config of the Triton "
                             "prefill (which would run instead); give one or the other")
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    num_kv_heads = key.shape[1] if key is not None else kv_cache.shape[3] // head_size
    gqa = num_heads // num_kv_heads
    block_size = kv_cache.shape[2]
    cache_dtype = kv_cache.dtype
    fp8_kv = is_fp8_dtype(cache_dtype)
    x = cache_x(cache_dtype)
    kc = k_view(kv_cache, num_kv_heads)
    vc = v_view(kv_cache, num_kv_heads, interleaved_v)
    compute = _compute_dtype(query, key, cache_dtype)
    interpret = interpreting()
    target = target or launch_target(query.device)
    block_d = triton.next_power_of_2(head_size)
    use_window = sliding_window is not None and sliding_window > 0
    window = int(sliding_window) if use_window else 0
    use_out_scale = output_scale is not None
    out_max = fp8_max(output.dtype) if use_out_scale else 0.0
    dummy = query  # stands for absent optional tensors (never read: constexpr-disabled)
    common = dict(
        COMPUTE=TL_DTYPES[compute], USE_WINDOW=use_window, USE_ALIBI=alibi_slopes is not None,
        USE_SINKS=sinks is not None, USE_SOFTCAP=logits_soft_cap > 0, FP8_KV=fp8_kv,
        INTERLEAVED_V=interleaved_v, USE_OUT_SCALE=use_out_scale, OUT_MAX=out_max,
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32",
    )
    ptrs = (k_scale, v_scale, alibi_slopes if alibi_slopes is not None else dummy,
            sinks if sinks is not None else dummy, output_scale if use_out_scale else dummy)
    softcap = float(logits_soft_cap) if logits_soft_cap > 0 else 1.0

    # --- decode: sequences with query_len == 1 ------------------------------------------------
    # The configs are keyed by the cache dtype; at head size 512 an fp32 query over a narrower
    # cache takes the fp32 cache's tiles (the 16-bit cache's decode tile with fp32 dots needs
    # 289 KB of shared memory on sm_90, more than it has).
    cfg_dtype = torch.float32 if head_size > 256 and compute == torch.float32 else cache_dtype
    dcfg = decode_cfg or decode_config(head_size, gqa, block_size, cfg_dtype, interpret,
                                       interleaved_v)
    block_h = max(16, min(64, triton.next_power_of_2(gqa)))
    head_chunks = triton.cdiv(gqa, block_h)
    max_ctx = max_seq_len if max_seq_len is not None else block_table.shape[1] * block_size
    num_splits_given = num_splits  # the verify launch plans its own splits unless given
    kind, num_splits = decode_plan(dcfg, num_splits, num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                                   head_chunks=head_chunks, max_ctx=max_ctx,
                                   num_sms=target.num_sms)
    merge = split_merge_of(dcfg, num_splits)
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_size, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32,
                              device=query.device)
    else:
        part_acc = part_ml = torch.empty(0, dtype=torch.float32, device=query.device)
    pa_strides = (num_heads * num_splits * head_size, num_splits * head_size, head_size)
    decode_args = (
        output, part_acc, part_ml, query, kc, vc, block_table, seq_lens, query_start_loc, *ptrs,
        scale, softcap, window,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), block_table.stride(0),
        *pa_strides,
    )
    grid = (num_seqs, num_kv_heads * head_chunks, num_splits)
    shape = dict(GQA=gqa, BLOCK_H=block_h, HEAD_CHUNKS=head_chunks, HEAD_SIZE=head_size,
                 BLOCK_D=block_d, BLOCK_SIZE=block_size, X=x, NUM_SPLITS=num_splits)
    if kind.startswith("streams"):
        # a stream's keys must sit in one block: S divides the block size's power-of-2 part
        s = min(dcfg.tile_n // dcfg.num_warps, _pow2_part(block_size))
        _paged_decode_streams_kernel[grid](
            *decode_args, W=dcfg.num_warps, S=s, ONE_LOOP=kind == "streams",
            num_warps=dcfg.num_warps, num_stages=dcfg.num_stages, **shape, **common)
    else:
        # fp8 cache, bf16 query: the dots in fp16 with the query scaled by a power of two
        # (DecodeConfig.fp8_fp16_dot); an fp16 or fp32 query computes in its own dtype anyway.
        fp16_dot = dcfg.fp8_fp16_dot and fp8_kv and compute == torch.bfloat16
        dcommon = {**common, "COMPUTE": TL_DTYPES[torch.float16]} if fp16_dot else common
        counters = part_ml  # never read unless the last split merges
        if num_splits > 1 and merge == "last_split":
            counters = _merge_counters(query.device, num_seqs * num_kv_heads * head_chunks)
            if counters is None:  # first use inside a graph capture: the reduce kernel instead
                merge, counters = "reduce", part_ml
        _paged_decode_kernel[grid](
            *decode_args[:3], counters, *decode_args[3:],
            TILE_N=dcfg.tile_n, SUB=min(dcfg.tile_n, _pow2_part(block_size)),
            ONE_LOOP=kind in ("rows", "keys"), KEYS_MAJOR=kind.startswith("keys"),
            RESCALE_MARGIN=float(dcfg.rescale_margin), K_ROWS=dcfg.k_rows, Q_POW2_SCALE=fp16_dot,
            SPLIT_MERGE=_SPLIT_MERGE_CODE[merge] if num_splits > 1 else 0,
            num_warps=dcfg.num_warps, num_stages=dcfg.num_stages, **shape, **dcommon)
    if num_splits > 1 and merge != "last_split":
        _decode_reduce_kernel[(num_seqs, num_heads)](
            output, part_acc, part_ml, query_start_loc, v_scale, ptrs[4],
            output.stride(0), output.stride(1), *pa_strides,
            HEAD_SIZE=head_size, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), FP8_KV=fp8_kv,
            USE_OUT_SCALE=use_out_scale, OUT_MAX=out_max,
            num_warps=reduce_num_warps(num_splits, head_size),
        )

    # --- verify: sequences with 2 <= query_len <= q_max (needs the max_query_len hint) -------
    q_max = 0
    if max_query_len is not None and max_query_len > 1:
        # rounded up to a power of two: fewer kernel specializations as the hint varies
        q_max = min(triton.next_power_of_2(max_query_len), VERIFY_MAX_QUERY_LEN
                    if verify_max_query_len is None else verify_max_query_len)
    if q_max > 1:
        _launch_verify(
            q_max, output, query, key, value, kc, vc, block_table, seq_lens, query_start_loc, ptrs,
            common, scale, softcap, window, bool(causal), num_splits_given, max_ctx, target,
            verify_cfg or verify_config(head_size, gqa, block_size, cfg_dtype, interpret,
                                        interleaved_v, q_max), x=x)
    else:
        q_max = 1

    # --- prefix prefill: sequences with query_len > q_max -------------------------------------
    if max_query_len is not None and max_query_len <= q_max:
        return
    choice = prefill_kernel or DEFAULT_PREFILL_KERNEL
    if choice == "gluon" and prefill_cfg is not None:  # ROCM_ATTN_PREFILL_KERNEL=gluon: as any reason, said once
        _warn_triton_prefill("a prefill_cfg, a Triton prefill config, was given")
    if choice != "triton" and prefill_cfg is None and _gluon_prefill_runs(
            choice, interpret, output, query, key, value, kv_cache, causal, sliding_window,
            alibi_slopes, sinks, logits_soft_cap, output_scale) and _run_gluon(
            choice, output, query, key, value, kc, vc, block_table, seq_lens, query_start_loc,
            scale, interleaved_v, q_max):
        return
    pcfg = prefill_cfg or prefill_config(head_size, gqa, block_size, compute, interpret)
    block_m, block_n = pcfg.block_m, pcfg.block_n
    has_new = key is not None
    k_new = key if has_new else dummy.view(num_tokens, num_heads, head_size)
    v_new = value if has_new else k_new
    descs = (dense_kv_descriptors(k_new, v_new, head_size, block_n, pcfg.dense_tma and target.tma)
             if has_new else None)
    _prefix_prefill_kernel[(num_tokens // block_m + num_seqs, num_heads)](
        output, query, *(descs or (k_new, v_new)), kc, vc, block_table, seq_lens, query_start_loc, *ptrs,
        scale, softcap, window, num_seqs,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), block_table.stride(0),
        GQA=gqa, HEAD_SIZE=head_size, BLOCK_D=block_d, BLOCK_SIZE=block_size, X=x,
        SUB=min(block_n, _pow2_part(block_size)), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_NEW_KV=has_new, CAUSAL=bool(causal), RESCALE_MARGIN=float(pcfg.context_margin),
        DENSE_MARGIN=float(pcfg.dense_margin),
        LONGEST_FIRST=pcfg.longest_first and bool(causal), DENSE_TMA=descs is not None,
        K_ROWS=pcfg.k_rows, SHORT_QUERY_MAX=q_max,
        num_warps=pcfg.num_warps, num_stages=pcfg.num_stages, **common,
    )


@functools.cache
def _gluon_launch():
    """The Gluon prefill's launcher (imported on first use: Gluon only where it runs)."""
    from ..gluon.prefix_prefill import launch
    return launch


# Why the Gluon prefill failed to build or launch under "auto" (the first failure; the default
# then leaves every launch of this process to the Triton prefill).
_GLUON_AUTO_FAILURE: list[str] = []


def _run_gluon(choice: str, *args) -> bool:
    """Run the Gluon prefill on ``args`` (its ``launch``'s); True when it ran. Under "auto" the
    caller did not ask for it: a failure to build or launch it (a ptxas, driver or GPU it was
    not tested with) is not theirs, so it warns once, naming the error, and the Triton prefill
    runs this launch and every later one. Asked for ("gluon"), the error propagates. Nothing
    is written when the launch raises: the compile and the launch checks come first."""
    try:
        _gluon_launch()(*args)
        return True
    except Exception as e:  # noqa: BLE001 - any build/launch failure (a CUDA fault resurfaces at the Triton launch)
        if choice != "auto":
            raise
        last_line = (str(e).strip().splitlines() or [""])[-1]  # a compiler error's verdict is its last line
        why = f"{type(e).__name__}: {last_line[:300]}"
        _GLUON_AUTO_FAILURE.append(why)
        warnings.warn(f"paged_attention: the Gluon prefill (the default on sm_90) failed to build or launch "
                      f"({why}); the Triton prefill runs this launch and every later one in this process "
                      f"(ROCM_ATTN_PREFILL_KERNEL=triton says so explicitly; =gluon raises the error)",
                      stacklevel=3)
        return False


def _gluon_prefill_runs(choice: str, interpret: bool, output, query, key, value, kv_cache, *features) -> bool:
    """Whether the Gluon prefill runs this launch (``choice`` "auto" or "gluon"; the rest:
    ``eligibility.prefill_kernel_for``'s arguments but the last). "auto" takes it where it
    covers the launch under the Triton release and at the block sizes it was tested with, and
    it has not failed to build in this process (``_run_gluon``), else runs the Triton kernel
    silently; "gluon" takes it wherever it covers the launch, else warns once per reason."""
    if choice == "auto" and _GLUON_AUTO_FAILURE:
        return False
    if interpret:
        reason = _GLUON_INTERPRETER_REASON  # asks nothing more: no host cost on a CPU
    else:
        reason = _gluon_ineligibility(output, query, key, value, kv_cache, *features, interpret)
        if reason is None and choice == "auto":
            reason = _gluon_auto_problem(kv_cache.shape[2])
    if reason is None:
        return True
    if choice == "gluon":
        _warn_triton_prefill(reason)
    return False


_WARNED_REASONS: set[str] = set()


def _warn_triton_prefill(reason: str) -> None:
    """The Gluon prefill was asked for but does not cover this launch: say why, once per reason."""
    if reason not in _WARNED_REASONS:
        _WARNED_REASONS.add(reason)
        warnings.warn(f"paged_attention: prefill kernel 'gluon' (ROCM_ATTN_PREFILL_KERNEL or prefill_kernel=) "
                      f"does not cover this launch ({reason}); the Triton prefill runs it", stacklevel=3)


def _launch_verify(q_max, output, query, key, value, kc, vc, block_table, seq_lens,
                   query_start_loc, ptrs, common, scale, softcap, window, causal, num_splits,
                   max_ctx, target, cfg, *, x):
    """The verify kernel (and its split reduction) over sequences of 2..q_max query tokens."""
    if cfg.kind not in ("rows", "rows3"):
        raise ValueError(f"paged_attention: verify kind {cfg.kind!r}; supported: 'rows', 'rows3'")
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = kc.shape[1]
    gqa = num_heads // num_kv_heads
    block_r = verify_rows(gqa, q_max, head_size)
    chunks = triton.cdiv(q_max * gqa, block_r)
    kind, splits = decode_plan(cfg, num_splits, num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                               head_chunks=chunks, max_ctx=max_ctx, num_sms=target.num_sms)
    # partial rows [seqs, q_max, heads, splits] (acc: x head_size; max and sum: x 2)
    rows = num_seqs * q_max * num_heads * splits if splits > 1 else 0
    part_acc = torch.empty(rows * head_size, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(rows * 2, dtype=torch.float32, device=query.device)
    p_strides = (q_max * num_heads * splits, num_heads * splits)
    has_new = key is not None
    k_new = key if has_new else query  # never read without new K/V (constexpr-disabled)
    v_new = value if has_new else query
    block_size = kc.shape[3]
    _paged_verify_kernel[(num_seqs, num_kv_heads * chunks, splits)](
        output, part_acc, part_ml, query, k_new, v_new, kc, vc, block_table, seq_lens,
        query_start_loc, *ptrs, scale, softcap, window,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), block_table.stride(0), *p_strides,
        GQA=gqa, Q_MAX=q_max, BLOCK_R=block_r, ROW_CHUNKS=chunks, HEAD_SIZE=head_size,
        BLOCK_D=triton.next_power_of_2(head_size), BLOCK_SIZE=block_size, X=x,
        TILE_N=cfg.tile_n, SUB=min(cfg.tile_n, _pow2_part(block_size)),
        NEW_N=max(16, triton.next_power_of_2(q_max)), NUM_SPLITS=splits, HAS_NEW_KV=has_new,
        CAUSAL=causal,
        ONE_LOOP=kind == "rows", RESCALE_MARGIN=float(cfg.rescale_margin), K_ROWS=cfg.k_rows,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
    if splits > 1:
        _verify_reduce_kernel[(num_seqs * q_max, num_heads)](
            output, part_acc, part_ml, query_start_loc, ptrs[4],
            output.stride(0), output.stride(1), *p_strides,
            HEAD_SIZE=head_size, BLOCK_D=triton.next_power_of_2(head_size), NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), Q_MAX=q_max,
            USE_OUT_SCALE=common["USE_OUT_SCALE"], OUT_MAX=common["OUT_MAX"],
            num_warps=reduce_num_warps(splits, head_size))
