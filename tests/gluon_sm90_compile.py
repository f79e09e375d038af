"""Compile the Gluon prefix prefill (``kernels/gluon/prefix_prefill.py``) for sm_90 without a GPU.

One line per launch variant: registers, stack (spills), shared memory, the partitions'
setmaxnreg budgets, and the 16-byte / smaller cp.async counts of the gather. A variant
FAILs when it does not compile, spills, needs more shared memory than sm_90 has, or has a
gather that lost its 16-byte packets. Exit 1 on a FAIL, 3 when this machine cannot compile
Gluon for sm_90 at all (no ptxas...). Run without ``TRITON_INTERPRET``; used by
tests/test_triton_sm90_compile.py. ``--variants [NAME ...] [--bench-shape-only]``: the named
context-gather variants (``prefix_prefill.SWEEP_VARIANTS``, default all) instead, with their
counts of load-partition thread barriers.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import re  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
# the Triton kernels' compile check: cuobjdump's resource report and sm_90's shared memory
from triton_sm90_compile import SM90_MAX_SMEM, _resources  # noqa: E402

# (label, compile_sm90 keywords): the default config's launch (the bench's shape), then the
# other V interior, dtype, block size, GQA and head size the GPU tests run
VARIANTS = [
    ("bf16 d128 bs16 gqa4 standard V", dict()),
    ("fp16 d128 bs32 gqa8 interleaved V", dict(dtype=torch.float16, block_size=32, gqa=8, num_heads=8,
                                               interleaved_v=True)),
    ("bf16 d64 bs16 gqa1 interleaved V", dict(head_size=64, gqa=1, num_heads=8, interleaved_v=True)),
]


def compile_sm90(dtype=torch.bfloat16, head_size: int = 128, num_heads: int = 32, gqa: int = 4,
                 block_size: int = 16, interleaved_v: bool = False, short_query_max: int = 1, cfg=None) -> dict:
    """Compile the kernel for sm_90 under ``cfg`` (default: ``DEFAULT_CONFIG``; frontend,
    optimizer, ptxas; no driver): registers, stack (spills), shared memory, the setmaxnreg
    budgets, the number of 16-byte cp.async in the PTX (a gather that lost its vectorization
    would show none) and of the load partition's thread barriers (``bar.sync 0``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from inductor_rocm_attn.kernels.gluon import prefix_prefill as pp

    fn, cfg = pp._gluon_prefix_prefill_kernel, cfg or pp.DEFAULT_CONFIG
    ty = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def desc(rows):
        return f"tensordesc<{ty}[{rows},{head_size}],{pp._smem_layout((rows, head_size), dtype)!r}>"

    sig = dict(q_desc=desc(pp.BLOCK_M), k_desc=desc(cfg.block_n), v_desc=desc(cfg.block_n), v_ptr=f"*{ty}",
               out_ptr=f"*{ty}", kc_ptr=f"*{ty}", vc_ptr=f"*{ty}", block_table_ptr="*i32", seq_lens_ptr="*i32",
               query_start_loc_ptr="*i32", qk_scale="fp32", num_seqs="i32")
    for name in ("stride_vt", "stride_ot", "stride_oh", "stride_kcb", "stride_kch", "stride_vcb", "stride_vch",
                 "stride_bt"):
        sig[name] = "i32"
    if cfg.v_load == "tma":  # the V cache's TMA descriptor (prefix_prefill._v_cache_descriptor)
        v_box = gl.NVMMASharedLayout(swizzle_byte_width=2 * block_size, element_bitwidth=16, rank=2)
        sig["vc_ptr"] = f"tensordesc<{ty}[{head_size},{block_size}],{v_box!r}>"
    consts = pp._constexprs(num_heads, gqa, head_size, block_size, interleaved_v, short_query_max, cfg)
    sig.update({k: "constexpr" for k in consts})
    sig = {name: sig[name] for name in fn.arg_names}
    aligned = ("v_ptr", "stride_vt", "out_ptr", "kc_ptr", "vc_ptr", "block_table_ptr", "seq_lens_ptr",
               "query_start_loc_ptr", "stride_ot", "stride_oh", "stride_kcb", "stride_kch", "stride_vcb",
               "stride_vch", "stride_bt")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=pp._options(cfg))
    ptx = kernel.asm["ptx"]
    return dict(**_resources(kernel, fn.__name__),
                setmaxnreg=setmaxnreg_budgets(ptx),
                cp_async_16=len(re.findall(r"cp\.async\.cg\.shared\.global(?:\.L2::\w+)?\s*\[[^\]]*\],\s*\[[^\]]*\],"
                                           r"\s*0x10", ptx)),
                cp_async_small=len(re.findall(r"cp\.async\.ca\.shared\.global", ptx)),
                load_bar_sync=len(re.findall(r"\bbar\.sync\s+0\s*,", ptx)))


def setmaxnreg_budgets(ptx: str) -> list[str]:
    """The register budgets the partitions' setmaxnreg instructions set, sorted."""
    return sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))


def specialize_launch(module, call) -> tuple:
    """Run ``call`` (which launches ``module._gluon_prefix_prefill_kernel`` once, on CPU
    tensors: the launch is intercepted, nothing runs) and compile that launch for sm_90 as the
    GPU would: its arguments through Triton's own binder (the types, ``tt.divisibility`` and
    constexpr-1 specialization a real launch keys its cache on), then frontend, optimizer and
    ptxas. Returns the compiled kernel, (signature, constexprs, attributes, options) and the grid."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    fn = module._gluon_prefix_prefill_kernel
    seen = []
    fn.run = lambda *args, grid=None, warmup=False, **kw: seen.append((args, kw, grid))
    try:
        call()
    finally:
        del fn.run
    (args, kw, grid), = seen
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    # what JITFunction.run does before it compiles, minus the driver
    kw = dict(kw, debug=kw.get("debug", fn.debug) or knobs.runtime.debug,
              instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kw)
    options, sig, consts, attrs = fn._pack_args(backend, kw, bound, specialization, options)
    kernel = triton_compile(GluonASTSource(fn, sig, consts, attrs), target=target, options=options.__dict__)
    return kernel, (sig, consts, attrs, options), grid


def compile_launch() -> dict:
    """``launch()`` itself on CPU tensors, compiled for sm_90 as a real launch would pass its
    arguments (``specialize_launch``): the host side and the kernel signature agree
    (``compile_sm90`` builds its own signature)."""
    from inductor_rocm_attn.kernels.gluon import prefix_prefill as pp
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, k_view, v_view

    def call():
        t, hq, hkv, d, bs = 300, 8, 2, 128, 16
        q = torch.randn(t, hq, d, dtype=torch.bfloat16)
        k, v = (torch.randn(t, hkv, d, dtype=torch.bfloat16) for _ in range(2))
        cache = allocate_kv_cache(KVCacheSpec(bs, hkv, d, torch.bfloat16, CacheLayout.LBHNC), 40, "cpu")
        pp.launch(torch.empty_like(q), q, k, v, k_view(cache, hkv), v_view(cache, hkv, True),
                  torch.zeros(2, 20, dtype=torch.int32), torch.tensor([200, 250], dtype=torch.int32),
                  torch.tensor([0, 100, 300], dtype=torch.int32), d ** -0.5, True, 8)

    kernel, _, grid = specialize_launch(pp, call)
    return dict(grid=grid, shared=kernel.metadata.shared)


def variant_cases(names=(), bench_shape_only: bool = False):
    """(label, compile_sm90 keywords) of the named context-gather variants (``names``, default
    all of ``prefix_prefill.SWEEP_VARIANTS``) at the shapes of ``VARIANTS`` and at block size 32
    (``bench_shape_only``: the first, the benchmark's), a variant that does not cover a shape
    (``_check_variant``) left out."""
    from inductor_rocm_attn.kernels.gluon import prefix_prefill as pp

    shapes = VARIANTS + [("bf16 d128 bs32 gqa4 standard V", dict(block_size=32))]
    shapes = shapes[:1] if bench_shape_only else shapes
    out = []
    for name in names or pp.SWEEP_VARIANTS:
        cfg = pp.SWEEP_VARIANTS[name]
        for label, kw in shapes:
            try:
                pp._check_variant(cfg, kw.get("head_size", 128), kw.get("block_size", 16),
                                  kw.get("interleaved_v", False))
            except ValueError:
                continue
            out.append((f"{name}: {label}", dict(kw, cfg=cfg)))
    return out


def main() -> int:
    argv = sys.argv[1:]
    variants = "--variants" in argv
    names = [a for a in argv if not a.startswith("--")]
    try:
        from inductor_rocm_attn.kernels.gluon import prefix_prefill  # noqa: F401
    except Exception as e:  # noqa: BLE001 - no Gluon here at all
        print(f"SKIP: the Gluon prefill does not import: {type(e).__name__}: {e}")
        return 3
    bad = 0
    for label, kw in (variant_cases(names, "--bench-shape-only" in argv) if variants else VARIANTS):
        try:
            r = compile_sm90(**kw)
        except Exception as e:  # noqa: BLE001 - one line per variant
            text = str(e)
            if "ptxas" in text and ("not found" in text or "No such file" in text):
                print(f"SKIP: cannot compile for sm_90 here: {text.strip().splitlines()[-1][:300]}")
                return 3
            bad += 1
            print(f"{label}: FAIL {type(e).__name__}: {text.strip().splitlines()[-1][:300] if text.strip() else ''}")
            continue
        problems = [p for p, bad_ in (("spills", r["stack"] > 0), ("shared memory over 227 KB", r["smem"] > SM90_MAX_SMEM),
                                      ("gather not in 16-byte cp.async", r["cp_async_16"] == 0 or r["cp_async_small"]))
                    if bad_]
        bad += bool(problems)
        print(f"{label}: regs {r['regs']} stack {r['stack']} B smem {r['smem']} B setmaxnreg "
              f"{','.join(r['setmaxnreg'])} cp.async 16 B x{r['cp_async_16']}"
              + (f" bar.sync(load) x{r['load_bar_sync']}" if variants else "")
              + (f"  FAIL ({', '.join(problems)})" if problems else ""), flush=True)
    if variants:
        return 1 if bad else 0
    try:
        r = compile_launch()
        print(f"launch() of a varlen batch (LBHNC, interleaved V): grid {r['grid']}, compiles for sm_90", flush=True)
    except Exception as e:  # noqa: BLE001
        bad += 1
        text = str(e).strip()
        print(f"launch() arguments: FAIL {type(e).__name__}: {text.splitlines()[-1][:300] if text else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
