"""The native (csrc) provider: CUDA/HIP paged decode and cache writer, built on first use.

The kernels live in ``csrc/`` (one source for CUDA and HIP). Nothing is compiled at install
or import: the first call that needs the extension (or ``python -m inductor_rocm_attn
build-native``) builds it with ``torch.utils.cpp_extension`` (ninja; nvcc with a CUDA torch,
hipcc with a ROCm torch) into the torch extensions directory, under a file lock, and later
processes load the cached build. ``unavailable_reason()`` never builds: it tells "no GPU",
"no toolchain", "not built yet" or "build failed: <first error line>".

What the kernels support (the capability table's "native" row is the contract):

- ``paged_attention``: decode only (every sequence has query_len 1; the ``prefill`` and
  ``output_scale`` features are not supported), head sizes 64 and 128, block sizes that are
  multiples of 16 (16 and 32 measured), LHBNC and LBHNC caches (the block stride is a kernel
  argument), standard and interleaved V, fp16/bf16 models, caches fp16/bf16/fp8 e4m3/e5m2
  with per-tensor scales (e4m3fnuz on ROCm), GQA any ratio (up to 8 query heads of one KV head
  per CTA: K/V read once), sliding window, ALiBi, logits soft cap, sinks, causal or not (a
  decode token sees every cached key either way), long contexts through KV splits.
- ``reshape_and_cache``: the same caches and layouts, any block size that is a multiple of 16
  and head sizes that are multiples of 16, fp16/bf16/fp32 key/value with any token and head
  strides (channels contiguous). Kernels (``WRITER_VARIANTS``, the ``variant`` argument):
  ``scatter`` (no shared memory, for decode batches) and ``tile8``/``tile16``/``tile32``
  (tokens of one head per CTA, V through shared memory into 16-byte stores, for prefill);
  by default the launcher picks by token count.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from ..layout import cache_layout_of
from ..validation import check_bool
from .merge_counters import merge_counters

__all__ = [
    "paged_attention",
    "reshape_and_cache",
    "unavailable_reason",
    "build_state",
    "build",
    "build_native_cli",
    "num_kv_splits",
    "decode_launch_config",
    "plan_decode",
    "DecodeLaunch",
    "ctas_per_sm",
    "num_kv_splits_wave",
    "DECODE_VARIANTS",
    "WRITER_VARIANTS",
    "HEAD_SIZES",
]

HEAD_SIZES = (64, 128)
BLOCK_MULTIPLE = 16
MODEL_DTYPES = (torch.float16, torch.bfloat16)
_FP8_CACHE_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, n))
CACHE_DTYPES = (torch.float16, torch.bfloat16) + _FP8_CACHE_DTYPES
WRITER_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 64
KEY_TILE = 16  # keys per kernel tile

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
# The extension's sources; csrc/emulate (CPU emulation for tests) is not part of it.
SOURCES = ("bindings.cpp", "paged_decode.cu", "reshape_and_cache.cu")
_HEADERS = ("native_api.h", "launch_util.h", "ra_compat.cuh", "paged_decode.cuh", "paged_decode_mma.cuh")
_EXTRA_CFLAGS = ("-O3",)  # the C++ standard: cpp_extension picks the one of the torch headers
_EXTRA_CUDA_CFLAGS = ("-O3",)


# --- build ------------------------------------------------------------------------------------


def _is_hip() -> bool:
    return torch.version.hip is not None


def _compiler_path() -> str | None:
    """nvcc (CUDA torch) or hipcc (ROCm torch), as torch.utils.cpp_extension would find it."""
    from torch.utils import cpp_extension

    if _is_hip():
        home = cpp_extension.ROCM_HOME
        name = "hipcc"
    else:
        home = cpp_extension.CUDA_HOME
        name = "nvcc"
    if home:
        p = Path(home) / "bin" / name
        if p.exists():
            return str(p)
    return shutil.which(name)


def _toolchain_reason() -> str | None:
    compiler = "hipcc" if _is_hip() else "nvcc"
    if _compiler_path() is None:
        env = "ROCM_HOME" if _is_hip() else "CUDA_HOME"
        return f"no toolchain: {compiler} not found (set {env} or put {compiler} on PATH)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "no toolchain: ninja not found (pip install ninja)"
    return None


def _arch_tag() -> str:
    if _is_hip():
        arch = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":")[0]
        return os.environ.get("PYTORCH_ROCM_ARCH", arch)
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    return f"sm{major}{minor}"


def _build_name() -> str:
    """Extension name: a hash of the sources, flags, torch build and target arch, so a
    changed source or another GPU never loads a stale build."""
    h = hashlib.sha256()
    for f in SOURCES + _HEADERS:
        h.update(f.encode())
        h.update((CSRC_DIR / f).read_bytes())
    h.update(repr((_EXTRA_CFLAGS, _EXTRA_CUDA_CFLAGS, torch.__version__, torch.version.cuda,
                   torch.version.hip, _arch_tag(), sys.version_info[:2])).encode())
    return f"rocm_attn_native_{h.hexdigest()[:16]}"


def _build_dir(name: str) -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension.get_default_build_root()) / name


def _library_path(name: str) -> Path:
    return _build_dir(name) / f"{name}.so"


def _failure_path(name: str) -> Path:
    return _build_dir(name) / "build_failed.txt"


def build_state() -> tuple[str, str | None]:
    """``(state, detail)``; state is one of "no_gpu", "no_toolchain", "build_failed",
    "not_built", "ready". Cheap: looks at files, never builds."""
    if not torch.cuda.is_available():
        return "no_gpu", "no GPU: no CUDA/ROCm GPU visible to torch"
    if not CSRC_DIR.is_dir():
        return "no_toolchain", f"no sources: {CSRC_DIR} is missing from this installation"
    name = _build_name()
    if _library_path(name).exists():
        return "ready", None
    why = _toolchain_reason()
    if why is not None:
        return "no_toolchain", why
    failed = _failure_path(name)
    if failed.exists():
        first = failed.read_text(errors="replace").splitlines()[:1] or ["(no message)"]
        return "build_failed", f"build failed: {first[0]} (log: {failed}; rebuild with build-native --force)"
    return "not_built", ("not built yet (built on first use, or run "
                         "`python -m inductor_rocm_attn build-native`)")


def unavailable_reason() -> str | None:
    """Why the native kernels cannot run now, or None; "not built yet" means the first use
    will build them (minutes)."""
    return build_state()[1]


def _first_error_line(text: str) -> str:
    for line in text.splitlines():
        if "error" in line.lower() and "error building extension" not in line.lower():
            return line.strip()[:300]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0][:300] if lines else "unknown error"


def _import_library(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(*, verbose: bool = False, force: bool = False):
    """Build (or load the cached build of) the extension and return the module.

    Two processes never build at once: a file lock serialises them, and the second finds
    the first one's library. A failed build leaves ``build_failed.txt`` (first line: the
    first compiler error) so later processes report it without retrying; ``force`` retries.
    """
    check_bool("native.build", "verbose", verbose)
    check_bool("native.build", "force", force)
    why = _toolchain_reason() if not _library_path(_build_name()).exists() or force else None
    if why is not None:
        raise RuntimeError(f"rocm_attn native: {why}")
    from filelock import FileLock  # a torch dependency
    from torch.utils import cpp_extension

    name = _build_name()
    build_dir = _build_dir(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(build_dir) + ".lock"):
        lib = _library_path(name)
        if lib.exists() and not force:
            return _import_library(name, lib)
        failed = _failure_path(name)
        if failed.exists() and not force:
            raise RuntimeError(f"rocm_attn native: {build_state()[1]}")
        failed.unlink(missing_ok=True)
        try:
            mod = cpp_extension.load(
                name=name, sources=[str(CSRC_DIR / s) for s in SOURCES],
                extra_cflags=list(_EXTRA_CFLAGS), extra_cuda_cflags=list(_EXTRA_CUDA_CFLAGS),
                extra_include_paths=[str(CSRC_DIR)], build_directory=str(build_dir),
                verbose=verbose)
        except Exception as e:  # record the failure for unavailable_reason()
            text = str(e)
            failed.write_text(_first_error_line(text) + "\n\n" + text)
            raise RuntimeError(f"rocm_attn native: build failed: {_first_error_line(text)} "
                               f"(log: {failed})") from e
        return mod


@functools.cache
def _module():
    return build()


def build_native_cli(argv: list[str] | None = None) -> int:
    """``python -m inductor_rocm_attn build-native [--force] [--quiet]``: build ahead of time."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m inductor_rocm_attn build-native",
                                 description="Build the native (csrc) kernels for this GPU.")
    ap.add_argument("--force", action="store_true", help="rebuild even after a failed or cached build")
    ap.add_argument("--quiet", action="store_true", help="do not show the compiler commands")
    args = ap.parse_args(argv)
    state, detail = build_state()
    if state == "no_gpu":
        print(f"build-native: {detail}; nothing to build for")
        return 1
    if state == "ready" and not args.force:
        print(f"build-native: already built ({_library_path(_build_name())})")
        return 0
    why = _toolchain_reason()
    if why is not None:
        print(f"build-native: {why}")
        return 1
    name = _build_name()
    print(f"build-native: compiler {_compiler_path()}, target {_arch_tag()}, torch {torch.__version__}")
    print(f"build-native: compiling {', '.join(SOURCES)} from {CSRC_DIR}")
    print(f"build-native: into {_build_dir(name)} (several minutes: every cache dtype x head size x "
          "GQA tile of the decode kernel is instantiated)")
    t0 = time.monotonic()
    try:
        build(verbose=not args.quiet, force=args.force)
    except RuntimeError as e:
        print(f"build-native: {e} after {time.monotonic() - t0:.0f} s")
        return 1
    print(f"build-native: done in {time.monotonic() - t0:.0f} s: {_library_path(name)}")
    return 0


# --- launch planning (host shapes only: CUDA-graph capturable) --------------------------------


def heads_per_cta(gqa: int) -> int:
    return 1 if gqa <= 1 else 2 if gqa <= 2 else 4 if gqa <= 4 else 8


def decode_smem_bytes(head_size: int, elem_bytes: int, gt: int, num_warps: int, stages: int) -> int:
    """Dynamic shared memory of one decode CTA (mirrors ``DecodeSmem`` in paged_decode.cuh)."""
    tile = KEY_TILE * head_size * elem_bytes
    warp = stages * 2 * tile + 2 * gt * KEY_TILE * 4 + ((gt + 3) // 4) * 16
    merge = num_warps * (gt * head_size + 2 * gt) * 4
    return max(num_warps * warp, merge)


@functools.cache
def _device_limits(index: int) -> tuple[int, int, int, bool]:
    """(SM count, warp size, dynamic shared memory a block may opt into, tensor-core kernel
    usable: an NVIDIA GPU of sm_80 or newer)."""
    props = torch.cuda.get_device_properties(index)
    warp = getattr(props, "warp_size", None)
    if not warp:
        warp = 64 if _is_hip() and "gfx9" in getattr(props, "gcnArchName", "") else 32
    smem = getattr(props, "shared_memory_per_block_optin", 0) or (64 << 10 if _is_hip() else 48 << 10)
    mma = not _is_hip() and props.major >= 8 and int(warp) == 32
    return props.multi_processor_count, int(warp), int(smem), mma


# (num_warps, stages) tried in order until the CTA fits the device's shared memory.
DECODE_CONFIGS = ((4, 3), (4, 2), (2, 3), (2, 2), (1, 2))


def decode_launch_config(head_size: int, elem_bytes: int, gqa: int, max_smem: int) -> tuple[int, int]:
    gt = heads_per_cta(gqa)
    for warps, stages in DECODE_CONFIGS:
        if decode_smem_bytes(head_size, elem_bytes, gt, warps, stages) <= max_smem:
            return warps, stages
    raise ValueError(f"native paged_attention: head_size {head_size} needs more shared memory "
                     f"than the device's {max_smem} bytes")


def num_kv_splits(num_seqs: int, num_kv_heads: int, head_chunks: int, max_seq_len: int,
                  num_sms: int, num_warps: int) -> int:
    """KV splits from host shapes: none once the CTAs fill the GPU twice over; else about 4
    CTAs per SM, each warp keeping at least 2 tiles of 16 keys."""
    ctas = max(1, num_seqs * num_kv_heads * head_chunks)
    if ctas >= 2 * num_sms:
        return 1
    want = -(-4 * num_sms // ctas)
    tiles = -(-max(1, max_seq_len) // KEY_TILE)
    cap = max(1, tiles // (2 * num_warps))
    return max(1, min(want, cap, MAX_SPLITS))


# Resident decode CTAs per SM, for the "wave" split rule: from shared memory (the driver reserves
# 1 KB per CTA) and threads; registers are not known here (the kernels compile to <= 255, which
# never lowers these counts below what shared memory allows for the (warps, stages) in use:
# 8 warps/SM at 255 registers still fit 65536).
_SMEM_RESERVED_PER_CTA = 1024


@functools.cache
def _sm_smem(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_multiprocessor", 0) or (64 << 10 if _is_hip() else 228 << 10))


def ctas_per_sm(smem_per_cta: int, num_warps: int, warp_size: int, sm_smem: int,
                max_threads: int = 2048, max_ctas: int = 32) -> int:
    by_smem = sm_smem // (smem_per_cta + _SMEM_RESERVED_PER_CTA)
    return max(1, min(by_smem, max_threads // (num_warps * warp_size), max_ctas))


def num_kv_splits_wave(num_seqs: int, num_kv_heads: int, head_chunks: int, max_seq_len: int,
                       num_sms: int, num_warps: int, resident_per_sm: int,
                       min_tiles_per_warp: int = 2) -> int:
    """KV splits so that the grid is at most one wave of resident CTAs (rounded down, as the
    Triton decode's rule), each warp keeping at least ``min_tiles_per_warp`` tiles
    (``split_rule="wave"``). ``num_kv_splits`` aims at 4 CTAs per SM, but a (4 warps, 3 stages)
    CTA of 98 KB fits 2 per SM on an H200: B=16 L=4096 ran 640 CTAs on 264 slots (5 splits,
    141.4 us); the wave rule gives 2 splits (118.6 us)."""
    ctas = max(1, num_seqs * num_kv_heads * head_chunks)
    slots = resident_per_sm * num_sms
    want = max(1, slots // ctas)
    tiles = -(-max(1, max_seq_len) // KEY_TILE)
    cap = max(1, tiles // (min_tiles_per_warp * num_warps))
    return max(1, min(want, cap, MAX_SPLITS))


# KV split rules: "four_per_sm" (``num_kv_splits``), "wave" (``num_kv_splits_wave``), "triton"
# ("wave", but one split once the CTAs fill 2 x SMs).
SPLIT_RULES = ("four_per_sm", "wave", "triton")


def plan_splits(num_seqs: int, num_kv_heads: int, gqa: int, max_ctx: int, head_size: int, elem_bytes: int,
                num_warps: int, stages: int, *, num_sms: int, warp_size: int, sm_smem: int,
                split_rule: str = "four_per_sm") -> int:
    """The KV split count of a (num_warps, stages) launch under ``split_rule`` (host shapes only)."""
    _check_split_rule(split_rule)
    gt = heads_per_cta(gqa)
    chunks = -(-gqa // gt)
    if split_rule == "triton" and num_seqs * num_kv_heads * chunks >= 2 * num_sms:
        return 1
    if split_rule in ("wave", "triton"):
        per_sm = ctas_per_sm(decode_smem_bytes(head_size, elem_bytes, gt, num_warps, stages), num_warps,
                             warp_size, sm_smem)
        return num_kv_splits_wave(num_seqs, num_kv_heads, chunks, max_ctx, num_sms, num_warps, per_sm)
    return num_kv_splits(num_seqs, num_kv_heads, chunks, max_ctx, num_sms, num_warps)


def _check_split_rule(split_rule: str) -> None:
    if split_rule not in SPLIT_RULES:
        raise ValueError(f"native paged_attention: split_rule {split_rule!r}; supported: {SPLIT_RULES}")


# The default launch by grid size (CTAs = num_seqs x num_kv_heads x head chunks, before splits).
# H200, bf16, 32/8 heads, d128, block 16 (bench_native.py --variants; us, [Triton / SDPA] on
# the same case). On the kernel of 2026-12-03 (history 2026-12-03_2022_*), L=4096:
#   B=1  [15.6 / 16.9]: 4 warps, 3 stages, four_per_sm (32 splits) 25.9; 1 warp, 3 stages, wave
#                       (64 splits) 30.9; 4-warp wave 25.8
#   B=16 [81.2 / 76.0]: 4-warp four_per_sm (5 splits) 141.4; 4-warp wave (2) 118.6;
#                       1-warp wave (8) 112.2
#   B=64 [254.0 / 248.5]: 4-warp (1 split) 388.6; 1-warp wave (2 splits) 354.9
# On the K-column kernel (history 2026-12-04_1740_*), B=1, L = 1024 / 4096 / 16384:
#   [12.7 / 11.6, 16.5 / 16.8, 32.4 / 32.1]: 4-warp four_per_sm (8, 32, 64 splits) 18.4 / 24.2 /
#   53.1; 4-warp wave (8, 32, 33) 18.7 / 24.0 / 44.1; 1-warp wave 22.5 / 29.3 / 45.5; B=16
#   1-warp wave 41.5 / 87.7 / 266.4, 4-warp wave 41.9 / 92.4 / 290.8.
# So: one warp, 3 stages, the wave rule once the grid is at least half the SMs (B=16: 128 CTAs
# >= 66 on 132 SMs); below it (B=1: 8 CTAs) decode_launch_config's 4-warp config and the wave
# rule too (no worse than four_per_sm at any measured L, -17% at B=1 L=16384). Measured only
# with the tensor-core kernel on the H200; the CUDA-core kernel (HIP) follows the same rule.
WIDE_GRID_LAUNCH = (1, 3, "wave")  # (num_warps, stages, split_rule)
NARROW_GRID_SPLIT_RULE = "wave"


# How several KV splits are merged: "reduce", a second kernel; "last_split", the last split
# CTA of each (sequence, KV head, head chunk) to finish, through the ticket counters the Triton
# decode uses (kernels/merge_counters.py), with no second launch. "reduce" is the default: on
# the H200 "last_split" was slower at every B (L=4096, B = 1 / 16 / 64: 27.2 / 99.7 / 278.5 us
# against 21.4 / 86.6 / 270.3; benchmarks/results/history/2026-12-05_1411_*).
SPLIT_MERGES = ("reduce", "last_split")
DEFAULT_SPLIT_MERGE = "reduce"


class DecodeLaunch(NamedTuple):
    num_warps: int
    stages: int
    num_splits: int
    split_rule: str


def plan_decode(num_seqs: int, num_kv_heads: int, gqa: int, max_ctx: int, head_size: int, elem_bytes: int, *,
                num_sms: int, warp_size: int, max_smem: int, sm_smem: int, num_warps: int | None = None,
                stages: int | None = None, num_splits: int | None = None,
                split_rule: str | None = None) -> DecodeLaunch:
    """The launch ``paged_attention`` runs, from host shapes only (no device read: CUDA-graph
    capturable). ``max_smem``: dynamic shared memory a CTA may opt into; ``sm_smem``: an SM's.

    With neither ``num_warps`` nor ``stages`` given: ``WIDE_GRID_LAUNCH`` when the grid is at
    least half the SM count and its CTA fits ``max_smem``, else ``decode_launch_config`` with
    ``NARROW_GRID_SPLIT_RULE``. Giving ``num_warps`` or ``stages`` opts out of that choice: the
    other comes from ``decode_launch_config`` and the rule is ``NARROW_GRID_SPLIT_RULE``. An
    explicit ``split_rule`` or ``num_splits`` replaces the planned one either way.
    """
    if split_rule is not None:
        _check_split_rule(split_rule)
    gt = heads_per_cta(gqa)
    grid = num_seqs * num_kv_heads * -(-gqa // gt)
    rule = NARROW_GRID_SPLIT_RULE
    if num_warps is None and stages is None:
        w, s, r = WIDE_GRID_LAUNCH
        if 2 * grid >= num_sms and decode_smem_bytes(head_size, elem_bytes, gt, w, s) <= max_smem:
            num_warps, stages, rule = w, s, r
    if num_warps is None or stages is None:
        w, s = decode_launch_config(head_size, elem_bytes, gqa, max_smem)
        num_warps, stages = num_warps or w, stages or s
    split_rule = split_rule or rule
    if num_splits is None:
        num_splits = plan_splits(num_seqs, num_kv_heads, gqa, max_ctx, head_size, elem_bytes, num_warps, stages,
                                 num_sms=num_sms, warp_size=warp_size, sm_smem=sm_smem, split_rule=split_rule)
    return DecodeLaunch(int(num_warps), int(stages), int(num_splits), split_rule)


# Named launch variants of the native decode for A/B runs (benchmarks/bench_native.py
# --variants): keyword arguments of ``paged_attention``. "default" is what the provider runs
# (``plan_decode``); the others fix (warps, stages, split rule), so that they launch the same
# on every grid: "w4s3" is the default before the wide-grid launch (on the H200: what
# decode_launch_config gives), "w1s3_wave" the wide-grid launch everywhere.
DECODE_VARIANTS: dict[str, dict] = {
    "default": {},
    "w4s3": dict(num_warps=4, stages=3, split_rule="four_per_sm"),
    "w4s3_wave": dict(num_warps=4, stages=3, split_rule="wave"),
    "w1s3_wave": dict(num_warps=1, stages=3, split_rule="wave"),
    "w1s3_triton": dict(num_warps=1, stages=3, split_rule="triton"),
    "w2s3_wave": dict(num_warps=2, stages=3, split_rule="wave"),
    "last_split": dict(split_merge="last_split"),
}

# Cache-writer kernels by name -> csrc WriterVariant code (native_api.h). None (the default)
# lets the launcher pick by token count (writer_variant_for in csrc/reshape_and_cache.cu).
WRITER_VARIANTS: dict[str, int] = {"scatter": 1, "tile8": 2, "tile16": 3, "tile32": 4}


# --- validation ------------------------------------------------------------------------------


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def check_decode_args(output, query, kv_cache, query_start_loc, seq_lens, block_table, k_scale,
                      v_scale, alibi_slopes, sinks, output_scale, max_query_len) -> int:
    """Validate a decode call before anything is written; returns num_kv_heads."""
    op = "native paged_attention"
    if max_query_len is not None and max_query_len > 1:
        raise NotImplementedError(
            f"{op}: max_query_len {max_query_len}: only decode (query_len 1 for every sequence) is "
            "supported; prefill goes to the triton provider (the capability table marks native "
            "decode-only)")
    if output_scale is not None:
        raise NotImplementedError(f"{op}: output_scale (fused fp8 output quant) is not supported; "
                                  "use the triton provider")
    _check(query.dim() == 3, f"{op}: query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    head_size = query.shape[2]
    _check(head_size in HEAD_SIZES, f"{op}: head_size {head_size} is not supported; supported: {HEAD_SIZES}")
    _check(query.dtype in MODEL_DTYPES, f"{op}: query dtype {query.dtype} is not supported; supported: {MODEL_DTYPES}")
    _check(output.dtype == query.dtype and output.shape == query.shape,
           f"{op}: output must match query ({tuple(query.shape)}, {query.dtype}), got "
           f"{tuple(output.shape)}, {output.dtype}")
    _check(query.stride(2) == 1 and output.stride(2) == 1, f"{op}: query/output channels must be contiguous")
    cache_layout_of(kv_cache)  # raises for anything but LHBNC / LBHNC
    _check(kv_cache.dtype in CACHE_DTYPES,
           f"{op}: kv_cache dtype {kv_cache.dtype} is not supported; supported: {CACHE_DTYPES}")
    block_size = kv_cache.shape[2]
    _check(block_size % BLOCK_MULTIPLE == 0,
           f"{op}: block_size {block_size} is not supported; it must be a multiple of {BLOCK_MULTIPLE}")
    _check(kv_cache.shape[3] % head_size == 0,
           f"{op}: kv_cache width {kv_cache.shape[3]} is not a multiple of head_size {head_size}")
    num_kv_heads = kv_cache.shape[3] // head_size
    _check(query.shape[1] % num_kv_heads == 0,
           f"{op}: num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    _check((kv_cache.stride(0) * kv_cache.element_size()) % 16 == 0
           and (kv_cache.stride(1) * kv_cache.element_size()) % 16 == 0 and kv_cache.data_ptr() % 16 == 0,
           f"{op}: kv_cache must start on 16 bytes with a block stride of a multiple of 16 bytes "
           f"(16-byte copies), got stride {kv_cache.stride(0)} at address {kv_cache.data_ptr():#x}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        _check(t.dtype in (torch.int32, torch.int64),
               f"{op}: {name} dtype {t.dtype} is not supported; supported: int32, int64")
    _check(block_table.dim() == 2 and block_table.stride(1) == 1,
           f"{op}: block_table must be [num_seqs, max_blocks] with contiguous rows")
    _check(query_start_loc.shape[0] == seq_lens.shape[0] + 1,
           f"{op}: query_start_loc has {query_start_loc.shape[0]} entries, expected num_seqs + 1 = "
           f"{seq_lens.shape[0] + 1}")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check(t.dtype == torch.float32 and t.numel() >= 1, f"{op}: {name} must be a float32 tensor with one element")
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        _check(t is None or t.shape == (query.shape[1],),
               f"{op}: {name} must be [num_heads] = [{query.shape[1]}], got {None if t is None else tuple(t.shape)}")
    return num_kv_heads


def check_write_args(key, value, kv_cache, slot_mapping, k_scale, v_scale) -> None:
    op = "native reshape_and_cache"
    _check(key.dim() == 3 and value.shape == key.shape,
           f"{op}: key/value must both be [num_tokens, num_kv_heads, head_size], got "
           f"{tuple(key.shape)} and {tuple(value.shape)}")
    _check(key.dtype in WRITER_INPUT_DTYPES and value.dtype == key.dtype,
           f"{op}: key/value dtype {key.dtype}/{value.dtype} is not supported; supported: {WRITER_INPUT_DTYPES}")
    _check(key.stride(2) == 1 and value.stride(2) == 1, f"{op}: key/value channels must be contiguous")
    cache_layout_of(kv_cache)
    _check(kv_cache.dtype in CACHE_DTYPES,
           f"{op}: kv_cache dtype {kv_cache.dtype} is not supported; supported: {CACHE_DTYPES}")
    x = 16 // kv_cache.element_size()
    _check(key.shape[2] % x == 0, f"{op}: head_size {key.shape[2]} must be a multiple of {x} for {kv_cache.dtype}")
    _check(kv_cache.shape[2] % BLOCK_MULTIPLE == 0,
           f"{op}: block_size {kv_cache.shape[2]} is not supported; it must be a multiple of {BLOCK_MULTIPLE}")
    _check(kv_cache.shape[3] == key.shape[1] * key.shape[2],
           f"{op}: kv_cache width {kv_cache.shape[3]} != num_kv_heads * head_size = {key.shape[1] * key.shape[2]}")
    _check(slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.dim() == 1,
           f"{op}: slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    _check(slot_mapping.shape[0] <= key.shape[0],
           f"{op}: slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check(t.dtype == torch.float32 and t.numel() >= 1, f"{op}: {name} must be a float32 tensor with one element")


def writer_variant_code(variant: str) -> int:
    """The csrc WriterVariant code of a ``WRITER_VARIANTS`` name."""
    code = WRITER_VARIANTS.get(variant) if isinstance(variant, str) else None
    _check(code is not None, f"native reshape_and_cache: variant {variant!r} is not supported; "
                             f"supported: {tuple(WRITER_VARIANTS)} (or None: chosen by token count)")
    return code


def _check_device(op: str, t: torch.Tensor, **others: torch.Tensor | None) -> None:
    """``t`` on a GPU and every other given tensor on the same one (the kernel reads them all
    through raw pointers: a tensor elsewhere would be an illegal address, or another device's
    memory)."""
    if t.device.type != "cuda":
        raise ValueError(f"native {op}: tensors must be on a CUDA/ROCm GPU, got {t.device}")
    for name, o in others.items():
        if o is not None and o.device != t.device:
            raise ValueError(f"native {op}: {name} is on {o.device}, the other tensors on {t.device}")


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).contiguous()


# --- entry points (signatures of kernels.reference) -------------------------------------------


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
    num_warps: int | None = None,
    stages: int | None = None,
    tensor_cores: bool | None = None,
    split_rule: str | None = None,
    split_merge: str | None = None,
) -> None:
    """Paged decode over the cache (semantics: ``reference.paged_attention`` with query_len 1).

    output/query ``[num_tokens, num_heads, head_size]`` fp16/bf16; key/value unused (a decode
    token's K/V are already in the cache); kv_cache ``[num_blocks, 2, block_size,
    num_kv_heads * head_size]`` LHBNC or LBHNC; query_start_loc ``[num_seqs + 1]``, seq_lens
    ``[num_seqs]``, block_table ``[num_seqs, max_blocks]`` int32/int64; k_scale/v_scale ``[1]``
    fp32; alibi_slopes/sinks ``[num_heads]``. ``causal`` does not matter for a decode token.
    ``max_query_len`` must be 1 (or None: the caller guarantees decode-only; sequences with
    another query length are skipped and their rows left unwritten). ``num_splits``,
    ``num_warps``, ``stages``, ``split_rule`` (``SPLIT_RULES``) override the launch plan
    (``plan_decode``: one warp and one wave of CTAs on wide grids, 4 warps below),
    ``tensor_cores`` the kernel choice (default: the mma kernel on NVIDIA sm_80+, CUDA-core dot
    products elsewhere), ``split_merge`` (``SPLIT_MERGES``) how KV splits are merged (default
    ``DEFAULT_SPLIT_MERGE``).
    """
    split_merge = DEFAULT_SPLIT_MERGE if split_merge is None else split_merge
    if split_merge not in SPLIT_MERGES:
        raise ValueError(f"native paged_attention: split_merge {split_merge!r}; supported: {SPLIT_MERGES}")
    num_kv_heads = check_decode_args(output, query, kv_cache, query_start_loc, seq_lens, block_table,
                                     k_scale, v_scale, alibi_slopes, sinks, output_scale, max_query_len)
    _check_device("paged_attention", query, output=output, kv_cache=kv_cache, query_start_loc=query_start_loc,
                  seq_lens=seq_lens, block_table=block_table, k_scale=k_scale, v_scale=v_scale,
                  alibi_slopes=alibi_slopes, sinks=sinks)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or query.shape[0] == 0:
        return
    sms, warp, smem, mma = _device_limits(query.device.index or 0)
    if tensor_cores is None:
        tensor_cores = mma
    head_size = query.shape[2]
    gqa = query.shape[1] // num_kv_heads
    max_ctx = max_seq_len if max_seq_len is not None else block_table.shape[1] * kv_cache.shape[2]
    launch = plan_decode(num_seqs, num_kv_heads, gqa, max_ctx, head_size, kv_cache.element_size(),
                         num_sms=sms, warp_size=warp, max_smem=smem, sm_smem=_sm_smem(query.device.index or 0),
                         num_warps=num_warps, stages=stages, num_splits=num_splits, split_rule=split_rule)
    window = int(sliding_window) if sliding_window is not None and sliding_window > 0 else 0
    counters = None
    if launch.num_splits > 1 and split_merge == "last_split":  # None while a capture would grow it
        counters = merge_counters(query.device, num_seqs * num_kv_heads * -(-gqa // heads_per_cta(gqa)))
    _module().paged_decode(
        output, query, kv_cache, query_start_loc, seq_lens, block_table, float(scale), k_scale, v_scale,
        window, _f32(alibi_slopes), _f32(sinks), float(logits_soft_cap or 0.0), bool(interleaved_v),
        num_kv_heads, launch.num_splits, launch.num_warps, launch.stages, warp, smem, bool(tensor_cores),
        counters)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
    *,
    variant: str | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` (fp16/bf16/fp32, any
    token/head strides) into the paged cache; same semantics as ``reference.reshape_and_cache``
    (slot < 0 skipped, fp8: value / scale saturated). ``variant`` (a ``WRITER_VARIANTS`` name)
    overrides the kernel the launcher picks by token count."""
    code = 0 if variant is None else writer_variant_code(variant)
    check_write_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    _check_device("reshape_and_cache", key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping,
                  k_scale=k_scale, v_scale=v_scale)
    if slot_mapping.shape[0] == 0:
        return
    _module().reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale, bool(interleaved_v), code)
