"""Launch the native tensor-core decode and our Triton decode once each (after warm-ups) on
one case, for Nsight Compute to profile side by side.

    ncu --clock-control none --kernel-name regex:'paged_decode' --launch-skip 4 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 benchmarks/profile_decode_ncu.py --batch 64 --ctx 4096

Warm-ups: two launches of each (so the first profiled launch is compiled and cached). The
script checks both outputs against SDPA before the profiled launches.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_native import case_and_reference, rel_err  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    c, _, _, _, ref = case_and_reference(args.batch, args.ctx)
    for name, fn in (("native", c.native), ("triton", c.triton)):
        c.out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        err = rel_err(c.out, ref)
        print(f"{name}: rel err {err:.2e}", flush=True)
        assert err < 1e-2, name
    torch.cuda.synchronize()
    for fn in (c.native, c.triton):  # the profiled launches (after --launch-skip)
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
