"""Compile our Triton kernels for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter (what CPU CI runs) executes kernels as Python and skips the checks of
the real frontend, e.g. that a name bound in both branches of a runtime ``if`` keeps one
type; such a kernel passes CI and fails on the GPU. This script calls each public wrapper
with CPU tensors, intercepts every kernel launch (nothing runs) and compiles it with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``: the frontend, the
optimizer and ptxas, no driver. Run without ``TRITON_INTERPRET``; prints one line per
launch and exits non-zero on the first failure. Used by tests/test_triton_sm90_compile.py.

It also fingerprints the generated code, to show that a refactor left the kernels unchanged:

    python tests/triton_sm90_compile.py --sass before.json        # on the old tree
    python tests/triton_sm90_compile.py --compare before.json     # on the new tree

``--sass`` writes, per launch, a hash of its sm_90 SASS (``cuobjdump -sass`` of the cubin,
the kernel's own name replaced, so moving or renaming a kernel does not count as a change)
and its instruction count; ``--compare`` prints the before/after table and exits 4 when a
launch's SASS differs or a launch is missing (launches new since the base are listed only).
A launch is named by its label (dtype, V interior), kernel, constexpr values, argument types
and options, all by parameter name.

The head-size-512 launches also report their registers, stack (spills) and shared memory
and fail if they spill or overflow sm_90's shared memory; ``--resources`` reports them for
every launch. The default run compiles a subset of them (every config and kernel);
``--only-d512`` compiles all of them and nothing else.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import replace

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import inductor_rocm_attn  # noqa: E402,F401
from inductor_rocm_attn.kernels.triton.configs import (  # noqa: E402
    DecodeConfig, LaunchTarget, prefill_config)
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache  # noqa: E402

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
       torch.int32: "i32", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_LAUNCHES: list = []
H200 = LaunchTarget(num_sms=132, tma=True)
_SASS: dict[str, dict] = {}  # launch name -> fingerprint (filled when fingerprinting)


def _capture_run(self, *args, grid=None, warmup=False, **kwargs):
    _LAUNCHES.append((self, args, kwargs))


def _signature(fn: JITFunction, args, kwargs):
    """Types, constexprs, options and the divisibility attributes a real launch specializes on
    (pointers 16-byte aligned, ints divisible by 16): without them loads do not vectorize."""
    sig, consts, attrs = {}, {}, {}
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    for i, name in enumerate(fn.arg_names):
        if name not in values:  # defaulted parameter
            p = fn.params[i]
            values[name] = p.default
        v = values[name]
        if fn.params[i].is_constexpr:
            sig[name] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TY[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, TensorDescriptor):
            sig[name] = f"tensordesc<{_TY[v.base.dtype]}[{','.join(map(str, v.block_shape))}]>"
        elif v is None:
            sig[name] = "constexpr"
            consts[(i,)] = None
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i64" if abs(v) >= 2**31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={v!r}")
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return sig, consts, attrs, options


def _launch_name(label, fn, sig, consts, options) -> str:
    """A launch's name from parameter names only (stable when positions or modules change)."""
    const = ",".join(f"{fn.arg_names[i[0]]}={v!r}" for i, v in sorted(consts.items()))
    types = ",".join(f"{k}:{v}" for k, v in sig.items() if v != "constexpr")
    opts = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{label} | {fn.__name__} | {const} | {types} | {opts}"


def _cuobjdump(kernel, flag: str) -> str:
    """What Triton's bundled ``cuobjdump <flag>`` prints for the compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def _sass_fingerprint(kernel, name: str) -> dict:
    """sha256 of the kernel's SASS (addresses, instructions and control words), with the
    kernel's symbol name replaced; plus its instruction count."""
    sass = _cuobjdump(kernel, "-sass")
    lines = [ln.strip().replace(name, "KERNEL") for ln in sass.splitlines()
             if ln.strip().startswith("/*")]
    n = sum(1 for ln in lines if re.match(r"/\*[0-9a-f]{4,}\*/", ln))
    return {"sass_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(), "instructions": n}


def _expect(kernel: str, **constexprs) -> int:
    """1 (and a FAIL line) unless the latest launch of ``kernel`` had these constexpr values:
    the launcher's choices (split count, one loop, TMA) checked without a GPU."""
    for fn, _, kwargs in reversed(_LAUNCHES):
        if fn.__name__ == kernel:
            got = {k: kwargs.get(k) for k in constexprs}
            if got == constexprs:
                return 0
            print(f"FAIL launch of {kernel}: {got}, expected {constexprs}", flush=True)
            return 1
    print(f"FAIL no launch of {kernel}", flush=True)
    return 1


def _resources(kernel, name: str) -> dict:
    """What one compiled launch holds per thread and per program: registers, stack (local
    memory: > 0 means ptxas spilled, our kernels keep no local arrays) and shared memory
    (Triton's dynamic share plus the cubin's static one), from ``cuobjdump -res-usage``."""
    usage = _cuobjdump(kernel, "-res-usage")
    line = usage[usage.index(f"Function {name}:"):]
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line.splitlines()[1])}
    return {"regs": field["REG"], "stack": field["STACK"] + field["LOCAL"],
            "smem": kernel.metadata.shared + field["SHARED"]}


# sm_90 limits a launch must keep: 255 registers a thread (more spill), 227 KB of shared
# memory a program (232448 bytes, the opt-in maximum; the driver reserves 1 KB more).
SM90_MAX_SMEM = 232448


def compile_launches(label: str, fingerprint: bool = False, resources: bool = False,
                     spills_ok: bool = False, stack_budget: dict[str, int] | None = None) -> int:
    """Compile every launch recorded since the last call. ``resources``: also print each
    launch's registers / stack / shared memory, and fail one that spills (stack > 0, or more
    than ``stack_budget[kernel name]`` bytes; unless ``spills_ok``) or needs more shared
    memory than sm_90 has."""
    failures = 0
    seen = set()
    for fn, args, kwargs in _LAUNCHES:
        sig, consts, attrs, options = _signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, repr(v)) for k, v in consts.items())),
               tuple(sorted(attrs)), tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        try:
            kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                    options=options)
            print(f"ok   {label}: {fn.__name__}", flush=True)
            if resources:
                use = _resources(kernel, fn.__name__)
                short = ",".join(f"{fn.arg_names[i[0]]}={v}" for i, v in sorted(consts.items())
                                 if fn.arg_names[i[0]] in _SHORT)
                allowed = (stack_budget or {}).get(fn.__name__, 0)
                over = (use["stack"] > allowed and not spills_ok) or use["smem"] > SM90_MAX_SMEM
                print(f"{'FAIL' if over else 'res '} {fn.__name__}: {use['regs']} regs, stack "
                      f"{use['stack']} B, smem {use['smem']} B ({short} {options})", flush=True)
                failures += over
            if fingerprint:
                _SASS[_launch_name(label, fn, sig, consts, options)] = _sass_fingerprint(kernel, fn.__name__)
        except Exception as e:  # report every kernel, then fail
            failures += 1
            msg = str(e).strip().splitlines()
            print(f"FAIL {label}: {fn.__name__}: {msg[-1] if msg else e!r}", flush=True)
            traceback.print_exc(limit=1)
    _LAUNCHES.clear()
    return failures


def _probe() -> str | None:
    """None when this Triton can compile a trivial kernel for sm_90 here, else why not."""
    import triton.language as tl

    @triton.jit
    def _k(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), 1.0)

    try:
        triton.compile(ASTSource(_k, {"x_ptr": "*fp32", "N": "constexpr"}, {(1,): 16}),
                       target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # API or toolchain, not our kernels
        return f"{type(e).__name__}: {e}"[:300]
    return None


def _compare(base_path: str) -> int:
    """Print the before/after table of the launches' SASS; 4 when any differs or is missing."""
    with open(base_path) as f:
        base = json.load(f)
    bad = 0
    print("\n| launch | kernel | instructions before / after | SASS sha256 before / after | verdict |")
    print("|---|---|---|---|---|")
    for name in sorted(set(base) | set(_SASS)):
        b, a = base.get(name), _SASS.get(name)
        same = b is not None and a is not None and b["sass_sha256"] == a["sass_sha256"]
        bad += not same and b is not None  # a new launch (not in the base) changes nothing
        verdict = "identical" if same else ("missing after" if a is None else
                                            "new" if b is None else "DIFFERS")
        label, kernel, consts = name.split(" | ")[:3]
        short = ",".join(c for c in consts.split(",") if c.split("=")[0] in _SHORT)
        print(f"| {label} {short} | {kernel} | {b['instructions'] if b else '-'} / "
              f"{a['instructions'] if a else '-'} | {b['sass_sha256'][:12] if b else '-'} / "
              f"{a['sass_sha256'][:12] if a else '-'} | {verdict} |")
    print(f"\n{len(base)} launches before, {len(_SASS)} after, {bad} of those before not identical")
    return 4 if bad else 0


# constexprs shown in the --compare table (the full launch names are in the --sass file)
_SHORT = {"GQA", "TILE_N", "W", "NUM_SPLITS", "ONE_LOOP", "KEYS_MAJOR", "BLOCK_M", "BLOCK_N",
          "DENSE_TMA", "HAS_NEW_KV", "BLOCK_T", "NUM_HEADS", "Q_MAX", "BLOCK_R"}


def _bench_shapes(tk, fingerprint: bool, resources: bool = False) -> int:
    """The default launches at the benchmarks' shapes (bf16, d=128, block 16), where the tuned
    configs apply: decode with 32/8 heads at L=4096, B=64 (one split) and B=1 (split, one
    loop); the end-to-end model's 16/8 heads with interleaved V (B=64, L=2048); prefill of
    B=4 x 4096 new tokens with no prefix and a 4096-token prefix. Nothing runs: the tensors
    only carry shapes, strides and dtypes (the cache is small, the block table empty)."""
    dtype, HKV, D, BS = torch.bfloat16, 8, 128, 16
    one = torch.ones(1)
    decode = [(32, False, 64, 4096), (32, False, 1, 4096), (16, True, 64, 2048)]
    prefill = [(32, 4, 4096, 0), (32, 4, 4096, 4096)]
    failures = 0
    for hq, interleaved, b, ctx in decode:
        cache = allocate_kv_cache(KVCacheSpec(BS, HKV, D, dtype, CacheLayout.LHBNC), 16, "cpu")
        q = torch.empty(b, hq, D, dtype=dtype)
        tk.paged_attention(torch.empty_like(q), q, None, None, cache,
                           torch.arange(b + 1, dtype=torch.int32), torch.full((b,), ctx, dtype=torch.int32),
                           torch.zeros(b, ctx // BS, dtype=torch.int32), D ** -0.5, one, one, True, -1,
                           None, None, 0.0, interleaved, None, 1, ctx, target=H200)
        # the tuned one-warp three-loop config; B=1 splits the keys 64 ways, 4 tiles each:
        # one loop (configs.ONE_LOOP_MAX_TILES)
        failures += _expect("_paged_decode_kernel", TILE_N=16, num_warps=1, NUM_SPLITS=64 if b == 1 else 1,
                            ONE_LOOP=b == 1)
    for b, q_len, ctx in [(64, 4, 4096), (4, 4, 4096)]:  # verify: B=64 one split, B=4 splits
        cache = allocate_kv_cache(KVCacheSpec(BS, HKV, D, dtype, CacheLayout.LHBNC), 16, "cpu")
        q = torch.empty(b * q_len, 32, D, dtype=dtype)
        kv = [torch.empty(b * q_len, HKV, D, dtype=dtype) for _ in range(2)]
        n_before = len(_LAUNCHES)
        tk.paged_attention(torch.empty_like(q), q, *kv, cache,
                           torch.arange(b + 1, dtype=torch.int32) * q_len,
                           torch.full((b,), ctx, dtype=torch.int32),
                           torch.zeros(b, ctx // BS, dtype=torch.int32), D ** -0.5, one, one, True, -1,
                           None, None, 0.0, False, None, q_len, ctx, target=H200)
        failures += _expect("_paged_verify_kernel", BLOCK_R=16, num_warps=1, TILE_N=16, ONE_LOOP=b == 4,
                            NUM_SPLITS=1 if b == 64 else 33)
        names = [fn.__name__ for fn, _, _ in _LAUNCHES[n_before:]]
        if "_prefix_prefill_kernel" in names:
            print("FAIL a verify batch launched the prefill kernel", flush=True)
            failures += 1
    for hq, b, n, prefix in prefill:
        cache = allocate_kv_cache(KVCacheSpec(BS, HKV, D, dtype, CacheLayout.LHBNC), 16, "cpu")
        q = torch.empty(b * n, hq, D, dtype=dtype)
        kv = [torch.empty(b * n, HKV, D, dtype=dtype) for _ in range(2)]
        tk.paged_attention(torch.empty_like(q), q, *kv, cache, torch.arange(b + 1, dtype=torch.int32) * n,
                           torch.full((b,), n + prefix, dtype=torch.int32),
                           torch.zeros(b, (n + prefix) // BS, dtype=torch.int32), D ** -0.5, one, one,
                           True, -1, None, None, 0.0, False, None, n, n + prefix, target=H200)
        failures += _expect("_prefix_prefill_kernel", BLOCK_M=128, BLOCK_N=128, num_warps=8, DENSE_TMA=True)
    return failures + compile_launches("bench shapes bf16", fingerprint, resources)


def _paged(tk, cache, qlens, clens, dtype, H, D, interleaved, **knobs) -> None:
    """One paged_attention launch set over a batch of ``qlens`` new / ``clens`` cached tokens."""
    HKV, BS = cache.shape[3] // D, cache.shape[2]
    one = torch.ones(1)
    n = sum(qlens)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
    seq_lens = torch.tensor([a + b for a, b in zip(qlens, clens)], dtype=torch.int32)
    width = -(-int(seq_lens.max()) // BS)
    table = torch.arange(len(qlens) * width, dtype=torch.int32).view(len(qlens), width) % cache.shape[0]
    q = torch.empty(n, H, D, dtype=dtype)
    kv = [torch.empty(n, HKV, D, dtype=dtype) for _ in range(2)]
    tk.paged_attention(torch.empty_like(q), q, *kv, cache, qsl, seq_lens, table, D ** -0.5, one, one, True, -1,
                       None, None, 0.0, interleaved, None, max(qlens), int(seq_lens.max()), target=H200,
                       **knobs)


def _head_512(tk, fingerprint: bool, full: bool) -> int:
    """Head size 512 (Gemma4's full-attention layers; 16 query / 2 KV heads here, GQA 8) with
    the default launch configs, checked for spills and shared memory (``SM90_MAX_SMEM``); the
    16-bit prefill and encoder launches may spill up to 128 bytes a thread, verify 32 (their
    tuned tiles do, measured faster than the tiles that do not).

    The default run: every config head size 512 has (16-bit, fp8 and fp32 caches) and every
    attention kernel (decode with its splits merged by the last split and by the reduce
    kernel, verify and its reduce kernel, prefill through TMA, the encoder kernel), and the
    fused writers of a 16-bit cache. ``full`` (``--only-d512``, about 80 launches, two
    minutes of ptxas here) adds interleaved V, one-split and 8-split decode, 8-token writer
    programs, the writers' other forms, verify over 4k keys (B=2 and B=64), 64 decode
    splits of every cache dtype and prefill through pointers, and compiles the launches of an
    fp32 model over a bf16 cache (whose tile choice the default run checks without compiling),
    for shared memory only: its fp32 dots over converted 16-bit tiles spill, as they do at
    head size 256."""
    T, H, HKV, D, BS = 8, 16, 2, 512, 16
    one = torch.ones(1)
    failures = 0
    variants = [(torch.bfloat16, torch.bfloat16, False), (torch.bfloat16, torch.float8_e4m3fn, False),
                (torch.float32, torch.float32, False), (torch.float32, torch.bfloat16, False)]
    if full:
        variants.insert(1, (torch.bfloat16, torch.bfloat16, True))
    for dtype, cache_dtype, interleaved in variants:
        label = f"d512 {dtype} cache {cache_dtype} interleaved_v={interleaved}"
        cache = allocate_kv_cache(KVCacheSpec(BS, HKV, D, cache_dtype, CacheLayout.LHBNC), 16, "cpu")
        slots, pos = torch.arange(T), torch.arange(T)
        q = torch.randn(T, H, D, dtype=dtype)
        k, v = torch.randn(2, T, HKV, D, dtype=dtype)
        w = torch.ones(D, dtype=dtype)
        if cache_dtype == dtype and dtype != torch.float32:  # the writers: 16-bit caches
            cos_sin = torch.randn(64, D)
            cos, sin = torch.randn(2, T, D, dtype=dtype)
            qkv = torch.randn(T, (H + 2 * HKV) * D, dtype=dtype)
            tk.reshape_and_cache(k, v, cache, slots, one, one, interleaved)
            tk.rope_and_cache(pos, q.clone(), k.clone(), v, cache, slots, cos_sin, True, one, one, interleaved)
            tk.qk_norm_rope_and_cache(qkv, w, w, 1e-6, pos, cos_sin, True, cache, slots, one, one, interleaved,
                                      H, HKV, D)
            tk.rope_cos_sin_and_cache(q.clone(), k.clone(), v, cos, sin, True, cache, slots, one, one, interleaved)
            tk.qk_norm_rope_cos_sin_and_cache(q.clone(), k.clone(), v, w, w, 1e-6, cos, sin, True, cache, slots,
                                              one, one, interleaved)
            # Gemma4's full layers: its RMSNorm (weight in fp32, rounded once) at head 512
            tk.qk_norm_rope_cos_sin_and_cache(q.clone(), k.clone(), v, w, w, 1e-6, cos, sin, True, cache, slots,
                                              one, one, interleaved, gemma4_norm=True)
            if full:
                tk.rotary_embedding(pos, q.clone(), k.clone(), D, cos_sin, True)
                tk.qk_norm_rope_and_cache(qkv, w, w, 1e-6, pos, cos_sin, True, cache, slots, one, one,
                                          interleaved, H, HKV, D, torch.empty(T, H, D, dtype=dtype),
                                          torch.empty(T, HKV, D, dtype=dtype), False)
                # Gemma4's partial rotary: a quarter of the head rotated
                tk.rope_cos_sin_and_cache(q.clone(), k.clone(), v, cos[:, :128], sin[:, :128], True, cache,
                                          slots, one, one, interleaved)
                # a long prefill's writers: 8 tokens a program (configs.writer_block_t)
                n = 600
                big = [torch.randn(n, h, D, dtype=dtype) for h in (H, HKV, HKV)]
                wide = torch.arange(n) % (cache.shape[0] * BS)
                tk.reshape_and_cache(big[1], big[2], cache, wide, one, one, interleaved)
                tk.rope_and_cache(torch.arange(n) % 64, big[0], big[1].clone(), big[2], cache, wide, cos_sin,
                                  True, one, one, interleaved)
                tk.qk_norm_rope_and_cache(torch.randn(n, (H + 2 * HKV) * D, dtype=dtype), w, w, 1e-6,
                                          torch.arange(n) % 64, cos_sin, True, cache, wide, one, one,
                                          interleaved, H, HKV, D)
                tk.rope_cos_sin_and_cache(big[0], big[1].clone(), big[2], *torch.randn(2, n, D, dtype=dtype),
                                          True, cache, wide, one, one, interleaved)
        elif cache_dtype != dtype:
            tk.reshape_and_cache(k, v, cache, slots, one, one, interleaved)
        # a mixed batch: decode and verify with their splits merged by the last split / the
        # verify reduce kernel, prefill through TMA; bf16: 64 decode splits of 16k keys merged
        # by the reduce kernel
        runs = [([5, 1, 70], [20, 33, 0], {})]
        if dtype == torch.bfloat16 and cache_dtype == dtype:
            runs.append(([1], [16384], {}))
        if full:  # decode of 8 splits (B=4), of one (B=256), verify over 4k keys (B=2, B=64),
            # 64 decode splits for every cache dtype, prefill through pointers
            runs += [([1] * 4, [4096] * 4, {}), ([1] * 256, [4096] * 256, {}), ([4, 3], [4096, 2000], {}),
                     ([4] * 64, [4096] * 64, {}), ([1], [16384], {}),
                     ([5, 1, 70], [20, 33, 0], {"prefill_cfg": replace(
                         prefill_config(D, H // HKV, BS, dtype), dense_tma=False)})]
        for qlens, clens, knobs in runs:
            _paged(tk, cache, qlens, clens, dtype, H, D, interleaved, **knobs)
        if cache_dtype == dtype:
            x = torch.empty(70, H, D, dtype=dtype)
            tk.encoder_attention(torch.empty_like(x), x, *torch.empty(2, 70, HKV, D, dtype=dtype),
                                 torch.tensor([0, 30, 70], dtype=torch.int32), D ** -0.5, False, -1, None, None,
                                 0.0, None)
        if dtype == torch.float32 and cache_dtype != dtype:
            # an fp32 query over a bf16 cache takes the fp32 cache's decode and verify tiles
            failures += _expect("_paged_decode_kernel", TILE_N=16, num_warps=8, K_ROWS=0)
            failures += _expect("_paged_verify_kernel", TILE_N=16, num_warps=16)
            if not full:  # the choice only: these launches spill (see the docstring)
                _LAUNCHES.clear()
                continue
        # The 16-bit prefill tile (32 rows x 16 keys over 4 warps) spills 8-80 bytes a thread,
        # the verify tile (16 keys over 4 warps) 8; both were measured faster than every
        # spill-free tile (configs.prefill_config, configs.verify_config): bounded.
        budget = {} if dtype == torch.float32 else {"_prefix_prefill_kernel": 128, "_encoder_attention_kernel": 128,
                                                    "_paged_verify_kernel": 32}
        failures += compile_launches(label, fingerprint, resources=True,
                                     spills_ok=dtype == torch.float32 and cache_dtype != dtype,
                                     stack_budget=budget)
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sass", metavar="OUT.json", help="write each launch's SASS fingerprint")
    ap.add_argument("--compare", metavar="BASE.json", help="compare the SASS with a --sass file")
    ap.add_argument("--only-d512", action="store_true",
                    help="only the head-size-512 launches, all of them (the default run compiles a subset)")
    ap.add_argument("--resources", action="store_true",
                    help="print each launch's registers / stack / shared memory (the head-size-512 "
                         "launches always check them)")
    args = ap.parse_args()
    fingerprint = bool(args.sass or args.compare)
    why = _probe()
    if why is not None:
        print(f"SKIP: triton {triton.__version__} cannot compile for sm_90 here: {why}")
        return 3
    JITFunction.run = _capture_run  # launches are recorded, never run
    from inductor_rocm_attn.kernels import triton as tk

    failures = _head_512(tk, fingerprint, full=args.only_d512)
    T, H, HKV, D, BS = 8, 16, 8, 128, 16
    for dtype in (torch.bfloat16, torch.float16) if not args.only_d512 else ():
        for interleaved in (False, True):
            label = f"{dtype} interleaved_v={interleaved}"
            cache = allocate_kv_cache(KVCacheSpec(BS, HKV, D, dtype, CacheLayout.LHBNC), 16, "cpu")
            one = torch.ones(1)
            slots = torch.arange(T)
            pos = torch.arange(T)
            cos_sin = torch.randn(64, D)
            q = torch.randn(T, H, D, dtype=dtype)
            k = torch.randn(T, HKV, D, dtype=dtype)
            v = torch.randn(T, HKV, D, dtype=dtype)
            tk.reshape_and_cache(k, v, cache, slots, one, one, interleaved)
            tk.rotary_embedding(pos, q.clone(), k.clone(), D, cos_sin, True)
            tk.rope_and_cache(pos, q.clone(), k.clone(), v, cache, slots, cos_sin, True, one, one, interleaved)
            qkv = torch.randn(T, (H + 2 * HKV) * D, dtype=dtype)
            tk.qk_norm_rope_and_cache(qkv, torch.ones(D, dtype=dtype), torch.ones(D, dtype=dtype), 1e-6, pos,
                                      cos_sin, True, cache, slots, one, one, interleaved, H, HKV, D)
            tk.qk_norm_rope_and_cache(qkv, torch.ones(D, dtype=dtype), torch.ones(D, dtype=dtype), 1e-6, pos,
                                      cos_sin, True, cache, slots, one, one, interleaved, H, HKV, D,
                                      torch.empty(T, H, D, dtype=dtype), torch.empty(T, HKV, D, dtype=dtype), False)
            # per-token cos/sin writers (transformers): with and without the norm, rotate-only
            cos, sin = torch.randn(2, T, D, dtype=dtype)
            w = torch.ones(D, dtype=dtype)
            tk.rope_cos_sin_and_cache(q.clone(), k.clone(), v, cos, sin, True, cache, slots, one, one, interleaved)
            tk.qk_norm_rope_cos_sin_and_cache(q.clone(), k.clone(), v, w, w, 1e-6, cos, sin, True, cache, slots,
                                              one, one, interleaved)
            tk.qk_norm_rope_cos_sin_and_cache(q.clone(), k.clone(), v, w, w, 1e-6, cos, sin, True, cache, slots,
                                              one, one, interleaved, gemma4_norm=True)
            tk.rope_cos_sin_and_cache(q.clone(), k.clone(), v, cos[:, :64], sin[:, :64], False, cache,
                                      slots[:0], one, one, interleaved)
            # paged attention: a decode batch and a mixed prefill + decode batch
            # (decode, long decode that splits the keys and reduces, mixed prefill + decode)
            runs = [(([1, 1, 1], [40, 7, 100]), None), (([1, 1], [2000, 1500]), None),
                    (([5, 1], [20, 33]), None)]
            runs += [(([1, 1, 1], [40, 7, 100]), DecodeConfig(*cfg)) for cfg in (
                (64, 4, 3, "streams3"), (32, 2, 3, "streams"), (16, 1, 3, "keys3"), (32, 2, 3, "keys"))]
            runs += [(([5, 1, 70], [20, 33, 0]), "dense_pointers")]  # the ROCm / odd-stride path
            # verify (2..8 query tokens): a verify batch, a long one that splits and reduces, and
            # a mixed decode + verify + prefill batch; then the tile-16 three-loop config
            runs += [(([4, 3, 2], [40, 7, 100]), None), (([4, 8], [2000, 1500]), None),
                     (([1, 5, 12], [20, 33, 0]), None),
                     (([4, 2], [2000, 1500]), ("verify", DecodeConfig(16, 1, 3, "rows3")))]
            for (qlens, clens), cfg in runs:
                vcfg = None
                if isinstance(cfg, tuple):
                    vcfg, cfg = cfg[1], None
                pcfg = None
                if cfg == "dense_pointers":
                    cfg, pcfg = None, replace(prefill_config(D, H // HKV, BS, dtype), dense_tma=False)
                n = sum(qlens)
                qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
                seq_lens = torch.tensor([a + b for a, b in zip(qlens, clens)], dtype=torch.int32)
                width = -(-int(seq_lens.max()) // BS)
                table = torch.arange(len(qlens) * width, dtype=torch.int32).view(len(qlens), width) % 16
                out = torch.empty(n, H, D, dtype=dtype)
                tk.paged_attention(out, torch.randn(n, H, D, dtype=dtype), torch.randn(n, HKV, D, dtype=dtype),
                                   torch.randn(n, HKV, D, dtype=dtype), cache, qsl, seq_lens, table, D ** -0.5,
                                   one, one, True, -1, None, None, 0.0, interleaved, None,
                                   max(qlens), int(seq_lens.max()), decode_cfg=cfg, prefill_cfg=pcfg,
                                   target=H200, verify_cfg=vcfg)
                if max(qlens) > 8:  # TMA for the new tokens' K/V unless the config turns it off
                    failures += _expect("_prefix_prefill_kernel", DENSE_TMA=pcfg is None)
                if max(qlens) > 1:  # 2..8 query tokens: the verify kernel
                    failures += _expect("_paged_verify_kernel", Q_MAX=min(8, 1 << (max(qlens) - 1).bit_length()))
            failures += compile_launches(label, fingerprint, args.resources)
    if not args.only_d512:
        failures += _bench_shapes(tk, fingerprint, args.resources)
    if failures:
        return 1
    if args.sass:
        with open(args.sass, "w") as f:
            json.dump(_SASS, f, indent=1, sort_keys=True)
        print(f"wrote {len(_SASS)} SASS fingerprints to {args.sass}")
    if args.compare:
        return _compare(args.compare)
    return 0


if __name__ == "__main__":
    sys.exit(main())
