"""Checks of a layer's call: the step's metadata against the layer's KV cache, and the
per-call tensors of the layer-level ops. Errors name the op, the parameter, the bad value and
what is supported, and are raised before anything is written.

A step's metadata is checked once per cache geometry and the result memoized on the
metadata object (``check_step_metadata``): the first layer of a step pays, the others hit a
dict. For metadata from ``build_attention_metadata`` the first layer pays less: what does not
depend on the layer (the index tensors' types, dtypes, shapes, layout) the builder checked
when it made them (``check_step_tensors``). What is read from the index tensors follows
``validation.index_checks_on`` (CPU: always; GPU: with ``ROCM_ATTN_CHECK_INDICES=1``);
metadata planned by ``build_attention_metadata`` is checked on a GPU too, from the bounds its
builder recorded (``AttentionMetadata.plan``), without reading a tensor back.
"""

from __future__ import annotations

import math

import torch

from . import capabilities, validation
from .layout import is_fp8_dtype
from .metadata import plan_tensor_ptrs
from .validation import (
    _INDEX_TYPES, check_channel_stride, check_dtype, check_index_layout, check_positions,
    check_sequence_shapes, check_sequences, check_slot_range, check_slots_follow_table, check_written_blocks_once,
    index_checks_on, is_int,
)

_METADATA_TENSORS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions")


def check_step_metadata(op: str, md, num_tokens: int, device: torch.device,
                        num_blocks: int | None = None, block_size: int | None = None) -> None:
    """Check a step's ``AttentionMetadata`` for a layer whose tensors have ``num_tokens`` rows
    on ``device``, against its KV cache of ``num_blocks`` blocks of ``block_size`` tokens
    (None for a layer without a cache). Memoized on ``md``: once per step and geometry."""
    key = (num_tokens, num_blocks, block_size, device)
    checked = md._checked
    if key not in checked:
        _check_step(op, md, num_tokens, device, num_blocks, block_size)
        checked[key] = None


def check_encoder_step(op: str, md) -> None:
    """An encoder layer attends within the step's tokens and has no cache: a step whose
    sequences have cached context (``seq_lens`` past their query lengths) is refused, not
    computed without that context. From the builder's plan, else read from the tensors where
    index checks are on. Memoized on ``md``."""
    checked = md._checked
    if "encoder" in checked:
        return
    if _plan_holds(md):
        context = md.plan.context_tokens
    elif index_checks_on(md.seq_lens.device):
        context = int(md.seq_lens.sum()) - int(md.query_start_loc[-1])
    else:
        context = 0
    if context > 0:
        raise ValueError(f"{op}: an encoder layer's step has {context} cached context tokens (seq_lens past the "
                         "query lengths); encoder attention has no KV cache and attends within the step's tokens: "
                         "build its metadata with context_lens 0")
    checked["encoder"] = None


def _plan_holds(md) -> bool:
    plan = md.plan
    return (plan is not None and plan.block_size == md.block_size
            and plan.tensor_ptrs == plan_tensor_ptrs(md))


def _builder_tensors(md, plan) -> bool:
    """Whether ``md``'s index tensors are the very tensor objects ``build_attention_metadata``
    made, still at the addresses it recorded: then their types, dtypes, shapes, layout and
    device are the ones it checked (``check_step_tensors``) when it made them."""
    t = plan.tensors
    return (len(t) == 5 and md.query_start_loc is t[0] and md.seq_lens is t[1] and md.block_table is t[2]
            and md.slot_mapping is t[3] and md.positions is t[4] and plan.tensor_ptrs == plan_tensor_ptrs(md))


def _check_step(op: str, md, num_tokens: int, device: torch.device, num_blocks: int | None,
                block_size: int | None) -> None:
    plan = md.plan
    if plan is not None and plan.buffers is not None:  # views of buffers that a later step refills
        plan.buffers.check_current(op, plan)
        plan.buffers.note_checked(md)  # the memo the caller sets goes at the buffers' next fill
    has_cache = num_blocks is not None
    where = "the KV cache" if has_cache else "the query"
    if has_cache and md.block_size != block_size:
        got = md.block_size if type(md.block_size) is int else f"{md.block_size!r} (a {type(md.block_size).__name__})"
        raise ValueError(
            f"{op}: metadata built for block_size {got}, but the layer's KV cache has block_size "
            f"{block_size}; build the step's metadata with block_size={block_size}"
        )
    # A step planned by the builder is checked in two parts: what does not depend on the layer
    # (the tensors' types, dtypes, shapes, layout) once, by the builder; here only the rest.
    planned = plan is not None and plan.block_size == md.block_size and _builder_tensors(md, plan)
    if not planned:
        check_step_tensors(op, md, device, where, has_cache)
    elif plan.device != device:
        _device_error(op, "query_start_loc", plan.device, device, where)
    slots = md.slot_mapping
    n = md.num_actual_tokens
    for name in ("num_actual_tokens", "max_query_len", "max_seq_len"):
        v = getattr(md, name)
        if not (type(v) is int or is_int(v)) or v < 0:  # type(v) is int: the common case, without the ABC check
            raise ValueError(f"{op}: metadata {name} must be an int >= 0, got {v!r}")
    if md.causal is not None and not isinstance(md.causal, bool):
        raise ValueError(f"{op}: metadata causal must be True, False or None, got {md.causal!r}")
    if n > num_tokens:
        raise ValueError(f"{op}: num_actual_tokens {n} > the {num_tokens} tokens the layer was given")
    if slots.shape[0] != num_tokens:
        # rows past the step's tokens would be left unwritten and returned as output: padding
        # is the metadata's to state (one slot, -1, per padding token)
        raise ValueError(
            f"{op}: the step's metadata plans {slots.shape[0]} tokens ({n} real, {slots.shape[0] - n} padding) but "
            f"the layer was given {num_tokens}; its slot_mapping needs one entry per token (build the step's "
            f"metadata for the tokens the model runs; build_attention_metadata(..., num_padded_tokens=...) pads it)")
    if index_checks_on(device):
        qsl, lens = check_sequences(
            op, md.query_start_loc, md.seq_lens, md.block_table if has_cache else None,
            num_tokens=num_tokens, num_blocks=num_blocks, block_size=block_size,
            max_query_len=md.max_query_len, max_seq_len=md.max_seq_len)
        _check_covers(op, n, qsl[-1])
        if has_cache:
            check_slot_range(op, slots, num_blocks, block_size)
            check_slots_follow_table(op, slots, qsl, lens, md.block_table, block_size)
            if not (planned or _plan_holds(md)):  # the builder checked its own steps so
                check_written_blocks_once(op, slots, md.positions, qsl, lens, md.block_table, block_size)
    elif planned or _plan_holds(md):
        _check_plan(op, md, num_tokens, num_blocks)


def check_step_tensors(op: str, md, device: torch.device, where: str, has_cache: bool = True) -> None:
    """The layer-independent part of a step's check: its index tensors are tensors of index
    dtypes on ``device`` (``where``'s: the layer's KV cache or query), shaped as
    ``AttentionMetadata`` says, with dense rows (the block table only with ``has_cache``:
    a layer without a cache does not read it)."""
    for name in _METADATA_TENSORS:
        t = getattr(md, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: metadata {name} must be a tensor, got {type(t).__name__}")
        check_dtype(op, f"metadata {name}", t, _INDEX_TYPES)
        if t.device != device:
            _device_error(op, name, t.device, device, where)
    check_sequence_shapes(op, md.query_start_loc, md.seq_lens, md.block_table if has_cache else None)
    slots, positions = md.slot_mapping, md.positions
    if slots.dim() != 1 or positions.shape != slots.shape:
        raise ValueError(f"{op}: metadata slot_mapping and positions must be 1-D with one entry per token, "
                         f"got {tuple(slots.shape)} and {tuple(positions.shape)}")
    check_index_layout(op, slot_mapping=slots, positions=positions)


def _device_error(op: str, name: str, got: torch.device, device: torch.device, where: str):
    raise ValueError(
        f"{op}: metadata tensor {name} is on {got} but {where} is on {device}; build the "
        f"metadata on that device (build_attention_metadata(..., device={str(device)!r}))"
    )


def _check_covers(op: str, num_actual_tokens: int, end: int) -> None:
    if num_actual_tokens != end:
        raise ValueError(f"{op}: num_actual_tokens {num_actual_tokens} != query_start_loc[-1] = {end} (the "
                         "sequences must cover exactly the step's real tokens)")


def _check_plan(op: str, md, num_tokens: int, num_blocks: int | None) -> None:
    """The builder's host-side bounds against the layer (no device read)."""
    plan = md.plan
    if plan.num_tokens > num_tokens:
        raise ValueError(f"{op}: query_start_loc[-1] = {plan.num_tokens} runs past the {num_tokens} query tokens")
    _check_covers(op, md.num_actual_tokens, plan.num_tokens)
    for name, hint, longest, what in (("max_query_len", md.max_query_len, plan.max_query_len, "query"),
                                      ("max_seq_len", md.max_seq_len, plan.max_seq_len, "sequence")):
        if hint < longest:
            raise ValueError(f"{op}: {name} {hint} is smaller than the longest {what} ({longest} tokens); the "
                             f"hint must be >= every {what} length ({validation.HINT_USES[what]})")
    if num_blocks is not None and plan.max_block_id >= num_blocks:
        raise IndexError(
            f"{op}: the step uses block id {plan.max_block_id} but the KV cache has {num_blocks} blocks "
            f"(valid block ids: 0..{num_blocks - 1}); plan the step for this cache "
            "(build_attention_metadata(..., num_blocks=...))"
        )


def check_step_positions(op: str, md, positions: torch.Tensor, rows: int) -> None:
    """The positions a layer's RoPE reads, inside the cos/sin table of ``rows`` rows: read on
    CPU (or with ``ROCM_ATTN_CHECK_INDICES=1``), else from the builder's bounds when they are
    the step's own positions tensor."""
    if index_checks_on(positions.device):
        check_positions(op, positions, rows)
    elif (md.plan is not None and md.plan.max_position >= rows and _plan_holds(md)
          and positions.data_ptr() == md.positions.data_ptr()):
        raise IndexError(f"{op}: the step's positions reach {md.plan.max_position}, outside the cos/sin table "
                         f"(valid: 0..{rows - 1})")


_INDEX_DTYPES = frozenset(_INDEX_TYPES)
_FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def check_rope_inputs(op: str, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_tokens: int,
                      device: torch.device, md) -> None:
    """Every call of a layer's RoPE: one position per token (an index dtype, dense), on
    ``device``, inside the cos/sin table, a 2-D float table with unit channel stride (``md``:
    the step's metadata, None in a profiling run)."""
    if positions.shape[:1] != (num_tokens,) or positions.device != device or cos_sin_cache.device != device:
        raise ValueError(f"{op}: positions ({tuple(positions.shape)} on {positions.device}) and cos_sin_cache "
                         f"(on {cos_sin_cache.device}) must have one entry per token ({num_tokens}) on {device}")
    if not (positions.dim() == 1 and positions.dtype in _INDEX_DTYPES
            and (num_tokens <= 1 or positions.stride()[0] == 1) and cos_sin_cache.dim() == 2
            and cos_sin_cache.dtype in _FLOAT_DTYPES and cos_sin_cache.stride()[1] == 1):
        validation.check_float_tensor(op, "cos_sin_cache", cos_sin_cache)
        if cos_sin_cache.dim() != 2:
            raise ValueError(f"{op}: cos_sin_cache must be [max_position, rot_dim], got {tuple(cos_sin_cache.shape)}")
        validation.check_positions_tensor(op, positions, num_tokens, cos_sin_cache)
    if md is not None:
        check_step_positions(op, md, positions, cos_sin_cache.shape[0])
    elif index_checks_on(positions.device):
        check_positions(op, positions, cos_sin_cache.shape[0])


def check_cos_sin_call(op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, device: torch.device) -> None:
    """Every call of a per-token cos/sin writer: query/key/value of one dtype with the value's
    T rows, and cos/sin ``[T, rot_dim]`` of model dtypes (one row per token, as the kernels read
    them), all on ``device``."""
    t = value.shape[0]
    cs = cos.shape
    if not (query.shape[0] == t and key.shape[0] == t and query.dtype is key.dtype is value.dtype
            and cos.dtype in _MODEL_DTYPES and sin.dtype in _MODEL_DTYPES
            and len(cs) == 2 and cs[0] == t and sin.shape == cs and query.device == device
            and key.device == device and value.device == device and cos.device == device
            and sin.device == device):
        raise ValueError(
            f"{op}: query {tuple(query.shape)} {query.dtype} on {query.device}, key {tuple(key.shape)} "
            f"{key.dtype} on {key.device}, value {tuple(value.shape)} {value.dtype} on {value.device}, cos "
            f"{tuple(cos.shape)} {cos.dtype} on {cos.device}, sin {tuple(sin.shape)} {sin.dtype} on {sin.device}: "
            f"expected query/key/value of one dtype, {t} rows each (cos/sin [{t}, rot_dim] of "
            f"{capabilities.MODEL_DTYPES}), all on {device}"
        )


def check_heads(op: str, name: str, x: torch.Tensor, num_heads: int, head_size: int, num_tokens: int) -> None:
    """Every call of a fused RoPE layer op, which rotates ``x`` in place: the layer's heads,
    ``[num_tokens, num_heads, head_size]`` or ``[num_tokens, num_heads * head_size]`` (the kernels
    rotate whatever heads they are given, and another head size pairs other channels)."""
    xs = x.shape
    if not ((len(xs) == 3 and xs[0] == num_tokens and xs[1] == num_heads and xs[2] == head_size)
            or (len(xs) == 2 and xs[0] == num_tokens and xs[1] == num_heads * head_size)):
        raise ValueError(f"{op}: {name} must be the layer's heads, [{num_tokens}, {num_heads}, {head_size}] or "
                         f"[{num_tokens}, {num_heads} * {head_size}], got {tuple(xs)}")


def check_rotated(op: str, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None) -> None:
    """Every call of a fused RoPE layer op, which rotates ``query`` and ``key`` (None: only the
    query) in place (and caches ``value``, None: not written): neither expanded nor the memory
    of another of them; the common case in three pointer and two stride compares."""
    if key is None:
        if 0 in query.stride():
            validation.check_written(op, dict(query=query), {})
        return
    qp, kp = query.data_ptr(), key.data_ptr()
    if (qp == kp or 0 in query.stride() or 0 in key.stride()
            or (value is not None and value.data_ptr() in (qp, kp))):
        validation.check_written(op, dict(query=query, key=key), {} if value is None else dict(value=value))


def norm_weights_ok(q_weight: torch.Tensor, k_weight: torch.Tensor, eps, head_size: int,
                    device: torch.device) -> bool:
    """Every call of a QK-norm writer, the common case in one expression: q/k weights ``[head_size]``
    of float dtypes, contiguous, on ``device``, and a finite ``eps >= 0``. False: the caller
    runs its full checks, which name what is wrong."""
    return (q_weight.shape == (head_size,) and k_weight.shape == (head_size,)
            and q_weight.dtype in _FLOAT_DTYPES and k_weight.dtype in _FLOAT_DTYPES
            and q_weight.is_contiguous() and k_weight.is_contiguous()
            and q_weight.device == device and k_weight.device == device
            and type(eps) is float and 0.0 <= eps < math.inf)


# Per-call checks: one boolean expression on the fast path (host attributes only); the
# message is worked out only when it fails.
_MODEL_DTYPES = frozenset(capabilities.MODEL_DTYPES)


def check_cache_update(op: str, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, md,
                       num_kv_heads: int, head_size: int) -> int:
    """Every call of a layer's cache update, in one pass: a bound cache, key/value
    ``[T, num_kv_heads, head_size]`` on its device, and the step's metadata against it (memoized
    as ``check_step_metadata``). Returns T."""
    shape = kv_cache.shape
    if len(shape) != 4:
        cache_shape(op, layer, kv_cache)
    device = kv_cache.device
    ks = key.shape
    dtype = key.dtype
    if not (len(ks) == 3 and ks[1] == num_kv_heads and ks[2] == head_size and value.shape == ks
            and dtype in _MODEL_DTYPES and value.dtype is dtype and key.device == device
            and value.device == device and key.stride()[2] == 1 and value.stride()[2] == 1):
        _explain_kv(op, key, value, device, ks[0] if len(ks) else 0, num_kv_heads, head_size)
    t = ks[0]
    memo = (t, shape[0], shape[2], device)
    checked = md._checked
    if memo not in checked:
        _check_step(op, md, t, device, shape[0], shape[2])
        checked[memo] = None
    return t


def check_attention_call(op: str, layer, query: torch.Tensor, key: torch.Tensor | None,
                         value: torch.Tensor | None, output: torch.Tensor, kv_cache: torch.Tensor, md,
                         num_heads: int, num_kv_heads: int, head_size: int) -> int:
    """Every call of a layer's attention (not preceded by its cache update), in one pass: a
    bound cache, query/output ``[T, num_heads, head_size]`` on its device, key/value when the
    step has a query longer than one token (only then does a kernel read them), and the step's
    metadata (memoized as ``check_step_metadata``). Returns T."""
    shape = kv_cache.shape
    if len(shape) != 4:
        cache_shape(op, layer, kv_cache)
    device = kv_cache.device
    # check_layer_query inlined: this runs per layer per step, between the piecewise graphs
    qs = query.shape
    if not (len(qs) == 3 and qs[1] == num_heads and qs[2] == head_size and output.shape == qs
            and query.device == device and output.device == device and query.stride()[2] == 1
            and output.stride()[2] == 1):
        _explain_query(op, query, output, device, num_heads, head_size, None)
    t = qs[0]
    if key is not None and md.max_query_len > 1:
        check_layer_kv(op, key, value, device, t, num_kv_heads, head_size)
        if key.dtype is not query.dtype and not is_fp8_dtype(query.dtype):
            raise ValueError(f"{op}: key dtype {key.dtype} != query dtype {query.dtype}")
    memo = (t, shape[0], shape[2], device)
    checked = md._checked
    if memo not in checked:
        _check_step(op, md, t, device, shape[0], shape[2])
        checked[memo] = None
    return t


def check_layer_kv(op: str, key: torch.Tensor, value: torch.Tensor, device: torch.device,
                   num_tokens: int, num_kv_heads: int, head_size: int) -> None:
    """Every call: key/value ``[num_tokens, num_kv_heads, head_size]`` of one model dtype, on
    ``device`` (the cache's)."""
    dtype = key.dtype
    if not ((num_tokens, num_kv_heads, head_size) == key.shape == value.shape and dtype in _MODEL_DTYPES
            and value.dtype is dtype and key.device == device and value.device == device
            and key.stride()[2] == 1 and value.stride()[2] == 1):
        _explain_kv(op, key, value, device, num_tokens, num_kv_heads, head_size)


def _explain_kv(op, key, value, device, num_tokens, num_kv_heads, head_size):
    if not (num_tokens, num_kv_heads, head_size) == key.shape == value.shape:
        raise ValueError(f"{op}: key and value must be [num_tokens, num_kv_heads, head_size] = "
                         f"[{num_tokens}, {num_kv_heads}, {head_size}], got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if key.dtype not in _MODEL_DTYPES or value.dtype is not key.dtype:
        raise ValueError(f"{op}: key and value must have one dtype of {capabilities.MODEL_DTYPES}, got "
                         f"{key.dtype} and {value.dtype}")
    if key.device != device or value.device != device:
        raise ValueError(f"{op}: key is on {key.device} and value on {value.device}, but the KV cache is on "
                         f"{device}")
    check_channel_stride(op, key=key, value=value)


def check_layer_query(op: str, query: torch.Tensor, output: torch.Tensor, device: torch.device,
                      num_heads: int, head_size: int, num_tokens: int | None = None) -> None:
    """Every call: query and output ``[num_tokens, num_heads, head_size]`` on ``device``
    (``num_tokens`` None: any)."""
    qs = query.shape
    if not (len(qs) == 3 and qs[1] == num_heads and qs[2] == head_size and output.shape == qs
            and (num_tokens is None or qs[0] == num_tokens) and query.device == device
            and output.device == device and query.stride()[2] == 1 and output.stride()[2] == 1):
        _explain_query(op, query, output, device, num_heads, head_size, num_tokens)


def _explain_query(op, query, output, device, num_heads, head_size, num_tokens):
    qs = query.shape
    if not (len(qs) == 3 and qs[1] == num_heads and qs[2] == head_size and output.shape == qs
            and (num_tokens is None or qs[0] == num_tokens)):
        raise ValueError(f"{op}: query and output must be [num_tokens, num_heads, head_size] = "
                         f"[{'T' if num_tokens is None else num_tokens}, {num_heads}, {head_size}], got "
                         f"{tuple(qs)} and {tuple(output.shape)}")
    if query.device != device or output.device != device:
        raise ValueError(f"{op}: query is on {query.device} and output on {output.device}, but the KV cache "
                         f"(or the step's tensors) is on {device}")
    check_channel_stride(op, query=query, output=output)


# --- per-call tensors of a layer ---------------------------------------------------------------


def check_qkv(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """``Attention.forward``: query, key and value of one dtype on one device (what the
    attention op would reject about them together, rejected before the cache update writes)."""
    try:
        if query.dtype is key.dtype is value.dtype and query.device == key.device == value.device:
            return
    except AttributeError:
        raise TypeError(f"Attention {layer.layer_name!r}: query, key and value must be tensors, got "
                        f"{type(query).__name__}, {type(key).__name__}, {type(value).__name__}") from None
    for name, x in (("query", query), ("value", value)):
        if x.device != key.device:
            raise ValueError(f"Attention {layer.layer_name!r}: {name} is on {x.device} but key is on {key.device}; "
                             "query, key and value must be on one device (the KV cache's)")
        if x.dtype is not key.dtype and not (name == "query" and is_fp8_dtype(x.dtype)):  # fp8 query: its own dtype
            raise ValueError(f"Attention {layer.layer_name!r}: {name} dtype {x.dtype} != key dtype {key.dtype}")
    if is_fp8_dtype(query.dtype):  # what the attention refuses of it, refused before the cache update writes
        layer.impl.check_fp8_query(query, layer.kv_cache)


def cache_shape(op: str, layer, kv_cache: torch.Tensor) -> torch.Size:
    """The cache's logical shape; a clear error when the layer has none bound yet, or one of
    another rank."""
    shape = kv_cache.shape
    if len(shape) != 4 and kv_cache.numel():  # bound, but not a cache
        raise ValueError(
            f"{op}: layer {getattr(layer, 'layer_name', layer)!r} has a KV cache of shape {tuple(shape)}; a cache has "
            "the logical shape [num_blocks, 2, block_size, num_kv_heads * head_size] (bind_kv_caches, or "
            "allocate_kv_cache(layer.kv_cache_spec(dtype), num_blocks), makes one)")
    if len(shape) != 4:
        raise RuntimeError(
            f"{op}: layer {getattr(layer, 'layer_name', layer)!r} has no KV cache bound: call "
            "inductor_rocm_attn.bind_kv_caches(model, num_blocks, dtype, device) (or assign "
            "layer.kv_cache) before running it"
        )
    return shape


def token_rows(op: str, name: str, x: torch.Tensor, heads: int, head_size: int) -> torch.Tensor:
    """``x`` as ``[T, heads, head_size]`` (a view of ``[T, heads * head_size]``)."""
    if x.dim() == 3:
        return x
    shape = x.shape
    if len(shape) == 2 and shape[1] == heads * head_size:  # else a view would regroup other rows
        try:
            return x.view(shape[0], heads, head_size)
        except RuntimeError:
            pass
    raise ValueError(f"{op}: {name} must be [num_tokens, {heads} * {head_size}] (unit stride along the last "
                     f"dim) or [num_tokens, {heads}, {head_size}], got {tuple(shape)} with strides {x.stride()}")
