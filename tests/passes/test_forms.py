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


def _rot(form):
    """The rotated width the partial forms are traced with here (of a 32-channel head)."""
    return 16 if form in forms.PARTIAL_COS_SIN_ROPE_FORMS else None


def _per_token_args(form, dtype, d=32):
    _, rank = forms.PER_TOKEN_ROPE_FORMS[form]
    lead = (2, 5) if rank == 4 else (5,)
    x_shape = (2, 4, 5, d) if form in forms.HEADS_FIRST_FORMS else (*lead, 4, d)
    width = forms.cos_sin_width(form, d, _rot(form))
    return (torch.randn(*x_shape, dtype=dtype), torch.randn(*lead, width, dtype=dtype),
            torch.randn(*lead, width, dtype=dtype))


@pytest.mark.parametrize("form", list(forms.PER_TOKEN_ROPE_FORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cos_sin_rope_pattern_matches_its_form_only(form, dtype):
    """Each per-token form's pattern matches its own function and no other form's pattern
    does (full / partial / halves, [B, T, H, D] / heads-first / token-major)."""
    fn, rank = forms.PER_TOKEN_ROPE_FORMS[form]
    args = _per_token_args(form, dtype)
    r = _matches(Form(fn), args, forms.rope_cos_sin_pattern(form, dtype, 32, _rot(form)))
    assert r["kw"] is not None, r["why"]
    tensors = {n for n in r["inputs"] if isinstance(n.meta.get("val"), torch.Tensor)}
    x, cos, sin = (r["kw"][k] for k in ("x", "cos", "sin"))
    assert x.meta["val"].dim() == rank and {cos, sin} == tensors - {x} and cos is not sin
    for other in forms.PER_TOKEN_ROPE_FORMS:
        if other == form:
            continue
        m = _matches(Form(fn), args, forms.rope_cos_sin_pattern(other, dtype, 32, _rot(other)))["kw"]
        if _HEADS_FIRST_OF.get(form) == other:  # the same function of x.transpose(1, 2): equivalent
            assert m is not None and m["x"].target is torch.ops.aten.permute.default, other
        elif dtype == torch.float32 and {form, other} == _SAME_IN_FP32:  # its conversions vanish in fp32
            assert m is not None, other
        else:
            assert m is None, other
    if form not in forms.PARTIAL_COS_SIN_ROPE_FORMS:  # a partial pattern holds the rotated width only
        assert _matches(Form(fn), args, forms.rope_cos_sin_pattern(form, dtype, 64))["kw"] is None  # other head


_SAME_IN_FP32 = {"transformers_gptj_pair_rows", "transformers_gptj_pair_rows_fp32"}
_HEADS_FIRST_OF = {"transformers_neox": "heads_first_neox", "transformers_neox_partial": "heads_first_neox_partial"}


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
