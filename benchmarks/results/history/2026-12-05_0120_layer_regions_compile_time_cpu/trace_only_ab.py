"""Trace-only A/B in one process: regions off (flat) / on, alternating; min and median of N."""
import time, sys, statistics, json, os, torch
import inductor_rocm_attn as ira
from inductor_rocm_attn import layer_regions
from inductor_rocm_attn.models import TinyDecoder, qwen3_0_6b_config
from inductor_rocm_attn.compilation import compile_piecewise, build as B
class Stop(Exception): pass
def stop(runner, gm, ex, plan=None): raise Stop()
B.build = stop
N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
cfg = qwen3_0_6b_config(num_layers=28, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_size=64, vocab_size=512)
saved = layer_regions._NESTED
def one(regions):
    layer_regions._NESTED = saved if regions else None
    torch.manual_seed(0)
    m = TinyDecoder(cfg).eval(); ira.bind_kv_caches(m, 64, torch.float32, "cpu")
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        compile_piecewise(m, capture_sizes=[1, 2, 4, 8, 16, 32, 64], max_num_seqs=64, max_model_len=2304, trace_cache=False)
    except Exception as e:
        assert "Stop" in repr(e) or isinstance(e, Stop), e
    return time.perf_counter() - t0, time.process_time() - c0
one(True); one(False)  # warm-up
res = {False: [], True: []}
for i in range(N):
    for r in (False, True):
        w, c = one(r); res[r].append((w, c)); print(r, f"wall {w:.2f} cpu {c:.2f} load {os.getloadavg()[0]:.1f}", flush=True)
for r in (False, True):
    ws = [x[0] for x in res[r]]; cs = [x[1] for x in res[r]]
    print("regions" if r else "flat   ", f"wall min {min(ws):.2f} med {statistics.median(ws):.2f}  cpu min {min(cs):.2f} med {statistics.median(cs):.2f}")
print(json.dumps({("regions" if r else "flat"): res[r] for r in res}))
