"""The plain-PyTorch forms, traced into patterns: each matches its own form in a post-grad graph
at any token count (and binds eps), and not the other forms or a norm over another axis."""

import pytest
import torch
from torch import nn

from fx_capture import capture
from inductor_rocm_attn.passes import forms

NO_FUSIONS = dict(qk_norm_rope_kv_cache_fusion=False, rope_kv_cache_fusion=False, attn_quant_fusion=False)


class Form(nn.Module):
    """``fn(x [T, 4, 32], ...)`` with the form's constant inputs as buffers."""

    def __init__(self, fn, **buffers):
        super().__init__()
        self.fn = fn
        for k, v in buffers.items():
            self.register_buffer(k, v)

    def forward(self, x, *rest):
        return self.fn(x, *self._buffers.values(), *rest)


def _matches(fn, args, pattern):
    """``forms.match(pattern, <node computing fn's output>)`` in ``fn``'s post-grad graph, with
    the graph's placeholders (read inside the capture: the graph is gone afterwards)."""
    result = {}

    def inspect(graph):
        root = next(n for n in graph.nodes if n.op == "output").args[0][0]
        kw, why = forms.match(pattern, root)
        result.update(kw=kw, why=why, inputs=[n for n in graph.nodes if n.op == "placeholder"])

    capture(fn, *args, user_pass=inspect, **NO_FUSIONS)
    return result


@pytest.mark.parametrize("form", list(forms.ROPE_FORMS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rope_pattern_matches_its_form_only(form, dtype):
    fn, _ = forms.ROPE_FORMS[form]
    mod = Form(fn, cos_sin_cache=torch.randn(64, 32, dtype=dtype))
    args = (torch.randn(5, 4, 32, dtype=dtype), torch.arange(5))
    r = _matches(mod, args, forms.rope_pattern(form, dtype, 4, 32))
    assert r["kw"] is not None, r["why"]
    assert {r["kw"]["x"], r["kw"]["positions"], r["kw"]["cos_sin_cache"]} <= set(r["inputs"])
    other = next(f for f in forms.ROPE_FORMS if f != form)
    assert _matches(mod, args, forms.rope_pattern(other, dtype, 4, 32))["kw"] is None
    assert _matches(mod, args, forms.rope_pattern(form, dtype, 4, 64))["kw"] is None  # other geometry


@pytest.mark.parametrize("form", list(forms.COS_SIN_ROPE_FORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cos_sin_rope_pattern_matches_its_form_only(form, dtype):
    fn, rank = forms.COS_SIN_ROPE_FORMS[form]
    lead = (2, 5) if rank == 4 else (5,)
    args = (torch.randn(*lead, 4, 32, dtype=dtype), torch.randn(*lead, 32, dtype=dtype),
            torch.randn(*lead, 32, dtype=dtype))
    r = _matches(Form(fn), args, forms.rope_cos_sin_pattern(form, dtype, 32))
    assert r["kw"] is not None, r["why"]
    tensors = {n for n in r["inputs"] if isinstance(n.meta.get("val"), torch.Tensor)}
    x, cos, sin = (r["kw"][k] for k in ("x", "cos", "sin"))
    assert x.meta["val"].dim() == rank and {cos, sin} == tensors - {x} and cos is not sin
    other = next(f for f in forms.COS_SIN_ROPE_FORMS if f != form)
    assert _matches(Form(fn), args, forms.rope_cos_sin_pattern(other, dtype, 32))["kw"] is None
    assert _matches(Form(fn), args, forms.rope_cos_sin_pattern(form, dtype, 64))["kw"] is None  # other head


@pytest.mark.parametrize("form", list(forms.RMS_FORMS))
def test_rms_pattern_binds_eps(form):
    eps = 3e-6
    mod = Form(lambda x, w: forms.RMS_FORMS[form](x, w, eps), weight=torch.randn(32))
    r = _matches(mod, (torch.randn(5, 4, 32),), forms.rms_pattern(form, torch.float32, 4, 32))
    assert r["kw"] is not None, r["why"]
    assert r["kw"]["eps"] == pytest.approx(eps)


def test_rms_pattern_refuses_a_norm_over_another_axis():
    def over_heads(x, w):
        x32 = x.to(torch.float32)
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(1, keepdim=True) + 1e-6)).to(x.dtype)

    mod = Form(over_heads, weight=torch.randn(32))
    r = _matches(mod, (torch.randn(5, 4, 32),), forms.rms_pattern("hf", torch.float32, 4, 32))
    assert r["kw"] is None and r["why"]


def test_fp8_quant_pattern():
    fp8 = torch.float8_e4m3fn
    mod = Form(forms.make_fp8_quant_plain(fp8), scale=torch.tensor([0.5]))
    r = _matches(mod, (torch.randn(5, 4, 32),), forms.fp8_quant_pattern(torch.float32, fp8, 3))
    assert r["kw"] is not None, r["why"]
    other = forms.fp8_quant_pattern(torch.float32, torch.float8_e5m2, 3)  # other bounds and cast
    assert _matches(mod, (torch.randn(5, 4, 32),), other)["kw"] is None
