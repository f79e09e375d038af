"""Where the Gluon prefill's prefix case loses time (sm_90): its context phase against its
dense phase and FlashInfer FA3, repeated in one process.

    python benchmarks/probe_prefill_context.py [--cfgs default tile_noinc ...] [--reps 3] [--no-identity]
        [--interleaved-v] [--block-size 16]

Cases (bf16, causal, 32/8 heads, d=128, block 16 unless ``--block-size``, standard V unless
``--interleaved-v``): B=4 x 4096 new tokens with a 4096-token
prefix (the bench's), the same with the pages contiguous (an identity block table: whether
the random page placement costs), B=32 x 128 new tokens with a 4096-token prefix (almost all
of the work in the context phase), and B=4 x 4096 without a prefix (the dense phase alone).
``--no-identity`` leaves out the contiguous-pages case (no run so far has told it from random
pages).
Each Gluon config (``prefix_prefill.SWEEP_VARIANTS`` names) is checked against SDPA on a
NaN-poisoned output, then timed ``--reps`` times, the configs interleaved (the spread of one
config across reps is the run's noise); FlashInfer FA3 (``--peers``, its prebuilt modules:
``benchmarks/peers.py``) on the same values. Prints a table and writes
``results/probe_prefill_context_<stamp>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_prefill as bp  # noqa: E402
from common import stamp, write_json  # noqa: E402

CASES = [  # (B, new tokens, prefix, page placement)
    (4, 4096, 4096, "random"),
    (4, 4096, 4096, "identity"),
    (32, 128, 4096, "random"),
    (4, 4096, 0, "random"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cfgs", nargs="+", default=["default", "load8", "tile_noinc", "tile_joint"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-identity", action="store_true", help="leave out the contiguous-pages case")
    ap.add_argument("--interleaved-v", action="store_true", help="the interleaved V interior")
    ap.add_argument("--block-size", type=int, default=bp.BS, choices=(16, 32, 64, 128))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    bp.IV, bp.BS = args.interleaved_v, args.block_size
    from inductor_rocm_attn.kernels.gluon import prefix_prefill as pp

    cfgs = {name: bp.gluon_config(name) for name in args.cfgs}
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}", flush=True)
    rows = []
    for b, n, p, placement in CASES:
        if args.no_identity and placement == "identity":
            continue
        c = bp.PrefillCase(b, n, p, seed=p + 3)
        if placement == "identity":
            c.block_table = torch.arange(c.block_table.numel(), dtype=torch.int32,
                                         device="cuda").view_as(c.block_table).contiguous()
        q, k, v = c.sdpa_inputs()
        ref = bp.sdpa_causal(q, k, v, c.scale)
        flops = 4 * b * bp.HQ * bp.D * (n * p + n * (n + 1) / 2)
        peer = dict(triton_tflops=float("nan"))
        bp.flashinfer_prefill_peers(c, ref, flops, peer)
        row = dict(B=b, new=n, prefix=p, placement=placement, fa3_tflops=peer.get("flashinfer_fa3_tflops"),
                   gluon_tflops={name: [] for name in cfgs}, errors={})
        for _ in range(args.reps):
            for name, cfg in cfgs.items():
                try:
                    with bp.gluon_launch_config(cfg):
                        row["errors"][name] = bp.checked_gluon_run(c, ref)
                        t = bp.graph_time_ms(lambda: c.run(prefill_kernel="gluon"))
                    row["gluon_tflops"][name].append(flops / (t * 1e-3) / 1e12)
                except Exception as e:  # noqa: BLE001 - a config that fails is a result
                    row["errors"][name] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        fa3 = row["fa3_tflops"]
        print(f"B={b} new={n} prefix={p} {placement}: FA3 {fa3 or float('nan'):.0f} | " + " | ".join(
            f"{name} {' '.join(f'{x:.0f}' for x in ts) or row['errors'][name]}"
            for name, ts in row["gluon_tflops"].items()), flush=True)
        del c, q, k, v, ref
        torch.cuda.empty_cache()
    write_json(os.path.join(args.out, f"probe_prefill_context_{stamp()}.json"), dict(rows=rows),
               dtype="bf16", heads=f"{bp.HQ}/{bp.HKV}", head_size=bp.D, block_size=bp.BS, interleaved_v=bp.IV,
               configs={name: str(cfg) if cfg is not None else "auto: default_config's choice" for name, cfg in cfgs.items()}, timing="CUDA-graph replay, do_bench median",
               gluon_default=str(pp.DEFAULT_CONFIG))


if __name__ == "__main__":
    main()
