"""Which prefill launches the Gluon kernel covers (host side, pure Python: no Gluon import
until a launch on a Hopper GPU asks).

``prefill_kernel_for`` is what ``kernels.triton.paged_attention`` asks per call: the static
part (dtypes, head and block size, the launch's features, the device) is cached per key, the
tensor part (strides and alignment for TMA) is a few attribute reads. A launch the kernel
does not cover runs the Triton kernel; ``paged_attention`` warns once per reason.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["prefill_kernel_for", "static_ineligibility", "tensor_ineligibility", "auto_problem",
           "unavailable_reason", "BLOCK_N",
           "HEAD_SIZES", "TESTED_TRITON", "AUTO_BLOCK_SIZES", "INTERPRETER_REASON"]

BLOCK_N = 128  # the kernel's key tile (prefix_prefill.DEFAULT_CONFIG.block_n)
HEAD_SIZES = (64, 128)
_DTYPES = (torch.bfloat16, torch.float16)
INTERPRETER_REASON = "TRITON_INTERPRET=1 (Gluon kernels have no interpreter)"


# Gluon is Triton's experimental layer: its API changes between releases. The default ("auto")
# takes the kernel only under the Triton release its GPU tests, memcheck and benchmarks ran on,
# and at the block sizes its GPU tests, memcheck and benchmarks ran (block 8 at head 128 is
# covered but has not run on a GPU: taken when asked for, prefill_kernel="gluon").
TESTED_TRITON = ("3.6.",)
AUTO_BLOCK_SIZES = (16, 32, 64, 128)


@functools.cache
def auto_problem(block_size: int) -> str | None:
    """None when the default ("auto") may take the Gluon prefill with this Triton at this cache
    block size (a launch the kernel covers), else why not."""
    import triton

    if not triton.__version__.startswith(TESTED_TRITON):
        return (f"Triton {triton.__version__} (the Gluon prefill is tested with "
                f"{', '.join(v + 'x' for v in TESTED_TRITON)})")
    if block_size not in AUTO_BLOCK_SIZES:
        return (f"block size {block_size} (the default takes the Gluon prefill at block sizes "
                f"{', '.join(map(str, AUTO_BLOCK_SIZES))}, those its GPU tests ran)")
    return None


@functools.cache
def _gluon_problem() -> str | None:
    """None when the Gluon Hopper kernel module imports, else why not."""
    try:
        from . import prefix_prefill  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not available here
        return f"the Gluon kernel does not import ({type(e).__name__}: {str(e).strip()[:200]})"
    return None


@functools.cache
def _device_problem(device_type: str, device_index: int) -> str | None:
    if device_type != "cuda" or torch.version.hip is not None:
        return f"device {device_type}:{device_index} is not an NVIDIA GPU (the kernel is NVIDIA sm_90 only)"
    cap = torch.cuda.get_device_capability(device_index)
    if cap != (9, 0):
        return f"device capability {cap} is not (9, 0) (the kernel uses Hopper's wgmma, TMA and setmaxnreg)"
    return None


@functools.cache
def static_ineligibility(device_type: str, device_index: int, query_dtype: torch.dtype, key_dtype, cache_dtype,
                         head_size: int, block_size: int, causal: bool, sliding_window: bool, soft_cap: bool,
                         alibi: bool, sinks: bool, output_scale: bool, interpreting: bool) -> str | None:
    """None when the Gluon prefill covers a launch with these static properties, else the
    first reason it does not (``key_dtype`` None: no new K/V given). Cached per key."""
    if interpreting:
        return INTERPRETER_REASON
    if key_dtype is None:
        return "no new key/value tensors (the kernel reads the new tokens from key/value)"
    if query_dtype not in _DTYPES:
        return f"query dtype {query_dtype} (supported: bfloat16, float16)"
    if key_dtype != query_dtype or cache_dtype != query_dtype:
        return (f"query {query_dtype}, key {key_dtype} and cache {cache_dtype} are not one dtype "
                f"(an fp8 or mixed-dtype cache runs the Triton kernel)")
    if head_size not in HEAD_SIZES:
        return f"head size {head_size} (supported: {', '.join(map(str, HEAD_SIZES))})"
    min_block = 8 * 128 // head_size  # a K chunk of the gather (8 keys at d128, 16 at d64) in one page
    if block_size < min_block or BLOCK_N % block_size:
        return (f"block size {block_size} at head size {head_size} (supported: a divisor of {BLOCK_N} "
                f"of at least {min_block})")
    if not causal:
        return "non-causal attention"
    for flag, what in ((sliding_window, "a sliding window"), (soft_cap, "a logits soft cap"),
                       (alibi, "ALiBi slopes"), (sinks, "attention sinks"), (output_scale, "an output scale")):
        if flag:
            return what
    return unavailable_reason(device_type, device_index)


def unavailable_reason(device_type: str, device_index: int) -> str | None:
    """None when the Gluon prefill can run on this device (an NVIDIA sm_90 GPU, the kernel
    module imports), else why not."""
    return _device_problem(device_type, device_index) or _gluon_problem()


def _tma_problem(name: str, t: torch.Tensor, head_size: int) -> str | None:
    """``t`` [tokens, heads, head_size] viewable as a TMA-readable [tokens, heads * head_size]."""
    if (t.stride(2) == 1 and t.stride(1) == head_size and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0 and t.shape[0] > 0):
        return None
    return (f"{name} is not TMA-readable as [tokens, heads * head_size] (strides {tuple(t.stride())}, "
            f"address % 16 = {t.data_ptr() % 16})")


def tensor_ineligibility(output: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """None when the launch's tensors suit the kernel (TMA-readable query/key/value, contiguous
    output channels, a 16-byte aligned cache: the gather's packets), else why not: strides and
    alignment only."""
    head_size = query.shape[2]
    if kv_cache.data_ptr() % 16:
        return f"the KV cache is not 16-byte aligned (address % 16 = {kv_cache.data_ptr() % 16})"
    for name, t in (("query", query), ("key", key), ("value", value)):
        problem = _tma_problem(name, t, head_size)
        if problem is not None:
            return problem
    if output.stride(2) != 1:
        return f"output channels are not contiguous (strides {tuple(output.stride())})"
    return None


def prefill_kernel_for(output, query, key, value, kv_cache, causal, sliding_window, alibi_slopes, sinks,
                       logits_soft_cap, output_scale, interpreting: bool) -> str | None:
    """None when the Gluon prefill covers this ``paged_attention`` launch, else why not."""
    device = query.device
    reason = static_ineligibility(
        device.type, device.index or 0, query.dtype, None if key is None else key.dtype, kv_cache.dtype,
        query.shape[2], kv_cache.shape[2], bool(causal), sliding_window is not None and sliding_window > 0,
        logits_soft_cap > 0, alibi_slopes is not None, sinks is not None, output_scale is not None,
        interpreting)
    if reason is None:
        reason = tensor_ineligibility(output, query, key, value, kv_cache)
    return reason
