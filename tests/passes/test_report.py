"""The fusion report: one line per candidate, misses superseded by another pass's fusion of the
same cache update shown as informational."""

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
