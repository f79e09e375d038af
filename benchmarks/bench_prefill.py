"""Prefix-prefill benchmark: ``paged_attention``'s prefill kernels (query_len > 1) vs PyTorch SDPA.

B=4 sequences of 4096 new tokens with a cached prefix of 0 or 4096 tokens (paged, block 16,
random placement), 32 query heads / 8 KV heads (GQA 4), head 128, causal, bf16. Checks the
output against SDPA (bottom-right causal over prefix + new tokens, K/V expanded to 32 heads
and made contiguous), then times both as CUDA-graph replays (``common.graph_time_us``:
do_bench median, L2 flushed). FLOPs counted causally: 4 * B * H * D * (N * P + N * (N + 1) / 2) for N new tokens
and prefix P. SDPA's dense causal 4096 run (same FLOPs as the no-prefix case) is the anchor.

``--kernels triton gluon`` (the default): A/B of the prefill kernels in the same run on every
case: the Triton prefill (``prefill_kernel="triton"``, the ``triton`` columns) and the
warp-specialized Gluon prefill (``prefill_kernel="gluon"``, NVIDIA sm_90 only: what the
default ``auto`` runs there), each checked against SDPA before it is timed; a Gluon launch
that falls back to Triton (another GPU, head size 512...) is reported as unavailable, not
timed. ``--kernels triton``: the Triton rows only.

``--gluon-cfgs default tile load_warps=8,maxnreg=128,consumer_regs=232 ...``: the Gluon
prefill under each config (a name of ``prefix_prefill.SWEEP_VARIANTS`` or ``field=value,...``
changes of its default ``GluonPrefillConfig``) on every case, in the same run: output
NaN-poisoned, checked against SDPA, then timed (the ``gluon_cfgs`` rows of the JSON); a
config that fails to build, run or match is a row with its error, not a timing.

``--peers flashinfer``: FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (fa3, and fa2)
in the same run, over the same values in its own NHD pages (prefix and new tokens; ``peers.py``),
checked against SDPA; a "peer unavailable: <reason>" row where it cannot run.

    python benchmarks/bench_prefill.py [--prefix 0 4096] [--sweep] [--peers flashinfer]
    python benchmarks/bench_prefill.py --kernels triton gluon  # Gluon vs Triton prefill (Hopper)
    python benchmarks/bench_prefill.py --head-size 512 --kv-heads 4 --batch 1  # Gemma4 full layers
    python benchmarks/bench_prefill.py --kernels triton --gluon-cfgs all  # every Gluon variant (Hopper)

Writes benchmarks/results/prefill_<date>.json and .md (or --out DIR).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import warnings

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import graph_time_us, stamp, write_json  # noqa: E402
from peers import FlashInferPrefill, PeerUnavailable, flashinfer_version, nhd_pages, write_tokens  # noqa: E402
from inductor_rocm_attn.kernels.triton import paged_attention  # noqa: E402  (the function)
from inductor_rocm_attn.kernels.triton.configs import PrefillConfig, prefill_config  # noqa: E402
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, dense_kv  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
IV = False  # interleaved V interior (--interleaved-v: the layout the fused cache writers switch to)
DTYPE = torch.bfloat16
# A/B variants of the tuned config: fields of PrefillConfig replaced (lazy-rescale margins
# "margin" = context and dense margin, causal row blocks longest first, the new tokens' K/V
# through TMA descriptors, how the paged context's K tiles are read).
_BASE = dict(margin=0.0, longest_first=False, dense_tma=False)
VARIANTS = {
    "margin0_grid_order": _BASE,
    "margin8": {**_BASE, "margin": 8.0},
    "longest_first": {**_BASE, "longest_first": True},
    "margin8_longest_first": {**_BASE, "margin": 8.0, "longest_first": True},
    "dense_tma": {**_BASE, "dense_tma": True},
    "margin8_dense_tma": {**_BASE, "margin": 8.0, "dense_tma": True},
    "all": {"margin": 8.0, "longest_first": True, "dense_tma": True},
    "k_gather": {"k_rows": 0},  # the default margins
    "k_rows_single": {"k_rows": 1},  # packet rows only for one-run tiles (the default before)
    "k_rows_multi": {"k_rows": 2},  # the default
}
SWEEP = [(128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3),
         (128, 32, 8, 4), (64, 64, 4, 4)]


def graph_time_ms(fn) -> float:
    return graph_time_us(fn, warmup_calls=1, warmup_ms=50, rep_ms=300) / 1e3


def variant_config(name: str) -> PrefillConfig:
    """The tuned config of the bench's shape with variant ``name``'s fields replaced."""
    changes = dict(VARIANTS[name])
    margin = changes.pop("margin", None)
    if margin is not None:
        changes.update(context_margin=margin, dense_margin=margin)
    return dataclasses.replace(prefill_config(D, HQ // HKV, BS, DTYPE), **changes)


class PrefillCase:
    def __init__(self, b: int, n: int, prefix: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        L = n + prefix
        nblk = b * triton.cdiv(L, BS)
        spec = KVCacheSpec(BS, HKV, D, DTYPE, CacheLayout.LHBNC)
        self.kv_cache = allocate_kv_cache(spec, nblk + 8, "cuda")
        self.kv_cache.copy_(torch.randn(self.kv_cache.shape, generator=g, device="cuda", dtype=DTYPE))
        perm = torch.randperm(nblk + 8, generator=g, device="cuda")[:nblk]
        self.block_table = perm.view(b, -1).to(torch.int32).contiguous()
        self.seq_lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda") * n
        self.query = torch.randn(b * n, HQ, D, generator=g, device="cuda", dtype=DTYPE)
        self.key = torch.randn(b * n, HKV, D, generator=g, device="cuda", dtype=DTYPE)
        self.value = torch.randn(b * n, HKV, D, generator=g, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.query)
        self.scale = D ** -0.5
        self.one = torch.ones(1, device="cuda")
        self.b, self.n, self.prefix = b, n, prefix

    def run(self, **kw):
        paged_attention(self.out, self.query, self.key, self.value, self.kv_cache, self.qsl,
                        self.seq_lens, self.block_table, self.scale, self.one, self.one, True, -1,
                        None, None, 0.0, IV, None, max_query_len=self.n,
                        max_seq_len=self.n + self.prefix, **kw)

    def sdpa_inputs(self):
        """q ``[B, HQ, N, D]``, k/v ``[B, HQ, P+N, D]`` contiguous (prefix from the cache)."""
        b, n, p = self.b, self.n, self.prefix
        q = self.query.view(b, n, HQ, D).transpose(1, 2).contiguous()
        k_new = self.key.view(b, n, HKV, D)
        v_new = self.value.view(b, n, HKV, D)
        if p:
            kd, vd = dense_kv(self.kv_cache, HKV, IV)
            bt = self.block_table[:, : p // BS].long()
            k_new = torch.cat([kd[bt].reshape(b, p, HKV, D), k_new], 1)
            v_new = torch.cat([vd[bt].reshape(b, p, HKV, D), v_new], 1)
        k = k_new.transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous()
        v = v_new.transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous()
        return q, k, v


def sdpa_causal(q, k, v, scale):
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True)
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


FLASHINFER_BACKENDS = ("fa3", "fa2")
_UNAVAILABLE_SEEN: set[str] = set()


def flashinfer_prefill_peers(c: PrefillCase, ref, flops: float, row: dict):
    """FlashInfer's paged prefill on the case's values (prefix pages plus the new tokens
    written into its pages), checked against SDPA and timed; fills ``row``."""
    pages = nhd_pages(c.kv_cache, HKV, IV)
    write_tokens(pages, c.block_table, c.prefix, c.key, c.value)
    lens = [c.n + c.prefix] * c.b
    for be in FLASHINFER_BACKENDS:
        key = f"flashinfer_{be}"
        why = None
        try:
            peer = FlashInferPrefill(pages, c.block_table, lens, c.query, c.qsl, c.scale, backend=be)
            out = peer.run().view(c.b, c.n, HQ, D).transpose(1, 2)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            row[key + "_err"] = err
            if err < 1e-2:
                t = graph_time_ms(peer.run)
                row[key + "_ms"] = t
                row[key + "_tflops"] = flops / (t * 1e-3) / 1e12
                row[key + "_ratio_triton_over_peer"] = row["triton_tflops"] / row[key + "_tflops"]
            else:
                why = f"{key}: output differs from SDPA (rel err {err:.2e})"
        except PeerUnavailable as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - e.g. not capturable in a CUDA graph
            why = f"{key}: {type(e).__name__}: {e}"[:300]
        if why:
            row[key + "_ms"] = None
            row[key + "_unavailable"] = why
            if why not in _UNAVAILABLE_SEEN:
                _UNAVAILABLE_SEEN.add(why)
                print(f"  peer unavailable: {why}", flush=True)
    del pages


def checked_gluon_run(c: PrefillCase, ref) -> float:
    """Run the case's launch with ``prefill_kernel="gluon"`` on a NaN-poisoned output; its
    relative error against SDPA's ``ref``. Raises when the Triton prefill ran instead (the
    launcher's warning) or the output differs."""
    got = c.out.view(c.b, c.n, HQ, D).transpose(1, 2)
    c.out.fill_(float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.run(prefill_kernel="gluon")
    torch.cuda.synchronize()
    fallback = [str(w.message) for w in caught if "prefill kernel 'gluon'" in str(w.message)]
    if fallback:  # the Triton prefill ran: not a Gluon timing
        raise RuntimeError(fallback[0])
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    if not err < 1e-2:  # NaN fails too
        raise RuntimeError(f"output differs from SDPA (rel err {err:.2e})")
    return err


def gluon_prefill_row(c: PrefillCase, ref, flops: float, row: dict) -> None:
    """The Gluon prefill on the case (output NaN-poisoned, checked against SDPA, then timed);
    fills ``row``'s ``gluon_*`` fields, or ``gluon_unavailable`` with the reason."""
    try:
        err = row["gluon_rel_err_vs_sdpa"] = checked_gluon_run(c, ref)
        t = graph_time_ms(lambda: c.run(prefill_kernel="gluon"))
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run or is wrong is a result
        row["gluon_ms"] = None
        row["gluon_unavailable"] = f"{type(e).__name__}: {e}"[:300]
        print(f"  gluon prefill unavailable: {row['gluon_unavailable']}", flush=True)
        return
    row.update(gluon_ms=t, gluon_tflops=flops / (t * 1e-3) / 1e12)
    row["ratio_gluon_over_triton"] = row["gluon_tflops"] / row["triton_tflops"]
    print(f"  gluon prefill: {t:.3f} ms {row['gluon_tflops']:4.0f} TFLOP/s (x{row['ratio_gluon_over_triton']:.2f} "
          f"of Triton)  err {err:.1e}", flush=True)


def gluon_config(spec: str):
    """A ``GluonPrefillConfig`` from a ``SWEEP_VARIANTS`` name or ``field=value,...`` changes of
    ``DEFAULT_CONFIG`` (values converted to the field's type); ``"auto"``: None, the launcher's
    own choice (``prefix_prefill.default_config``), timed among the configs."""
    from inductor_rocm_attn.kernels.gluon import prefix_prefill as pp

    if spec == "auto":
        return None
    if spec in pp.SWEEP_VARIANTS:
        return pp.SWEEP_VARIANTS[spec]
    types = {f.name: type(getattr(pp.DEFAULT_CONFIG, f.name)) for f in dataclasses.fields(pp.GluonPrefillConfig)}
    changes = {}
    for item in spec.split(","):
        name, eq, value = item.partition("=")
        if not eq or name not in types:
            raise ValueError(f"--gluon-cfgs: {spec!r} is neither 'auto', a variant ({', '.join(pp.SWEEP_VARIANTS)}) nor "
                             f"field=value changes of GluonPrefillConfig (fields: {', '.join(types)})")
        changes[name] = types[name](value)
    return dataclasses.replace(pp.DEFAULT_CONFIG, **changes)


@contextlib.contextmanager
def gluon_launch_config(cfg, launches: list | None = None):
    """Inside: every Gluon prefill launch ``paged_attention`` makes runs under ``cfg`` (a
    ``GluonPrefillConfig``; None: the launcher's ``default_config``), each one appended to ``launches`` when given; the library's
    launcher is back on exit."""
    import importlib

    pa_mod = importlib.import_module("inductor_rocm_attn.kernels.triton.paged_attention")
    real = pa_mod._gluon_launch

    def launch(*a, **k):
        if launches is not None:
            launches.append(1)
        return real()(*a, **k, cfg=cfg)

    pa_mod._gluon_launch = lambda: launch
    try:
        yield
    finally:
        pa_mod._gluon_launch = real


def gluon_cfg_rows(c: PrefillCase, ref, flops: float, specs: list[str], out: list) -> None:
    """The Gluon prefill under each config of ``specs`` (``gluon_config``) on the case: the
    launch ``paged_attention`` makes, with the config; output NaN-poisoned, checked against
    SDPA, then timed. Appends one row a config to ``out``."""
    for spec in specs:
        row = dict(prefix=c.prefix, cfg=spec)
        try:
            cfg = gluon_config(spec)
            row["config"] = dataclasses.asdict(cfg) if cfg is not None else "auto"
            launches = []
            with gluon_launch_config(cfg, launches):
                err = row["rel_err_vs_sdpa"] = checked_gluon_run(c, ref)
                if not launches:  # the Triton prefill ran: not a timing of this config
                    raise RuntimeError("the Gluon prefill did not run")
                t = graph_time_ms(lambda: c.run(prefill_kernel="gluon"))
        except Exception as e:  # noqa: BLE001 - a config that cannot build, run or match is a result
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"  gluon cfg {spec}: {row['error']}", flush=True)
            out.append(row)
            continue
        row.update(ms=t, tflops=flops / (t * 1e-3) / 1e12)
        print(f"  gluon cfg {spec}: {t:.3f} ms {row['tflops']:4.0f} TFLOP/s  err {err:.1e}", flush=True)
        out.append(row)


def main():
    global HQ, HKV, D, BS, IV
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--prefix", type=int, nargs="+", default=[0, 4096])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cfgs", nargs="+", default=None, metavar="BM,BN,WARPS,STAGES[,K_ROWS]",
                    help="with --sweep: these configs instead of the built-in list (e.g. head 512)")
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                    help="also time the default config with these changes (A/B in one run)")
    ap.add_argument("--kernels", nargs="+", default=["triton", "gluon"], choices=("triton", "gluon"),
                    help="prefill kernels to time on every case (default both: the Gluon prefill is the "
                         "default on sm_90; triton always runs: it is the reference row)")
    ap.add_argument("--gluon-cfgs", nargs="+", default=[], metavar="NAME|FIELD=VALUE,...",
                    help="also time the Gluon prefill under these configs (names of prefix_prefill.SWEEP_VARIANTS, "
                         "'all' for every one, 'auto' for the launcher's own choice, or field=value changes of "
                         "GluonPrefillConfig's DEFAULT_CONFIG), each checked "
                         "against SDPA first (NVIDIA sm_90)")
    ap.add_argument("--peers", nargs="*", default=[], choices=("flashinfer",),
                    help="also time these peers on every case (same values, their own layout)")
    ap.add_argument("--q-heads", type=int, default=HQ, help=f"query heads (default {HQ})")
    ap.add_argument("--kv-heads", type=int, default=HKV, help=f"KV heads (default {HKV})")
    ap.add_argument("--head-size", type=int, default=D,
                    help=f"head size (default {D}; e.g. 512 for Gemma4's full-attention layers)")
    ap.add_argument("--block-size", type=int, default=BS, choices=(16, 32, 64, 128),
                    help=f"cache block size (default {BS}; FlashInfer's prebuilt modules are for 16 only)")
    ap.add_argument("--interleaved-v", action="store_true",
                    help="the interleaved V interior (what a layer whose cache write is fused reads)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if any(p % args.block_size for p in args.prefix):
        ap.error(f"--prefix {args.prefix}: each must be a multiple of --block-size {args.block_size}")
    if args.kv_heads < 1 or args.q_heads % args.kv_heads:
        ap.error(f"--q-heads {args.q_heads} is not a multiple of --kv-heads {args.kv_heads}")
    HQ, HKV, D, BS, IV = args.q_heads, args.kv_heads, args.head_size, args.block_size, args.interleaved_v
    sweep_cfgs = [tuple(int(x) for x in c.split(",")) for c in args.cfgs] if args.cfgs else SWEEP
    gluon_specs = list(args.gluon_cfgs)
    if "all" in gluon_specs:
        from inductor_rocm_attn.kernels.gluon.prefix_prefill import SWEEP_VARIANTS

        gluon_specs = [s for s in gluon_specs if s != "all"] + [s for s in SWEEP_VARIANTS if s not in gluon_specs]
    for spec in gluon_specs:  # a misspelt config fails before anything runs
        try:
            gluon_config(spec)
        except (ValueError, TypeError) as e:
            ap.error(str(e))
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}")
    b, n = args.batch, args.new
    rows, sweep, variants, gluon_cfgs = [], [], [], []
    # Anchor: SDPA dense causal, N tokens, HQ heads (same FLOPs as the no-prefix case).
    g = torch.Generator(device="cuda").manual_seed(1)
    qa, ka, va = (torch.randn(b, HQ, n, D, generator=g, device="cuda", dtype=DTYPE) for _ in range(3))
    t_anchor = graph_time_ms(lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True))
    anchor_flops = 4 * b * HQ * D * (n * (n + 1) / 2)
    anchor_tfs = anchor_flops / (t_anchor * 1e-3) / 1e12
    print(f"SDPA dense causal B={b} N={n}: {t_anchor:.3f} ms {anchor_tfs:.0f} TFLOP/s")
    del qa, ka, va
    for p in args.prefix:
        c = PrefillCase(b, n, p, seed=p + 3)
        q, k, v = c.sdpa_inputs()
        ref = sdpa_causal(q, k, v, c.scale)
        c.out.fill_(float("nan"))
        c.run(prefill_kernel="triton")  # the Triton row is Triton's even where the default is Gluon
        got = c.out.view(b, n, HQ, D).transpose(1, 2)
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert err < 1e-2, f"prefix {p}: triton vs SDPA rel err {err:.3e}"
        flops = 4 * b * HQ * D * (n * p + n * (n + 1) / 2)
        t_tri = graph_time_ms(lambda: c.run(prefill_kernel="triton"))
        try:
            t_sdpa = graph_time_ms(lambda: sdpa_causal(q, k, v, c.scale))
        except Exception as e:  # noqa: BLE001
            print(f"  SDPA with prefix {p}: {type(e).__name__}: {e}")
            t_sdpa = float("nan")
        tri_tfs = flops / (t_tri * 1e-3) / 1e12
        sdpa_tfs = flops / (t_sdpa * 1e-3) / 1e12
        row = dict(B=b, new=n, prefix=p, triton_ms=t_tri, triton_tflops=tri_tfs, sdpa_ms=t_sdpa,
                   sdpa_tflops=sdpa_tfs, ratio_vs_sdpa_same_case=tri_tfs / sdpa_tfs,
                   ratio_vs_sdpa_dense_anchor=tri_tfs / anchor_tfs, rel_err_vs_sdpa=err)
        rows.append(row)
        if "gluon" in args.kernels:
            gluon_prefill_row(c, ref, flops, row)
        if gluon_specs:
            gluon_cfg_rows(c, ref, flops, gluon_specs, gluon_cfgs)
        if "flashinfer" in args.peers:
            flashinfer_prefill_peers(c, ref, flops, row)
            fa3 = row.get("flashinfer_fa3_tflops")
            if fa3 and row.get("gluon_tflops"):  # the issue's bar: Gluon at or above FA3
                row["ratio_gluon_over_fa3"] = row["gluon_tflops"] / fa3
            for r in gluon_cfgs:
                if fa3 and r["prefix"] == p and "tflops" in r:
                    r["ratio_over_fa3"] = r["tflops"] / fa3
        print(f"prefix={p:5d}: triton {t_tri:.3f} ms {tri_tfs:4.0f} TFLOP/s | SDPA same case {t_sdpa:.3f} ms "
              f"{sdpa_tfs:4.0f} TFLOP/s | x{row['ratio_vs_sdpa_dense_anchor']:.2f} of dense anchor  err {err:.1e}"
              + "".join(f" | FlashInfer {be} {row[f'flashinfer_{be}_tflops']:4.0f} TFLOP/s"
                        for be in FLASHINFER_BACKENDS if row.get(f"flashinfer_{be}_tflops")),
              flush=True)
        for name in args.variants:  # A/B against the default, same case, same run
            cfg = variant_config(name)
            try:
                c.out.fill_(float("nan"))
                c.run(prefill_cfg=cfg)
                v_err = float((got.float() - ref.float()).norm() / ref.float().norm())
                t = graph_time_ms(lambda: c.run(prefill_cfg=cfg))
            except Exception as e:  # noqa: BLE001  (a variant that fails to build is a result)
                print(f"  variant {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            variants.append(dict(prefix=p, variant=name, ms=t, tflops=flops / (t * 1e-3) / 1e12,
                                 rel_err_vs_sdpa=v_err))
            print(f"  variant {name}: {t:.3f} ms {flops / (t * 1e-3) / 1e12:4.0f} TFLOP/s  "
                  f"err {v_err:.1e}", flush=True)
        if args.sweep:
            for tiles in sweep_cfgs:
                cfg = PrefillConfig(*tiles)
                try:  # each config's output checked against SDPA before it is timed
                    c.out.fill_(float("nan"))
                    c.run(prefill_cfg=cfg)
                    s_err = float((got.float() - ref.float()).norm() / ref.float().norm())
                    t = graph_time_ms(lambda: c.run(prefill_cfg=cfg))
                except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                    print(f"  cfg {cfg}: {type(e).__name__}: {str(e)[:200]}")
                    sweep.append(dict(prefix=p, cfg=dataclasses.asdict(cfg), error=f"{type(e).__name__}: {str(e)[:300]}"))
                    continue
                sweep.append(dict(prefix=p, cfg=dataclasses.asdict(cfg), ms=t,
                                  tflops=flops / (t * 1e-3) / 1e12, rel_err_vs_sdpa=s_err))
                print(f"  cfg BM={cfg.block_m} BN={cfg.block_n} warps={cfg.num_warps} "
                      f"stages={cfg.num_stages} k_rows={cfg.k_rows}: {t:.3f} ms "
                      f"{flops / (t * 1e-3) / 1e12:4.0f} TFLOP/s  err {s_err:.1e}", flush=True)
        del c, q, k, v, ref
        torch.cuda.empty_cache()
    meta = dict(dtype="bf16", heads=f"{HQ}/{HKV}", head_size=D, block_size=BS, interleaved_v=IV, causal=True,
                kernels=args.kernels, peers=args.peers,
                flashinfer=flashinfer_version() if "flashinfer" in args.peers else None,
                sdpa_dense_anchor_ms=t_anchor, sdpa_dense_anchor_tflops=anchor_tfs,
                default_config=dataclasses.asdict(prefill_config(D, HQ // HKV, BS, DTYPE)),
                timing="CUDA-graph replay, do_bench median")
    name = f"prefill_{stamp()}" + (f"_hq{HQ}" if HQ != 32 else "") + (f"_hkv{HKV}" if HKV != 8 else "")
    name += f"_d{D}" if D != 128 else ""
    name += f"_bs{BS}" if BS != 16 else ""
    name += "_iv" if IV else ""
    meta = write_json(os.path.join(args.out, name + ".json"),
                      dict(rows=rows, sweep=sweep, variants=variants, gluon_cfgs=gluon_cfgs), **meta)["meta"]
    lines = [f"# Prefix prefill, {dev} ({meta['date']})", "",
             f"`{meta['command']}`; torch {meta['torch']}, triton {meta['triton']}; bf16, causal, "
             f"heads {HQ}/{HKV}, d={D}, block {BS}{', interleaved V' if IV else ''}, B={b}, {n} new tokens; {meta['timing']}. "
             f"SDPA dense causal anchor ({HQ} heads, N={n}): {anchor_tfs:.0f} TFLOP/s.", "",
             "| prefix | Triton ms | Triton TFLOP/s | SDPA same case ms | SDPA TFLOP/s | Triton / SDPA dense anchor "
             "| FlashInfer fa3 ms | fa3 TFLOP/s | Triton / fa3 | FlashInfer fa2 TFLOP/s "
             "| Gluon ms | Gluon TFLOP/s | Gluon / Triton | Gluon / fa3 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda r, k_, f: format(r[k_], f) if r.get(k_) else "-"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['prefix']} | {r['triton_ms']:.3f} | {r['triton_tflops']:.0f} | {r['sdpa_ms']:.3f} | "
                     f"{r['sdpa_tflops']:.0f} | {r['ratio_vs_sdpa_dense_anchor']:.2f} | "
                     f"{fmt(r, 'flashinfer_fa3_ms', '.3f')} | {fmt(r, 'flashinfer_fa3_tflops', '.0f')} | "
                     f"{fmt(r, 'flashinfer_fa3_ratio_triton_over_peer', '.2f')} | "
                     f"{fmt(r, 'flashinfer_fa2_tflops', '.0f')} | {fmt(r, 'gluon_ms', '.3f')} | "
                     f"{fmt(r, 'gluon_tflops', '.0f')} | {fmt(r, 'ratio_gluon_over_triton', '.2f')} | "
                     f"{fmt(r, 'ratio_gluon_over_fa3', '.2f')} |")
    lines += [f"\npeer unavailable: {w}" for w in sorted(
        {r[k_] for r in rows for k_ in r if k_.endswith("_unavailable") and k_ != "gluon_unavailable"})]
    lines += [f"\ngluon prefill unavailable: {w}" for w in sorted(
        {r["gluon_unavailable"] for r in rows if r.get("gluon_unavailable")})]
    if gluon_cfgs:
        lines += ["", "| prefix | Gluon config | ms | TFLOP/s | / fa3 | rel err vs SDPA |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['prefix']} | {r['cfg']} | " + (f"{r['ms']:.3f} | {r['tflops']:.0f} | "
                                                         f"{fmt(r, 'ratio_over_fa3', '.2f')} | {r['rel_err_vs_sdpa']:.1e} |"
                                                         if "ms" in r else f"{r['error']} | - | - | - |")
                  for r in gluon_cfgs]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
