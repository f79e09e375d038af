"""The ``Attention`` layer a model author drops in, and KV-cache binding for a model.

``forward`` emits exactly the layer-level ops the fusion passes look for:
``unified_kv_cache_update`` (returns a dependency token; not emitted by a layer that writes
no cache: an encoder layer, a KV-sharing one) then ``unified_attention_with_output`` (takes
it), so write-before-read survives compilation.
"""

from __future__ import annotations

import torch
from torch import nn

from . import step_checks
from .backend import RocmAttentionImpl, note_cache_bound
from .cache_holds import check_free
from .capabilities import AttentionType, check_block_size, check_head_size, check_model_dtype
from .config_checks import check_cache_scales
from .forward_context import SLOT_PREFIX, latest_copy_name, register_copy, register_layer, registered_layers
from .layout import CacheLayout, allocate_kv_cache, as_cache_layout, as_device
from .validation import check_bool, check_channel_stride, check_positive_int, check_scales

__all__ = ["Attention", "attention_layers", "bind_kv_caches"]

_SCALE_BUFFERS = ("_k_scale", "_v_scale")  # the per-tensor fp8 cache scales (float32 [1])


class Attention(nn.Module):
    """Paged attention over this layer's KV cache.

    Args:
        num_heads, head_size, num_kv_heads: query heads, channels per head, KV heads (GQA).
        layer_name: unique name; compiled graphs refer to the layer by it.
        scale: softmax scale (default ``head_size ** -0.5``).
        block_size, cache_layout, kv_cache_dtype: cache geometry (see ``layout``).
        k_scale, v_scale: per-tensor fp8 cache scales (dequant = multiply).
        register: add the layer to the registry of live layers (the default). A layer owned
            by a cache object that hands the forward context its own layer table (see
            ``forward_context``) is not registered.
        kv_sharing_target_layer_name: read that (earlier) layer's cache instead of owning one;
            this layer then writes nothing.
        Others as in ``RocmAttentionImpl``.

    ``forward(query [T, Hq*D], key [T, Hkv*D], value [T, Hkv*D]) -> [T, Hq*D]``; 3-D
    ``[T, H, D]`` inputs (any strides, unit channel stride) are taken as they are.

    A registered layer's copy (``copy.deepcopy``, unpickling) registers itself under its
    name, or ``name#copyN`` while the original is alive, with its own copy of the cache (a
    sharing layer's copy reads the copy of its target, made with it).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        *,
        layer_name: str,
        kv_sharing_target_layer_name: str | None = None,
        num_kv_heads: int | None = None,
        scale: float | None = None,
        block_size: int = 16,
        cache_layout: CacheLayout | str = CacheLayout.LHBNC,
        kv_cache_dtype: str = "auto",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        q_scale: float = 1.0,
        alibi_slopes=None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attn_type: AttentionType | str = AttentionType.DECODER,
        sinks: torch.Tensor | None = None,
        causal: bool | None = None,
        register: bool = True,
    ):
        super().__init__()
        if not isinstance(layer_name, str) or not layer_name:
            raise ValueError(f"Attention: layer_name must be a non-empty str, got {layer_name!r}")
        if layer_name.startswith(SLOT_PREFIX):  # such a name resolves only to a piecewise runner's slot
            raise ValueError(f"Attention: layer_name {layer_name!r} starts with {SLOT_PREFIX!r}, reserved for the "
                             "slot aliases of shared compiled code; choose another name")
        check_bool("Attention", "register", register)
        check_block_size(block_size, "Attention")
        if scale is None:  # the default scale needs a valid head size first
            check_head_size(head_size, "Attention")
        cache_layout = as_cache_layout(cache_layout, "Attention")
        self.impl = RocmAttentionImpl(
            num_heads, head_size, head_size**-0.5 if scale is None else scale, num_kv_heads,
            alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap, attn_type, sinks,
            causal, q_scale, kv_sharing_target_layer_name=kv_sharing_target_layer_name,
        )
        check_cache_scales("Attention", kv_cache_dtype, k_scale, v_scale)
        if kv_sharing_target_layer_name == layer_name:
            raise ValueError(f"Attention {layer_name!r}: kv_sharing_target_layer_name names the layer itself")
        self.layer_name = layer_name
        self.num_heads, self.head_size = self.impl.num_heads, self.impl.head_size
        self.num_kv_heads = self.impl.num_kv_heads
        self.block_size = int(block_size)
        self.cache_layout = cache_layout
        # Scales are tensors so they can change without recompiling; not parameters.
        self.register_buffer("_k_scale", torch.tensor([k_scale], dtype=torch.float32), persistent=False)
        self.register_buffer("_v_scale", torch.tensor([v_scale], dtype=torch.float32), persistent=False)
        self.kv_cache = torch.empty(0)
        self.registered = register
        if register:
            register_layer(layer_name, self)

    def __setattr__(self, name, value):
        if name in _SCALE_BUFFERS and isinstance(value, torch.Tensor):
            # every path reads these buffers as they are, checked here rather than on each call
            check_scales(f"Attention {self.__dict__.get('layer_name', '')!r}", **{name[1:]: value})
            impl = self.__dict__.get("impl")
            if impl is not None:  # a new tensor: its version count starts again
                impl._scales_checked = -1
        if name == "kv_cache" and not isinstance(value, torch.Tensor):  # every call would fail on its .shape
            raise TypeError(f"Attention {self.__dict__.get('layer_name', '')!r}: kv_cache must be a tensor (a cache from "
                            f"bind_kv_caches or allocate_kv_cache), got {type(value).__name__}")
        if name == "kv_cache" and "kv_cache" in self.__dict__:
            check_free(f"Attention {self.__dict__.get('layer_name', '')!r}: binding a KV cache", [self], rebind=True)
            _check_cache_not_written_by_another(self, value)
        super().__setattr__(name, value)
        if name == "kv_cache":  # resolved kernels and captured graphs were checked against the old cache
            note_cache_bound()

    def _apply(self, fn, recurse=True):
        # model.half() / .to(bfloat16) converts every float buffer; the scales stay fp32 (the
        # contract's dtype; in fp16 a small scale rounds, or flushes to 0): only their device
        # follows, taken from the unconverted values.
        scales = {n: self._buffers[n] for n in _SCALE_BUFFERS}
        out = super()._apply(fn, recurse)
        for n, before in scales.items():
            after = self._buffers[n]
            if after is not None and after.dtype != torch.float32:
                self._buffers[n] = before.to(device=after.device)
        self.impl._scales_checked = -1  # new tensors: their version counts start again
        return out

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.__dict__.get("registered", False):
            name = self.layer_name
            self.layer_name = register_copy(name, self)
            target = self.impl.kv_sharing_target_layer_name
            if target is not None and self.layer_name != name:
                # A copy of a sharing layer (renamed: the original is alive) reads the copy of
                # its target, an earlier layer copied just before it, not the original's cache.
                self.impl.kv_sharing_target_layer_name = latest_copy_name(target)

    # --- cache ----------------------------------------------------------------------------

    def kv_cache_spec(self, model_dtype: torch.dtype, device=None):
        return self.impl.kv_cache_spec(self.block_size, model_dtype, self.cache_layout, device)

    def set_interleaved_v_cache(self, enabled: bool = True) -> bool:
        """Switch the V interior of this layer (converting cached data in place)."""
        target = self.impl.kv_sharing_target_layer_name
        if target is not None:  # its reads follow the target's interior: its own flag is read by nothing
            raise ValueError(f"set_interleaved_v_cache: layer {self.layer_name!r} reads the KV cache of {target!r} "
                             f"with that layer's V interior; switch {target!r}")
        return self.impl.set_interleaved_v_cache(enabled, self.kv_cache)

    @property
    def interleaved_v(self) -> bool:
        return self.impl.interleaved_v

    # --- forward -----------------------------------------------------------------------------

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # What the attention op would reject about q/k/v together is rejected here, before
        # the cache update writes (the ops themselves check the rest, each before writing).
        step_checks.check_qkv(self, query, key, value)
        qs = query.shape
        t, h, hkv, d = qs[0], self.num_heads, self.num_kv_heads, self.head_size
        if query.stride()[-1] != 1:  # what the attention would reject, rejected before the cache update writes
            check_channel_stride(f"Attention {self.layer_name!r}", query=query)
        if len(qs) == 3:  # possibly strided: a fresh contiguous output
            if qs[1] != h or qs[2] != d:
                raise self._shape_error("query", query, h)
            output = query.new_empty(t, h, d)
        else:
            try:
                query = query.view(t, h, d)
            except RuntimeError:
                raise self._shape_error("query", query, h) from None
            output = torch.empty_like(query)  # the query's strides if dense: still a unit channel stride
        ks, vs = key.shape, value.shape
        if ks[:1] != qs[:1] or vs[:1] != qs[:1]:  # one row per token (a view would regroup other rows)
            raise self._shape_error("key and value", key, hkv, t, value)
        if len(ks) != 3:
            try:
                key, value = key.view(t, hkv, d), value.view(t, hkv, d)
            except RuntimeError:
                raise self._shape_error("key and value", key, hkv, t, value) from None
        token = None
        impl = self.impl
        if impl.uses_kv_cache:
            token = torch.ops.rocm_attn.unified_kv_cache_update(key, value, self.layer_name)
            if not torch.compiler.is_compiling():  # eager only: a traced forward keeps no state
                # The attention after this cache update skips what this call checked or made
                # (RocmAttentionImpl.forward).
                impl._forward_made = (query, output)
        torch.ops.rocm_attn.unified_attention_with_output(query, key, value, output, self.layer_name, token)
        return output.view(t, self.num_heads * self.head_size)

    def _shape_error(self, name, x, heads, tokens=None, value=None) -> ValueError:
        t = "num_tokens" if tokens is None else f"{tokens} (the query's tokens)"
        got = tuple(x.shape) if value is None else f"{tuple(x.shape)} and {tuple(value.shape)}"
        return ValueError(f"Attention {self.layer_name!r}: {name} must be [{t}, {heads} * {self.head_size}] or "
                          f"[{t}, {heads}, {self.head_size}], got {got}")

    def extra_repr(self) -> str:
        return f"{self.layer_name}: {self.impl!r}, block={self.block_size}, {self.cache_layout.value}"


def attention_layers(model: nn.Module) -> list[Attention]:
    """Every ``Attention`` module of ``model``, in ``model.modules()`` order."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_caches(model: nn.Module, num_blocks: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu", poison: bool = False) -> dict[str, torch.Tensor]:
    """Allocate each attention layer's cache (``num_blocks`` blocks) and attach it.

    Layers that use no cache (encoder types) get none, nor do layers that share an earlier
    layer's cache (``kv_sharing_target_layer_name``, checked here). ``poison`` fills caches
    with NaN (or fp8 max) so a read of an unwritten slot shows up in tests.
    """
    check_positive_int("bind_kv_caches", "num_blocks", num_blocks)
    check_bool("bind_kv_caches", "poison", poison)
    check_model_dtype(dtype, "bind_kv_caches")  # the model's dtype; the layers' kv_cache_dtype picks storage
    if not isinstance(model, nn.Module):
        raise TypeError(f"bind_kv_caches: model must be a torch.nn.Module, got {type(model).__name__}")
    layers = attention_layers(model)
    if not layers:  # binding nothing would pass silently and the model would never use a cache
        raise ValueError(
            f"bind_kv_caches: {type(model).__name__} holds no inductor_rocm_attn.Attention layer; for a "
            "transformers model use inductor_rocm_attn.integrations.transformers.PagedCache"
        )
    check_free("bind_kv_caches", layers, rebind=True)
    device = as_device(device, "bind_kv_caches")
    # every cache is allocated (and every sharing layer checked) before the first is attached:
    # a refused call leaves each layer with the cache it had
    caches, specs, owners = {}, {}, {}
    for layer in layers:
        target = layer.impl.kv_sharing_target_layer_name
        if target is None and not layer.impl.uses_kv_cache:
            continue
        spec = layer.kv_cache_spec(dtype, device)
        if target is not None:
            if target not in caches:
                raise ValueError(
                    f"bind_kv_caches: layer {layer.layer_name!r} shares the KV cache of {target!r}, which "
                    "is not an earlier layer of this model with a cache of its own"
                )
            if spec != specs[target]:
                raise ValueError(f"bind_kv_caches: layer {layer.layer_name!r} ({spec}) cannot read the cache "
                                 f"of {target!r} ({specs[target]}): the geometry differs")
            _check_shared_scales(layer, owners[target])
            continue
        cache = allocate_kv_cache(spec, num_blocks, device)
        if poison:
            cache.view(torch.uint8).fill_(0xFF)  # all-ones bytes: NaN in every cache dtype
        caches[layer.layer_name], specs[layer.layer_name] = cache, spec
        owners[layer.layer_name] = layer
    for layer in layers:
        if layer.layer_name in caches:
            layer.kv_cache = caches[layer.layer_name]
    return caches


def _memory_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, past the last)`` that ``t``'s elements span (strides >= 0)."""
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _check_cache_not_written_by_another(layer: Attention, cache: torch.Tensor) -> None:
    """A cache ``layer`` writes must not share memory with another registered layer's: each
    would overwrite the other's keys and values in the slots both write (a layer that reads
    another's cache names it in ``kv_sharing_target_layer_name`` and holds none itself)."""
    impl = layer.__dict__.get("impl")
    if impl is None or not impl.uses_kv_cache or not cache.numel() or cache.device.type == "meta":
        return
    lo, hi = _memory_range(cache)
    for other in registered_layers().values():  # a copy: the registry may change meanwhile
        held = other.__dict__.get("kv_cache")
        if (other is layer or held is None or not held.numel() or held.device != cache.device
                or not other.impl.uses_kv_cache):
            continue
        olo, ohi = _memory_range(held)
        if lo < ohi and olo < hi:
            raise ValueError(
                f"Attention {layer.__dict__.get('layer_name', '')!r}: this KV cache shares memory with the cache of "
                f"layer {other.layer_name!r}; two layers writing one cache overwrite each other's keys and values. "
                f"Give each layer its own cache (bind_kv_caches), or build the reading layer with "
                f"kv_sharing_target_layer_name={other.layer_name!r} (it then holds no cache of its own)")


def _check_shared_scales(layer: Attention, target: Attention) -> None:
    """A layer that shares ``target``'s cache reads it with ``target``'s k/v scales: scales of
    its own (other than the default 1.0) that differ from them would be ignored."""
    own, theirs = (layer._k_scale, layer._v_scale), (target._k_scale, target._v_scale)
    if any(t.device.type == "meta" for t in own + theirs):  # no values to compare
        return
    own, theirs = [float(t) for t in own], [float(t) for t in theirs]
    if own != [1.0, 1.0] and own != theirs:
        raise ValueError(
            f"bind_kv_caches: layer {layer.layer_name!r} (k_scale {own[0]}, v_scale {own[1]}) reads the cache of "
            f"{target.layer_name!r} with that layer's scales (k_scale {theirs[0]}, v_scale {theirs[1]}); give it "
            "the same scales, or none")
