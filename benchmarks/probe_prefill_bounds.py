"""Which side bounds the Gluon prefill's context phase (sm_90): the kernel timed with one side
of its context work taken out, so the other side runs alone. Timing only: the outputs of the
diagnostic kernels are wrong by construction and are not checked (the real kernel is).

    python benchmarks/probe_prefill_bounds.py [--modes real no_load ...] [--cfg NAME] [--context-only] [--out DIR]

Modes, each in its own process (the kernel module's functions are replaced before its first
compile, so Triton compiles and caches the diagnostic kernel under its own key):

- ``real``: the library kernel (checked against SDPA first);
- ``no_load``: the load partition publishes each context stage without copying anything
  into it (the consumers compute on whatever the stage holds): the consumers' own rate;
- ``no_math``: the consumers wait for each stage and release it without their wgmmas (the
  softmax still runs, on zeros): the load partition's rate, with the ping-pong kept;
- ``no_fence``: the consumers' async-proxy fences left out (the wgmma may read a cp.async
  stage before its bytes are visible to the async proxy: what the fences cost).

``--cfg``: the ``GluonPrefillConfig`` of every mode (a ``SWEEP_VARIANTS`` name or
``field=value,...``, as ``bench_prefill.py --gluon-cfgs``; default: the kernel's default).

Cases: B=32 x 128 new tokens with a 4096-token prefix (the context phase nearly alone) and
B=4 x 4096 new tokens without a prefix (the dense phase alone); bf16, causal, 32/8 heads,
d=128, block 16. Prints a table and writes ``probe_prefill_bounds_<stamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = [(32, 128, 4096), (4, 4096, 0)]
MODES = ("real", "no_load", "no_math", "no_fence")


def _patch(mode: str) -> None:
    """Replace the kernel module's context loader (``no_load``) or its wgmma issue helpers
    (``no_math``) before anything compiles."""
    global gl, mbarrier, warpgroup_mma, pp  # the replacements' globals: Gluon resolves names there
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma

    from inductor_rocm_attn.kernels.gluon import prefix_prefill as pp

    if mode == "no_load":
        @gluon.jit
        def _load_context_tile(k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, kc_head, vc_head, bt_row,
                               stride_kcb, stride_vcb, ctx_len, j,
                               BLOCK_N: gl.constexpr, HEAD: gl.constexpr, STAGES: gl.constexpr,
                               BLOCK_SIZE: gl.constexpr, LOAD_WARPS: gl.constexpr, INTERLEAVED_V: gl.constexpr,
                               VT_LAYOUT: gl.constexpr, PARTIAL: gl.constexpr, GATHER_TILE_K: gl.constexpr,
                               GATHER_TILE_V: gl.constexpr, JOINT_PUBLISH: gl.constexpr,
                               NOINC_PUBLISH: gl.constexpr, SPLIT_RELEASE: gl.constexpr, v_fill, v_head_row,
                               V_TMA: gl.constexpr):
            s = j % STAGES
            mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
            mbarrier.arrive(k_ready.index(s), count=1)
            mbarrier.arrive(v_ready.index(s), count=1)

        pp._load_context_tile = _load_context_tile
    elif mode == "no_math":
        @gluon.jit
        def _issue_qk(q_rows, k_bufs, k_ready, j, STAGES: gl.constexpr, FENCE: gl.constexpr,
                      BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
            ROWS: gl.constexpr = q_rows.shape[0]
            mbarrier.wait(k_ready.index(j % STAGES), (j // STAGES) & 1)
            return gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

        @gluon.jit
        def _issue_pv(p, acc, v_bufs, v_ready, j, STAGES: gl.constexpr, VT: gl.constexpr, HEAD: gl.constexpr,
                      BLOCK_N: gl.constexpr, VT_LAYOUT: gl.constexpr):
            mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
            return acc

        pp._issue_qk = _issue_qk
        pp._issue_pv = _issue_pv
    elif mode == "no_fence":
        @gluon.jit
        def _issue_qk(q_rows, k_bufs, k_ready, j, STAGES: gl.constexpr, FENCE: gl.constexpr,
                      BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
            ROWS: gl.constexpr = q_rows.shape[0]
            s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
            s = j % STAGES
            mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
            return warpgroup_mma(q_rows, k_bufs.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)

        @gluon.jit
        def _issue_pv(p, acc, v_bufs, v_ready, j, STAGES: gl.constexpr, VT: gl.constexpr, HEAD: gl.constexpr,
                      BLOCK_N: gl.constexpr, VT_LAYOUT: gl.constexpr):
            mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
            return warpgroup_mma(p, pp._v_operand(v_bufs, j, STAGES, VT, HEAD, BLOCK_N, VT_LAYOUT), acc,
                                 is_async=True)

        pp._issue_qk = _issue_qk
        pp._issue_pv = _issue_pv
    elif mode != "real":
        raise ValueError(f"mode {mode!r} (supported: {', '.join(MODES)})")


def _child(mode: str, cases, cfg_spec: str | None) -> None:
    """One mode over ``cases`` (under ``cfg_spec``): prints one JSON line a case."""
    import functools

    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    import bench_prefill as bp

    _patch(mode)
    if cfg_spec:  # before the first launch: paged_attention's launcher binds pp.launch then
        from inductor_rocm_attn.kernels.gluon import prefix_prefill as pp

        pp.launch = functools.partial(pp.launch, cfg=bp.gluon_config(cfg_spec))
    for b, n, p in cases:
        c = bp.PrefillCase(b, n, p, seed=p + 3)
        flops = 4 * b * bp.HQ * bp.D * (n * p + n * (n + 1) / 2)
        row = dict(mode=mode, cfg=cfg_spec or "default", B=b, new=n, prefix=p)
        try:
            if mode == "real":
                q, k, v = c.sdpa_inputs()
                row["rel_err_vs_sdpa"] = bp.checked_gluon_run(c, bp.sdpa_causal(q, k, v, c.scale))
                del q, k, v
            t = bp.graph_time_ms(lambda: c.run(prefill_kernel="gluon"))
            row.update(ms=t, tflops=flops / (t * 1e-3) / 1e12)
        except Exception as e:  # noqa: BLE001 - a mode that cannot build or run is a result
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print("ROW " + json.dumps(row), flush=True)
        del c
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--context-only", action="store_true", help="only the context-heavy case")
    ap.add_argument("--cfg", default=None, help="GluonPrefillConfig of every mode (default: the kernel's)")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cases = CASES[:1] if args.context_only else CASES
    if args.child:
        _child(args.child, cases, args.cfg)
        return
    sys.path.insert(0, os.path.dirname(__file__))
    import torch
    from common import stamp, write_json

    rows = []
    for mode in args.modes:
        child = [sys.executable, __file__, "--child", mode] + (["--context-only"] if args.context_only else []) \
            + (["--cfg", args.cfg] if args.cfg else [])
        proc = subprocess.run(child, capture_output=True, text=True)
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        for r in got:
            print(f"{mode} B={r['B']} new={r['new']} prefix={r['prefix']}: "
                  f"{r.get('error') or format(r['tflops'], '.0f') + ' TFLOP/s'}", flush=True)
        if proc.returncode or len(got) < len(cases):
            print(f"{mode}: exit {proc.returncode}\n{proc.stderr[-2000:]}", flush=True)
        rows += got
    print(f"# {torch.cuda.get_device_name()}: Gluon prefill ({args.cfg or 'default'}), TFLOP/s (ms)")
    print("| mode | " + " | ".join(f"B={b} new={n} prefix={p}" for b, n, p in cases) + " |")
    print("|---|" + "---|" * len(cases))
    for mode in args.modes:
        cells = []
        for b, n, p in cases:
            r = next((r for r in rows if r["mode"] == mode and (r["B"], r["new"], r["prefix"]) == (b, n, p)), None)
            cells.append("-" if r is None else r.get("error") or f"{r['tflops']:.0f} ({r['ms']:.3f})")
        print(f"| {mode} | " + " | ".join(cells) + " |", flush=True)
    write_json(os.path.join(args.out, f"probe_prefill_bounds_{stamp()}.json"), dict(rows=rows),
               dtype="bf16", heads="32/8", head_size=128, block_size=16, modes=args.modes, cfg=args.cfg or "default",
               timing="CUDA-graph replay, do_bench median; no_load / no_math outputs are wrong by design")


if __name__ == "__main__":
    main()
