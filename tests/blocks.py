"""One attention block of ``models.DecoderLayer`` (from the qkv projection on), for pass tests.

``AttnBlock(cfg, name)(positions [T], qkv [T, (Hq + 2 Hkv) * D]) -> [T, Hq * D]`` runs the
block's QK-norm (Qwen3 configs), RoPE and Attention modules exactly as the decoder does.
``variant`` builds the near-misses the passes must not fuse.
"""

from __future__ import annotations

import torch
from torch import nn

from inductor_rocm_attn.models import DecoderLayer, rotate_half

rocm = torch.ops.rocm_attn


def rope_gptj_model(positions, q, k, cos_sin_cache, head_size):
    """GPT-J RoPE as HF's modeling_gptj writes it (interleaved pairs), q/k ``[T, H * D]``."""

    def rotate_every_two(x):
        x1 = x[:, :, ::2]
        x2 = x[:, :, 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    cos, sin = cos_sin_cache.to(q.dtype)[positions].chunk(2, dim=-1)
    cos = torch.repeat_interleave(cos[:, None, :], 2, 2)
    sin = torch.repeat_interleave(sin[:, None, :], 2, 2)
    t = q.shape[0]
    qh, kh = q.view(t, -1, head_size), k.view(t, -1, head_size)
    return ((qh * cos + rotate_every_two(qh) * sin).reshape(t, -1),
            (kh * cos + rotate_every_two(kh) * sin).reshape(t, -1))


class AttnBlock(nn.Module):
    def __init__(self, cfg, name: str, variant: str = "plain", gptj_hf: bool = False):
        super().__init__()
        self.cfg, self.variant, self.gptj_hf = cfg, variant, gptj_hf
        self.layer = DecoderLayer(cfg, name)
        d, hq = cfg.head_size, cfg.num_heads
        if variant == "norm_whole_q":  # RMSNorm over all of q, not per head
            from inductor_rocm_attn.models import RMSNorm

            self.layer.q_norm = RMSNorm(hq * d, cfg.rms_eps, cfg.norm_impl)
        if variant == "k_eps_differs":
            self.layer.k_norm.eps = cfg.rms_eps * 10

    def rope(self, positions, q, k):
        if self.gptj_hf:
            return rope_gptj_model(positions, q, k, self.layer.rotary.cos_sin_cache, self.cfg.head_size)
        return self.layer.rotary(positions, q, k)

    def forward(self, positions, qkv):
        cfg, lay = self.cfg, self.layer
        d, hq, hkv = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
        t = qkv.shape[0]
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        if cfg.qk_norm:
            if self.variant == "norm_whole_q":
                q = lay.q_norm(q)
            else:
                q = lay.q_norm(q.reshape(t, hq, d)).reshape(t, hq * d)
            k = lay.k_norm(k.reshape(t, hkv, d)).reshape(t, hkv * d)
        if self.variant == "plain" or self.variant in ("norm_whole_q", "k_eps_differs"):
            q, k = self.rope(positions, q, k)
            return lay.attn(q, k, v)
        name = lay.attn.layer_name
        q3 = lambda x, h: x.reshape(t, h, d)  # noqa: E731
        out = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)
        if self.variant == "cache_unrotated_k":  # K goes to the cache before rotation
            q_rot, _ = self.rope(positions, q, k)
            token = rocm.unified_kv_cache_update(q3(k, hkv), q3(v, hkv), name)
            rocm.unified_attention_with_output(q3(q_rot, hq), q3(k, hkv), q3(v, hkv), out, name, token)
        elif self.variant == "attn_reads_other_key":  # RoPE'd K cached, attention reads unrotated K
            q_rot, k_rot = self.rope(positions, q, k)
            token = rocm.unified_kv_cache_update(q3(k_rot, hkv), q3(v, hkv), name)
            rocm.unified_attention_with_output(q3(q_rot, hq), q3(k, hkv), q3(v, hkv), out, name, token)
        elif self.variant == "mixed_rope":  # x * cos + rotate_half(OTHER) * sin
            cos, sin = lay.rotary.cos_sin_cache.to(q.dtype)[positions].chunk(2, dim=-1)
            cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
            sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
            qh, kh, vh = q3(q, hq), q3(k, hkv), q3(v, hkv)
            q_rot = qh * cos + rotate_half(qh) * sin
            k_rot = kh * cos + rotate_half(vh) * sin
            token = rocm.unified_kv_cache_update(k_rot, vh, name)
            rocm.unified_attention_with_output(q_rot, k_rot, vh, out, name, token)
        elif self.variant == "q_other_positions":  # q and k rotated at different positions
            q_rot, _ = self.rope(positions + 1, q, k)
            _, k_rot = self.rope(positions, q, k)
            token = rocm.unified_kv_cache_update(q3(k_rot, hkv), q3(v, hkv), name)
            rocm.unified_attention_with_output(q3(q_rot, hq), q3(k_rot, hkv), q3(v, hkv), out, name, token)
        else:
            raise ValueError(self.variant)
        return out.view(t, hq * d)


def block_inputs(cfg, num_tokens: int = 5, dtype=torch.float32, device="cpu"):
    d = cfg.head_size
    qkv = torch.randn(num_tokens, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, dtype=dtype, device=device)
    positions = torch.arange(num_tokens, device=device)
    return positions, qkv


class WriterQuantBlock(nn.Module):
    """One attention layer whose cache update is ``writer`` (one of ``WRITERS``: the plain
    update or a fused RoPE / QK-norm writer op, called directly, as the fusion passes leave
    it), its attention into a fresh buffer, and a static fp8 quant of the attention output:
    the attention + quant fusion's site for each kind of cache update.

    ``(positions [T], qkv [T, (Hq + 2 Hkv) * D]) -> fp8 [T, Hq * D]``; ``scale`` is the quant's
    fp32 scale ``[1]`` (a buffer: change it in place to call a compiled block with another value).
    """

    WRITERS = ("kv_cache_update", "rope", "rope_cos_sin", "qk_norm_qkv", "qk_norm_rope_cos_sin")

    def __init__(self, writer: str, name: str, num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 32):
        from inductor_rocm_attn import Attention

        super().__init__()
        if writer not in self.WRITERS:
            raise ValueError(writer)
        self.writer, self.name = writer, name
        self.h, self.hkv, self.d = num_heads, num_kv_heads, head_size
        self.attn = Attention(num_heads, head_size, num_kv_heads=num_kv_heads, layer_name=name)
        g = torch.Generator().manual_seed(0)
        self.register_buffer("cos_sin_cache", torch.randn(64, head_size, generator=g))
        self.register_buffer("q_weight", torch.rand(head_size, generator=g) + 0.5)
        self.register_buffer("k_weight", torch.rand(head_size, generator=g) + 0.5)
        self.register_buffer("scale", torch.full((1,), 0.5))

    def write(self, positions, qkv, output_scale=None):
        """``(q [T, Hq, D], k, v [T, Hkv, D], token)`` after the layer's cache update, called
        with ``output_scale`` (what the fusion gives it; the module's forward passes None)."""
        t, h, hkv, d = qkv.shape[0], self.h, self.hkv, self.d
        if self.writer == "qk_norm_qkv":
            q, k, token = rocm.unified_qk_norm_rope_and_kv_cache_update(
                qkv, self.q_weight, self.k_weight, 1e-6, positions, self.cos_sin_cache, True, h, hkv, d, self.name,
                output_scale)
            return q, k, qkv[:, (h + hkv) * d:].reshape(t, hkv, d), token
        q, k, v = (x.reshape(t, n, d).clone() for x, n in zip(qkv.split([h * d, hkv * d, hkv * d], -1), (h, hkv, hkv)))
        half = self.cos_sin_cache[positions].chunk(2, dim=-1)
        cos, sin = (torch.cat((c, c), dim=-1) for c in half)
        if self.writer == "kv_cache_update":
            token = rocm.unified_kv_cache_update(k, v, self.name, output_scale)
        elif self.writer == "rope":
            token = rocm.unified_rope_and_kv_cache_update(positions, q, k, v, self.cos_sin_cache, True, self.name,
                                                          output_scale)
        elif self.writer == "rope_cos_sin":
            token = rocm.unified_rope_cos_sin_and_kv_cache_update(q, k, v, cos, sin, True, self.name, output_scale)
        else:
            token = rocm.unified_qk_norm_rope_cos_sin_and_kv_cache_update(
                q, k, v, self.q_weight, self.k_weight, 1e-6, cos, sin, True, self.name, output_scale=output_scale)
        return q, k, v, token

    def forward(self, positions, qkv):
        t = qkv.shape[0]
        q, k, v, token = self.write(positions, qkv)
        out = torch.empty(t, self.h, self.d, dtype=qkv.dtype, device=qkv.device)
        rocm.unified_attention_with_output(q, k, v, out, self.name, token)
        return rocm.static_scaled_fp8_quant(out.reshape(t, self.h * self.d), self.scale, torch.float8_e4m3fn)
