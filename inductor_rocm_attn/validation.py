"""Input checks shared by the ops: each error names the op, the parameter, the bad value and
what is supported, and is raised before anything is written.

When each check runs:

- Shape, dtype, device and metadata-consistency checks are host-side (no tensor is read)
  and run on every call.
- Index-range checks read index tensors (``slot_mapping`` and ``block_table`` inside the
  cache, positions inside the cos/sin table, ``query_start_loc`` / ``seq_lens`` /
  ``cu_seqlens`` consistency, the ``max_query_len`` / ``max_seq_len`` hints). They run on
  every call for CPU tensors; on a GPU they would need a device sync (and break graph
  capture), so there they run only with ``ROCM_ATTN_CHECK_INDICES=1``.
- A step's metadata built by ``build_attention_metadata`` was index-checked on the host
  when it was planned (``AttentionMetadata.plan``): the layers compare those bounds with
  their cache (a few integer comparisons), on a GPU too, at no device cost.
- The layers check a step's metadata once per cache geometry and memoize the result on the
  metadata object (``check_step_metadata``): the first layer of a step pays, the others hit
  a dict.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence

import torch

from . import capabilities
from .layout import cache_layout_of, cache_x, is_fp8_dtype

_INDEX_TYPES = (torch.int32, torch.int64)
_SHOW = 16  # entries of an index tensor quoted in an error


ENV_ON = ("1", "true", "yes", "on")
ENV_OFF = ("", "0", "false", "no", "off")
_ENV_SWITCHES: dict[tuple[str, str], bool] = {}  # (name, raw value) -> parsed


def env_switch(name: str) -> bool:
    """An on/off environment variable: unset or one of ``ENV_OFF`` is off, one of ``ENV_ON``
    on (either in any case); any other value is refused (a misspelled "ture" was off, silently)."""
    raw = os.environ.get(name, "")
    parsed = _ENV_SWITCHES.get((name, raw))
    if parsed is None:
        word = raw.strip().lower()
        if word not in ENV_ON + ENV_OFF:
            raise ValueError(f"inductor_rocm_attn: environment variable {name}={raw!r}: expected one of {ENV_ON} (on) or "
                             f"{ENV_OFF[1:]} (off), or unset")
        parsed = _ENV_SWITCHES[(name, raw)] = word in ENV_ON
    return parsed


def _check_indices_on_device() -> bool:
    return env_switch("ROCM_ATTN_CHECK_INDICES")


def index_checks_on(device: torch.device) -> bool:
    """Whether index tensors on ``device`` are read and range-checked: always on CPU, on a
    GPU only with ``ROCM_ATTN_CHECK_INDICES=1`` and never while a CUDA/HIP graph is being
    captured (a read-back would break the capture)."""
    if device.type == "cpu":
        return True
    if device.type == "meta" or not _check_indices_on_device():  # meta: no values to read
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def vocab_size_of(model) -> int | None:
    """The vocabulary size a model states (transformers' ``config``, our models' ``cfg``),
    else None."""
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None)):
        vocab = getattr(holder, "vocab_size", None)
        if is_int(vocab):
            return vocab
    return None


def check_token_ids(op: str, input_ids: torch.Tensor, vocab_size: int | None) -> None:
    """A step's token ids: an integer tensor, and (where index tensors are read: CPU, or a GPU
    with ``ROCM_ATTN_CHECK_INDICES=1``) inside the vocabulary; the embedding would otherwise
    read out of bounds (a CPU abort, a GPU device assert)."""
    if input_ids.dtype not in _INDEX_TYPES:
        raise TypeError(f"{op}: input_ids must be int64 or int32 token ids, got {input_ids.dtype}")
    if vocab_size is None or input_ids.numel() == 0 or not index_checks_on(input_ids.device):
        return
    bad = (input_ids < 0) | (input_ids >= vocab_size)
    if bool(bad.any()):
        at = _first(bad)  # any rank: [T] steps, [B, T] batches
        raise ValueError(f"{op}: input_ids[{', '.join(map(str, at))}] = {int(input_ids[at])} is outside the "
                         f"vocabulary [0, {vocab_size})")


def _want_index_checks(t: torch.Tensor) -> bool:
    return index_checks_on(t.device)


def _show(t: torch.Tensor) -> str:
    values = t[:_SHOW].tolist()
    return str(values) if t.shape[0] <= _SHOW else f"{str(values)[:-1]}, ... ({t.shape[0]} entries)]"


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {desc}")


def check_eps(op: str, eps) -> None:
    """An RMSNorm epsilon: a finite number >= 0 (a negative one turns rows NaN)."""
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")


def _is_float(t: torch.Tensor) -> bool:
    """float64/32/16 or bfloat16 (fp8 holds scaled codes, not values)."""
    return t.dtype.is_floating_point and not is_fp8_dtype(t.dtype)


def check_float_tensor(op: str, name: str, t: torch.Tensor) -> None:
    if not _is_float(t):
        raise ValueError(f"{op}: {name} must be a float32, bfloat16, float16 or float64 tensor, got {t.dtype}")


def check_rms_norm(op: str, x: torch.Tensor, weight: torch.Tensor, eps) -> None:
    check_same_device(op, input=x, weight=weight)
    check_float_tensor(op, "input", x)
    check_float_tensor(op, "weight", weight)
    if x.dim() == 0 or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"{op}: weight must be [hidden] = [{x.shape[-1] if x.dim() else '?'}] for input "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}")
    check_eps(op, eps)


def check_fp8_quant(op: str, x: torch.Tensor, scale: torch.Tensor, out_dtype) -> None:
    check_same_device(op, input=x, scale=scale)
    check_float_tensor(op, "input", x)
    if not is_fp8_dtype(out_dtype):
        raise ValueError(f"{op}: out_dtype must be an fp8 dtype (torch.float8_e4m3fn, torch.float8_e4m3fnuz, "
                         f"torch.float8_e5m2, ...), got {out_dtype}")
    check_scales(op, scale=scale)


def check_dtype(op: str, name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported: {tuple(allowed)}")


def is_int(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_bool(op: str, name: str, value, *, optional: bool = False) -> None:
    """A flag: True or False (``optional``: or None). Any other value is refused: a string
    such as "no" or "false" is truthy and would turn the flag on."""
    if value is True or value is False or (optional and value is None):
        return
    allowed = "True, False or None" if optional else "True or False"
    raise TypeError(f"{op}: {name} must be {allowed}, got {value!r:.60}")


def check_positive_int(op: str, name: str, value) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")


def check_positive_finite(op: str, name: str, value) -> None:
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0):
        raise ValueError(f"{op}: {name} must be a positive finite number, got {value!r}")


def check_gqa(op: str, num_heads, num_kv_heads) -> None:
    """Query heads in groups over the KV heads: both positive ints, ``num_heads`` a multiple of
    ``num_kv_heads`` (query head h reads KV head ``h // (num_heads // num_kv_heads)``)."""
    if not (is_int(num_heads) and is_int(num_kv_heads)) or num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"{op}: num_heads and num_kv_heads must be positive ints, got {num_heads!r} and "
                         f"{num_kv_heads!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{op}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")


def per_head_tensor(op: str, name: str, value, num_heads: int, *, finite: bool = False) -> torch.Tensor:
    """``value`` (a tensor, or a list/tuple of floats) as a ``[num_heads]`` tensor without NaN
    (``finite``: without NaN or infinities); lists become float32."""
    if not isinstance(value, torch.Tensor):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{op}: {name} must be a tensor or a list of floats, got {type(value).__name__!r}")
        value = torch.as_tensor(value, dtype=torch.float32)
    check_per_head(op, name, value, num_heads, contiguous=False)
    if value.device.type != "meta":
        if finite and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{op}: {name} must be finite, got {value.tolist()}")
        if bool(torch.isnan(value).any()):
            raise ValueError(f"{op}: {name} must not hold NaN, got {value.tolist()}")
    return value.contiguous()  # the kernels read head h at offset h


def check_per_head(op: str, name: str, t: torch.Tensor | None, num_heads: int, *,
                   contiguous: bool = True) -> None:
    """A per-head tensor (``alibi_slopes``, ``sinks``): ``[num_heads]`` floats; the kernels
    read head h at offset h, so (``contiguous``) unit stride."""
    if t is None:
        return
    if tuple(t.shape) != (num_heads,):
        raise ValueError(f"{op}: {name} must be [num_heads] = [{num_heads}], got {tuple(t.shape)}")
    if not _is_float(t):
        raise TypeError(f"{op}: {name} must be a float tensor (float32, bfloat16, float16 or float64), got {t.dtype}")
    if contiguous and num_heads > 1 and t.stride(0) != 1:
        raise ValueError(f"{op}: {name} must be contiguous (the kernels read head h at offset h), got "
                         f"stride {t.stride(0)}; pass {name}.contiguous()")


def check_per_head_values(op: str, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None) -> None:
    """The values a layer's configuration refuses, refused by the kernel-level ops too: ALiBi
    slopes finite, sinks without NaN or +inf (-inf: no sink for that head). Read where index
    tensors are (on CPU, or with ``ROCM_ATTN_CHECK_INDICES=1``)."""
    if alibi_slopes is not None and index_checks_on(alibi_slopes.device) and not bool(
            torch.isfinite(alibi_slopes).all()):
        raise ValueError(f"{op}: alibi_slopes must be finite, got {alibi_slopes.tolist()}")
    if sinks is not None and index_checks_on(sinks.device) and bool((torch.isnan(sinks) | (sinks == math.inf)).any()):
        raise ValueError(f"{op}: sinks must not hold NaN or +inf (every row would turn NaN); -inf means no sink "
                         f"for a head, got {sinks.tolist()}")


def check_index_layout(op: str, **tensors: torch.Tensor | None) -> None:
    """Index tensors are read as dense rows by the kernels: 1-D ones contiguous, 2-D ones
    (block tables) with contiguous rows."""
    for name, t in tensors.items():
        if t is not None and t.numel() > 1 and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have unit stride along its last dim (the kernels read it as "
                             f"dense rows), got strides {t.stride()}; pass {name}.contiguous()")


def check_norm_weight_layout(op: str, **weights: torch.Tensor | None) -> None:
    """RMSNorm weights ``[head_size]``: the Triton kernels read channel d at offset d, so a
    strided view (e.g. a column of a stacked ``[head_size, 2]`` q/k weight) would give them
    other channels' weights."""
    for name, w in weights.items():
        if w is not None and w.numel() > 1 and w.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous (the kernels read channel d at offset d), got "
                             f"stride {w.stride(-1)}; pass {name}.contiguous()")


def check_channel_stride(op: str, **tensors: torch.Tensor | None) -> None:
    """The attention kernels read each head's channels as one dense vector."""
    for name, t in tensors.items():
        if t is not None and t.numel() > 1 and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have unit stride along head_size (any other strides work), got "
                             f"strides {t.stride()}")


def check_written(op: str, written: dict, read: dict) -> None:
    """Tensors an op writes (in place, or its output): none an expanded (stride-0) view, whose
    rows share memory (the Triton kernels wrote every row into it, the last one won), and none
    starting at the address of another argument (``written`` or ``read``): the same tensor
    passed twice, whose result depends on the order the kernels' programs run in (a key
    rotated twice, a rotated key cached as the value, output rows overwriting keys another
    tile still reads). Metadata only; views of one buffer that start at other addresses
    (q/k/v slices of a fused qkv) are not compared. Runs on every call of the kernel-level
    ops: the common path is one ``data_ptr`` and one ``stride`` per tensor."""
    ptrs = {t.data_ptr(): name for name, t in read.items() if t is not None}
    for name, t in reversed(written.items()):  # the first written name wins in the message
        if t is None:
            continue
        if 0 in t.stride() and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            raise ValueError(f"{op}: {name} is an expanded view (strides {t.stride()}): its rows share memory and "
                             f"each is written; pass a tensor of its own ({name}.clone())")
        ptr = t.data_ptr()
        other = ptrs.get(ptr)
        if other is not None and t.numel() and (written.get(other) if other in written else read[other]).numel():
            raise ValueError(f"{op}: {name} and {other} are the same memory (the op writes {name} while it reads "
                             f"{other}); pass separate tensors")
        ptrs[ptr] = name


def check_attention_options(op: str, scale: float, sliding_window: int, logits_soft_cap: float) -> None:
    """The kernel-level attention ops' scalars: a positive finite scale, a window of -1 / 0
    (none) or a positive int, a soft cap of 0 (off) or a positive finite number."""
    check_softmax_scale(op, scale)
    if not is_int(sliding_window) or sliding_window < -1:
        raise ValueError(f"{op}: sliding_window must be -1 or 0 (none) or a positive int, got {sliding_window!r}")
    if not (isinstance(logits_soft_cap, numbers.Real) and math.isfinite(logits_soft_cap) and logits_soft_cap >= 0):
        raise ValueError(f"{op}: logits_soft_cap must be 0 (off) or a positive finite number, got "
                         f"{logits_soft_cap!r}")


def check_softmax_scale(op: str, scale: float) -> None:
    """The softmax scale must be a positive finite number: the kernels take each row's max on
    unscaled scores (as FlashAttention does), which only equals the max of the scaled ones
    for a positive scale."""
    check_positive_finite(op, "scale", scale)


# --- caches and slots ------------------------------------------------------------------------


def check_kv_cache_dtype(op: str, kv_cache: torch.Tensor) -> None:
    """A cache holds a model dtype (fp16/bf16/fp32) or fp8 codes: the kernels read nothing else."""
    if not is_fp8_dtype(kv_cache.dtype) and kv_cache.dtype not in capabilities.MODEL_DTYPES:
        raise ValueError(f"{op}: kv_cache dtype {kv_cache.dtype} is not a supported cache dtype; supported: "
                         f"{tuple(capabilities.MODEL_DTYPES)} or an fp8 dtype")


def check_kv_cache(op: str, kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    cache_layout_of(kv_cache, op)  # raises on a bad shape or stride pattern
    check_kv_cache_dtype(op, kv_cache)
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


def check_slot_range(op: str, slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every slot is padding (< 0) or inside the cache (reads the tensor)."""
    if not slot_mapping.numel():
        return
    num_slots = num_blocks * block_size
    bad = slot_mapping >= num_slots
    if bool(bad.any()):
        (i,) = _first(bad)
        raise IndexError(
            f"{op}: slot_mapping entry {int(slot_mapping[i])} (token {i}) is outside the cache "
            f"({num_blocks} blocks x {block_size} = {num_slots} slots; entries < 0 mark padding)"
        )
    written = slot_mapping[slot_mapping >= 0]
    ordered = written.sort().values
    same = ordered[1:] == ordered[:-1]
    if bool(same.any()):  # two tokens into one slot: which one lands is undefined
        slot = int(ordered[1:][same][0])
        i, j = torch.nonzero(slot_mapping == slot)[:2, 0].tolist()
        raise ValueError(f"{op}: slot_mapping[{i}] and slot_mapping[{j}] are both {slot}; each token needs "
                         "its own cache slot (entries < 0 mark padding)")


def check_slot_mapping(op: str, slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_tokens: int) -> None:
    check_dtype(op, "slot_mapping", slot_mapping, _INDEX_TYPES)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > num_tokens:
        raise ValueError(
            f"{op}: slot_mapping must be 1-D with at most {num_tokens} entries (one per token), "
            f"got shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != kv_cache.device:
        raise ValueError(f"{op}: slot_mapping is on {slot_mapping.device} but kv_cache is on {kv_cache.device}")
    check_index_layout(op, slot_mapping=slot_mapping)
    if _want_index_checks(slot_mapping):
        check_slot_range(op, slot_mapping, kv_cache.shape[0], kv_cache.shape[2])


def check_scales(op: str, **scales: torch.Tensor | None) -> None:
    """Per-tensor scales: one float32 element, positive and finite (the value is read where
    index tensors are: on CPU, or with ``ROCM_ATTN_CHECK_INDICES=1``)."""
    for name, s in scales.items():
        if s is None:
            continue
        # shape () or (1,): a [1, 1, 1] scale broadcast static_scaled_fp8_quant's output to 3-D
        if s.numel() != 1 or s.dim() > 1:
            raise ValueError(f"{op}: {name} must be a per-tensor scale (1 element, shape () or (1,)), got shape "
                             f"{tuple(s.shape)}")
        # the kernels read a float32 (the native ones through a float pointer); an int or fp8
        # tensor would be taken for its value, a 16-bit one rounds small scales
        if s.dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be a float32 tensor (a per-tensor scale), got {s.dtype}")
        if index_checks_on(s.device):
            check_positive_finite(op, name, float(s.reshape(())))


def check_cache_write(op: str, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    check_same_device(op, key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping,
                      k_scale=k_scale, v_scale=v_scale)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"{op}: key and value must both be [num_tokens, num_kv_heads, head_size], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_dtype(op, "key", key, capabilities.MODEL_DTYPES)
    if value.dtype != key.dtype:
        raise ValueError(f"{op}: key dtype {key.dtype} != value dtype {value.dtype}")
    check_kv_cache(op, kv_cache, key.shape[1], key.shape[2])
    check_scales(op, k_scale=k_scale, v_scale=v_scale)
    check_slot_mapping(op, slot_mapping, kv_cache, key.shape[0])


# --- sequences: query_start_loc, seq_lens, block_table ---------------------------------------


def check_sequence_shapes(op: str, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          block_table: torch.Tensor | None) -> None:
    """Host-side: dtypes and shapes of the per-sequence index tensors."""
    names = (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table))
    for name, t in names:
        if t is not None:
            check_dtype(op, name, t, _INDEX_TYPES)
    if (seq_lens.dim() != 1 or query_start_loc.dim() != 1
            or query_start_loc.shape[0] != seq_lens.shape[0] + 1
            or (block_table is not None and block_table.dim() != 2)):
        raise ValueError(
            f"{op}: expected query_start_loc [B+1], seq_lens [B], block_table [B, max_blocks]; got "
            f"{tuple(query_start_loc.shape)}, {tuple(seq_lens.shape)}, "
            f"{None if block_table is None else tuple(block_table.shape)}"
        )
    if block_table is not None and block_table.shape[0] < seq_lens.shape[0]:
        raise ValueError(f"{op}: block_table has {block_table.shape[0]} rows for {seq_lens.shape[0]} sequences")
    check_index_layout(op, query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table)


def check_query_start_loc(op: str, query_start_loc: torch.Tensor, num_tokens: int,
                          name: str = "query_start_loc", exact: bool = False) -> list[int]:
    """Reads the tensor: starts at 0, never decreases, ends inside the ``num_tokens`` query rows
    (``exact``: at ``num_tokens``). Returns it as a host list."""
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:])):
        raise ValueError(f"{op}: {name} must start at 0 and never decrease, got {_show(query_start_loc)}")
    end = qsl[-1]
    if exact and end != num_tokens:
        raise ValueError(f"{op}: {name}[-1] = {end} but query has {num_tokens} tokens: every token must "
                         "belong to a sequence")
    if end > num_tokens:
        raise ValueError(f"{op}: {name}[-1] = {end} runs past the {num_tokens} query tokens")
    return qsl


# What the launch does with each hint (max_query_len: "query", max_seq_len: "sequence"), for
# the errors of a hint below the step's longest.
HINT_USES = {"query": "the GPU launcher skips the prefill or verify launch those rows need",
             "sequence": "the launch plans its KV splits for it"}


def _check_hint(op: str, name: str, hint: int | None, lengths: list[int], what: str) -> None:
    if hint is None or not lengths:
        return
    longest = max(lengths)
    if hint < longest:
        raise ValueError(
            f"{op}: {name} {hint} is smaller than the longest {what} ({longest} tokens, sequence "
            f"{lengths.index(longest)}); the hint must be >= every {what} length ({HINT_USES[what]})"
        )


def check_sequences(op: str, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor | None, *, num_tokens: int, num_blocks: int | None,
                    block_size: int | None, max_query_len: int | None,
                    max_seq_len: int | None) -> tuple[list[int], list[int]]:
    """Reads the tensors: query_start_loc valid for ``num_tokens`` rows, ``seq_lens >=
    query_lens``, the launch hints cover the step, and every block a sequence uses (its
    first ceil(seq_len / block_size) entries) is in the cache. Returns query_start_loc and
    seq_lens as host lists."""
    qsl = check_query_start_loc(op, query_start_loc, num_tokens)
    lens = seq_lens.tolist()
    qlens = [b - a for a, b in zip(qsl, qsl[1:])]
    short = next((s for s, (n, q) in enumerate(zip(lens, qlens)) if n < q), None)
    if short is not None:
        raise ValueError(f"{op}: seq_lens[{short}] = {lens[short]} is smaller than that sequence's query length "
                         f"{qlens[short]} (seq_lens counts the cached and the new tokens)")
    _check_hint(op, "max_query_len", max_query_len, qlens, "query")
    _check_hint(op, "max_seq_len", max_seq_len, lens, "sequence")
    if block_table is not None:
        check_block_table(op, block_table, lens, num_blocks, block_size)
    return qsl, lens


def check_block_table(op: str, block_table: torch.Tensor, seq_lens: torch.Tensor | list[int],
                      num_blocks: int, block_size: int) -> None:
    """Every block a sequence uses (the first ceil(seq_len / block_size) entries) is in the cache."""
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens
    if not lens:
        return
    used = [-(-n // block_size) for n in lens]
    most = max(used)
    if most > block_table.shape[1]:
        s = used.index(most)
        raise ValueError(f"{op}: sequence {s} of {lens[s]} tokens needs {most} blocks but block_table has "
                         f"{block_table.shape[1]} columns")
    table = block_table[: len(lens), :most]
    cols = torch.arange(most, device=table.device)
    need = torch.tensor(used, device=table.device)
    bad = (cols[None, :] < need[:, None]) & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        s, j = _first(bad)
        raise IndexError(f"{op}: block_table[{s}, {j}] = {int(table[s, j])} is outside the cache "
                         f"(valid block ids: 0..{num_blocks - 1})")


def check_slots_follow_table(op: str, slot_mapping: torch.Tensor, qsl: list[int], lens: list[int],
                             block_table: torch.Tensor, block_size: int) -> None:
    """Reads the tensors: the slot of each real token is where its sequence's block table puts
    its position (or < 0: not written), and tokens past ``query_start_loc[-1]`` (padding) write
    nothing, so a write never lands in another sequence's blocks. ``qsl``/``lens``: the host
    lists ``check_sequences`` returned."""
    n = qsl[-1]
    slots = slot_mapping.to(torch.int64)
    written_pad = slots[n:] >= 0
    if bool(written_pad.any()):
        (i,) = _first(written_pad)
        raise ValueError(f"{op}: slot_mapping[{n + i}] = {int(slots[n + i])} belongs to a padding token (past "
                         f"query_start_loc[-1] = {n}) and must be < 0")
    if n == 0:
        return
    dev = slots.device
    qlens = [b - a for a, b in zip(qsl, qsl[1:])]
    tok = torch.arange(n, device=dev)
    seq = torch.searchsorted(torch.tensor(qsl[1:], device=dev), tok, right=True)  # token -> sequence
    # token i of sequence s sits at position (seq_len - query_len) + (i - start)
    offset = torch.tensor([m - q - a for a, q, m in zip(qsl, qlens, lens)], device=dev)
    pos = offset[seq] + tok
    want = block_table[seq, pos // block_size].to(torch.int64) * block_size + pos % block_size
    got = slots[:n]
    bad = (got >= 0) & (got != want)
    if bool(bad.any()):
        (i,) = _first(bad)
        raise ValueError(
            f"{op}: slot_mapping[{i}] = {int(got[i])} but token {i} (sequence {int(seq[i])}, position "
            f"{int(pos[i])}) belongs in slot {int(want[i])} per block_table (block_size {block_size}); "
            "slots must follow the block table (or be < 0: not written)"
        )


def check_written_blocks_once(op: str, slot_mapping: torch.Tensor, positions: torch.Tensor, qsl: list[int],
                              lens: list[int], block_table: torch.Tensor, block_size: int, *,
                              table_name: str = "block_table", unread: Sequence[bool] | None = None) -> None:
    """Reads the tensors: a block that receives a new token appears once among the blocks the
    step's sequences use, else the write lands in another sequence's context (a block in two
    tables) or in the same sequence's earlier tokens (a block twice in one table). Shared
    prefix blocks that nobody writes are fine. ``qsl``/``lens``: the step's host lists;
    ``table_name``: the caller's name of ``block_table`` in the message; ``unread[s]``: the
    blocks of sequence s do not count (the builder's padding sequences: they write nothing and
    their output rows are unspecified). Vectorized: about 0.1 ms for 64 sequences of 2048
    tokens on the 2-core CPU machine."""
    n = qsl[-1]
    if n == 0 or not lens or block_table.numel() == 0:
        return
    dev = block_table.device
    table = block_table[: len(lens)].to(torch.int64)
    need = torch.tensor([0 if unread is not None and unread[s] else -(-m // block_size)
                         for s, m in enumerate(lens)], device=dev)
    used = torch.arange(table.shape[1], device=dev)[None, :] < need[:, None]
    # entries past a sequence's blocks may hold anything (-1 for "none"): counted with weight 0
    counts = torch.bincount(table.masked_fill(~used, 0).flatten(), weights=used.flatten().to(torch.float32))
    slots = slot_mapping[:n].to(torch.int64)
    written = slots >= 0
    shared = torch.zeros_like(written)
    shared[written] = counts[slots[written] // block_size] > 1
    if not bool(shared.any()):
        return
    (i,) = _first(shared)
    block = int(slots[i]) // block_size
    s = int(torch.searchsorted(torch.tensor(qsl[1:]), torch.tensor(i), right=True))
    users = torch.nonzero((table == block) & used).tolist()
    where = ", ".join(f"{table_name}[{a}][{b}]" for a, b in users[:4]) + (", ..." if len(users) > 4 else "")
    raise ValueError(f"{op}: block {block} receives a new token of sequence {s} (token {i}, position "
                     f"{int(positions[i])}) but is used {len(users)} times in this step ({where}); a block written "
                     "in a step must belong to one sequence, once (shared prefix blocks are read-only)")


# --- whole-op checks (kernel-level ops; a layer's first call of a signature) -------------------


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
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> None:
    check_same_device(
        op, output=output, query=query, key=key, value=value, kv_cache=kv_cache,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
        k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes, sinks=sinks,
        output_scale=output_scale,
    )
    if query.dim() != 3:
        raise ValueError(f"{op}: query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    num_tokens, num_heads, head_size = query.shape
    if key is not None:
        if key.dim() != 3 or value is None or value.shape != key.shape or key.shape[0] != num_tokens:
            raise ValueError(f"{op}: key/value must be [num_tokens, num_kv_heads, head_size] with the query's "
                             f"{num_tokens} tokens, got {tuple(key.shape)} and "
                             f"{None if value is None else tuple(value.shape)}")
        if key.dtype != query.dtype and not is_fp8_dtype(query.dtype):
            raise ValueError(f"{op}: key dtype {key.dtype} != query dtype {query.dtype}")
        if value.dtype != key.dtype:
            raise ValueError(f"{op}: value dtype {value.dtype} != key dtype {key.dtype}")
        num_kv_heads = key.shape[1]
    else:
        if value is not None:  # a value without its key would be ignored: every key is read from the cache
            raise ValueError(f"{op}: value is given but key is None; pass both (the step's new tokens) or "
                             "neither (every key and value read from the cache)")
        if kv_cache.dim() != 4:  # its shape error, before the head count is read from it
            cache_layout_of(kv_cache, op)
        num_kv_heads = kv_cache.shape[3] // head_size
    check_gqa(op, num_heads, num_kv_heads)
    check_kv_cache(op, kv_cache, num_kv_heads, head_size)
    if output.shape != query.shape:
        raise ValueError(f"{op}: output shape {tuple(output.shape)} does not match query {tuple(query.shape)}")
    check_channel_stride(op, query=query, key=key, value=value, output=output)
    if output_scale is None and output.dtype != query.dtype and not is_fp8_dtype(query.dtype):
        raise ValueError(f"{op}: output dtype {output.dtype} != query dtype {query.dtype}")
    if output_scale is not None and not is_fp8_dtype(output.dtype):
        raise ValueError(f"{op}: output_scale (fused fp8 output quant) needs an fp8 output, got {output.dtype}")
    check_sequence_shapes(op, query_start_loc, seq_lens, block_table)
    check_per_head(op, "alibi_slopes", alibi_slopes, num_heads)
    check_per_head(op, "sinks", sinks, num_heads)
    check_per_head_values(op, alibi_slopes, sinks)
    check_scales(op, k_scale=k_scale, v_scale=v_scale, output_scale=output_scale)
    for name, hint in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if hint is not None and (not isinstance(hint, int) or hint < 0):
            raise ValueError(f"{op}: {name} must be an int >= 0, got {hint!r}")
    if _want_index_checks(block_table):
        check_sequences(op, query_start_loc, seq_lens, block_table, num_tokens=num_tokens,
                        num_blocks=kv_cache.shape[0], block_size=kv_cache.shape[2],
                        max_query_len=max_query_len, max_seq_len=max_seq_len)


def check_positions(op: str, positions: torch.Tensor, rows: int) -> None:
    """Reads the tensor: every position is a row of the cos/sin table."""
    bad = (positions < 0) | (positions >= rows)
    if bool(bad.any()):
        (i,) = _first(bad)
        raise IndexError(f"{op}: positions entry {int(positions[i])} (token {i}) is outside the cos/sin table "
                         f"(valid: 0..{rows - 1})")


def check_positions_tensor(op: str, positions: torch.Tensor, num_tokens: int, cos_sin_cache: torch.Tensor) -> None:
    check_dtype(op, "positions", positions, _INDEX_TYPES)
    if positions.dim() != 1 or positions.shape[0] != num_tokens:
        raise ValueError(f"{op}: positions must be [num_tokens] = [{num_tokens}], got {tuple(positions.shape)}")
    check_index_layout(op, positions=positions, cos_sin_cache=cos_sin_cache)
    if cos_sin_cache.shape[0] == 0:  # every position would be outside it (read out of bounds on a GPU)
        raise ValueError(f"{op}: cos_sin_cache has no rows (shape {tuple(cos_sin_cache.shape)}); it needs a row "
                         "per position, [max_position, rot_dim]")
    if _want_index_checks(positions):
        check_positions(op, positions, cos_sin_cache.shape[0])


def check_rotary(op: str, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                 head_size: int, cos_sin_cache: torch.Tensor) -> None:
    check_same_device(op, positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    check_dtype(op, "query", query, capabilities.MODEL_DTYPES)
    check_float_tensor(op, "cos_sin_cache", cos_sin_cache)
    rot = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if rot <= 0 or rot % 2 or rot > head_size:
        raise ValueError(
            f"{op}: cos_sin_cache must be [max_position, rot_dim] with an even rot_dim <= "
            f"head_size {head_size}, got {tuple(cos_sin_cache.shape)}"
        )
    if positions.dim() != 1 or (query.dim() and positions.shape[0] != query.shape[0]):  # before the rows it counts
        raise ValueError(f"{op}: positions must be [num_tokens], one entry per query token "
                         f"({query.shape[0] if query.dim() else '?'}), got {tuple(positions.shape)}")
    for name, t in (("query", query), ("key", key)):
        if t is None:
            continue
        # a 3-D tensor's heads are its dim 1: its last dim must be head_size (else its heads
        # would be cut into others); a 2-D one is [T, heads * head_size]
        if (t.dim() not in (2, 3) or t.shape[0] != positions.shape[0] or t.shape[-1] % head_size
                or (t.dim() == 3 and t.shape[2] != head_size)):
            raise ValueError(
                f"{op}: {name} {tuple(t.shape)} must be [num_tokens, num_heads * {head_size}] "
                f"(or [num_tokens, num_heads, {head_size}]) with num_tokens = {positions.shape[0]}"
            )
        if t.dtype != query.dtype:
            raise ValueError(f"{op}: {name} dtype {t.dtype} != query dtype {query.dtype}")
    check_positions_tensor(op, positions, query.shape[0], cos_sin_cache)


def check_qk_norm_rope(op: str, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int,
                       num_kv_heads: int, head_size: int) -> None:
    check_same_device(op, qkv=qkv, q_weight=q_weight, k_weight=k_weight, positions=positions,
                      cos_sin_cache=cos_sin_cache)
    check_dtype(op, "qkv", qkv, capabilities.MODEL_DTYPES)
    capabilities.check_head_size(head_size, op)
    check_gqa(op, num_heads, num_kv_heads)
    width = (num_heads + 2 * num_kv_heads) * head_size
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"{op}: qkv must be [num_tokens, (num_heads + 2 * num_kv_heads) * head_size] = "
            f"[T, {width}], got {tuple(qkv.shape)}"
        )
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_size,):
            raise ValueError(f"{op}: {name} must be [head_size] = [{head_size}], got {tuple(w.shape)}")
        check_float_tensor(op, name, w)
    check_norm_weight_layout(op, q_weight=q_weight, k_weight=k_weight)
    check_float_tensor(op, "cos_sin_cache", cos_sin_cache)
    # rot_dim 0 would skip the rotation silently (rotary_embedding refuses it too)
    if (cos_sin_cache.dim() != 2 or not 0 < cos_sin_cache.shape[1] <= head_size
            or cos_sin_cache.shape[1] % 2):
        raise ValueError(f"{op}: cos_sin_cache must be [max_position, rot_dim] with an even rot_dim in "
                         f"(0, {head_size}], got {tuple(cos_sin_cache.shape)}")
    check_positions_tensor(op, positions, qkv.shape[0], cos_sin_cache)


def check_encoder_attention(op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cu_seqlens: torch.Tensor, alibi_slopes, sinks, max_seqlen: int | None = None) -> None:
    check_same_device(op, query=query, key=key, value=value, cu_seqlens=cu_seqlens,
                      alibi_slopes=alibi_slopes, sinks=sinks)
    if (query.dim() != 3 or key.dim() != 3 or key.shape != value.shape or key.shape[0] != query.shape[0]
            or key.shape[2] != query.shape[2]):
        raise ValueError(
            f"{op}: query [T, Hq, D] and key/value [T, Hkv, D] (one T, one D) expected, got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    check_dtype(op, "query", query, capabilities.MODEL_DTYPES)
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise ValueError(f"{op}: {name} dtype {t.dtype} != query dtype {query.dtype}")
    capabilities.check_head_size(query.shape[2], op)
    check_gqa(op, query.shape[1], key.shape[1])
    check_dtype(op, "cu_seqlens", cu_seqlens, _INDEX_TYPES)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{op}: cu_seqlens must be [num_seqs + 1], got {tuple(cu_seqlens.shape)}")
    check_index_layout(op, cu_seqlens=cu_seqlens)
    check_channel_stride(op, query=query, key=key, value=value)
    check_per_head(op, "alibi_slopes", alibi_slopes, query.shape[1])
    check_per_head(op, "sinks", sinks, query.shape[1])
    check_per_head_values(op, alibi_slopes, sinks)
    if _want_index_checks(cu_seqlens):
        cu = check_query_start_loc(op, cu_seqlens, query.shape[0], "cu_seqlens", exact=True)
        _check_hint(op, "max_seqlen", max_seqlen, [b - a for a, b in zip(cu, cu[1:])], "sequence")


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
        row = math.prod(x.shape[1:])  # elements of one token (x[0] fails without tokens)
        ok = x.dim() in (2, 3) and x.shape[0] == t and row % d == 0 and (x.dim() == 2 or x.shape[2] == d)
        if not ok or (heads is not None and row != heads * d):
            raise ValueError(
                f"{op}: {name} must be [num_tokens, heads, head_size] (or [num_tokens, heads * head_size]) "
                f"with num_tokens {t}, head_size {d}{'' if heads is None else f', {heads} heads'} (value "
                f"{tuple(value.shape)}), got {tuple(x.shape)}"
            )
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            raise ValueError(f"{op}: {name} dtype {x.dtype} != query dtype {query.dtype}")
    check_gqa(op, math.prod(query.shape[1:]) // d, hkv)
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
        if w is not None:
            check_float_tensor(op, name, w)
    check_norm_weight_layout(op, q_weight=q_weight, k_weight=k_weight)
    if q_weight is not None and k_weight is not None and q_weight.dtype != k_weight.dtype:
        raise ValueError(f"{op}: q_weight dtype {q_weight.dtype} != k_weight dtype {k_weight.dtype}")
