"""Launch the Gluon prefill (and FlashInfer FA3 on the same values) once each on a case, inside
a CUDA profiler range, for Nsight Compute to profile: where the prefix case's context phase
loses time (per-instruction stall samples of the load and consumer partitions).

    ncu --profile-from-start off --clock-control none --section SourceCounters \
        --section WarpStateStats --section MemoryWorkloadAnalysis -o prefill \
        python3 benchmarks/profile_prefill_ncu.py --batch 32 --new 128 --prefix 4096

``--gluon-cfgs default v_tma`` profiles each config in turn (one launch each, in that order,
then FA3). Each output is NaN-poisoned and checked against SDPA before the profiled launches (two
warm-ups each, outside the range, so the profiled launch is compiled and cached). FA3 needs
FlashInfer's wheels and prebuilt modules (``benchmarks/peers.py``); without them only the
Gluon prefill is profiled, and the script says so.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_prefill as bp  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--no-peer", action="store_true", help="profile the Gluon prefill alone")
    ap.add_argument("--gluon-cfgs", nargs="+", default=["default"], metavar="NAME|FIELD=VALUE,...",
                    help="Gluon prefill configs to profile, one launch each (bench_prefill.py --gluon-cfgs)")
    args = ap.parse_args()
    c = bp.PrefillCase(args.batch, args.new, args.prefix, seed=args.prefix + 3)
    q, k, v = c.sdpa_inputs()
    ref = bp.sdpa_causal(q, k, v, c.scale)
    del q, k, v
    launches = []
    for spec in args.gluon_cfgs:
        cfg = bp.gluon_config(spec)

        def run(_cfg=cfg):  # the launch paged_attention makes, under this config
            with bp.gluon_launch_config(_cfg):
                c.run(prefill_kernel="gluon")
        with bp.gluon_launch_config(cfg):
            print(f"gluon {spec}: rel err {bp.checked_gluon_run(c, ref):.2e}", flush=True)
        launches.append(run)
    if not args.no_peer:
        from peers import PeerUnavailable

        try:
            from peers import FlashInferPrefill, nhd_pages, write_tokens

            pages = nhd_pages(c.kv_cache, bp.HKV, False)
            write_tokens(pages, c.block_table, c.prefix, c.key, c.value)
            fa3 = FlashInferPrefill(pages, c.block_table, [c.n + c.prefix] * c.b, c.query, c.qsl, c.scale,
                                    backend="fa3")
            out = fa3.run().view(c.b, c.n, bp.HQ, bp.D).transpose(1, 2)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            print(f"fa3: rel err {err:.2e}", flush=True)
            assert err < 1e-2, err
            launches.append(fa3.run)
        except PeerUnavailable as e:
            print(f"fa3 not profiled: {e}", flush=True)
    for fn in launches:  # warm-ups: compiled, cached, plans made
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in launches:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
