"""Small decoder models built on the ``Attention`` layer (demo, tests, benchmarks).

Llama-style (RoPE, no QK-norm) and Qwen3-style (per-head QK RMSNorm before RoPE) blocks,
with RoPE and RMSNorm written either in the plain-PyTorch forms HF models use
(``rotate_half``, ``x * rsqrt(mean(x^2) + eps) * w`` with HF's dtype casts) or as our
custom ops, so the fusion passes can be exercised on both. Weights are random.

``TinyDecoder(cfg, tp=TensorParallel...)`` builds one rank's tensor-parallel shard (its
query / KV heads and MLP slice, row-parallel projections that all-reduce; see
``parallel.py``); ``cfg`` always describes the whole model.

A layer's code before and after its attention is marked as two compile regions
(``layer_regions``): ``compile_piecewise`` traces each once and reuses it for the other layers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from . import layer_regions
from .layer import Attention
from .validation import is_int

if TYPE_CHECKING:
    from .parallel import TensorParallel

_NAME_COUNTER = itertools.count()


@dataclasses.dataclass
class DecoderConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    qk_norm: bool = True  # Qwen3-style
    rope_theta: float = 10000.0
    rotary_dim: int | None = None  # None: whole head
    is_neox: bool = True
    max_position: int = 4096
    rms_eps: float = 1e-6
    block_size: int = 16
    cache_layout: str = "LHBNC"
    kv_cache_dtype: str = "auto"
    rope_impl: str = "torch"  # "torch" (HF rotate_half) or "op" (rocm_attn.rotary_embedding)
    norm_impl: str = "torch"  # "torch" (HF RMSNorm) or "op" (rocm_attn.rms_norm)


def qwen3_config(**kw) -> DecoderConfig:
    return DecoderConfig(qk_norm=True, **kw)


def llama_config(**kw) -> DecoderConfig:
    return DecoderConfig(qk_norm=False, **kw)


def qwen3_0_6b_config(**kw) -> DecoderConfig:
    """Qwen3-0.6B's shape (28 layers, hidden 1024, 16/8 heads, d=128), small vocab."""
    base = dict(vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_layers=28,
                num_heads=16, num_kv_heads=8, head_size=128, qk_norm=True, rope_theta=1e6)
    base.update(kw)
    return DecoderConfig(**base)


class RMSNorm(nn.Module):
    """HF-style RMSNorm (fp32 statistics, cast back, then weight) or our ``rms_norm`` op."""

    def __init__(self, dim: int, eps: float, impl: str = "torch"):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.eps, self.impl = eps, impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "op":
            return torch.ops.rocm_attn.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds ``cos_sin_cache [max_position, rotary_dim]`` (cos half, sin half)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, theta: float,
                 is_neox: bool, impl: str = "torch"):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)
        self.head_size, self.rotary_dim, self.is_neox, self.impl = head_size, rotary_dim, is_neox, impl

    def forward(self, positions, q, k):
        """q ``[T, Hq * D]``, k ``[T, Hkv * D]`` -> rotated (same shapes)."""
        if self.impl == "op":
            q, k = q.clone(), k.clone()
            torch.ops.rocm_attn.rotary_embedding(positions, q, k, self.head_size,
                                                 self.cos_sin_cache.to(q.dtype), self.is_neox)
            return q, k
        if not self.is_neox or self.rotary_dim != self.head_size:
            raise NotImplementedError("the plain-PyTorch RoPE form is the HF NeoX full-head one")
        # HF form: cos/sin gathered by position, duplicated halves, rotate_half.
        cos, sin = self.cos_sin_cache.to(q.dtype)[positions].chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
        t = q.shape[0]
        qh = q.view(t, -1, self.head_size)
        kh = k.view(t, -1, self.head_size)
        q = qh * cos + rotate_half(qh) * sin
        k = kh * cos + rotate_half(kh) * sin
        return q.reshape(t, -1), k.reshape(t, -1)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


_IMPLS = ("torch", "op")


def check_config(cfg: DecoderConfig, op: str = "DecoderConfig") -> None:
    """What the attention layer does not check itself: the RoPE / RMSNorm forms and the
    rotary width (an unknown impl string ran the "torch" form; rotary_dim 0 rotated the whole
    head, an odd one a table one channel wider)."""
    for name in ("rope_impl", "norm_impl"):
        value = getattr(cfg, name)
        if value not in _IMPLS:
            raise ValueError(f"{op}: {name} {value!r} is not supported; supported: {_IMPLS}")
    rot = cfg.rotary_dim
    if rot is not None and (not is_int(rot) or rot <= 0 or rot % 2 or not is_int(cfg.head_size)
                            or rot > cfg.head_size):
        raise ValueError(f"{op}: rotary_dim must be None (the whole head) or an even int in "
                         f"[2, head_size {cfg.head_size}], got {rot!r}")
    if (not isinstance(cfg.rms_eps, (int, float)) or isinstance(cfg.rms_eps, bool)
            or not math.isfinite(cfg.rms_eps) or cfg.rms_eps < 0):
        raise ValueError(f"{op}: rms_eps must be a finite number >= 0, got {cfg.rms_eps!r}")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_name: str, tp: "TensorParallel | None" = None):
        super().__init__()
        check_config(cfg)
        self.cfg = cfg
        d, hq, hkv, inter = cfg.head_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        if tp is not None:  # this rank's heads and MLP slice; o_proj and down_proj all-reduce
            heads = tp.heads(hq, hkv)
            hq, hkv, inter = heads.num_heads, heads.num_kv_heads, tp.intermediate(inter)
        row_linear = tp.row_linear if tp is not None else _linear
        self.num_heads, self.num_kv_heads = hq, hkv  # this rank's (all of them without tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_impl)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (hq + 2 * hkv) * d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps, cfg.norm_impl)
            self.k_norm = RMSNorm(d, cfg.rms_eps, cfg.norm_impl)
        self.rotary = RotaryEmbedding(d, cfg.rotary_dim or d, cfg.max_position, cfg.rope_theta,
                                      cfg.is_neox, cfg.rope_impl)
        self.attn = Attention(hq, d, num_kv_heads=hkv, layer_name=layer_name,
                              block_size=cfg.block_size, cache_layout=cfg.cache_layout,
                              kv_cache_dtype=cfg.kv_cache_dtype)
        self.o_proj = row_linear(hq * d, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_impl)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = row_linear(inter, cfg.hidden_size)
        # Tensor-parallel layers all-reduce inside residual_mlp: traced inline, not as a region.
        self.compile_regions = tp is None

    def qkv(self, positions, hidden):
        cfg = self.cfg
        d, hq, hkv = cfg.head_size, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(self.input_layernorm(hidden))
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        if cfg.qk_norm:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, hq, d)).reshape(t, hq * d)
            k = self.k_norm(k.reshape(t, hkv, d)).reshape(t, hkv * d)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def residual_mlp(self, hidden, o):
        hidden = hidden + self.o_proj(o)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden)).chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)

    def forward(self, positions, hidden, attention=None):
        if layer_regions.active() and self.compile_regions:  # compile_piecewise's trace: each region traced once
            q, k, v = _qkv_region(self, positions, hidden)
            return _residual_mlp_region(self, hidden, self.attn(q, k, v) if attention is None else attention(q, k, v))
        q, k, v = self.qkv(positions, hidden)
        o = self.attn(q, k, v) if attention is None else attention(q, k, v)
        return self.residual_mlp(hidden, o)


# The layer's code around its attention, as compile regions (``layer_regions``).
_qkv_region = layer_regions.region(DecoderLayer.qkv)
_residual_mlp_region = layer_regions.region(DecoderLayer.residual_mlp)


class TinyDecoder(nn.Module):
    """A decoder-only LM over the paged backend: ``forward(input_ids [T], positions [T]) -> logits [T, V]``."""

    def __init__(self, cfg: DecoderConfig, name: str | None = None, tp: "TensorParallel | None" = None):
        super().__init__()
        check_config(cfg)
        if tp is not None:
            from .parallel import check_tensor_parallel

            check_tensor_parallel("TinyDecoder", tp, optional=True)
        self.cfg = cfg
        # the positions the RoPE table holds: compile_piecewise keeps max_model_len within them
        self.max_positions = cfg.max_position
        name = name or f"model{next(_NAME_COUNTER)}"
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, f"{name}.layers.{i}.attn", tp)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_impl)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.no_grad():  # keep activations O(1) through depth
            for p in self.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.lm_head(self.norm(hidden))

    @torch.no_grad()
    def dense_forward(self, token_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Logits of every token of each whole sequence with plain causal SDPA: no cache at all."""
        cfg = self.cfg
        outs = []
        for ids in token_ids:
            positions = torch.arange(ids.shape[0], device=ids.device)

            def sdpa(q, k, v):
                t, hq, hkv = q.shape[0], self.layers[0].num_heads, self.layers[0].num_kv_heads
                qh = q.view(t, hq, cfg.head_size).transpose(0, 1)
                kh = k.view(t, hkv, cfg.head_size).transpose(0, 1)
                vh = v.view(t, hkv, cfg.head_size).transpose(0, 1)
                rep = hq // hkv
                o = F.scaled_dot_product_attention(
                    qh, kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0), is_causal=True
                )
                return o.transpose(0, 1).reshape(t, -1)

            hidden = self.embed(ids)
            for layer in self.layers:
                hidden = layer(positions, hidden, attention=sdpa)
            outs.append(self.lm_head(self.norm(hidden)))
        return outs
