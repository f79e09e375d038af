"""Trace-only A/B in one process: the layer regions off (flat), as Dynamo's nested regions,
and stamped (``layer_regions.MODE``), alternating; CPU and wall seconds of compile_piecewise
up to where the build starts (trace, stamp / inline). Min and median of N rounds.

    PYTHONPATH=. python trace_only_ab.py [N] [modes...]   (default: 4 rounds, flat nested stamp)
"""
import json
import os
import statistics
import sys
import time

import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import layer_regions
from inductor_rocm_attn.compilation import build as B
from inductor_rocm_attn.compilation import compile_piecewise
from inductor_rocm_attn.models import TinyDecoder, qwen3_0_6b_config


class Stop(Exception):
    pass


def stop(runner, gm, ex, plan=None):
    counts.append((runner.stats.region_calls, runner.stats.region_subgraphs))
    raise Stop()


B.build = stop
counts = []
N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
MODES = sys.argv[2:] or ["flat", "nested", "stamp"]
cfg = qwen3_0_6b_config(num_layers=28, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                        head_size=64, vocab_size=512)


def one(mode):
    layer_regions.MODE = None if mode == "flat" else mode
    torch.manual_seed(0)
    m = TinyDecoder(cfg).eval()
    ira.bind_kv_caches(m, 64, torch.float32, "cpu")
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        compile_piecewise(m, capture_sizes=[1, 2, 4, 8, 16, 32, 64], max_num_seqs=64, max_model_len=2304,
                          trace_cache=False)
    except Exception as e:
        assert "Stop" in repr(e) or isinstance(e, Stop), e
    return time.perf_counter() - t0, time.process_time() - c0


print(f"torch {torch.__version__}, modes {MODES}")
for mode in MODES:  # warm-up
    one(mode)
res = {m: [] for m in MODES}
for i in range(N):
    for mode in MODES:
        w, c = one(mode)
        res[mode].append((w, c))
        print(f"{mode:7} wall {w:.2f} cpu {c:.2f} region calls / traced {counts[-1]} load {os.getloadavg()[0]:.1f}",
              flush=True)
for mode in MODES:
    ws = [x[0] for x in res[mode]]
    cs = [x[1] for x in res[mode]]
    print(f"{mode:7} wall min {min(ws):.2f} med {statistics.median(ws):.2f}  cpu min {min(cs):.2f} "
          f"med {statistics.median(cs):.2f}")
print(json.dumps({"torch": torch.__version__, "rounds": res}))
