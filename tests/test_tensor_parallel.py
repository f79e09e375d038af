"""Tensor parallelism (``inductor_rocm_attn.parallel``): TP=2 logits equal TP=1 logits.

The cheap tests check the head split / KV-head replication rules and the weight slicing in
this process. The scenario runs this file as a worker under ``torch.distributed.run``
(``--standalone``: a free rendezvous port; 2 processes, gloo on CPU, NCCL on 2 GPUs), the way
a user launches a tensor-parallel program, with a wall-clock limit so a hang fails the test.
Each rank builds the same TP=1 model (rank 0's weights broadcast), takes its shard
(``shard_model``) and runs one schedule: prefill of two sequences, two decode steps, a mixed
step (decode + prefill of a third sequence), two decode steps of all three:

- Qwen3-style (4 query / 2 KV heads: one KV head per rank): eager, then ``torch.compile``
  with the plugin (the QK-norm + RoPE + cache-write fusion must fire for every layer on
  every rank; the post-grad graph holds the all-reduces outside every fusion site);
- Llama-style (4 query / 1 KV head: the KV head replicated on both ranks; RoPE and RMSNorm
  as our ops): eager, then ``compile_piecewise`` (collectives inside the compiled pieces;
  on CPU ``RerunGraphBackend`` stands in for graphs, so decode steps replay whole-step
  "graphs" and the prefill and mixed steps the piecewise ones; on GPUs real CUDA/HIP graphs).

Tolerance, fp32: max |logit diff| <= 1e-4 against the TP=1 model (logits are O(1)). Sharding
changes only the summation order: each row-parallel projection sums two partial dot products
of half the length, and compiled code orders reductions differently again; measured
about 3e-6. bf16 (GPUs): relative error (norm) <= 2e-2, as tests/test_compile_e2e.py.
Both ranks compute the logits from the same all-reduced hidden states with the replicated
lm_head, so their logits must be bitwise equal (on GPUs: for the eager variants). Each
rank's KV cache holds its heads' slice of the TP=1 model's cache (same tolerance).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn.models import TinyDecoder, llama_config, qwen3_config
from inductor_rocm_attn.parallel import TensorParallel, shard_heads, shard_model, shard_state_dict

BLOCK = 16
NUM_BLOCKS = 12
FP32_ATOL = 1e-4
BF16_RTOL = 2e-2
#: The whole 2-process scenario (two cold compiles per rank on 2 shared cores: ~1-2 min).
LAUNCH_TIMEOUT_S = int(os.environ.get("ROCM_ATTN_TP_TEST_TIMEOUT_S", "420"))
#: A collective waiting longer than this fails the rank (a rank may still be compiling).
COLLECTIVE_TIMEOUT_S = 300

# Steps: sequence -> new tokens. Prefill, 2 decodes, mixed (decode + prefill), 2 decodes.
SCHEDULE = [{"a": 5, "b": 7}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 1, "c": 6},
            {"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 1, "c": 1}]
CAPTURE_SIZES = [2, 4, 8, 16]


def _qwen3_cfg():
    return qwen3_config(num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=128,
                        num_heads=4, num_kv_heads=2, block_size=BLOCK)


def _llama_cfg():
    return llama_config(num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=128,
                        num_heads=4, num_kv_heads=1, block_size=BLOCK, rope_impl="op", norm_impl="op")


# === cheap tests (this process) =============================================================


@pytest.mark.parametrize("hq,hkv,size,expect", [
    (8, 4, 2, [(4, 2, 0, 0, 1), (4, 2, 4, 2, 1)]),           # KV heads split
    (8, 8, 4, [(2, 2, 2 * r, 2 * r, 1) for r in range(4)]),
    (8, 2, 4, [(2, 1, 0, 0, 2), (2, 1, 2, 0, 2), (2, 1, 4, 1, 2), (2, 1, 6, 1, 2)]),  # replicated
    (4, 1, 2, [(2, 1, 0, 0, 2), (2, 1, 2, 0, 2)]),
])
def test_shard_heads_split_and_replicate(hq, hkv, size, expect):
    got = [dataclasses.astuple(shard_heads(hq, hkv, size, r)) for r in range(size)]
    assert got == expect
    for r in range(size):  # the query heads of a rank read only its KV heads (GQA grouping)
        s = shard_heads(hq, hkv, size, r)
        needed = {q * hkv // hq for q in range(s.q_start, s.q_start + s.num_heads)}
        assert needed == set(range(s.kv_start, s.kv_start + s.num_kv_heads))


@pytest.mark.parametrize("hq,hkv,size,match", [
    (6, 2, 4, "num_heads=6 cannot be split over 4 ranks"),
    (12, 3, 2, "num_kv_heads=3 over 2 ranks"),
    (16, 6, 4, "not a multiple of num_kv_heads"),
    (8, 8, 0, "rank 0 of size 0"),
])
def test_shard_heads_rejects_what_it_cannot_split(hq, hkv, size, match):
    with pytest.raises(ValueError, match=match):
        shard_heads(hq, hkv, size, 0)


def test_intermediate_must_divide():
    cfg = _qwen3_cfg()
    with pytest.raises(ValueError, match="intermediate_size=256 cannot be split over 3 ranks"):
        TinyDecoder(dataclasses.replace(cfg, num_heads=6, num_kv_heads=3), tp=TensorParallel(3, 0, "unused"))


@pytest.mark.parametrize("other", [dict(num_heads=8, num_kv_heads=2, head_size=32),  # 8 + 2 * 2 heads of 32
                                   dict(num_heads=2, num_kv_heads=2, head_size=64),  # QK-norm weights of 64
                                   dict(intermediate_size=128)])
def test_shard_state_dict_refuses_another_models_weights(other):
    """A state dict of another model whose fused qkv is as wide (4 + 2 * 4 heads against the
    config's 8 + 2 * 2) was cut along the config's heads: rank 0's shard loaded into the
    shard model without an error (only the other rank's ``narrow`` ran past o_proj). Every
    weight that carries the head geometry is compared with the config first."""
    cfg = dataclasses.replace(_qwen3_cfg(), num_heads=4, num_kv_heads=4, head_size=32)
    name = "tp_other_" + "_".join(map(str, other.values()))
    sd = TinyDecoder(dataclasses.replace(cfg, **other), name=name).state_dict()
    with pytest.raises(ValueError, match=r"shard_state_dict: layers\.0\.\w+\.weight has shape \(.*\) but the model of "
                                         r"cfg \(num_heads=4, num_kv_heads=4, head_size=32, .*\) has \(.*\): the state "
                                         r"dict is not of this config's model"):
        shard_state_dict(sd, cfg, TensorParallel(2, 0, "unused"))


@pytest.mark.parametrize("make", [_qwen3_cfg, _llama_cfg], ids=["kv_split", "kv_replicated"])
def test_shards_reassemble_the_full_weights(make):
    """Rank shards load into ``TinyDecoder(cfg, tp=...)`` and, put back together in head
    order, are the full weights (replicated KV rows: the same on every replica)."""
    cfg = make()
    torch.manual_seed(0)
    full = TinyDecoder(cfg).state_dict()
    size, d = 2, cfg.head_size
    shards = []
    for r in range(size):
        tp = TensorParallel(size, r, "unused")
        sd = shard_state_dict(full, cfg, tp)
        TinyDecoder(cfg, tp=tp).load_state_dict(sd)  # shapes match the shard model
        shards.append((shard_heads(cfg.num_heads, cfg.num_kv_heads, size, r), sd))
    for i in range(cfg.num_layers):
        key = f"layers.{i}.qkv_proj.weight"
        w = full[key]
        q = torch.cat([sd[key][: s.num_heads * d] for s, sd in shards])
        assert torch.equal(q, w[: cfg.num_heads * d])
        for part in (0, 1):  # k, v
            off = (cfg.num_heads + part * cfg.num_kv_heads) * d
            for s, sd in shards:
                local = sd[key][(s.num_heads + part * s.num_kv_heads) * d:][: s.num_kv_heads * d]
                assert torch.equal(local, w[off + s.kv_start * d: off + (s.kv_start + s.num_kv_heads) * d])
        for name, dim in (("o_proj", 1), ("down_proj", 1)):
            k = f"layers.{i}.{name}.weight"
            assert torch.equal(torch.cat([sd[k] for _, sd in shards], dim=dim), full[k])
        k = f"layers.{i}.gate_up_proj.weight"
        gate = torch.cat([sd[k].chunk(2)[0] for _, sd in shards])
        up = torch.cat([sd[k].chunk(2)[1] for _, sd in shards])
        assert torch.equal(torch.cat([gate, up]), full[k])
    for k in ("embed.weight", "lm_head.weight", "norm.weight"):
        assert all(sd[k] is full[k] for _, sd in shards)


# === the multi-process scenarios ==========================================================


def _launch(tmp_dir: str, *worker_args: str, nproc: int = 2) -> dict:
    """Run this file under ``torch.distributed.run`` (``nproc`` processes); returns per-rank
    results."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "0", os.path.abspath(__file__), "--worker", "--out", tmp_dir, *worker_args]
    log_path = os.path.join(tmp_dir, "launch.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own session: it and its ranks
            proc.wait()
            rc = "timeout"
    out = open(log_path).read()
    if rc != 0:
        pytest.fail(f"tensor-parallel workers failed (rc={rc}, limit {LAUNCH_TIMEOUT_S} s):\n{out[-6000:]}")
    ranks = [json.load(open(os.path.join(tmp_dir, f"rank{r}.json"))) for r in range(nproc)]
    logits = [torch.load(os.path.join(tmp_dir, f"rank{r}_logits.pt")) for r in range(nproc)]
    return {"ranks": ranks, "logits": logits, "log": out}


@pytest.fixture(scope="module")
def cpu_run():
    with tempfile.TemporaryDirectory(prefix="rocm_attn_tp_") as tmp:
        yield _launch(tmp)


def _check_scenario(run: dict, dtype: torch.dtype) -> None:
    for res in run["ranks"]:
        for variant, steps in res["diffs"].items():
            for i, (err, rel) in enumerate(steps):
                if dtype == torch.float32:
                    assert err <= FP32_ATOL, (res["rank"], variant, i, err)
                else:
                    assert rel <= BF16_RTOL, (res["rank"], variant, i, err, rel)
            assert len(steps) == len(SCHEDULE), variant
        for variant, (err, rel) in res["cache_diffs"].items():
            assert (err <= FP32_ATOL) if dtype == torch.float32 else (rel <= BF16_RTOL), (variant, err, rel)


def _check_ranks_agree(run: dict, gpu: bool = False, eager_only: bool = False) -> None:
    """Bitwise equal logits on both ranks. On GPUs, compiled variants only close: Inductor
    may pick a different kernel config on each rank by timing, changing reduction order."""
    a = run["logits"][0]
    for b in run["logits"][1:]:
        assert a.keys() == b.keys()
        for variant, i in ((v, i) for v in a for i in range(len(SCHEDULE))):
            x, y = a[variant][i], b[variant][i]
            if gpu and not variant.endswith("eager"):
                rel = float((x.double() - y.double()).norm() / y.double().norm())
                assert rel <= BF16_RTOL / 2, (variant, i, rel)
            else:
                assert torch.equal(x, y), (variant, i, float((x.float() - y.float()).abs().max()))
    assert len(a) == (2 if eager_only else 4)


def _check_fusions_and_graphs(run: dict) -> None:
    for res in run["ranks"]:
        rank = res["rank"]
        # torch.compile: every layer of this rank fused (QK-norm + RoPE + cache write).
        fused = sorted(r["layer"] for r in res["records"]["qwen3_compiled"] if r["fused"])
        assert fused == ["tp_qwen3_compiled.layers.0.attn", "tp_qwen3_compiled.layers.1.attn"], (rank, res["records"])
        assert {r["pass"] for r in res["records"]["qwen3_compiled"] if r["fused"]} == {"qk_norm_rope_kv_cache_fusion"}
        assert res["interleaved_v"]["qwen3_compiled"] == [True, True]
        # Piecewise: one RoPE + cache-write fusion per compiled piece holding a layer's cache
        # update (2 layers: the first piece and the middle one), under slot aliases.
        fused = [r for r in res["records"]["llama_piecewise"] if r["fused"]]
        assert [r["pass"] for r in fused] == ["rope_kv_cache_fusion"] * 2, (rank, res["records"])
        assert all(r["layer"].startswith("__rocm_attn_slot") for r in fused)
        stats = res["piecewise_stats"]
        assert (stats["num_compiled_pieces"], stats["num_attention_pieces"], stats["plugin_active"]) == (3, 2, True)
        # every step replays a whole-step graph: the decodes their size's decode graph, the
        # prefill and the mixed step their size's mixed graph
        assert res["whole_step_replays"] == [True] * len(SCHEDULE)
        # Post-grad graphs: the full graph holds one all-reduce (+ wait) after each o_proj and
        # down_proj; the pieces hold them too (the first piece none: it ends at layer 0's
        # cache write); no collective between a fused writer and the matmul that feeds it.
        graphs = res["graphs"]
        full = [g for g in graphs if g["tag"] == "qwen3_compiled"]
        assert [(g["all_reduce"], g["wait_tensor"], g["fused"]) for g in full] == [(4, 4, 2)], graphs
        pieces = [g for g in graphs if g["tag"] == "llama_piecewise"]
        assert sorted((g["all_reduce"], g["wait_tensor"], g["fused"]) for g in pieces) == \
            [(0, 0, 1), (2, 2, 0), (2, 2, 1)], graphs
        assert not any(g["collective_in_site"] for g in graphs), graphs


def _check_cache_shards(run: dict) -> None:
    for res in run["ranks"]:
        # qwen3: 2 KV heads over 2 ranks -> 1 each; llama: 1 KV head replicated on both.
        assert res["cache_shapes"]["qwen3_eager"] == [NUM_BLOCKS, 2, BLOCK, 1 * 64]
        assert res["cache_shapes"]["llama_eager"] == [NUM_BLOCKS, 2, BLOCK, 1 * 64]
        assert res["kv_start"] == {"qwen3": res["rank"], "llama": 0}


@pytest.mark.compile
def test_tp2_logits_equal_tp1_eager_compiled_piecewise(cpu_run):
    _check_scenario(cpu_run, torch.float32)


@pytest.mark.compile
def test_ranks_compute_bitwise_equal_logits(cpu_run):
    _check_ranks_agree(cpu_run)


@pytest.mark.compile
def test_every_layer_fused_on_every_rank_collectives_outside_sites(cpu_run):
    _check_fusions_and_graphs(cpu_run)


@pytest.mark.compile
def test_each_rank_owns_its_kv_cache_shard(cpu_run):
    _check_cache_shards(cpu_run)


def test_tp4_eager_replicates_kv_heads_over_rank_pairs():
    """4 ranks, eager: the Qwen3-style model's 2 KV heads are each replicated on 2 ranks."""
    with tempfile.TemporaryDirectory(prefix="rocm_attn_tp4_") as tmp:
        run = _launch(tmp, "--eager-only", nproc=4)
    _check_scenario(run, torch.float32)
    _check_ranks_agree(run, eager_only=True)
    assert [res["kv_start"] for res in run["ranks"]] == [{"qwen3": r // 2, "llama": 0} for r in range(4)]
    assert [res["cache_shapes"]["qwen3_eager"][-1] for res in run["ranks"]] == [64] * 4


@pytest.mark.gpu
@pytest.mark.compile
def test_tp2_nccl_bf16_cuda_graphs():
    """The same scenario on 2 GPUs: NCCL, bf16, piecewise + whole-step CUDA/HIP graphs."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs ({torch.cuda.device_count()} visible)")
    with tempfile.TemporaryDirectory(prefix="rocm_attn_tp_gpu_") as tmp:
        run = _launch(tmp, "--device", "cuda", "--dtype", "bfloat16")
    _check_scenario(run, torch.bfloat16)
    _check_ranks_agree(run, gpu=True)
    _check_fusions_and_graphs(run)
    _check_cache_shards(run)
    assert all(res["cuda_graphs"] for res in run["ranks"])


# === worker (one process per rank, started by torch.distributed.run) ======================


def _worker(out_dir: str, device_kind: str, dtype_name: str, eager_only: bool) -> None:
    import datetime
    import time

    import torch.distributed as dist

    from inductor_rocm_attn.graph_capture import RerunGraphBackend, compile_piecewise
    from inductor_rocm_attn.layout import dense_kv
    from inductor_rocm_attn.parallel import shard_model
    from torch._inductor.custom_graph_pass import CustomGraphPass

    dtype = getattr(torch, dtype_name)
    rank = int(os.environ["RANK"])
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    tp = TensorParallel.from_group()

    # The schedule's block tables and token ids (the same for every variant: each model has
    # its own caches).
    alloc = ira.BlockAllocator(NUM_BLOCKS, BLOCK, shuffle_seed=3)
    gen = torch.Generator().manual_seed(1)
    seqs = {s: torch.randint(0, 128, (16,), generator=gen) for s in "abc"}
    steps = []
    for plan in SCHEDULE:
        ids, ql, cl, tables = [], [], [], []
        for s, n in plan.items():
            start = alloc.num_tokens(s)
            alloc.allocate(s, n)
            ids.append(seqs[s][start:start + n])
            ql.append(n)
            cl.append(start)
            tables.append(list(alloc.block_table(s)))
        steps.append((torch.cat(ids).to(device), ql, cl, tables))

    def build(cfg, name):
        torch.manual_seed(0)
        model = TinyDecoder(cfg, name=name).to(device=device, dtype=dtype).eval()
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)  # one set of weights, whatever each rank's RNG did
        ira.bind_kv_caches(model, NUM_BLOCKS, dtype, device, poison=True)
        return model

    def run_eager(model):
        outs = []
        for ids, ql, cl, tables in steps:
            md = ira.build_attention_metadata(ql, cl, tables, BLOCK, device)
            with torch.no_grad(), ira.set_forward_context(md):
                outs.append(model(ids, md.positions))
        return outs

    def run_compiled(model):
        compiled = torch.compile(model, backend="inductor")
        outs = []
        for ids, ql, cl, tables in steps:
            md = ira.build_attention_metadata(ql, cl, tables, BLOCK, device)
            pos = md.positions.clone()
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
            with torch.no_grad(), ira.set_forward_context(md):
                outs.append(compiled(ids, pos))
        return outs

    graphs, graph_tag = [], [None]

    class GraphInspector(CustomGraphPass):
        """Runs after the plugin's passes: counts collectives and fused writers, and checks
        that no collective lies between a fused writer and the matmul producing its input."""

        def __call__(self, graph):
            c10d = torch.ops._c10d_functional
            collectives = {c10d.all_reduce.default, c10d.wait_tensor.default}
            fused_ops = {torch.ops.rocm_attn.unified_qk_norm_rope_and_kv_cache_update.default,
                         torch.ops.rocm_attn.unified_rope_and_kv_cache_update.default}
            stops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
            functionalized = torch.ops.higher_order.auto_functionalized_v2  # the RoPE writer mutates q/k

            def op_of(n):
                return n.args[0] if n.target is functionalized else n.target

            fused = [n for n in graph.nodes if op_of(n) in fused_ops]
            in_site = False
            for node in fused:
                todo, seen = list(node.all_input_nodes), set()
                while todo:
                    n = todo.pop()
                    if n in seen or n.target in stops or n.op == "placeholder":
                        continue
                    seen.add(n)
                    in_site |= n.target in collectives
                    todo.extend(n.all_input_nodes)
            graphs.append({
                "tag": graph_tag[0], "fused": len(fused), "collective_in_site": in_site,
                "all_reduce": sum(n.target is c10d.all_reduce.default for n in graph.nodes),
                "wait_tensor": sum(n.target is c10d.wait_tensor.default for n in graph.nodes)})

        def uuid(self):
            return "rocm_attn_tp_test_graph_inspector"

    res = {"rank": rank, "diffs": {}, "cache_diffs": {}, "records": {}, "interleaved_v": {},
           "cache_shapes": {}, "graphs": graphs, "timings": {}}
    logits = {}

    def compare(variant, ref_outs, outs, ref_model, model, cfg):
        logits[variant] = [o.detach().cpu().clone() for o in outs]
        res["diffs"][variant] = [
            (float((o.float() - r.float()).abs().max()),
             float((o.double() - r.double()).norm() / r.double().norm())) for o, r in zip(outs, ref_outs)]
        res["interleaved_v"][variant] = [layer.interleaved_v for layer in ira.attention_layers(model)]
        res["cache_shapes"][variant] = list(ira.attention_layers(model)[0].kv_cache.shape)
        # This rank's cache = its KV heads' slice of the TP=1 cache, on every written slot.
        heads = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        kv = slice(heads.kv_start, heads.kv_start + heads.num_kv_heads)
        slots = [(t[p // BLOCK], p % BLOCK) for s in "abc" for t in [alloc.block_table(s)]
                 for p in range(alloc.num_tokens(s))]
        blk, off = torch.tensor([b for b, _ in slots]), torch.tensor([o for _, o in slots])
        worst = (0.0, 0.0)
        for lr, lm in zip(ira.attention_layers(ref_model), ira.attention_layers(model)):
            for x, y in zip(dense_kv(lr.kv_cache, lr.num_kv_heads, lr.interleaved_v),
                            dense_kv(lm.kv_cache, lm.num_kv_heads, lm.interleaved_v)):
                x, y = x[blk, off][:, kv].double(), y[blk, off].double()
                err = float((x - y).abs().max()) if not (x - y).isnan().any() else float("inf")
                worst = (max(worst[0], err), max(worst[1], float((x - y).norm() / x.norm())))
        res["cache_diffs"][variant] = worst

    def fresh_cache():  # a cache hit would skip the passes (and their report)
        import torch._inductor.utils as u

        return getattr(u, "fresh_cache", None) and u.fresh_cache() or u.fresh_inductor_cache()

    torch._inductor.config.post_grad_custom_post_pass = GraphInspector()
    ira.enable()
    report = ira.fusion_report()

    # Qwen3-style: KV heads split. Eager, then torch.compile with the plugin.
    cfg = _qwen3_cfg()
    ref = build(cfg, "ref_qwen3")
    ref_outs = run_eager(ref)
    res["kv_start"] = {"qwen3": tp.heads(cfg.num_heads, cfg.num_kv_heads).kv_start}
    for variant in ("qwen3_eager",) if eager_only else ("qwen3_eager", "qwen3_compiled"):
        model = shard_model(ref, tp, name=f"tp_{variant}")
        ira.bind_kv_caches(model, NUM_BLOCKS, dtype, device, poison=True)
        t0 = time.perf_counter()
        report.clear()
        graph_tag[0] = variant
        with fresh_cache():
            outs = run_eager(model) if variant.endswith("eager") else run_compiled(model)
        res["timings"][variant] = time.perf_counter() - t0
        res["records"][variant] = [{"layer": r.layer_name, "pass": r.pass_name, "fused": r.fused}
                                   for r in report.records]
        compare(variant, ref_outs, outs, ref, model, cfg)

    # Llama-style: the single KV head replicated. Eager, then compile_piecewise.
    cfg = _llama_cfg()
    ref = build(cfg, "ref_llama")
    ref_outs = run_eager(ref)
    res["kv_start"]["llama"] = tp.heads(cfg.num_heads, cfg.num_kv_heads).kv_start
    model = shard_model(ref, tp, name="tp_llama_eager")
    ira.bind_kv_caches(model, NUM_BLOCKS, dtype, device, poison=True)
    compare("llama_eager", ref_outs, run_eager(model), ref, model, cfg)

    if eager_only:
        _finish(out_dir, rank, res, logits)
        return
    model = shard_model(ref, tp, name="tp_llama_piecewise")
    ira.bind_kv_caches(model, NUM_BLOCKS, dtype, device, poison=True)
    report.clear()
    graph_tag[0] = "llama_piecewise"
    t0 = time.perf_counter()
    backend = RerunGraphBackend() if device.type == "cpu" else None
    with fresh_cache():
        runner = compile_piecewise(model, capture_sizes=CAPTURE_SIZES, max_num_seqs=4,
                                   max_num_tokens=16, max_model_len=64, graph_backend=backend)
    res["timings"]["llama_piecewise_compile"] = time.perf_counter() - t0
    outs, whole = [], []
    for ids, ql, cl, tables in steps:
        md = runner.prepare(ql, cl, tables)
        whole.append(runner.replays_whole_step(md))
        outs.append(runner(ids, md).clone())
    res["whole_step_replays"] = whole
    res["cuda_graphs"] = runner.use_cuda_graphs and backend is None
    st = runner.stats
    res["piecewise_stats"] = {"num_compiled_pieces": st.num_compiled_pieces,
                              "num_attention_pieces": st.num_attention_pieces,
                              "num_unique_compiles": st.num_unique_compiles,
                              "plugin_active": st.plugin_active, "compile_s": st.compile_s}
    res["records"]["llama_piecewise"] = [{"layer": r.layer_name, "pass": r.pass_name, "fused": r.fused}
                                         for r in report.records]
    compare("llama_piecewise", ref_outs, outs, ref, model, cfg)
    _finish(out_dir, rank, res, logits)


def _finish(out_dir: str, rank: int, res: dict, logits: dict) -> None:
    import torch.distributed as dist

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    torch.save(logits, os.path.join(out_dir, f"rank{rank}_logits.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="tensor-parallel test worker (run by torch.distributed.run)")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--eager-only", action="store_true")
    a = p.parse_args()
    _worker(a.out, a.device, a.dtype, a.eager_only)


@pytest.mark.parametrize("size,rank", [(0, 0), (2, 2), (2, -1), (2.0, 0), (2, 0.5), (True, 0)])
def test_tensor_parallel_rank_checked(size, rank):
    """TensorParallel took any size and rank: size 0 failed in intermediate() with a bare
    ZeroDivisionError, rank 3 of 2 sliced the MLP past its end, and float sizes or ranks gave
    shard_heads float head counts and starts (rank 0.5: q_start 1.0, kv_start 0.5)."""
    with pytest.raises(ValueError, match=rf"tensor parallel: rank {rank!r} of size {size!r} is not a valid rank"):
        TensorParallel(size, rank, "g")
    with pytest.raises(ValueError, match=rf"tensor parallel: rank {rank!r} of size {size!r} is not a valid rank"):
        shard_heads(4, 2, size, rank)


def test_shard_heads_head_counts_checked():
    for hq, hkv, name, bad in ((0, 1, "num_heads", 0), (4.0, 2, "num_heads", 4.0), (4, 2.0, "num_kv_heads", 2.0)):
        with pytest.raises(ValueError, match=rf"tensor parallel: {name} must be a positive int, got {bad!r}"):
            shard_heads(hq, hkv, 2, 0)
    with pytest.raises(ValueError, match=r"tensor parallel: group_name must be .*, got ''"):
        TensorParallel(2, 0, "")


def test_tp_must_be_a_tensor_parallel_and_a_shard_is_not_sharded_again():
    """A tp that is not a TensorParallel failed as an AttributeError ('NoneType' object has no
    attribute 'heads'); sharding a shard was refused as a state dict "not of this config's
    model", with nothing about the shard."""
    cfg = _qwen3_cfg()
    full = TinyDecoder(cfg, name="tp_check_full")
    for bad in (None, (2, 0, "g")):
        for who, call in (("shard_model", lambda: shard_model(full, bad)),
                          ("shard_state_dict", lambda: shard_state_dict(full.state_dict(), cfg, bad))):
            with pytest.raises(TypeError, match=rf"{who}: tp must be a TensorParallel .*, got {re.escape(repr(bad))}"):
                call()
    with pytest.raises(TypeError, match=r"TinyDecoder: tp must be a TensorParallel .* or None, got \(2, 0, 'g'\)"):
        TinyDecoder(cfg, name="tp_check_bad", tp=(2, 0, "g"))
    tp = TensorParallel(2, 0, "unused")
    shard = shard_model(full, tp, name="tp_check_shard")
    with pytest.raises(ValueError, match=r"shard_model: the model is already a tensor-parallel shard \(its row-parallel "
                                         r"linears all-reduce over group 'unused'\); shard the full model"):
        shard_model(shard, tp)


@pytest.mark.parametrize("group", [0, 5, "gloo"])
def test_from_group_refuses_what_is_not_a_group(group):
    """0 was taken for the default group (``group or WORLD``); 5 or a backend name failed as an
    AttributeError on the int or str. Refused before torch.distributed is even needed."""
    with pytest.raises(TypeError, match=rf"TensorParallel.from_group: group must be a ProcessGroup, a 1-D DeviceMesh "
                                        rf"or None \(the default group\), got {type(group).__name__} {group!r}"):
        TensorParallel.from_group(group)
