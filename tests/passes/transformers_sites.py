"""transformers attention sites for pass tests (needs transformers).

``decoder_layer(arch, dtype)``: one real decoder layer of a transformers model built from
config with ``attn_implementation="rocm_attn"``, as ``(fn, args)`` for ``fx_capture.capture``
(hidden states and the model's own cos/sin as inputs). ``SiteAttention``: transformers'
Llama / Qwen3 attention written out step for step (projections viewed ``[B, T, H, D]``,
optional per-head ``Qwen3RMSNorm``, transposes, ``apply_rotary_pos_emb``, the integration's
``attention_forward``), with variants that change the function the passes must not fuse.
"""

from __future__ import annotations

import itertools
import types

import torch
import transformers
from torch import nn

from inductor_rocm_attn.integrations.transformers import attention_forward

_COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=6),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, sliding_window=6, attn_logit_softcapping=5.0,
                                                query_pre_attn_scalar=24, layer_types=["sliding_attention"]),
    # RoPE over half of each head (partial rotary: fused with cos/sin rows of 16); a negative
    # for the QK-norm fusion: QK-norm over the whole projection before the view (not per head)
    "phi": lambda: transformers.PhiConfig(**{k: v for k, v in _COMMON.items() if k not in ("head_dim", "rms_norm_eps")},
                                          partial_rotary_factor=0.5),
    "olmo2": lambda: transformers.Olmo2Config(**_COMMON),
    # GPT-OSS's RoPE: the halves of each head rotated by half-width cos/sin, joined by a cat
    "gpt_oss": lambda: transformers.GptOssConfig(**dict(_COMMON, intermediate_size=128), num_local_experts=4,
                                                 num_experts_per_tok=2, layer_types=["full_attention"]),
    # Hunyuan: QK-norm after RoPE, per head on the heads-first [B, H, T, D] rotated q/k
    "hunyuan": lambda: transformers.HunYuanDenseV1Config(**_COMMON),
    # mRoPE: Qwen2-VL applies its sections inside the rotary embedding; the attention rotates
    # with plain apply_rotary_pos_emb on the per-token rows
    "qwen2_vl": lambda: transformers.Qwen2VLTextConfig(
        **_COMMON, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
}
B, T = 2, 5


def decoder_layer(arch: str, dtype=torch.float32, seed: int = 0, shared_positions: bool = False):
    """``(fn, (hidden [B, T, 128], cos, sin))``: layer 0 of ``arch`` with the model's cos/sin
    (``shared_positions``: from ``position_ids [1, T]``, cos/sin ``[1, T, D]`` broadcast over
    the batch)."""
    config = CONFIGS[arch]()
    torch.manual_seed(seed)
    if arch == "qwen2_vl":
        model = transformers.Qwen2VLTextModel._from_config(config, attn_implementation="rocm_attn", dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn",
                                                              dtype=dtype).model
    model.eval()
    layer = model.layers[0]
    hidden = torch.randn(B, T, config.hidden_size, dtype=dtype)
    positions = torch.arange(T)[None] if shared_positions else torch.arange(T)[None].expand(B, T)
    if arch == "qwen2_vl":  # (temporal, height, width) positions
        positions = torch.stack([positions, positions + 1, positions * 2])
    cos, sin = model.rotary_emb(hidden, positions)

    def fn(hidden, cos, sin):
        return layer(hidden, attention_mask=None, position_embeddings=(cos, sin), position_ids=positions)

    return fn, (hidden, cos, sin)


# --- transformers' attention written out, with variants ----------------------------------------


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    """GPT-J's rotation (pairs 2i, 2i + 1): another function of the same inputs."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    """``Qwen3RMSNorm``; ``dim``: the axis it normalizes over (-1: per head)."""

    def __init__(self, size, eps=1e-6, dim=-1):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(size))
        self.eps, self.dim = eps, dim

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(self.dim, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


_idx = itertools.count(1000)

VARIANTS = {
    "plain": "transformers' Llama attention",
    "mrope_sections": "Qwen2-VL's older form: mRoPE sections picked from [3, B, T, D] cos/sin in the attention",
    "gptj_rotation": "GPT-J's interleaved rotation with NeoX cos/sin rows",
    "partial_rotary": "RoPE over the first half of each head, the rest passed through",
    "k_other_positions": "the key rotated with cos/sin of other positions than the query",
    "cos_fp32": "cos/sin kept in fp32 for a half-precision q/k (the products promote)",
    "gptj_pair_rows": "GLM-style RoPE (Helium): GPT-J pairs, rows cut from the NeoX rows by repeat_interleave",
    "gptj_pair_rows_partial": "the same over the first half of each head (GLM, GLM4)",
    "gptj_pair_rows_fp32": "the same rotated in fp32 with fp32 rows, rounded once (Ernie 4.5)",
    "clip_qk": "q/k/v projections clamped in place before the view (OLMo's clip_qkv)",
    "pair_rows_second_half": "GLM-style RoPE with rows cut from the second half of the NeoX rows",
    "pair_rows_fp32_rounded_products": "Ernie-style RoPE rounding each product to the model dtype before the sum",
    "clip_qk_cos_term_unclamped": "clip_qk, the x * cos term reading the projection from before the clamp",
    "norm_over_heads": "QK-norm over the heads axis, not the head dim",
    "k_norm_eps_differs": "k-norm with another eps than q-norm",
}


class SiteAttention(nn.Module):
    """transformers' attention (Llama; Qwen3 with ``qk_norm``), written out; ``variant`` in
    ``VARIANTS``. ``forward(hidden [B, T, 128], cos, sin[, cos_k, sin_k]) -> [B, T, 128]``."""

    def __init__(self, variant: str = "plain", qk_norm: bool = False, hq: int = 4, hkv: int = 2, d: int = 32):
        super().__init__()
        assert variant in VARIANTS, variant
        self.variant, self.qk_norm = variant, qk_norm
        self.hq, self.hkv, self.head_dim = hq, hkv, d
        hidden = 128
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, n * d, bias=False) for n in (hq, hkv, hkv))
        self.o_proj = nn.Linear(hq * d, hidden, bias=False)
        if qk_norm:
            dim = -2 if variant == "norm_over_heads" else -1
            self.q_norm = RMSNorm(hq if dim == -2 else d, dim=dim)
            self.k_norm = RMSNorm(hkv if dim == -2 else d, dim=dim,
                                  eps=1e-5 if variant == "k_norm_eps_differs" else 1e-6)
            if dim == -2:  # the weight still multiplies the head dim
                self.q_norm.weight, self.k_norm.weight = (nn.Parameter(1 + 0.1 * torch.randn(d)) for _ in range(2))
        # what attention_forward reads from a transformers attention module
        self.layer_idx = next(_idx)
        self.scaling = d ** -0.5
        self.is_causal = True
        self.config = types.SimpleNamespace(sliding_window=None)

    def _rope(self, x, cos, sin, x_cos_term=None):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if "pair_rows" in self.variant:  # GLM's apply_rotary_pos_emb
            start = cos.shape[-1] // 2 if self.variant == "pair_rows_second_half" else 0
            cos = cos[..., start: start + cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
            sin = sin[..., start: start + sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
            if self.variant == "gptj_pair_rows_partial":
                rot = cos.shape[-1]
                x_rot, x_pass = x[..., :rot], x[..., rot:]
                return torch.cat([x_rot * cos + rotate_every_two(x_rot) * sin, x_pass], dim=-1)
            if self.variant == "gptj_pair_rows_fp32":
                return (x.float() * cos + rotate_every_two(x).float() * sin).to(x.dtype)
            if self.variant == "pair_rows_fp32_rounded_products":
                return (x.float() * cos).to(x.dtype) + (rotate_every_two(x).float() * sin).to(x.dtype)
            return x * cos + rotate_every_two(x) * sin
        if x_cos_term is not None:
            return x_cos_term * cos + rotate_half(x) * sin
        if self.variant == "partial_rotary":
            rot = x.shape[-1] // 2
            x_rot, x_pass = x[..., :rot], x[..., rot:]
            c, s = cos[..., :rot], sin[..., :rot]
            return torch.cat((x_rot * c + rotate_half(x_rot) * s, x_pass), dim=-1)
        turn = rotate_every_two if self.variant == "gptj_rotation" else rotate_half
        return x * cos + turn(x) * sin

    def forward(self, hidden, cos, sin, cos_k=None, sin_k=None):
        shape = (*hidden.shape[:-1], -1, self.head_dim)
        if self.variant.startswith("clip_qk"):  # OLMo: q/k/v clamped in place, then viewed
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
            q_unclamped = q.clone().view(shape).transpose(1, 2)
            for t in (q, k, v):
                t.clamp_(min=-0.5, max=0.5)
            q, k, v = q.view(shape), k.view(shape), v.view(shape).transpose(1, 2)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            x_cos = q_unclamped if self.variant == "clip_qk_cos_term_unclamped" else None
            q, k = self._rope(q, cos, sin, x_cos), self._rope(k, cos, sin)
            out, _ = attention_forward(self, q, k, v, None, scaling=self.scaling)
            return self.o_proj(out.reshape(*hidden.shape[:-1], -1))
        q = self.q_proj(hidden).view(shape)
        k = self.k_proj(hidden).view(shape)
        v = self.v_proj(hidden).view(shape).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.variant == "cos_fp32":
            cos, sin = cos.float(), sin.float()
        if self.variant == "mrope_sections":  # cos [3, B, T, D]: section i from source i % 3, once for q and k
            sections = [4, 6, 6] * 2
            cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1)
            sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1)
        q = self._rope(q, cos, sin)
        if self.variant == "k_other_positions":
            cos, sin = cos_k, sin_k
        k = self._rope(k, cos, sin)
        out, _ = attention_forward(self, q, k, v, None, scaling=self.scaling)
        return self.o_proj(out.reshape(*hidden.shape[:-1], -1))


def site_inputs(variant: str, dtype=torch.float32, d: int = 32, seed: int = 1):
    """``(hidden, cos, sin[, cos_k, sin_k])`` for ``SiteAttention``: the model's NeoX rows
    ``cat(f, f)`` of angles at positions ``0..T-1`` (``mrope_sections``: three position sources)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, 128, generator=g).to(dtype)

    def rows(positions):
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        f = positions[..., None].float() * inv
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    pos = torch.arange(T)[None].expand(B, T)
    if variant == "mrope_sections":
        pos = torch.stack([pos, pos + 1, 2 * pos])
    cos, sin = rows(pos)
    if variant in ("gptj_pair_rows_fp32", "pair_rows_fp32_rounded_products"):  # Ernie's rows stay fp32
        cos, sin = _fp32_rows(pos, d)
    if variant == "k_other_positions":
        return (hidden, cos, sin, *rows(pos + 3))
    return hidden, cos, sin


def _fp32_rows(positions, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = positions[..., None].float() * inv
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()


# --- Gemma4: tokens-first QK-norm + RoPE, attention_k_eq_v, a KV-shared layer ------------------


def gemma4_config():
    """Gemma4 text with the released head sizes: layer 0 sliding (head 256, 2 KV heads),
    layer 1 full (head 512, 1 KV head, ``attention_k_eq_v``: V is the V-norm of the key
    projection), layer 2 full and KV-shared (it reuses layer 1's K/V)."""
    return transformers.Gemma4TextConfig(
        **dict(_COMMON, num_hidden_layers=3, head_dim=256), global_head_dim=512, attention_k_eq_v=True,
        num_global_key_value_heads=1, num_kv_shared_layers=1, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=256)


class Gemma4NormRoundedBeforeWeight(nn.Module):
    """A look-alike of ``Gemma4RMSNorm`` the writer does not implement: the normalized value
    rounded to the model dtype *before* the weight (transformers' Llama order, with Gemma4's
    ``pow(..., -0.5)``). The same function as Gemma4's in fp32, not in 16-bit dtypes."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x):
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return h.to(x.dtype) * self.weight


def gemma4_attention(layers=(0, 1, 2), dtype=torch.float32, variant="plain", seed=0):
    """``(fn, args)``: the attention modules of the Gemma4 ``layers`` (``gemma4_config``) run in
    order, each adding its output to the hidden states, with one ``shared_kv_states`` dict (a
    KV-shared layer reads its target's K/V from it). ``args``: hidden ``[B, T, 128]`` and the
    model's cos/sin of the sliding and the full layers. ``variant``: "plain";
    "scale_free_k_norm" (every K-norm without its weight, as the V-norm); "rounded_before_weight"
    (q/k norms ``Gemma4NormRoundedBeforeWeight``)."""
    config = gemma4_config()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn", dtype=dtype).model
    model.eval()
    with torch.no_grad():  # the norm weights initialize to ones: make them tell a weight bug apart
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))).to(p))
    attns = [model.layers[i].self_attn for i in layers]
    for attn in attns:
        if variant == "scale_free_k_norm" and hasattr(attn, "k_norm"):
            attn.k_norm = type(attn.v_norm)(attn.head_dim, eps=attn.v_norm.eps, with_scale=False)
        elif variant == "rounded_before_weight":
            attn.q_norm = Gemma4NormRoundedBeforeWeight(attn.q_norm)
            if hasattr(attn, "k_norm"):
                attn.k_norm = Gemma4NormRoundedBeforeWeight(attn.k_norm)
        else:
            assert variant in ("plain", "scale_free_k_norm"), variant
    hidden = torch.randn(B, T, config.hidden_size, dtype=dtype)
    positions = torch.arange(T)[None].expand(B, T)
    rows = [t for kind in ("sliding_attention", "full_attention") for t in model.rotary_emb(hidden, positions, kind)]

    def fn(hidden, cos_sliding, sin_sliding, cos_full, sin_full):
        shared = {}
        for attn in attns:
            rows = (cos_sliding, sin_sliding) if attn.is_sliding else (cos_full, sin_full)
            hidden = hidden + attn(hidden, rows, None, shared)[0]
        return hidden

    return fn, (hidden, *rows)
