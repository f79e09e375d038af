"""The fusion report: one line per candidate, misses superseded by another pass's fusion of the
same cache update shown as informational."""

import pytest

from inductor_rocm_attn.passes.base import FusionRecord
from inductor_rocm_attn.passes.report import FusionReport


def test_report_lines_and_queries():
    report = FusionReport()
    assert "no candidates seen" in str(report)
    report.add(FusionRecord("qk_norm_rope_kv_cache_fusion", "l0", True, "fused qk", True))
    report.add(FusionRecord("rope_kv_cache_fusion", "l0", False, "already fused"))
    report.add(FusionRecord("rope_kv_cache_fusion", "l1", False, "not a RoPE output"))
    report.add(FusionRecord("attn_quant_fusion", "l0", False, "no quant"))
    lines = str(report).splitlines()
    assert lines[0] == "rocm_attn fusion report"
    assert lines[1].startswith("  FUSED l0") and lines[1].endswith("fused qk; layer switched to interleaved V")
    assert lines[2].startswith("  skip  l0")  # the same cache update was fused by the QK-norm pass
    assert lines[3].startswith("  MISS  l1") and lines[3].endswith("not a RoPE output")
    assert lines[4].startswith("  MISS  l0")  # another group: a real miss
    assert lines[5] == "  1 fusion(s) over 2 layer(s)"
    assert report.fused_layers("qk_norm_rope_kv_cache_fusion") == ["l0"]
    assert report.switched_layers() == ["l0"]
    report.clear()
    assert report.records == []


def test_shared_code_records_count_the_layers_they_serve():
    """Piecewise compiles report a slot alias once per distinct piece, with the layers it
    serves: fusions and layers count per served layer, and a miss is superseded only by a
    fusion of the same piece (the same alias in another piece is another set of layers)."""
    alias = "__rocm_attn_slot0__"
    shared = tuple(f"model.layers.{i}" for i in range(1, 28))
    report = FusionReport()
    report.add(FusionRecord("qk_norm_rope_kv_cache_fusion", alias, True, "fused qk", serves=("model.layers.0",)))
    report.add(FusionRecord("rope_kv_cache_fusion", alias, False, "already fused", serves=("model.layers.0",)))
    report.add(FusionRecord("qk_norm_rope_kv_cache_fusion", alias, False, "no norm", serves=shared))
    report.add(FusionRecord("rope_kv_cache_fusion", alias, True, "fused rope", serves=shared))
    report.add(FusionRecord("rope_kv_cache_fusion", alias, False, "no rope", serves=("model.layers.28",)))
    lines = str(report).splitlines()
    assert lines[1].startswith(f"  FUSED {alias}") and lines[1].endswith("fused qk [model.layers.0]")
    assert lines[2].startswith(f"  skip  {alias}")
    assert lines[3].startswith(f"  skip  {alias}")  # the shared piece fused the same cache update
    assert lines[3].endswith("no norm [shared by 27 layers: model.layers.1 .. model.layers.27]")
    assert lines[4].startswith(f"  FUSED {alias}")
    assert lines[5].startswith(f"  MISS  {alias}") and lines[5].endswith("[model.layers.28]")
    assert lines[6] == "  28 fusion(s) over 29 layer(s)"


def test_records_come_back_from_inductor_counters_in_order():
    """What Inductor does on a cache hit: add the compile's counter increments again. The
    report turns increments no pass here made into records, in their order, once."""
    from torch._dynamo.utils import counters

    from inductor_rocm_attn.passes import base

    base.replayed_records()  # what earlier compiles of this process left
    report = FusionReport(receives_replays=True)
    before = counters["inductor"].copy()
    base.begin_graph()
    for layer in ("l0", "l1"):
        rec = FusionRecord("qk_norm_rope_kv_cache_fusion", layer, True, "fused", True, True)
        base.count_record(rec)
        report.add(rec)
    base.count_record(FusionRecord("rope_kv_cache_fusion", "l1", False, "no RoPE"))
    deltas = counters["inductor"] - before
    cold = str(report)
    assert report.records and all(not r.from_cache for r in report.records)
    counters["inductor"] += deltas  # a second graph served from the cache
    counters["inductor"] += deltas  # and a third
    assert [(r.layer_name, r.fused, r.from_cache) for r in report.records[2:]] == [
        ("l0", True, True), ("l0", True, True), ("l1", True, True), ("l1", True, True),
        ("l1", False, True), ("l1", False, True)]
    assert len(report.records) == 8  # read again: nothing new
    assert FusionReport().records == []  # a report that does not receive replays
    report.clear()
    counters["inductor"] += deltas
    warm = str(report)
    assert warm.splitlines()[1:3] == cold.splitlines()[1:3]
    assert "MISS  l1" not in warm and "skip  l1" in warm  # superseded by l1's fusion, as cold


def test_counters_replaced_by_a_copy_replay_nothing_and_cleared_counters_replay_again():
    """Inductor's pattern-matcher init restores ``counters["inductor"]`` from a copy: the
    records counted before are not replays. ``counters.clear()`` starts over: an increment
    after it is one (a graph served from the cache then)."""
    from torch._dynamo.utils import counters

    from inductor_rocm_attn.passes import base

    base.replayed_records()
    base.begin_graph()
    before = counters["inductor"].copy()
    base.count_record(FusionRecord("rope_kv_cache_fusion", "l0", True, "fused"))
    (key,) = counters["inductor"] - before
    counters["inductor"] = counters["inductor"].copy()  # what torch's lazy pattern init does
    assert base.replayed_records() == []
    saved = counters["inductor"]
    try:
        counters.clear()
        counters["inductor"][key] += 1  # the same graph loaded from the cache
        assert [(r.layer_name, r.fused, r.from_cache) for r in base.replayed_records()] == [("l0", True, True)]
    finally:
        counters["inductor"] = saved + counters["inductor"]
        base.replayed_records()


@pytest.mark.compile
def test_report_survives_an_fx_graph_cache_hit():
    """Two compiles of one graph in one Inductor cache: the second is served from it and runs
    no pass, yet the report holds the same records again and the new layer is switched."""
    import gc

    import torch
    import torch._inductor.utils as u
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    import inductor_rocm_attn as ira
    from blocks import AttnBlock, block_inputs
    from inductor_rocm_attn.forward_context import get_layer
    from inductor_rocm_attn.models import qwen3_config
    from inductor_rocm_attn.passes.pass_manager import PassManager

    def run(report):
        torch.manual_seed(0)
        cfg = qwen3_config(num_heads=4, num_kv_heads=2, head_size=32)
        block = AttnBlock(cfg, "report_cache.attn")
        ira.bind_kv_caches(block, 4, torch.float32)
        md = ira.build_attention_metadata([6], [0], [[1]], 16)
        manager = PassManager(report=report)
        torch._dynamo.reset()
        with inductor_config.patch(post_grad_custom_post_pass=manager, fx_graph_cache=True), \
                torch.no_grad(), ira.set_forward_context(md):
            out = torch.compile(block)(*block_inputs(cfg, num_tokens=6))
        ran = sum(p.total_time_s > 0 for p in manager.passes)
        layer = get_layer("report_cache.attn")
        del block
        gc.collect()
        return out, ran, layer.interleaved_v

    from inductor_rocm_attn.passes import base

    base.replayed_records()  # what earlier compiles of this process left
    fresh = u.fresh_cache() if hasattr(u, "fresh_cache") else u.fresh_inductor_cache()
    with fresh:
        cold_report, warm_report = FusionReport(receives_replays=True), FusionReport(receives_replays=True)
        counters.clear()
        out1, ran1, switched1 = run(cold_report)
        cold = str(cold_report)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1 and ran1 > 0
        out2, ran2, switched2 = run(warm_report)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1 and ran2 == 0  # no pass ran
    assert "FUSED report_cache.attn" in cold and switched1 and switched2
    assert str(warm_report) == cold
    assert all(r.from_cache for r in warm_report.records)
    torch.testing.assert_close(out1, out2)
