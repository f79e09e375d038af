"""Native (csrc) decode and cache writer vs our Triton kernels vs SDPA, in one run.

Decode: bf16, 32 query heads / 8 KV heads, head 128, block 16, blocks placed at random;
B x L over {1, 16, 64, 128} x {1024, 4096, 16384}. Native and Triton read the paged cache,
SDPA the same tokens as contiguous K/V ``[B, 8, L, 128]`` (its best case). Each output is
checked against SDPA first (rel err < 1e-2), then timed as CUDA-graph replays
(``triton.testing.do_bench``, median, L2 flushed before each replay; ``--warm-l2``: 32 calls
back to back in one graph, no flush). Bandwidth counts K+V
read once plus q and out. ``--sweep`` also times the native kernel's launch configurations
(tensor cores or not x warps x stages x KV splits) at L = 4096 for B = 1, 16, 64; the main
table has the CUDA-core kernel (the one HIP runs) beside the default tensor-core one.

Writer: ``reshape_and_cache`` of K/V ``[T, 8, 128]`` bf16 at T = 1, 256 (random slots, a
decode batch) and 16384 (consecutive slots, a prefill), native vs Triton, outputs compared
bit for bit first.

    python benchmarks/bench_native.py [--batch ...] [--ctx ...] [--sweep] [--only decode|writer] [--out DIR]
    python benchmarks/bench_native.py --variants default w4s3 w4s3_wave w1s3_wave ... \
        --batch 1 16 64 --ctx 4096

``--writer-variants [names]`` (``native.WRITER_VARIANTS``; none or ``all``: every one) times
only the writer kernels, the launcher's choice ("auto") and Triton at T = 1, 16, 64, 256
(random slots), 4096, 16384 (consecutive slots), each cache compared bit for bit with Triton's
first (``writer_variants`` rows in the JSON):

    python benchmarks/bench_native.py --writer-variants

``--variants`` (names of ``native.DECODE_VARIANTS``, or ``all``) times only those launch
variants of the native decode, each checked against SDPA first, beside Triton and SDPA (no
main table, no writer): one device call A/Bs the default against the candidates. The
main table's native column is the default launch (``native.plan_decode``: its warps, stages
and splits are in the row).

Prints tables; writes benchmarks/results/native_<date>.json (command, machine, versions).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import common  # noqa: E402
from inductor_rocm_attn.kernels import native  # noqa: E402
from inductor_rocm_attn.kernels.triton import paged_attention as triton_paged_attention  # noqa: E402
from inductor_rocm_attn.kernels.triton import reshape_and_cache as triton_reshape_and_cache  # noqa: E402
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, dense_kv  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16


# --warm-l2: time calls back to back in one graph instead (inputs and kernel code stay in L2,
# as between the layers of a decode step), so a cold-start cost does not hide the kernel's own.
WARM_L2 = False
_WARM_CALLS = 32  # calls in one graph: one replay's launch cost spread over them


def graph_time_us(fn) -> float:
    """Median time of one call of ``fn`` from a CUDA graph: one call a replay, L2 flushed
    before each (the default), or, with ``WARM_L2``, ``_WARM_CALLS`` back-to-back calls."""
    if WARM_L2:
        return common.graph_time_us(fn, calls=_WARM_CALLS, flush_l2=False, replays=20)
    return common.graph_time_us(fn)


class DecodeCase:
    def __init__(self, b: int, L: int, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        nblk = b * L // BS
        spec = KVCacheSpec(BS, HKV, D, DTYPE, CacheLayout.LHBNC)
        self.kv_cache = allocate_kv_cache(spec, nblk + 8, "cuda")
        self.kv_cache.copy_(torch.randn(self.kv_cache.shape, generator=g, device="cuda", dtype=DTYPE))
        perm = torch.randperm(nblk + 8, generator=g, device="cuda")[:nblk]
        self.block_table = perm.view(b, L // BS).to(torch.int32).contiguous()
        self.seq_lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        self.query = torch.randn(b, HQ, D, generator=g, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.query)
        self.scale = D ** -0.5
        self.one = torch.ones(1, device="cuda")
        self.b, self.L = b, L

    def args(self):
        return (self.out, self.query, None, None, self.kv_cache, self.qsl, self.seq_lens, self.block_table,
                self.scale, self.one, self.one, True, -1, None, None, 0.0, False, None, 1, self.L)

    def native(self, **kw):
        native.paged_attention(*self.args(), **kw)

    def triton(self):
        triton_paged_attention(*self.args())

    def dense(self):
        kd, vd = dense_kv(self.kv_cache, HKV, False)  # [nb, BS, HKV, D]
        bt = self.block_table.long()
        k = kd[bt].reshape(self.b, self.L, HKV, D).transpose(1, 2).contiguous()
        v = vd[bt].reshape(self.b, self.L, HKV, D).transpose(1, 2).contiguous()
        return k, v


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def launch_plan(b: int, L: int, **kw) -> native.DecodeLaunch:
    """What native.paged_attention launches for this case with these keyword arguments."""
    sms, warp, smem, _ = native._device_limits(0)
    plan_kw = {k: v for k, v in kw.items() if k in ("num_warps", "stages", "num_splits", "split_rule")}
    return native.plan_decode(b, HKV, HQ // HKV, L, D, 2, num_sms=sms, warp_size=warp, max_smem=smem,
                              sm_smem=native._sm_smem(0), **plan_kw)


def case_and_reference(b, L):
    """A fresh decode case, its K/V made contiguous, the query as SDPA takes it, and SDPA's
    output on them (what every timed launch is checked against first)."""
    c = DecodeCase(b, L, seed=b * 7 + L)
    k, v = c.dense()
    q4 = c.query.view(b, HQ, 1, D)
    ref = F.scaled_dot_product_attention(q4, k, v, scale=c.scale, enable_gqa=True).view(b, HQ, D)
    return c, k, v, q4, ref


def bench_decode(batches, ctxs, sweep):
    rows, sweeps = [], []
    print(f"{'B':>4} {'L':>6} {'splits':>6} | {'native us':>9} {'TB/s':>5} | {'cuda-core':>9} {'TB/s':>5} | "
          f"{'triton us':>9} {'TB/s':>5} | {'sdpa us':>8} {'TB/s':>5} | native/sdpa native/triton")
    for b in batches:
        for L in ctxs:
            c, k, v, q4, ref = case_and_reference(b, L)
            errs = {}
            cuda_core = lambda: c.native(tensor_cores=False)  # noqa: E731
            for name, fn in (("native", c.native), ("native_cuda_core", cuda_core), ("triton", c.triton)):
                c.out.fill_(float("nan"))
                fn()
                errs[name] = rel_err(c.out, ref)
                assert errs[name] < 1e-2, f"B={b} L={L}: {name} vs SDPA rel err {errs[name]:.3e}"
            t_nat = graph_time_us(c.native)
            t_cc = graph_time_us(cuda_core)
            t_tri = graph_time_us(c.triton)
            t_sdpa = graph_time_us(lambda: F.scaled_dot_product_attention(q4, k, v, scale=c.scale, enable_gqa=True))
            nbytes = 2 * b * L * HKV * D * 2 + 2 * b * HQ * D * 2
            plan = launch_plan(b, L)
            splits = plan.num_splits
            row = dict(B=b, L=L, native_splits=splits, native_warps=plan.num_warps, native_stages=plan.stages,
                       native_split_rule=plan.split_rule, native_us=t_nat, native_cuda_core_us=t_cc,
                       native_cuda_core_tbs=nbytes / t_cc / 1e6, triton_us=t_tri, sdpa_us=t_sdpa,
                       native_tbs=nbytes / t_nat / 1e6, triton_tbs=nbytes / t_tri / 1e6,
                       sdpa_tbs=nbytes / t_sdpa / 1e6, native_vs_sdpa=t_nat / t_sdpa,
                       native_vs_triton=t_nat / t_tri, rel_err_vs_sdpa=errs)
            rows.append(row)
            print(f"{b:4d} {L:6d} {splits:6d} | {t_nat:9.1f} {row['native_tbs']:5.2f} | {t_cc:9.1f} "
                  f"{row['native_cuda_core_tbs']:5.2f} | {t_tri:9.1f} "
                  f"{row['triton_tbs']:5.2f} | {t_sdpa:8.1f} {row['sdpa_tbs']:5.2f} | "
                  f"x{row['native_vs_sdpa']:.2f}       x{row['native_vs_triton']:.2f}", flush=True)
            if sweep and L == 4096 and b in (1, 16, 64):
                configs = [(tc, w, st) for tc in (True, False)
                           for w, st in ((4, 3), (4, 2), (4, 4), (2, 3), (2, 4), (8, 2), (1, 4))]
                for tc, warps, stages in configs:
                    for sp in sorted({max(1, splits // 2), splits, min(native.MAX_SPLITS, 2 * splits)}):
                        kw = dict(tensor_cores=tc, num_warps=warps, stages=stages, num_splits=sp)
                        c.out.fill_(float("nan"))
                        c.native(**kw)
                        err = rel_err(c.out, ref)
                        t = graph_time_us(lambda: c.native(**kw))
                        sweeps.append(dict(B=b, L=L, **kw, us=t, tbs=nbytes / t / 1e6, rel_err_vs_sdpa=err))
                        print(f"    sweep {'mma ' if tc else 'cuda'} warps={warps} stages={stages} splits={sp:2d}: {t:8.1f} us "
                              f"{nbytes / t / 1e6:5.2f} TB/s  err {err:.1e}", flush=True)
            del c, k, v
            torch.cuda.empty_cache()
    return rows, sweeps


def bench_variants(batches, ctxs, names):
    """Each named native launch variant (native.DECODE_VARIANTS) per B x L, checked against SDPA
    before it is timed, beside Triton and SDPA."""
    rows = []
    print(f"{'B':>4} {'L':>6} {'variant':>18} {'warps':>5} {'st':>2} {'splits':>6} | {'us':>8} {'TB/s':>5} | "
          f"{'/triton':>7} {'/sdpa':>6} | err")
    for b in batches:
        for L in ctxs:
            c, k, v, q4, ref = case_and_reference(b, L)
            nbytes = 2 * b * L * HKV * D * 2 + 2 * b * HQ * D * 2
            c.out.fill_(float("nan"))
            c.triton()
            assert rel_err(c.out, ref) < 1e-2, f"B={b} L={L}: triton vs SDPA"
            t_tri = graph_time_us(c.triton)
            t_sdpa = graph_time_us(lambda: F.scaled_dot_product_attention(q4, k, v, scale=c.scale, enable_gqa=True))
            print(f"{b:4d} {L:6d} {'triton':>18} {'':>5} {'':>2} {'':>6} | {t_tri:8.1f} {nbytes / t_tri / 1e6:5.2f} | "
                  f"{'':>7} {'':>6} |", flush=True)
            print(f"{b:4d} {L:6d} {'sdpa':>18} {'':>5} {'':>2} {'':>6} | {t_sdpa:8.1f} {nbytes / t_sdpa / 1e6:5.2f} | "
                  f"{'':>7} {'':>6} |", flush=True)
            for name in names:
                kw = dict(native.DECODE_VARIANTS[name])
                warps, stages, splits, rule = launch_plan(b, L, **kw)
                row = dict(B=b, L=L, variant=name, kwargs=kw, num_warps=warps, stages=stages, splits=splits,
                           split_rule=rule, triton_us=t_tri, sdpa_us=t_sdpa)
                try:
                    c.out.fill_(float("nan"))
                    c.native(**kw)
                    err = rel_err(c.out, ref)
                    row["rel_err_vs_sdpa"] = err
                    if not err < 1e-2:
                        raise AssertionError(f"rel err vs SDPA {err:.3e}")
                    t = graph_time_us(lambda: c.native(**kw))
                except Exception as e:  # a failing candidate must not hide the others
                    row["error"] = f"{type(e).__name__}: {e}"
                    rows.append(row)
                    print(f"{b:4d} {L:6d} {name:>18} {warps:5d} {stages:2d} {splits:6d} | FAILED: {row['error']}",
                          flush=True)
                    continue
                row.update(us=t, tbs=nbytes / t / 1e6, vs_triton=t / t_tri, vs_sdpa=t / t_sdpa)
                rows.append(row)
                print(f"{b:4d} {L:6d} {name:>18} {warps:5d} {stages:2d} {splits:6d} | {t:8.1f} {row['tbs']:5.2f} | "
                      f"x{row['vs_triton']:6.2f} x{row['vs_sdpa']:5.2f} | {err:.1e}", flush=True)
            del c, k, v
            torch.cuda.empty_cache()
    return rows


class WriterCase:
    """K/V ``[T, 8, 128]`` bf16, slots of a decode batch (random, T < 4096) or a prefill
    (consecutive, T >= 4096), and one zeroed cache per writer."""

    def __init__(self, t: int, num_caches: int):
        g = torch.Generator(device="cuda").manual_seed(t)
        nblk = t // BS + 64
        spec = KVCacheSpec(BS, HKV, D, DTYPE, CacheLayout.LHBNC)
        self.caches = [allocate_kv_cache(spec, nblk, "cuda").zero_() for _ in range(num_caches)]
        self.key = torch.randn(t, HKV, D, generator=g, device="cuda", dtype=DTYPE)
        self.value = torch.randn(t, HKV, D, generator=g, device="cuda", dtype=DTYPE)
        if t >= 4096:  # a prefill: consecutive slots
            self.slots = torch.arange(t, device="cuda") + BS
        else:  # a decode batch: one token somewhere in each sequence's block
            self.slots = torch.randperm(nblk * BS, generator=g, device="cuda")[:t]
        self.one = torch.ones(1, device="cuda")
        self.nbytes = 2 * 2 * t * HKV * D * 2  # K and V, read and written

    def native(self, i: int, **kw):
        return lambda: native.reshape_and_cache(self.key, self.value, self.caches[i], self.slots, self.one,
                                                self.one, False, **kw)

    def triton(self, i: int):
        return lambda: triton_reshape_and_cache(self.key, self.value, self.caches[i], self.slots, self.one,
                                                self.one, False)

    def same(self, i: int, j: int) -> bool:
        torch.cuda.synchronize()
        return torch.equal(self.caches[i].view(torch.uint8), self.caches[j].view(torch.uint8))


def bench_writer(tokens):
    rows = []
    print(f"{'T':>6} | {'native us':>9} {'TB/s':>5} | {'triton us':>9} {'TB/s':>5} | native/triton")
    for t in tokens:
        c = WriterCase(t, 2)
        nat, tri = c.native(0), c.triton(1)
        nat()
        tri()
        assert c.same(0, 1), f"T={t}: writers differ"
        t_nat = graph_time_us(nat)
        t_tri = graph_time_us(tri)
        nbytes = c.nbytes
        row = dict(T=t, native_us=t_nat, triton_us=t_tri, native_tbs=nbytes / t_nat / 1e6,
                   triton_tbs=nbytes / t_tri / 1e6, native_vs_triton=t_nat / t_tri)
        rows.append(row)
        print(f"{t:6d} | {t_nat:9.2f} {row['native_tbs']:5.2f} | {t_tri:9.2f} {row['triton_tbs']:5.2f} | "
              f"x{row['native_vs_triton']:.2f}", flush=True)
    return rows


def bench_writer_variants(tokens, names):
    """Each native writer kernel (native.WRITER_VARIANTS; "auto" = the launcher's rule) per T
    beside Triton, its cache compared bit for bit with Triton's before it is timed."""
    rows = []
    print(f"{'T':>6} {'variant':>8} | {'us':>8} {'TB/s':>5} | {'/triton':>7}")
    for t in tokens:
        c = WriterCase(t, 2)
        tri = c.triton(1)
        tri()
        t_tri = graph_time_us(tri)
        print(f"{t:6d} {'triton':>8} | {t_tri:8.2f} {c.nbytes / t_tri / 1e6:5.2f} |", flush=True)
        for name in ["auto", *names]:
            row = dict(T=t, variant=name, triton_us=t_tri)
            try:
                fn = c.native(0, variant=None if name == "auto" else name)
                c.caches[0].zero_()
                fn()
                if not c.same(0, 1):
                    raise AssertionError("cache differs from Triton's")
                us = graph_time_us(fn)
            except Exception as e:  # a failing candidate must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                print(f"{t:6d} {name:>8} | FAILED: {row['error']}", flush=True)
                continue
            row.update(us=us, tbs=c.nbytes / us / 1e6, vs_triton=us / t_tri)
            rows.append(row)
            print(f"{t:6d} {name:>8} | {us:8.2f} {row['tbs']:5.2f} | x{row['vs_triton']:6.2f}", flush=True)
        del c
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="writer T values (default 1 256 16384; with --writer-variants 1 16 64 256 4096 16384)")
    ap.add_argument("--sweep", action="store_true", help="native launch configurations at L=4096")
    ap.add_argument("--only", choices=("decode", "writer"), default=None, help="run one of the two tables")
    ap.add_argument("--variants", nargs="+", default=None,
                    help=f"only time these native decode variants ('all' = {', '.join(native.DECODE_VARIANTS)})")
    ap.add_argument("--writer-variants", nargs="*", default=None,
                    help=f"only time these native writer kernels beside Triton (none or 'all' = "
                         f"{', '.join(native.WRITER_VARIANTS)}; the launcher's choice is always timed as 'auto')")
    ap.add_argument("--warm-l2", action="store_true",
                    help=f"time {_WARM_CALLS} back-to-back calls in one graph (no L2 flush) instead of one "
                         "call after an L2 flush")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    global WARM_L2
    WARM_L2 = args.warm_l2
    if args.writer_variants is not None:
        if args.writer_variants in ([], ["all"]):
            args.writer_variants = list(native.WRITER_VARIANTS)
        for name in args.writer_variants:
            if name not in native.WRITER_VARIANTS:
                ap.error(f"unknown writer variant {name!r}; known: {', '.join(native.WRITER_VARIANTS)}")
        if args.variants:
            ap.error("--variants and --writer-variants are separate runs")
    if args.tokens is None:
        args.tokens = [1, 16, 64, 256, 4096, 16384] if args.writer_variants is not None else [1, 256, 16384]
    if args.variants == ["all"]:
        args.variants = list(native.DECODE_VARIANTS)
    for name in args.variants or ():
        if name not in native.DECODE_VARIANTS:
            ap.error(f"unknown variant {name!r}; known: {', '.join(native.DECODE_VARIANTS)}")
    t0 = datetime.datetime.now()
    native._module()  # build (or load) before timing anything
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}; build {native._build_name()}")
    variants, writer_variants = [], []
    if args.variants:
        decode, sweeps, writer = [], [], []
        variants = bench_variants(args.batch, args.ctx, args.variants)
    elif args.writer_variants is not None:
        decode, sweeps, writer = [], [], []
        writer_variants = bench_writer_variants(args.tokens, args.writer_variants)
    else:
        decode, sweeps = bench_decode(args.batch, args.ctx, args.sweep) if args.only != "writer" else ([], [])
        writer = bench_writer(args.tokens) if args.only != "decode" else []
    result = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv), date=t0.isoformat(timespec="seconds"),
        machine=dict(gpu=props.name, sms=props.multi_processor_count, host=platform.node(),
                     python=platform.python_version()),
        versions=dict(torch=torch.__version__, cuda=torch.version.cuda, hip=torch.version.hip,
                      triton=triton.__version__),
        shape=dict(q_heads=HQ, kv_heads=HKV, head_size=D, block_size=BS, dtype=str(DTYPE)),
        timing=(f"warm L2: one call of {_WARM_CALLS} back to back in a CUDA graph, median of 20 replays"
                if WARM_L2 else "one call a CUDA-graph replay, L2 flushed before each (do_bench median)"),
        decode=decode, native_sweep=sweeps, writer=writer, native_variants=variants,
        writer_variants=writer_variants)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"native_{t0.strftime('%Y%m%d_%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
