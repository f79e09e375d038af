"""Input checks shared by the ops: each error names the op, the bad value and what is supported.

Shape/dtype/device checks are cheap and always run. Index-range checks (slot_mapping and
block_table inside the cache) need the values on the host: they always run for CPU tensors
and, on a GPU, only with ``ROCM_ATTN_CHECK_INDICES=1`` (they would force a device sync and
break graph capture).
"""

from __future__ import annotations

import math
import os

import torch

from . import capabilities
from .layout import cache_layout_of, cache_x, is_fp8_dtype

_INDEX_TYPES = (torch.int32, torch.int64)


def _check_indices_on_device() -> bool:
    return os.environ.get("ROCM_ATTN_CHECK_INDICES", "0") == "1"


def _want_index_checks(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or _check_indices_on_device()


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {desc}")


def check_dtype(op: str, name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported: {tuple(allowed)}")


def check_kv_cache(op: str, kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    cache_layout_of(kv_cache)  # raises on a bad shape or stride pattern
    _, _, block_size, hd = kv_cache.shape
    capabilities.check_block_size(block_size, op)
    capabilities.check_head_size(head_size, op)
    if hd != num_kv_heads * head_size:
        raise ValueError(
            f"{op}: kv_cache last dim {hd} != num_kv_heads * head_size = "
            f"{num_kv_heads} * {head_size}"
        )
    if head_size % cache_x(kv_cache.dtype):
        raise ValueError(f"{op}: head_size {head_size} is not a multiple of {cache_x(kv_cache.dtype)}")


def check_slot_mapping(op: str, slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_tokens: int) -> None:
    check_dtype(op, "slot_mapping", slot_mapping, _INDEX_TYPES)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > num_tokens:
        raise ValueError(
            f"{op}: slot_mapping must be 1-D with at most {num_tokens} entries (one per token), "
            f"got shape {tuple(slot_mapping.shape)}"
        )
    if _want_index_checks(slot_mapping) and slot_mapping.numel():
        num_slots = kv_cache.shape[0] * kv_cache.shape[2]
        hi = int(slot_mapping.max())
        if hi >= num_slots:
            raise IndexError(
                f"{op}: slot_mapping entry {hi} is outside the cache "
                f"({kv_cache.shape[0]} blocks x {kv_cache.shape[2]} = {num_slots} slots; "
                "entries < 0 mark padding)"
            )


def check_cache_write(op: str, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    check_same_device(op, key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"{op}: key and value must both be [num_tokens, num_kv_heads, head_size], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_dtype(op, "key", key, capabilities.MODEL_DTYPES)
    if value.dtype != key.dtype:
        raise ValueError(f"{op}: key dtype {key.dtype} != value dtype {value.dtype}")
    if not is_fp8_dtype(kv_cache.dtype) and kv_cache.dtype not in capabilities.MODEL_DTYPES:
        raise ValueError(f"{op}: kv_cache dtype {kv_cache.dtype} is not a supported cache dtype")
    check_kv_cache(op, kv_cache, key.shape[1], key.shape[2])
    check_slot_mapping(op, slot_mapping, kv_cache, key.shape[0])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.numel() != 1:
            raise ValueError(f"{op}: {name} must be a per-tensor scale (1 element), got shape {tuple(s.shape)}")


def check_paged_attention(
    op: str,
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    output_scale: torch.Tensor | None,
) -> None:
    check_same_device(
        op, output=output, query=query, key=key, value=value, kv_cache=kv_cache,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
    )
    if query.dim() != 3:
        raise ValueError(f"{op}: query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    num_tokens, num_heads, head_size = query.shape
    if key is not None:
        if key.dim() != 3 or value is None or value.shape != key.shape:
            raise ValueError(f"{op}: key/value must be [num_tokens, num_kv_heads, head_size]")
        if key.dtype != query.dtype and not is_fp8_dtype(query.dtype):
            raise ValueError(f"{op}: key dtype {key.dtype} != query dtype {query.dtype}")
        num_kv_heads = key.shape[1]
    else:
        num_kv_heads = kv_cache.shape[3] // head_size
    if num_heads % num_kv_heads:
        raise ValueError(f"{op}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_kv_cache(op, kv_cache, num_kv_heads, head_size)
    if output.shape != query.shape:
        raise ValueError(f"{op}: output shape {tuple(output.shape)} does not match query {tuple(query.shape)}")
    if output_scale is None and output.dtype != query.dtype and not is_fp8_dtype(query.dtype):
        raise ValueError(f"{op}: output dtype {output.dtype} != query dtype {query.dtype}")
    if output_scale is not None and not is_fp8_dtype(output.dtype):
        raise ValueError(f"{op}: output_scale (fused fp8 output quant) needs an fp8 output, got {output.dtype}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        check_dtype(op, name, t, _INDEX_TYPES)
    if block_table.dim() != 2 or seq_lens.dim() != 1 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"{op}: expected query_start_loc [B+1], seq_lens [B], block_table [B, max_blocks]; got "
            f"{tuple(query_start_loc.shape)}, {tuple(seq_lens.shape)}, {tuple(block_table.shape)}"
        )
    if block_table.shape[0] < seq_lens.shape[0]:
        raise ValueError(f"{op}: block_table has {block_table.shape[0]} rows for {seq_lens.shape[0]} sequences")
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and t.shape != (num_heads,):
            raise ValueError(f"{op}: {name} must be [num_heads] = [{num_heads}], got {tuple(t.shape)}")
    if _want_index_checks(block_table):
        check_block_table(op, block_table, seq_lens, kv_cache.shape[0], kv_cache.shape[2])


def check_block_table(op: str, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      num_blocks: int, block_size: int) -> None:
    """Every block a sequence uses (the first ceil(seq_len / block_size) entries) is in the cache."""
    if seq_lens.numel() == 0:
        return
    used = (seq_lens.to(torch.int64) + block_size - 1) // block_size
    if int(used.max()) > block_table.shape[1]:
        raise ValueError(
            f"{op}: a sequence of {int(seq_lens.max())} tokens needs {int(used.max())} blocks but "
            f"block_table has {block_table.shape[1]} columns"
        )
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    mask = cols[None, :] < used[:, None]
    entries = block_table[: seq_lens.shape[0]][mask]
    if entries.numel() and (int(entries.min()) < 0 or int(entries.max()) >= num_blocks):
        bad = entries[(entries < 0) | (entries >= num_blocks)][0]
        raise IndexError(f"{op}: block_table entry {int(bad)} is outside the cache (valid: 0..{num_blocks - 1})")


def check_rotary(op: str, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                 head_size: int, cos_sin_cache: torch.Tensor) -> None:
    check_same_device(op, positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    check_dtype(op, "positions", positions, _INDEX_TYPES)
    check_dtype(op, "query", query, capabilities.MODEL_DTYPES)
    rot = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if rot <= 0 or rot % 2 or rot > head_size:
        raise ValueError(
            f"{op}: cos_sin_cache must be [max_position, rot_dim] with an even rot_dim <= "
            f"head_size {head_size}, got {tuple(cos_sin_cache.shape)}"
        )
    for name, t in (("query", query), ("key", key)):
        if t is None:
            continue
        if t.shape[0] != positions.shape[0] or t[0].numel() % head_size:
            raise ValueError(
                f"{op}: {name} {tuple(t.shape)} must be [num_tokens, num_heads * {head_size}] "
                f"(or [num_tokens, num_heads, {head_size}]) with num_tokens = {positions.shape[0]}"
            )
        if t.dtype != query.dtype:
            raise ValueError(f"{op}: {name} dtype {t.dtype} != query dtype {query.dtype}")


def check_qk_norm_rope(op: str, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int,
                       num_kv_heads: int, head_size: int) -> None:
    check_same_device(op, qkv=qkv, q_weight=q_weight, k_weight=k_weight, positions=positions)
    check_dtype(op, "qkv", qkv, capabilities.MODEL_DTYPES)
    capabilities.check_head_size(head_size, op)
    width = (num_heads + 2 * num_kv_heads) * head_size
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"{op}: qkv must be [num_tokens, (num_heads + 2 * num_kv_heads) * head_size] = "
            f"[T, {width}], got {tuple(qkv.shape)}"
        )
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_size,):
            raise ValueError(f"{op}: {name} must be [head_size] = [{head_size}], got {tuple(w.shape)}")
    if positions.shape[0] != qkv.shape[0]:
        raise ValueError(f"{op}: positions has {positions.shape[0]} entries for {qkv.shape[0]} tokens")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] > head_size or cos_sin_cache.shape[1] % 2:
        raise ValueError(f"{op}: cos_sin_cache must be [max_position, rot_dim <= {head_size}]")


def check_encoder_attention(op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cu_seqlens: torch.Tensor, alibi_slopes, sinks) -> None:
    check_same_device(op, query=query, key=key, value=value, cu_seqlens=cu_seqlens)
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape or key.shape[0] != query.shape[0]:
        raise ValueError(
            f"{op}: query [T, Hq, D] and key/value [T, Hkv, D] expected, got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    check_dtype(op, "query", query, capabilities.MODEL_DTYPES)
    capabilities.check_head_size(query.shape[2], op)
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{op}: num_heads {query.shape[1]} is not a multiple of num_kv_heads {key.shape[1]}")
    check_dtype(op, "cu_seqlens", cu_seqlens, _INDEX_TYPES)
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and t.shape != (query.shape[1],):
            raise ValueError(f"{op}: {name} must be [num_heads] = [{query.shape[1]}], got {tuple(t.shape)}")


def check_softmax_scale(op: str, scale: float) -> None:
    """The softmax scale must be a positive finite number: the kernels take each row's max on
    unscaled scores (as FlashAttention does), which only equals the max of the scaled ones
    for a positive scale."""
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{op}: scale must be a positive finite number, got {scale!r}")


def check_rope_cos_sin(op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None = None,
                       k_weight: torch.Tensor | None = None) -> None:
    """The RoPE part of the per-token cos/sin writers: value ``[T, Hkv, D]``, query ``[T, Hq,
    D]`` or ``[T, Hq * D]``, key likewise with Hkv heads, cos/sin ``[T, rot_dim]`` (even
    ``rot_dim <= D``), weights ``[D]``."""
    check_same_device(op, query=query, key=key, value=value, cos=cos, sin=sin, q_weight=q_weight,
                      k_weight=k_weight)
    check_dtype(op, "query", query, capabilities.MODEL_DTYPES)
    if value.dim() != 3:
        raise ValueError(f"{op}: value must be [num_tokens, num_kv_heads, head_size], got {tuple(value.shape)}")
    t, hkv, d = value.shape
    capabilities.check_head_size(d, op)
    for name, x, heads in (("query", query, None), ("key", key, hkv)):
        ok = x.dim() in (2, 3) and x.shape[0] == t and x[0].numel() % d == 0 and (x.dim() == 2 or x.shape[2] == d)
        if not ok or (heads is not None and x[0].numel() != heads * d):
            raise ValueError(
                f"{op}: {name} must be [num_tokens, heads, head_size] (or [num_tokens, heads * head_size]) "
                f"with num_tokens {t}, head_size {d}{'' if heads is None else f', {heads} heads'} (value "
                f"{tuple(value.shape)}), got {tuple(x.shape)}"
            )
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            raise ValueError(f"{op}: {name} dtype {x.dtype} != query dtype {query.dtype}")
    if (query[0].numel() // d) % hkv:
        raise ValueError(f"{op}: num_heads {query[0].numel() // d} is not a multiple of num_kv_heads {hkv}")
    for name, c in (("cos", cos), ("sin", sin)):
        check_dtype(op, name, c, capabilities.MODEL_DTYPES)
        rot = c.shape[-1] if c.dim() == 2 else -1
        if c.dim() != 2 or c.shape[0] != t or rot <= 0 or rot % 2 or rot > d:
            raise ValueError(
                f"{op}: {name} must be [num_tokens, rot_dim] = [{t}, even rot_dim <= head_size {d}] "
                f"(one row per token), got {tuple(c.shape)}"
            )
    if sin.shape != cos.shape:
        raise ValueError(f"{op}: sin {tuple(sin.shape)} and cos {tuple(cos.shape)} differ")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and tuple(w.shape) != (d,):
            raise ValueError(f"{op}: {name} must be [head_size] = [{d}], got {tuple(w.shape)}")
    if q_weight is not None and k_weight is not None and q_weight.dtype != k_weight.dtype:
        raise ValueError(f"{op}: q_weight dtype {q_weight.dtype} != k_weight dtype {k_weight.dtype}")
