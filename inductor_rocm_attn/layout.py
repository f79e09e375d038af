"""Paged KV-cache layouts (docs/design.md, "KV-cache layouts").

A layer's cache is one tensor of *logical* shape
``[num_blocks, 2, block_size, num_kv_heads * head_size]`` (dim 1: the K and V head
groups). The physical order is carried by its strides, so every op takes the same
tensor and can tell the layout without an extra argument:

- ``LHBNC``: the K group of all blocks, then the V group of all blocks
  (``stride(1) == num_blocks * page``). The native kernels need it.
- ``LBHNC``: per block, its K page then its V page (``stride(0) == 2 * page``, or larger
  in a hybrid attention/Mamba cache whose blocks hold more than the two pages).

Inside a page (one block of one group, ``page = block_size * num_kv_heads * head_size``
elements), with ``x = 16 // element_size``:

- K:               ``[num_kv_heads, head_size // x, block_size, x]``
- V standard:      ``[num_kv_heads, head_size, block_size]``
- V interleaved:   ``[num_kv_heads, block_size // x, head_size, x]``

The views below expose these interiors over all blocks, keeping the block stride of the
physical layout, so kernels index ``[block, head, ...]`` the same way for both layouts.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import numbers

import torch

from .capabilities import MODEL_DTYPES, SUPPORTED_KV_CACHE_DTYPES, check_cache_geometry

__all__ = [
    "CacheLayout",
    "KVCacheSpec",
    "allocate_kv_cache",
    "as_cache_layout",
    "cache_layout_of",
    "cache_x",
    "cache_torch_dtype",
    "check_spec",
    "customize_spec",
    "dense_kv",
    "fp8_max",
    "is_fp8_dtype",
    "k_view",
    "v_view",
    "convert_v_layout_",
]


class CacheLayout(str, enum.Enum):
    """Physical order of a layer's paged KV cache (``Attention(cache_layout=...)``, the enum or
    its string); the logical shape is the same for both (docs/design.md, "KV-cache layouts")."""

    LHBNC = "LHBNC"  # [layer][head group K|V][block][token][channel]: groups contiguous
    LBHNC = "LBHNC"  # [layer][block][head group K|V][token][channel]: blocks contiguous

    @classmethod
    def _missing_(cls, value):
        # ``CacheLayout(value)`` of an unknown value: say what is supported (not the bare enum error).
        raise ValueError(f"rocm_attn: cache_layout {value!r} is not supported; supported: "
                         f"{', '.join(repr(m.value) for m in cls)}")


_FP8_DTYPES = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in _FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _fp8_e4m3_dtype(device: torch.device | str | None) -> torch.dtype:
    # MI300 (gfx94x) hardware uses the "fnuz" e4m3 variant; everything else the OCP one.
    if device is not None and torch.device(device).type == "cuda" and torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if "gfx94" in arch:
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def cache_torch_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device | None = None
) -> torch.dtype:
    """Storage dtype of a cache for the ``kv_cache_dtype`` string a layer is configured with."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "float16":
        return torch.float16
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return _fp8_e4m3_dtype(device)
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    raise ValueError(
        f"rocm_attn: kv_cache_dtype {kv_cache_dtype!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
    )


def cache_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte packet: the innermost K (and interleaved V) dimension."""
    return 16 // torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """What a layer needs from the cache allocator (the engine-facing description)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    layout: CacheLayout = CacheLayout.LHBNC
    num_head_slots: int = 2  # K and V are two head groups of one page pair

    @property
    def page_elems(self) -> int:
        """Elements in one block of one head group."""
        return self.block_size * self.num_kv_heads * self.head_size

    @property
    def state_content_bytes(self) -> int:
        """Bytes one token takes in ONE head slot (K or V): ``num_kv_heads * head_size`` elements.

        The seed's meaning: an allocator lays a block out as ``num_head_slots`` slots of
        ``block_size`` tokens of this many bytes each (the pages of ``page_size_bytes``).
        """
        return self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block over both head slots: ``num_head_slots`` pages (K page, V page).

        A hybrid cache may place blocks further apart than this (see ``cache_layout_of``).
        """
        return self.num_head_slots * self.block_size * self.state_content_bytes

    def logical_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.num_head_slots, self.block_size, self.num_kv_heads * self.head_size)


def customize_spec(
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    layout: CacheLayout | str = CacheLayout.LHBNC,
) -> KVCacheSpec:
    """Spec of a ROCM_ATTN layer's cache: two head groups (K, V), one page pair per block."""
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, dtype, CacheLayout(layout))
    check_spec(spec, "customize_spec")
    return spec


def _is_count(n) -> bool:
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0


def check_spec(spec: KVCacheSpec, op: str) -> None:
    """A spec whose cache the ops can read: a supported block and head size, a positive int
    ``num_kv_heads``, a cache dtype (fp16/bf16/fp32 or fp8), a known layout and two head slots
    (K and V)."""
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"{op}: spec must be a KVCacheSpec (see customize_spec), got {type(spec).__name__}")
    check_cache_geometry(spec.block_size, spec.head_size, op)
    if not _is_count(spec.num_kv_heads):
        raise ValueError(f"{op}: num_kv_heads must be a positive int, got {spec.num_kv_heads!r}")
    if not isinstance(spec.dtype, torch.dtype) or not (spec.dtype in MODEL_DTYPES or is_fp8_dtype(spec.dtype)):
        raise ValueError(f"{op}: dtype {spec.dtype!r} is not a cache dtype; supported: {MODEL_DTYPES} or an fp8 "
                         "dtype (see cache_torch_dtype)")
    if spec.num_head_slots != 2:
        raise ValueError(f"{op}: num_head_slots must be 2 (K and V), got {spec.num_head_slots!r}")
    # a KVCacheSpec built directly keeps its layout as given: any value but LBHNC was allocated
    # as LHBNC
    if spec.layout not in tuple(CacheLayout):
        raise ValueError(f"{op}: layout {spec.layout!r} is not supported; supported: "
                         f"{', '.join(repr(m.value) for m in CacheLayout)}")


def as_cache_layout(layout, op: str) -> CacheLayout:
    """``layout`` (a ``CacheLayout`` or its name) as a ``CacheLayout``; a ValueError naming ``op``
    and the supported layouts otherwise."""
    try:
        return CacheLayout(layout)
    except ValueError:
        raise ValueError(f"{op}: cache_layout {layout!r} is not supported; supported: "
                         f"{', '.join(repr(m.value) for m in CacheLayout)}") from None


def as_device(device, op: str) -> torch.device:
    """``device`` as a ``torch.device``; a ValueError naming ``op`` when it is not one, or is a
    GPU this process does not have (torch's own error, raised at the first allocation, named
    neither the call nor the device: "Torch not compiled with CUDA enabled")."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{op}: device {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if parsed.type == "cuda":
        why = _gpu_unavailable(parsed.index)
        if why is not None:
            raise ValueError(f"{op}: device {str(device)!r}: {why}")
    return parsed


@functools.cache
def _gpu_unavailable(index: int | None) -> str | None:
    """Why ``cuda[:index]`` cannot be used in this process, or None (asked once per index)."""
    if not torch.cuda.is_available():
        return f"this process sees no CUDA/ROCm GPU (torch {torch.__version__}); use 'cpu'"
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        return f"there are {count} GPUs here (cuda:0 .. cuda:{count - 1})"
    return None


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Allocate one layer's cache in logical shape, physically ordered by ``spec.layout``.

    Returns ``[num_blocks, 2, block_size, num_kv_heads * head_size]`` of ``spec.dtype``;
    contents are uninitialised (engines never read a slot before writing it).
    """
    if not _is_count(num_blocks):
        raise ValueError(f"allocate_kv_cache: num_blocks must be a positive int, got {num_blocks!r}")
    check_spec(spec, "allocate_kv_cache")
    device = as_device(device, "allocate_kv_cache")
    nb, g, bs, hd = spec.logical_shape(num_blocks)
    try:
        if spec.layout == CacheLayout.LBHNC:
            return torch.empty((nb, g, bs, hd), dtype=spec.dtype, device=device)
        # LHBNC: allocate [2, num_blocks, ...] and present it in logical order.
        return torch.empty((g, nb, bs, hd), dtype=spec.dtype, device=device).transpose(0, 1)
    except RuntimeError as e:  # the allocator's message names neither the call nor the cache's geometry
        size = nb * g * bs * hd * spec.dtype.itemsize
        # a GPU's OutOfMemoryError keeps its class (callers catch it); the CPU allocator's RuntimeError
        # becomes a MemoryError, as the block allocator's "out of blocks"
        exc = torch.OutOfMemoryError if isinstance(e, torch.OutOfMemoryError) else MemoryError
        raise exc(f"allocate_kv_cache: {num_blocks} blocks of {bs} tokens x {hd} channels x 2 "
                  f"({spec.dtype}) = {size / 2**30:.2f} GiB could not be allocated on {device}; "
                  f"use fewer blocks ({type(e).__name__}: {str(e).strip()[:200]})") from e


def cache_layout_of(kv_cache: torch.Tensor, op: str = "rocm_attn") -> CacheLayout:
    """Which physical layout a logical-shape cache tensor has (read from its strides); ``op``
    names the caller in the errors."""
    if kv_cache.dim() != 4 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{op}: kv_cache must have logical shape "
            f"[num_blocks, 2, block_size, num_kv_heads*head_size], got {tuple(kv_cache.shape)}"
        )
    page = kv_cache.shape[2] * kv_cache.shape[3]
    s0, s1, s2, s3 = kv_cache.stride()
    if s3 != 1 or s2 != kv_cache.shape[3]:
        raise ValueError(f"{op}: kv_cache pages must be contiguous, got strides {kv_cache.stride()}")
    # LBHNC: the V page follows the K page; the block stride is 2 pages, or more in a hybrid
    # attention/Mamba cache whose blocks also hold other state after the two pages.
    if s1 == page and (s0 >= 2 * page or kv_cache.shape[0] == 1):
        return CacheLayout.LBHNC
    if s0 == page and s1 == kv_cache.shape[0] * page:
        return CacheLayout.LHBNC
    raise ValueError(
        f"{op}: kv_cache strides {kv_cache.stride()} match neither LHBNC nor LBHNC: LHBNC "
        f"has strides ({page}, num_blocks * {page}, ...), LBHNC (a block stride >= {2 * page}, "
        f"{page}, ...), for a page of block_size * num_kv_heads * head_size = {page} elements"
    )


def _group_offset_and_block_stride(kv_cache: torch.Tensor) -> tuple[int, int]:
    return kv_cache.stride(1), kv_cache.stride(0)


def k_view(kv_cache: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """K interior over all blocks: ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``."""
    nb, _, bs, hd = kv_cache.shape
    d = hd // num_kv_heads
    x = cache_x(kv_cache.dtype)
    _, block_stride = _group_offset_and_block_stride(kv_cache)
    return kv_cache.as_strided(
        (nb, num_kv_heads, d // x, bs, x),
        (block_stride, d * bs, bs * x, x, 1),
        kv_cache.storage_offset(),
    )


def v_view(kv_cache: torch.Tensor, num_kv_heads: int, interleaved: bool) -> torch.Tensor:
    """V interior over all blocks.

    standard: ``[num_blocks, num_kv_heads, head_size, block_size]``;
    interleaved: ``[num_blocks, num_kv_heads, block_size // x, head_size, x]``.
    """
    nb, _, bs, hd = kv_cache.shape
    d = hd // num_kv_heads
    group_offset, block_stride = _group_offset_and_block_stride(kv_cache)
    offset = kv_cache.storage_offset() + group_offset
    if not interleaved:
        return kv_cache.as_strided((nb, num_kv_heads, d, bs), (block_stride, d * bs, bs, 1), offset)
    x = cache_x(kv_cache.dtype)
    return kv_cache.as_strided(
        (nb, num_kv_heads, bs // x, d, x), (block_stride, d * bs, d * x, x, 1), offset
    )


def _check_cache_heads(kv_cache: torch.Tensor, num_kv_heads: int, op: str, whole: bool = True) -> None:
    """A logical cache tensor (LHBNC or LBHNC; ``whole`` False: also a slice of blocks of one,
    whose K/V views read each block at the block stride) of a cache dtype whose last dim is
    ``num_kv_heads`` heads of a supported head size, in pages of a supported block size."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{op}: kv_cache must be a tensor, got {type(kv_cache).__name__}")
    if whole:
        cache_layout_of(kv_cache, op)
    elif (kv_cache.dim() != 4 or kv_cache.shape[1] != 2 or kv_cache.stride(3) != 1
          or kv_cache.stride(2) != kv_cache.shape[3]):
        raise ValueError(f"{op}: kv_cache must be a cache (or a slice of its blocks) of logical shape [num_blocks, 2, "
                         f"block_size, num_kv_heads*head_size] with contiguous pages, got shape "
                         f"{tuple(kv_cache.shape)}, strides {kv_cache.stride()}")
    hd = kv_cache.shape[3]
    if not _is_count(num_kv_heads) or hd % num_kv_heads:
        raise ValueError(f"{op}: num_kv_heads {num_kv_heads!r} does not divide the cache's last dim {hd} "
                         "(num_kv_heads * head_size)")
    check_cache_geometry(kv_cache.shape[2], hd // num_kv_heads, op)
    if not (kv_cache.dtype in MODEL_DTYPES or is_fp8_dtype(kv_cache.dtype)):
        raise ValueError(f"{op}: kv_cache dtype {kv_cache.dtype} is not a cache dtype")


def dense_kv(
    kv_cache: torch.Tensor, num_kv_heads: int, interleaved_v: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the cache out as two dense ``[num_blocks, block_size, num_kv_heads, head_size]`` tensors.

    For the reference path and tests; kernels index the interiors directly. Checks the cache
    and ``num_kv_heads`` first: views of another geometry would read other channels.
    """
    _check_cache_heads(kv_cache, num_kv_heads, "dense_kv", whole=False)
    nb, _, bs, hd = kv_cache.shape
    d = hd // num_kv_heads
    k = k_view(kv_cache, num_kv_heads).permute(0, 3, 1, 2, 4).reshape(nb, bs, num_kv_heads, d)
    v = v_view(kv_cache, num_kv_heads, interleaved_v)
    if interleaved_v:
        v = v.permute(0, 1, 2, 4, 3).reshape(nb, num_kv_heads, bs, d).permute(0, 2, 1, 3)
    else:
        v = v.permute(0, 3, 1, 2)
    return k.contiguous(), v.contiguous()


def convert_v_layout_(kv_cache: torch.Tensor, num_kv_heads: int, to_interleaved: bool) -> None:
    """Rewrite every block's V page in place between standard and interleaved order.

    Used when a layer is switched to (or from) interleaved V while its cache holds data,
    so no token is ever read in the wrong layout. Works block-chunk by block-chunk to keep
    the temporary small. Checks the cache and ``num_kv_heads`` first: views of another
    geometry would scramble every page.
    """
    from .validation import check_bool  # validation imports this module

    op = "convert_v_layout_"
    check_bool(op, "to_interleaved", to_interleaved)
    _check_cache_heads(kv_cache, num_kv_heads, op)
    nb = kv_cache.shape[0]
    src_view = v_view(kv_cache, num_kv_heads, interleaved=not to_interleaved)
    dst_view = v_view(kv_cache, num_kv_heads, interleaved=to_interleaved)
    chunk = max(1, (64 << 20) // max(1, kv_cache[0, 1].numel() * kv_cache.element_size()))
    for start in range(0, nb, chunk):
        end = min(nb, start + chunk)
        src = src_view[start:end]
        if to_interleaved:  # [n, H, D, B] -> [n, H, B/x, D, x]
            n, h, d, bs = src.shape
            x = dst_view.shape[-1]
            dense = src.reshape(n, h, d, bs // x, x).permute(0, 1, 3, 2, 4).clone()
        else:  # [n, H, B/x, D, x] -> [n, H, D, B]
            n, h, bx, d, x = src.shape
            dense = src.permute(0, 1, 3, 2, 4).reshape(n, h, d, bx * x).clone()
        dst_view[start:end].copy_(dense)
