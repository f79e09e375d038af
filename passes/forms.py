"""The plain-PyTorch forms the fusion passes recognize, traced into pattern-matcher patterns.

Each form is a plain eager function, written the way models write it (HF ``rotate_half``
RoPE with cos/sin gathered by position; transformers' RoPE with the model's per-token cos/sin
on ``[B, H, T, D]`` transposes, ``rotate_half`` sliced; HF RMSNorm with its dtype casts; the
plain static fp8 quant). A form is traced once per (dtype, head geometry) with ``fwd_only`` (Inductor's
own decompositions, so the pattern has the shape of a post-grad graph) and turned into a
``PatternExpr`` with ``fx_to_pattern``. Two values are made wildcards while converting:

- the token count: traced as ``_MAGIC_T`` and bound to one ``KeywordArg("_T")``, so it
  matches a symbolic (dynamic) or concrete token count, the same one everywhere (likewise
  the batch and head counts, ``_B`` / ``_H``, of the GPT-J per-token form, whose interleave
  reshapes to explicit sizes);
- ``eps``: traced as ``_MAGIC_EPS`` and bound to ``KeywordArg("eps")`` (the pattern
  matcher's ``scalar_workaround``), so the replacement gets the model's own eps.

Every other constant (head size, split sizes, dims, dtypes, fp8 bounds) stays exact, so a
norm over another axis, a split at another point or a cast to another dtype does not
match. Node user counts are relaxed (``MULTIPLE``): the passes only *recognize* with these
patterns; they rewrite by hand and leave dead nodes to dead-code elimination, so a shared
cos/sin gather (one per model, used by every layer) does not block a match.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import torch
from torch._inductor import pattern_matcher as pm

aten = torch.ops.aten

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, n)
)

_MAGIC_T = 97  # token count used while tracing; must not collide with a head geometry int
_MAGIC_B, _MAGIC_H = 5, 7  # batch and head counts of the forms whose reshapes spell them out
_MAGIC_EPS = 9.87654e-05
_POSITIONS = 8  # rows of the traced cos_sin_cache


# === forms (plain eager functions) ==========================================================


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_neox_hf(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF NeoX RoPE of ``x [T, H, D]``; ``cos_sin_cache [P, D]`` (cos half | sin half), ``positions [T]``."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def rotate_half_sliced(x: torch.Tensor) -> torch.Tensor:
    """``rotate_half`` as transformers writes it (slicing, in every model that has it)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_neox_hf_sliced(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``rope_neox_hf`` with the slicing ``rotate_half``."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    return x * cos + rotate_half_sliced(x) * sin


def rope_neox_transformers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' attention modules: the projection's view ``x [B, T, H, D]`` transposed to
    ``[B, H, T, D]``, rotated by ``apply_rotary_pos_emb`` with the model's per-token ``cos``/
    ``sin [B, T, D]`` (``unsqueeze_dim=1``), transposed back by the attention function."""
    x = x.transpose(1, 2)
    out = x * cos.unsqueeze(1) + rotate_half_sliced(x) * sin.unsqueeze(1)
    return out.transpose(1, 2)


def rope_neox_per_token(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same formula token-major: ``x [T, H, D]``, per-token ``cos``/``sin [T, D]``."""
    return x * cos.unsqueeze(1) + rotate_half_sliced(x) * sin.unsqueeze(1)


def rope_neox_tokens_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same formula on tokens-first ``x [B, T, H, D]`` with per-token ``cos``/``sin [B, T, D]``
    unsqueezed at the head dim (transformers' Gemma4: ``apply_rotary_pos_emb(..., unsqueeze_dim=2)``
    before the transpose to ``[B, H, T, D]``, which the attention function transposes back)."""
    return x * cos.unsqueeze(2) + rotate_half_sliced(x) * sin.unsqueeze(2)


def rope_neox_per_token_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_neox_per_token`` with a partial rotary (Phi-3, GPT-NeoX, StableLM): the first
    ``cos.shape[-1]`` channels of each head rotate, the rest pass (``torch.cat``)."""
    r = cos.shape[-1]
    return torch.cat((rope_neox_per_token(x[..., :r], cos, sin), x[..., r:]), dim=-1)


def rope_neox_transformers_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_neox_transformers`` with a partial rotary."""
    return rope_neox_per_token_partial(x.transpose(1, 2), cos, sin).transpose(1, 2)


def rope_neox_heads_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_neox_transformers`` on q/k already ``[B, H, T, D]`` (GPT-NeoX cuts them from a
    heads-first qkv); transposed back to ``[B, T, H, D]`` by the attention function."""
    return rope_neox_per_token(x, cos, sin).transpose(1, 2)


def rope_neox_heads_first_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_neox_heads_first`` with a partial rotary (GPT-NeoX's ``rotary_pct``)."""
    return rope_neox_per_token_partial(x, cos, sin).transpose(1, 2)


def rope_halves_transformers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's ``_apply_rotary_emb``: ``x [B, T, H, D]`` transposed to ``[B, H, T, D]``, its
    halves rotated by per-token ``cos``/``sin [B, T, D/2]`` (one value per channel pair, not
    repeated), joined by a ``cat``. The NeoX rotation with cos/sin ``cat((c, c))``."""
    x = x.transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * c - second * s, second * c + first * s), dim=-1).transpose(1, 2)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[:, :, ::2], x[:, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rope_gptj_hf(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF GPT-J RoPE (pairs ``(2i, 2i+1)``, as modeling_gptj writes it) of ``x [T, H, D]``."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.repeat_interleave(cos[:, None, :], 2, 2)
    sin = torch.repeat_interleave(sin[:, None, :], 2, 2)
    return x * cos + rotate_every_two(x) * sin


def rotate_pairs_interleaved(x: torch.Tensor) -> torch.Tensor:
    """transformers' Cohere ``rotate_half``: pairs ``(2i, 2i+1)`` -> ``(-x[2i+1], x[2i])``."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def rope_gptj_transformers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' Cohere attention: ``x [B, T, H, D]`` transposed to ``[B, H, T, D]``,
    rotated in fp32 with interleaved (GPT-J) pairs by per-token ``cos``/``sin [B, T, D]`` (each
    pair's angle repeated), cast back, transposed back by the attention function. The fused
    writers' ``is_neox=False`` with those rows: the same fp32 formula, rounded once."""
    dtype = x.dtype
    x = x.transpose(1, 2).float()
    out = x * cos.unsqueeze(1) + rotate_pairs_interleaved(x) * sin.unsqueeze(1)
    return out.to(dtype).transpose(1, 2)


def repeat_pairs(c: torch.Tensor) -> torch.Tensor:
    """The first half of the rows, each value repeated for a channel pair
    (``c[..., : c.shape[-1] // 2].repeat_interleave(2, dim=-1)``): GPT-J rows from the
    model's NeoX rows ``cat((f, f))``."""
    return c[..., : c.shape[-1] // 2].repeat_interleave(2, dim=-1)


def rope_gptj_pair_rows_transformers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' GLM-style ``apply_rotary_pos_emb`` (Helium): ``x [B, T, H, D]`` transposed
    to ``[B, H, T, D]``, the model's per-token rows ``cos``/``sin [B, T, D]`` unsqueezed and cut
    to GPT-J rows by ``repeat_pairs``, interleaved pairs rotated in the model dtype, transposed
    back. The fused writers' ``is_neox=False`` with the rows ``repeat_pairs(cos)``: the second
    half of the model's rows is not read, here as there."""
    x = x.transpose(1, 2)
    cos, sin = repeat_pairs(cos.unsqueeze(1)), repeat_pairs(sin.unsqueeze(1))
    out = x * cos + rotate_pairs_interleaved(x) * sin
    return out.transpose(1, 2)


def rope_gptj_pair_rows_transformers_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_gptj_pair_rows_transformers`` with a partial rotary (GLM, GLM4): the first
    ``cos.shape[-1]`` channels of each head rotate, the rest pass (``torch.cat``)."""
    x = x.transpose(1, 2)
    cos, sin = repeat_pairs(cos.unsqueeze(1)), repeat_pairs(sin.unsqueeze(1))
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    out = x_rot * cos + rotate_pairs_interleaved(x_rot) * sin
    return torch.cat([out, x_pass], dim=-1).transpose(1, 2)


def rope_gptj_pair_rows_transformers_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_gptj_pair_rows_transformers`` rotated in fp32 (Ernie 4.5): ``x`` and its rotation
    (a sign change and a permutation, exact in any dtype) each converted to fp32, times the
    rows as they come (fp32 or the model dtype), rounded once to the model dtype. The fused
    writers' formula: rows widened to fp32 exactly, fp32 arithmetic, one rounding."""
    dtype = x.dtype
    x = x.transpose(1, 2)
    cos, sin = repeat_pairs(cos.unsqueeze(1)), repeat_pairs(sin.unsqueeze(1))
    out = x.float() * cos + rotate_pairs_interleaved(x).float() * sin
    return out.to(dtype).transpose(1, 2)


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm over the last dim: fp32 statistics, cast back, then ``weight *``."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm_hf_weight_last(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As ``rms_norm_hf`` with the weight multiplied on the right (``x.to(dtype) * weight``)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype) * weight


def rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (``Gemma3RMSNorm``): fp32 statistics, times ``1 + weight`` in fp32,
    then one cast back."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * (1.0 + weight.to(torch.float32))).to(dtype)


def rms_norm_gemma4(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma4's RMSNorm (``Gemma4RMSNorm`` with its scale): fp32 statistics through
    ``pow(mean + eps, -0.5)``, times ``weight`` (not ``1 + weight``) in fp32, then one cast back."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (x * weight.float()).to(dtype)


def make_fp8_quant_plain(fp8_dtype: torch.dtype) -> Callable:
    m = torch.finfo(fp8_dtype).max

    def fp8_quant_plain(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Static per-tensor fp8 quant as models write it: ``(x / scale).clamp(min, max).to(fp8)``."""
        return (x / scale).clamp(-m, m).to(fp8_dtype)

    return fp8_quant_plain


ROPE_FORMS = {"hf_neox": (rope_neox_hf, True), "hf_neox_sliced": (rope_neox_hf_sliced, True),
              "hf_gptj": (rope_gptj_hf, False)}
# RoPE with the model's own per-token cos/sin: form -> (function, rank of x). NeoX pairs
# (i, i + D/2); the GPT-J forms (pairs 2i, 2i+1) are GPTJ_COS_SIN_ROPE_FORMS.
COS_SIN_ROPE_FORMS = {"transformers_neox": (rope_neox_transformers, 4), "per_token_neox": (rope_neox_per_token, 3),
                      "heads_first_neox": (rope_neox_heads_first, 4), "tokens_first_neox": (rope_neox_tokens_first, 4)}
# The same with a partial rotary: cos/sin narrower than the head (their width a pattern constant).
PARTIAL_COS_SIN_ROPE_FORMS = {"transformers_neox_partial": (rope_neox_transformers_partial, 4),
                              "per_token_neox_partial": (rope_neox_per_token_partial, 3),
                              "heads_first_neox_partial": (rope_neox_heads_first_partial, 4)}
# NeoX with cos/sin of half the head, one value per channel pair (the fused op gets them doubled).
HALF_COS_SIN_ROPE_FORMS = {"transformers_halves": (rope_halves_transformers, 4)}
# GPT-J pairs with per-token cos/sin, the fused writers' is_neox=False: Cohere's (its rows
# already GPT-J, rotated in fp32), and the GLM-style forms that cut GPT-J rows from the model's
# NeoX rows (``repeat_pairs``) in the model dtype or in fp32.
GPTJ_COS_SIN_ROPE_FORMS = {"transformers_gptj": (rope_gptj_transformers, 4),
                           "transformers_gptj_pair_rows": (rope_gptj_pair_rows_transformers, 4),
                           "transformers_gptj_pair_rows_fp32": (rope_gptj_pair_rows_transformers_fp32, 4)}
PARTIAL_COS_SIN_ROPE_FORMS["transformers_gptj_pair_rows_partial"] = (rope_gptj_pair_rows_transformers_partial, 4)
# Every interleaved-pairs (GPT-J) per-token form.
GPTJ_FORMS = frozenset({*GPTJ_COS_SIN_ROPE_FORMS, "transformers_gptj_pair_rows_partial"})
# Forms whose writer rows are ``repeat_pairs`` of the model's rows (the emitted rows repeat them).
PAIR_ROWS_FORMS = frozenset({"transformers_gptj_pair_rows", "transformers_gptj_pair_rows_fp32",
                             "transformers_gptj_pair_rows_partial"})
# Forms that widen q/k to fp32 before any product, so rows in fp32 or in the model dtype
# give the writer's arithmetic exactly (it widens the rows too). In an fp32 model their
# conversions vanish and the model-dtype form matches instead.
FP32_ROTATION_FORMS = frozenset({"transformers_gptj_pair_rows_fp32"})
# Forms whose q/k input is [B, H, T, D] (the rest of rank 4: [B, T, H, D]).
HEADS_FIRST_FORMS = frozenset({"heads_first_neox", "heads_first_neox_partial"})
# Every per-token form: name -> (function, rank of x).
PER_TOKEN_ROPE_FORMS = (COS_SIN_ROPE_FORMS | PARTIAL_COS_SIN_ROPE_FORMS | HALF_COS_SIN_ROPE_FORMS
                        | GPTJ_COS_SIN_ROPE_FORMS)
# Tried in this order. "gemma" first: in fp32 (its casts no-ops) a Gemma norm would also match
# "hf_weight_last" with the computed ``1 + weight`` as the weight (the same function, so exact
# either way, but reported as the plain form); no other form has that ``1 +``.
# "gemma4" (``pow(..., -0.5)``, not ``rsqrt``) overlaps no other form.
RMS_FORMS = {"gemma": rms_norm_gemma, "hf": rms_norm_hf, "hf_weight_last": rms_norm_hf_weight_last,
             "gemma4": rms_norm_gemma4}
# Forms whose weight enters as ``1 + weight`` (the fused op's ``gemma_norm``).
GEMMA_RMS_FORMS = frozenset({"gemma"})
# Forms whose weight multiplies in fp32 before the one rounding (the fused op's ``gemma4_norm``).
GEMMA4_RMS_FORMS = frozenset({"gemma4"})


# === tracing into patterns ==================================================================


def _relax_users(p: Any, seen: set) -> None:
    if not isinstance(p, pm.PatternExpr) or id(p) in seen:
        return
    seen.add(id(p))
    if isinstance(p, pm._TargetExpr):
        p.users = pm.MULTIPLE
    if isinstance(p, pm._TargetArgsExpr):
        for a in p.flat_args_kwargs[0]:
            _relax_users(a, seen)


def _trace(fn: Callable, args: list, argnames: list[str], eps: bool = False,
           sizes: dict[int, str] | None = None) -> pm.PatternExpr:
    """``fn`` traced on ``args`` as a pattern; the token count ``_MAGIC_T`` and the traced
    ``sizes`` (value -> name: the batch and head counts of a form whose reshapes spell them
    out) become wildcards."""
    gm = pm.fwd_only(fn, args)
    graph = gm.graph
    wild = {_MAGIC_T: "_T", **(sizes or {})}
    last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
    placeholders = {}
    with graph.inserting_after(last_ph):
        for value, name in wild.items():
            placeholders[value] = graph.placeholder(name)

    def sub(a):
        return placeholders[a] if type(a) is int and a in placeholders else a

    for node in list(graph.nodes):
        if node.op == "call_function":
            if node.target is aten.view.default:  # post-grad graphs hold views as reshapes
                node.target = aten.reshape.default
            node.args = torch.fx.node.map_aggregate(node.args, sub)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, sub)
    pattern = pm.fx_to_pattern(
        gm, argnames=[*argnames, *wild.values()], scalar_workaround={"eps": _MAGIC_EPS} if eps else None
    )
    _relax_users(pattern, set())
    return pattern


@functools.cache
def rope_pattern(form: str, dtype: torch.dtype, num_heads: int, head_size: int) -> pm.PatternExpr:
    """Pattern of ``ROPE_FORMS[form]`` on ``x [T, num_heads, head_size]`` in ``dtype``."""
    assert _MAGIC_T not in (num_heads, head_size, head_size // 2)
    fn, _ = ROPE_FORMS[form]
    args = [torch.randn(_MAGIC_T, num_heads, head_size, dtype=dtype),
            torch.randn(_POSITIONS, head_size, dtype=dtype),
            torch.zeros(_MAGIC_T, dtype=torch.int64)]
    return _trace(fn, args, ["x", "cos_sin_cache", "positions"])


# (batch, heads) traced for the forms that spell them out, the first pair that no size of
# the form's own equals (a wildcard must stand for nothing else)
_MAGIC_BH = ((_MAGIC_B, _MAGIC_H), (11, 13), (17, 19), (23, 29))


@functools.cache
def rope_cos_sin_pattern(form: str, dtype: torch.dtype, head_size: int, rot_dim: int | None = None,
                         cos_dtype: torch.dtype | None = None) -> pm.PatternExpr | None:
    """Pattern of ``PER_TOKEN_ROPE_FORMS[form]`` on heads of ``head_size`` in ``dtype``, its
    cos/sin ``cos_sin_width`` wide in ``cos_dtype`` (default ``dtype``; ``rot_dim``: the rotated
    channels of a partial form). Sizes other than those never appear in it: batch, tokens and
    heads are free. None where the traced token count would equal one of the form's sizes."""
    fn, rank = PER_TOKEN_ROPE_FORMS[form]
    width = cos_sin_width(form, head_size, rot_dim)
    own = {head_size, head_size // 2, rot_dim, width, width // 2, 2}
    if _MAGIC_T in own:
        return None
    # The GPT-J forms' interleave (stack + flatten) reshapes to sizes it spells out: traced
    # with batch and head counts of their own, made wildcards.
    spelled = form in GPTJ_FORMS
    batch, heads = next(((b, h) for b, h in _MAGIC_BH if not {b, h} & own), (None, None)) if spelled else (2, 3)
    if batch is None:
        return None
    lead = [batch, _MAGIC_T] if rank == 4 else [_MAGIC_T]
    x_shape = [batch, heads, _MAGIC_T, head_size] if form in HEADS_FIRST_FORMS else [*lead, heads, head_size]
    cos_dtype = cos_dtype or dtype
    args = [torch.randn(*x_shape, dtype=dtype), torch.randn(*lead, width, dtype=cos_dtype),
            torch.randn(*lead, width, dtype=cos_dtype)]
    sizes = {batch: "_B", heads: "_H"} if spelled else None
    return _trace(fn, args, ["x", "cos", "sin"], sizes=sizes)


def cos_sin_width(form: str, head_size: int, rot_dim: int | None = None) -> int:
    """The width of the cos/sin rows a per-token form takes."""
    if form in PARTIAL_COS_SIN_ROPE_FORMS:
        return rot_dim
    return head_size // 2 if form in HALF_COS_SIN_ROPE_FORMS else head_size


@functools.cache
def rms_pattern(form: str, dtype: torch.dtype, num_heads: int, head_size: int) -> pm.PatternExpr:
    """Pattern of ``RMS_FORMS[form]`` on ``x [T, num_heads, head_size]``, weight ``[head_size]``."""
    assert _MAGIC_T not in (num_heads, head_size)
    fn = RMS_FORMS[form]
    args = [torch.randn(_MAGIC_T, num_heads, head_size, dtype=dtype), torch.randn(head_size, dtype=dtype),
            _MAGIC_EPS]
    return _trace(fn, args, ["x", "weight", "eps"], eps=True)


@functools.cache
def fp8_quant_pattern(dtype: torch.dtype, fp8_dtype: torch.dtype, ndim: int) -> pm.PatternExpr:
    """Pattern of the plain static fp8 quant of an ``ndim``-D ``dtype`` tensor by a fp32 scale."""
    shape = [_MAGIC_T, 4, 32][:ndim]
    args = [torch.randn(*shape, dtype=dtype), torch.ones(1, dtype=torch.float32)]
    return _trace(make_fp8_quant_plain(fp8_dtype), args, ["x", "scale"])


def match(pattern: pm.PatternExpr, node: torch.fx.Node) -> tuple[dict | None, str]:
    """``(kwargs, "")`` when ``pattern`` matches at ``node``, else ``(None, why)``."""
    m = pattern.match(node)
    if not m:
        return None, _short(str(m))
    return dict(m.kwargs), ""


def _short(why: str) -> str:
    """A FailedMatch message with the (long) pattern repr cut to its head."""
    return re.sub(r"pattern=(\w+)\(([\w.]+).*", r"pattern=\2(...)", why, flags=re.S)
