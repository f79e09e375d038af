import time, sys, torch
import inductor_rocm_attn as ira
try:
    from inductor_rocm_attn import layer_regions
    if sys.argv[1] == "flat": layer_regions._NESTED = None
except ImportError:
    pass
from inductor_rocm_attn.models import TinyDecoder, qwen3_0_6b_config
from inductor_rocm_attn.compilation import compile_piecewise, build as B
class Stop(Exception): pass
def stop(runner, gm, ex, plan=None): raise Stop()
B.build = stop
cfg = qwen3_0_6b_config(num_layers=28, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_size=64, vocab_size=512)
out = []
for i in range(3):
    m = TinyDecoder(cfg).eval(); ira.bind_kv_caches(m, 64, torch.float32, "cpu")
    c0 = time.process_time()
    try:
        compile_piecewise(m, capture_sizes=[1, 2, 4, 8], max_num_seqs=8, max_model_len=256, trace_cache=False)
    except Exception:
        pass
    out.append(round(time.process_time() - c0, 2))
print(sys.argv[1], ira.__file__, "trace cpu s:", out)
