import sys, time, os
import torch
import inductor_rocm_attn as ira
from inductor_rocm_attn import layer_regions
from inductor_rocm_attn.compilation.regions import inline_regions
from inductor_rocm_attn.models import TinyDecoder, qwen3_0_6b_config
from torch._dynamo.utils import counters

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 28
use_regions = (sys.argv[2] if len(sys.argv) > 2 else "1") != "0"
if len(sys.argv) > 2 and sys.argv[2] in ("stamp", "nested"): layer_regions.MODE = sys.argv[2]
cfg = qwen3_0_6b_config(num_layers=layers, hidden_size=256, intermediate_size=512, num_heads=4,
                        num_kv_heads=2, head_size=64, vocab_size=512)
torch.manual_seed(0)
model = TinyDecoder(cfg).eval()
ira.bind_kv_caches(model, 64, torch.float32, "cpu")
alloc = ira.BlockAllocator(64, cfg.block_size); alloc.allocate(0, 24)
md = ira.build_attention_metadata([24], [0], [alloc.block_table(0)], cfg.block_size, "cpu")
ids = torch.randint(0, 512, (24,)); pos = md.positions.clone()
graphs = []
from inductor_rocm_attn.compilation.regions import stamp_regions
def backend(gm, ex):
    t1 = time.process_time()
    print("stamp", stamp_regions(gm, ex), "in %.3f s" % (time.process_time() - t1), "trace cpu %.2f" % (t1 - c0))
    graphs.append(gm)
    return gm.forward
torch._dynamo.mark_dynamic(ids, 0); torch._dynamo.mark_dynamic(pos, 0)
c = torch.compile(lambda a, b: model(a, b), backend=backend, fullgraph=True, dynamic=False)
if os.environ.get("WARMUP"):
    torch.compile(lambda x: x * 2, backend=lambda gm, ex: gm.forward, fullgraph=True)(torch.randn(3))
t0, c0 = time.perf_counter(), time.process_time()
import contextlib
with torch.no_grad(), ira.set_forward_context(md), (layer_regions.tracing(model) if use_regions else contextlib.nullcontext()):
    c(ids, pos)
print("torch", torch.__version__, "layers", layers, "regions", use_regions, layer_regions.MODE)
print("trace wall %.2f cpu %.2f" % (time.perf_counter() - t0, time.process_time() - c0))
gm = graphs[0]
hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]
print("invoke_subgraph calls", len(calls), "distinct", len({n.args[0].target for n in calls}))
for k, v in counters.items():
    if k in ("stats", "frames", "unimplemented", "graph_break", "recompiles", "inline_call") or "subgraph" in k:
        print(k, dict(v))
if os.environ.get("DUMP"):
    print(gm.graph)
    for n in calls[:4]:
        print(n.format_node())
        print(getattr(gm, n.args[0].target).graph)
