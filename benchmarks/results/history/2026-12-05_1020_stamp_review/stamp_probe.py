import sys, traceback, warnings, itertools
import torch
from inductor_rocm_attn import layer_regions
from inductor_rocm_attn.compilation.regions import stamp_regions
from inductor_rocm_attn.layer import Attention

mode = sys.argv[1] if len(sys.argv) > 1 else "stamp"
mode = None if mode == "none" else mode
_ids = itertools.count()

def trace(model, fn, *inputs):
    stats = []
    def backend(gm, ex):
        stats.append(stamp_regions(gm, ex) if mode == "stamp" else None)
        if mode == "nested":
            from inductor_rocm_attn.compilation.regions import inline_regions
            stats.append(inline_regions(gm))
        return gm.forward
    saved = layer_regions.MODE
    layer_regions.MODE = mode
    torch._dynamo.reset()
    try:
        with torch.no_grad(), layer_regions.tracing(model):
            return torch.compile(fn, backend=backend, fullgraph=True)(*inputs), stats
    finally:
        layer_regions.MODE = saved

class B(torch.nn.Module):
    compile_regions = True
    def __init__(s):
        super().__init__()
        s.lin = torch.nn.Linear(8, 8, bias=False)

def case(name, make, body, n=3, eager_check=True, shape=(5, 8)):
    torch.manual_seed(0)
    blocks = [B() for _ in range(n)]
    make(blocks)
    model = torch.nn.Sequential(*blocks)
    reg = layer_regions.region(body)
    def run(x):
        for b in model:
            x = reg(b, x)
            if isinstance(x, tuple): x = x[0] + x[-1]
        return x
    x = torch.randn(*shape)
    import copy
    saved_model = copy.deepcopy(model)
    with torch.no_grad():
        ref = run(x.clone())
    for b, s in zip(model, saved_model):
        for (k, t), (_, t0) in zip(b.named_buffers(), s.named_buffers()):
            t.copy_(t0)
    try:
        out, stats = trace(model, run, x.clone())
    except Exception as e:
        c = getattr(e, "inner_exception", None) or e
        print(f"{name:40s} REFUSED: {type(c).__name__}: {str(c).splitlines()[0][:150]}")
        return
    ok = torch.equal(out, ref)
    print(f"{name:40s} {'correct' if ok else 'WRONG'} stats={stats} maxdiff={(out-ref).abs().max().item():.3g}")

def lin(b, x): return b.lin(x)
# A: float attr
def mk_scale(bs):
    for i, b in enumerate(bs): b.scale = 1.0 + i
case("A float attr differs", mk_scale, lambda b, x: b.lin(x) * b.scale)
def mk_negzero(bs):
    bs[0].scale = 0.0; bs[1].scale = -0.0; bs[2].scale = 0.0
case("B -0.0 vs 0.0", mk_negzero, lambda b, x: b.lin(x) + torch.atan2(torch.full_like(x, b.scale), -torch.ones_like(x)))
def mk_flag(bs):
    for i, b in enumerate(bs): b.flag = (i % 2 == 0)
case("C bool flag branch", mk_flag, lambda b, x: b.lin(x).relu() if b.flag else b.lin(x).tanh())
def mk_child(bs):
    for i, b in enumerate(bs): b.lin.mult = float(i + 1)
case("D child attr", mk_child, lambda b, x: b.lin(x) * b.lin.mult)
def mk_dict(bs):
    for i, b in enumerate(bs): b.cfg = {"s": float(i + 1), "l": [i]}
case("E dict/list attr", mk_dict, lambda b, x: b.lin(x) * b.cfg["s"] + b.cfg["l"][0])
def mk_plain_tensor(bs):
    for i, b in enumerate(bs): b.t = torch.full((8,), float(i + 1))
case("F plain tensor attr", mk_plain_tensor, lambda b, x: b.lin(x) * b.t)
def mk_nonpersist(bs):
    for i, b in enumerate(bs): b.register_buffer("nb", torch.full((8,), float(i + 1)), persistent=False)
case("G non-persistent buffer", mk_nonpersist, lambda b, x: b.lin(x) * b.nb)
def mk_dtype(bs):
    bs[1].lin.double()
case("H param dtype differs", mk_dtype, lambda b, x: b.lin(x.to(b.lin.weight.dtype)).float())
def mk_rg(bs):
    bs[1].lin.weight.requires_grad_(False)
case("I requires_grad differs", mk_rg, lambda b, x: b.lin(x))
def mk_tied(bs):
    bs[2].lin.weight = bs[0].lin.weight
case("J tied rep<->later", mk_tied, lambda b, x: b.lin(x))
def mk_tied12(bs):
    bs[2].lin.weight = bs[1].lin.weight
case("J2 tied later<->later", mk_tied12, lambda b, x: b.lin(x))
def mk_ref_rep(bs):
    for b in bs: b.ref = bs[0].lin.weight
case("K plain ref to rep's param", mk_ref_rep, lambda b, x: b.lin(x) + x @ b.ref)
def mk_ref_rep_buf(bs):
    bs[0].register_buffer("anchor", torch.randn(8))
    for b in bs[1:]: b.register_buffer("anchor", torch.randn(8))
    for b in bs: b.anch0 = bs[0].anchor
case("K2 plain ref to rep's buffer", mk_ref_rep_buf, lambda b, x: b.lin(x) + b.anchor + 2 * b.anch0)
G = {}
def mk_global(bs):
    for i, b in enumerate(bs): G[b] = float(i + 1)
case("L global keyed by module", mk_global, lambda b, x: b.lin(x) * G[b])
def mk_mut(bs):
    for i, b in enumerate(bs): b.register_buffer("acc", torch.zeros(8))
def mutbody(b, x):
    b.acc.add_(x.sum(0)); return b.lin(x) + b.acc
case("M buffer mutated in place", mk_mut, mutbody)
case("N returns tuple", lambda bs: None, lambda b, x: (b.lin(x), x * 2))
case("O returns input unchanged", lambda bs: None, lambda b, x: x)
case("O2 returns (x, lin)", lambda bs: None, lambda b, x: (x, b.lin(x)))
def viewbody(b, x): return b.lin(x)[:, :4].repeat(1, 2)
case("O3 view output", lambda bs: None, lambda b, x: x.t().t())
SC = 3.0
case("P global float", lambda bs: None, lambda b, x: b.lin(x) * SC)
def mk_idx(bs):
    for i, b in enumerate(bs): b.idx = i
case("Q layer idx picks branch", mk_idx, lambda b, x: b.lin(x) * (2 if b.idx == 1 else 1))
def mk_attn(bs):
    for i, b in enumerate(bs):
        b.attn = Attention(2 if i == 0 else 4, 64 if i == 0 else 32, num_kv_heads=2 if i == 0 else 4,
                           layer_name=f"probe_attn_{next(_ids)}", register=False)
        b.lin = torch.nn.Linear(128, 128, bias=False)
case("R attr of Attention child", mk_attn, lambda b, x: b.lin(x).view(x.shape[0], -1, b.attn.head_size).softmax(-1).reshape(x.shape[0], -1), shape=(5, 128))
def mk_attnscale(bs):
    for i, b in enumerate(bs):
        b.attn = Attention(2, 32, num_kv_heads=2, scale=0.1 * (i + 1), layer_name=f"probe_attn_{next(_ids)}", register=False)
case("R2 Attention impl.scale", mk_attnscale, lambda b, x: b.lin(x) * b.attn.impl.scale)
def mk_train(bs):
    bs[1].train(False); bs[0].train(True); bs[2].train(True)
case("S training flag", mk_train, lambda b, x: b.lin(x) * (2 if b.training else 1))
def mk_nested(bs):
    for b in bs: b.lin.compile_regions = True
inner = layer_regions.region(lambda m, x: m(x))
case("T nested region modules", mk_nested, lambda b, x: inner(b.lin, x) + 1)
def mk_shared_child(bs):
    for b in bs[1:]: b.lin = bs[0].lin
case("U shared child module", mk_shared_child, lambda b, x: b.lin(x))
def mk_offset(bs):
    big = torch.randn(3 * 64)
    for i, b in enumerate(bs):
        b.lin.weight = torch.nn.Parameter(big[i*64:(i+1)*64].view(8, 8))
case("V params as views of one tensor", mk_offset, lambda b, x: b.lin(x))
def mk_counter(bs):
    for b in bs: b.calls = 0
def cbody(b, x):
    b.calls = b.calls + 1
    return b.lin(x) * b.calls
case("W python side effect on attr", mk_counter, cbody)
def ac(b, x):
    return b.lin(x) * (2.0 if torch.is_autocast_enabled("cpu") else 1.0)
def case_autocast():
    torch.manual_seed(0)
    model = torch.nn.Sequential(B(), B(), B())
    reg = layer_regions.region(lambda b, x: b.lin(x) * (2.0 if torch.is_grad_enabled() else 1.0))
    def run(x):
        x = reg(model[0], x)
        with torch.enable_grad():
            x = reg(model[1], x)
        return reg(model[2], x)
    x = torch.randn(5, 8)
    with torch.no_grad(): ref = run(x)
    try:
        out, stats = trace(model, run, x)
        print(f"{'X grad mode differs per layer':40s} {'correct' if torch.equal(out, ref) else 'WRONG'} {stats}")
    except Exception as e:
        c = getattr(e, "inner_exception", None) or e
        print(f"{'X grad mode differs per layer':40s} REFUSED: {type(c).__name__}: {str(c).splitlines()[0][:150]}")
case_autocast()
def case_ac():
    torch.manual_seed(0)
    model = torch.nn.Sequential(B(), B(), B())
    reg = layer_regions.region(lambda b, x: b.lin(x).float() * (2.0 if torch.is_autocast_enabled("cpu") else 1.0))
    def run(x):
        x = reg(model[0], x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = reg(model[1], x)
        return reg(model[2], x)
    x = torch.randn(5, 8)
    with torch.no_grad(): ref = run(x)
    try:
        out, stats = trace(model, run, x)
        print(f"{'Y autocast on one layer':40s} {'correct' if torch.equal(out, ref) else 'WRONG'} {stats} {(out-ref).abs().max().item():.3g}")
    except Exception as e:
        c = getattr(e, "inner_exception", None) or e
        print(f"{'Y autocast on one layer':40s} REFUSED: {type(c).__name__}: {str(c).splitlines()[0][:150]}")
case_ac()
def mutarg(b, x):
    x.mul_(2)
    return b.lin(x)
def case_mutarg():
    torch.manual_seed(0)
    model = torch.nn.Sequential(B(), B(), B())
    reg = layer_regions.region(mutarg)
    def run(x):
        y = x.clone()
        for b in model:
            z = reg(b, y)
            y = z + y  # reads the mutated argument
        return y
    x = torch.randn(5, 8)
    with torch.no_grad(): ref = run(x)
    out, st = trace(model, run, x)
    print(f"{'Z argument mutated in place':40s} {'correct' if torch.equal(out, ref) else 'WRONG'} {st}")
case_mutarg()
def case_retown():
    torch.manual_seed(0)
    model = torch.nn.Sequential(B(), B(), B())
    for i, b in enumerate(model): b.register_buffer("cache", torch.randn(10, 8))
    reg = layer_regions.region(lambda b, x: (b.lin(x), b.cache[: x.shape[0]], b.cache))
    def run(x):
        for b in model:
            o, c, w = reg(b, x)
            x = o + c + w[: x.shape[0]]
        return x
    x = torch.randn(5, 8)
    with torch.no_grad(): ref = run(x)
    out, st = trace(model, run, x)
    print(f"{'Z2 returns views/own tensors':40s} {'correct' if torch.equal(out, ref) else 'WRONG'} {st}")
case_retown()
