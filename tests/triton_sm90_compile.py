"""Compile our Triton kernels for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter (what CPU CI runs) executes kernels as Python and skips the checks of
the real frontend, e.g. that a name bound in both branches of a runtime ``if`` keeps one
type; such a kernel passes CI and fails on the GPU. This script calls each public wrapper
with CPU tensors, intercepts every kernel launch (nothing runs) and compiles it with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``: the frontend, the
optimizer and ptxas, no driver. Run without ``TRITON_INTERPRET``; prints one line per
launch and exits non-zero on the first failure. Used by tests/test_triton_sm90_compile.py.
"""

from __future__ import annotations

import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import inductor_rocm_attn  # noqa: E402,F401
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache  # noqa: E402

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
       torch.int32: "i32", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_LAUNCHES: list = []


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


def compile_launches(label: str) -> int:
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
            triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
            print(f"ok   {label}: {fn.__name__}", flush=True)
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


def main() -> int:
    why = _probe()
    if why is not None:
        print(f"SKIP: triton {triton.__version__} cannot compile for sm_90 here: {why}")
        return 3
    JITFunction.run = _capture_run
    from inductor_rocm_attn.kernels import triton as tk

    pa = sys.modules["inductor_rocm_attn.kernels.triton.paged_attention"]
    pa._num_sms = lambda device_index=0: 132  # H200
    pa._tma_capable = lambda device_index=0: True

    failures = 0
    T, H, HKV, D, BS = 8, 16, 8, 128, 16
    for dtype in (torch.bfloat16, torch.float16):
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
            # paged attention: a decode batch and a mixed prefill + decode batch
            # (decode, long decode that splits the keys and reduces, mixed prefill + decode)
            runs = [(([1, 1, 1], [40, 7, 100]), None), (([1, 1], [2000, 1500]), None),
                    (([5, 1], [20, 33]), None)]
            runs += [(([1, 1, 1], [40, 7, 100]), cfg) for cfg in ((64, 4, 3, "streams3"),
                                                                  (32, 2, 3, "streams"),
                                                                  (16, 1, 3, "keys3"),
                                                                  (32, 2, 3, "keys"))]
            runs += [(([5, 1, 70], [20, 33, 0]), "dense_pointers")]  # the ROCm / odd-stride path
            tma_default = pa.PREFILL_DENSE_TMA
            for (qlens, clens), cfg in runs:
                pa.PREFILL_DENSE_TMA = tma_default and cfg != "dense_pointers"
                cfg = None if cfg == "dense_pointers" else cfg
                n = sum(qlens)
                qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
                seq_lens = torch.tensor([a + b for a, b in zip(qlens, clens)], dtype=torch.int32)
                width = -(-int(seq_lens.max()) // BS)
                table = torch.arange(len(qlens) * width, dtype=torch.int32).view(len(qlens), width) % 16
                out = torch.empty(n, H, D, dtype=dtype)
                tk.paged_attention(out, torch.randn(n, H, D, dtype=dtype), torch.randn(n, HKV, D, dtype=dtype),
                                   torch.randn(n, HKV, D, dtype=dtype), cache, qsl, seq_lens, table, D ** -0.5,
                                   one, one, True, -1, None, None, 0.0, interleaved, None,
                                   max(qlens), int(seq_lens.max()), decode_cfg=cfg)
                pa.PREFILL_DENSE_TMA = tma_default
            failures += compile_launches(label)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
