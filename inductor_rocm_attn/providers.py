"""The provider registry: every kernel provider declared once, and the per-call kernel choice.

A provider is a frozen ``Provider`` record: its name, what its kernels support
(``capabilities.ProviderCaps``), the module holding them (one function per op, with the
signatures of ``kernels.reference``) and the checks that say whether it can run on this
machine. Selection, ``python -m inductor_rocm_attn info`` and every "unavailable because"
message read these records; nothing branches on a provider's name. A new provider is one
record in ``REGISTRY`` plus its kernel module.

Where several usable providers support a call, ``PREFERENCES`` (measured, per platform, op
and token range) says which goes first; otherwise ``REGISTRY`` order decides. The choice is
cached per call signature, so the eager path pays one dict lookup.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping

import torch

from . import capabilities
from .capabilities import FEATURES, HEAD_SIZES, MODEL_DTYPES, OPS, SUPPORTED_KV_CACHE_DTYPES, ProviderCaps
from .layout import CacheLayout, cache_layout_of, is_fp8_dtype

__all__ = [
    "PREFERENCES",
    "REGISTRY",
    "SIZED_OPS",
    "Preference",
    "Provider",
    "attention_features",
    "choose",
    "get",
    "kv_cache_dtype_of",
    "platform_of",
    "preference_order",
    "select",
    "token_bucket",
]

# --- availability checks: each returns why the provider cannot run here, or None ----------


def gpu_visible() -> str | None:
    return None if torch.cuda.is_available() else "no CUDA/ROCm GPU visible to torch"


@functools.cache
def _module_present(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@dataclasses.dataclass(frozen=True)
class Importable:
    """The Python module ``module`` can be imported (found without importing it)."""

    module: str
    reason: str

    def __call__(self) -> str | None:
        return None if _module_present(self.module) else self.reason


@dataclasses.dataclass(frozen=True)
class RocmOrEnv:
    """Runs on ROCm builds of torch; elsewhere only with the environment switch ``var=1``."""

    var: str
    reason: str

    def __call__(self) -> str | None:
        if torch.version.hip is not None or os.environ.get(self.var, "0") == "1":
            return None
        return self.reason


@dataclasses.dataclass(frozen=True)
class ModuleSays:
    """Asks the kernel module itself (its ``unavailable_reason()``): e.g. whether it is built."""

    module: str

    def __call__(self) -> str | None:
        return importlib.import_module(self.module).unavailable_reason()


# --- the records ---------------------------------------------------------------------------


@functools.cache
def _load(module: str, op: str) -> Callable:
    return getattr(importlib.import_module(module), op)


@dataclasses.dataclass(frozen=True)
class Provider:
    """One kernel provider: what it supports, where its kernels are, whether it runs here."""

    name: str
    caps: ProviderCaps
    module: str  # kernels: one function per op in caps.ops, signatures of kernels.reference
    checks: tuple[Callable[[], str | None], ...] = ()  # first reason found wins
    # Devices where select() may choose it (None: every device of caps). The reference runs
    # on GPU tensors too (the test oracle) but is never chosen there: a GPU call without a
    # GPU kernel is an error, not a silent slow fallback.
    dispatch_devices: tuple[str, ...] | None = None
    summary: str = ""

    def unavailable_reason(self) -> str | None:
        """Why this provider cannot run on this machine at all, or None if it can."""
        for check in self.checks:
            why = check()
            if why is not None:
                return why
        return None

    def supports(
        self,
        op: str,
        *,
        device: str | torch.device,
        head_size: int,
        dtype: torch.dtype,
        block_size: int | None = None,
        layout: CacheLayout | str | None = None,
        kv_cache_dtype: str = "auto",
        interleaved_v: bool = False,
        features: tuple[str, ...] = (),
    ) -> str | None:
        """Why this provider's kernels do not support the call, or None (pure: table only)."""
        return capabilities.supports(
            self.caps, op, name=self.name, device=getattr(device, "type", device),
            head_size=head_size, dtype=dtype, block_size=block_size,
            layout=None if layout is None else CacheLayout(layout), kv_cache_dtype=kv_cache_dtype,
            interleaved_v=interleaved_v, features=tuple(features),
        )

    def chosen_on(self, device: str) -> bool:
        return device in (self.caps.devices if self.dispatch_devices is None else self.dispatch_devices)

    def load(self, op: str) -> Callable:
        """This provider's kernel for ``op`` (imports its module on first use)."""
        if op not in self.caps.ops:
            raise NotImplementedError(f"provider {self.name} has no {op} kernel; its ops: {self.caps.ops}")
        return _load(self.module, op)


_PKG = __package__


def triton_head_sizes(hip: bool) -> tuple[int, ...]:
    """Head sizes the Triton kernels have launch configs for on this platform: head size 512's
    (kernels/triton/configs.py) need up to 195 KB of shared memory, which sm_90 has and AMD's
    64 KB of LDS has not, so on ROCm the Triton provider stops at 256 (a 512 call is refused
    by dispatch, naming this, instead of failing in Triton's compiler)."""
    return tuple(d for d in HEAD_SIZES if d <= 256) if hip else HEAD_SIZES


_ALL_LAYOUTS = (CacheLayout.LHBNC, CacheLayout.LBHNC)
_KERNELS = f"{_PKG}.kernels"

# Declaration order is the default preference on a GPU (PREFERENCES can reorder per call).
REGISTRY: dict[str, Provider] = {
    provider.name: provider
    for provider in (
        # AITER's fused_qk_rope_reshape_and_cache asserts a bf16 or fp8-e4m3 cache (so a bf16
        # model: "auto" would be fp16 for an fp16 model) and power-of-two head and block
        # sizes; it writes both V interiors (kernels/aiter.py). Partial rotary it cannot do.
        # No qk_norm_rope_and_cache: AITER's kernel for it cannot write our cache (kernels/aiter.py).
        Provider(
            name="aiter",
            summary="AMD AITER's fused RoPE + KV-cache kernel (optional; PyPI amd-aiter)",
            caps=ProviderCaps(
                devices=("cuda",),
                ops=("rope_and_cache",),
                head_sizes=(64, 128, 256),
                block_sizes=(16, 32, 64, 128, 256, 512, 1024),
                layouts=_ALL_LAYOUTS,
                model_dtypes=(torch.bfloat16,),
                kv_cache_dtypes=("auto", "bfloat16", "fp8", "fp8_e4m3"),
                interleaved_v=(False, True),
                features=(),
            ),
            module=f"{_KERNELS}.aiter",
            checks=(
                gpu_visible,
                RocmOrEnv("AITER_TRITON_ONLY", "AMD AITER runs on ROCm (set AITER_TRITON_ONLY=1 "
                                               "to use its Triton kernels elsewhere)"),
                Importable("aiter", "AMD AITER (PyPI: amd-aiter) is not importable"),
            ),
        ),
        Provider(
            name="triton",
            summary="Triton kernels for every op (the GPU default)",
            caps=ProviderCaps(
                devices=("cuda",),
                ops=OPS,
                head_sizes=triton_head_sizes(bool(torch.version.hip)),
                block_sizes=None,
                layouts=_ALL_LAYOUTS,
                model_dtypes=MODEL_DTYPES,
                kv_cache_dtypes=SUPPORTED_KV_CACHE_DTYPES,
                interleaved_v=(False, True),
                features=FEATURES,
            ),
            module=f"{_KERNELS}.triton",
            checks=(gpu_visible, Importable("triton", "triton is not installed")),
        ),
        # The csrc kernels (kernels/native.py): decode-only paged attention (a call that may
        # hold a prefill carries the "prefill" feature) and the cache writer. Declared after
        # Triton, which supports every call it does: it is chosen where a PREFERENCES rule,
        # from a measurement, puts it first. "not built" counts as unavailable (the first
        # use must not start a minutes-long build inside a forward call).
        Provider(
            name="native",
            summary="csrc HIP/CUDA kernels: paged decode and the KV-cache writer",
            caps=ProviderCaps(
                devices=("cuda",),
                ops=("paged_attention", "reshape_and_cache"),
                head_sizes=(64, 128),
                block_sizes=(16, 32),
                layouts=_ALL_LAYOUTS,
                model_dtypes=(torch.float16, torch.bfloat16),
                kv_cache_dtypes=SUPPORTED_KV_CACHE_DTYPES,
                interleaved_v=(False, True),
                features=("sliding_window", "alibi", "sinks", "logits_soft_cap", "non_causal"),
            ),
            module=f"{_KERNELS}.native",
            checks=(gpu_visible, ModuleSays(f"{_KERNELS}.native")),
        ),
        Provider(
            name="reference",
            summary="PyTorch: the CPU implementation and the float64 test oracle",
            caps=ProviderCaps(
                devices=("cpu", "cuda"),
                ops=OPS,
                head_sizes=HEAD_SIZES,
                block_sizes=None,
                layouts=_ALL_LAYOUTS,
                model_dtypes=MODEL_DTYPES,
                kv_cache_dtypes=SUPPORTED_KV_CACHE_DTYPES,
                interleaved_v=(False, True),
                features=FEATURES,
            ),
            module=f"{_KERNELS}.reference",
            dispatch_devices=("cpu",),
        ),
    )
}


def get(name: str) -> Provider:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown provider {name!r}; known: {tuple(REGISTRY)}") from None


# --- preference by measurement ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Preference:
    """On ``platform``, calls of ``op`` with ``min_tokens <= num_tokens < max_tokens`` try the
    providers in ``first`` before the others (which follow in ``REGISTRY`` order).

    A rule comes from a measurement: ``evidence`` names the result file in the repository.
    """

    platform: str  # "cuda" (NVIDIA), "rocm" (AMD) or "cpu": see platform_of
    op: str
    first: tuple[str, ...]
    min_tokens: int = 0
    max_tokens: int | None = None  # exclusive; None: no upper bound
    evidence: str = ""

    def matches(self, platform: str, op: str, num_tokens: int | None) -> bool:
        if platform != self.platform or op != self.op:
            return False
        if num_tokens is None:  # unknown size: only rules for every size apply
            return self.min_tokens == 0 and self.max_tokens is None
        return self.min_tokens <= num_tokens and (self.max_tokens is None or num_tokens < self.max_tokens)


_WRITERS_RUN1 = "benchmarks/results/history/2026-12-02_1602_writers_first_version/writers_run1_bench_fused_writers.md"

# First matching rule wins. Measured on the H200 (CUDA, AITER's Triton kernels with
# AITER_TRITON_ONLY=1), bf16, 32 q / 8 kv heads, d 128, block 16, LHBNC, interleaved V,
# CUDA-graph timing in us per call (``aiter`` = the aiter provider):
#
#   T                              1     64    256   1024   4096  16384
#   rope_and_cache          triton 1.87  3.01  6.01  10.06  39.31  173.00
#                           aiter  2.19  3.53  7.33  15.35  50.72  186.02
#   qk_norm_rope_and_cache  triton 2.10  3.20  7.17  13.04  50.61  225.14
#                           aiter  8.66  10.76 19.30 20.55  60.83  206.01
#
# (The aiter qk_norm_rope_and_cache row timed AITER's split+norm+rope kernel plus our cache
# writer, a path the aiter provider no longer takes: kernels/aiter.py says why.)
# On ROCm nothing is measured yet: REGISTRY order (aiter first when usable) stands there.
_NATIVE_VS_TRITON = ("benchmarks/results/history/2026-12-04_2011_native_query_loads_memcheck_h200/"
                     "native_20261204_201443.json")
_NATIVE_WRITER = ("benchmarks/results/history/2026-12-05_1432_native_writer_rule_memcheck_softcap_d512_h200/"
                  "native_writer_variants.json")
# The cache writer for the same case, the native launcher's choice ("auto") against Triton, us:
#   T       1     16    64    128   256   1024  4096  8192  16384  32768
#   native  6.75  6.78  7.14  8.00  8.93  18.98 17.09 26.50 44.48  81.66
#   triton  5.06  5.50  5.92  6.75  8.03  18.14 16.00 26.43 47.78  91.20

PREFERENCES: tuple[Preference, ...] = (
    # Native (csrc) against Triton on the H200 (bf16, 32/8 heads, d128, block 16): decode
    # 1.02-1.30x Triton's time at every B in {1, 16, 64, 128} x L in {1024, 4096, 16384}:
    # Triton first. The cache writer (table above): Triton first below 16384 tokens (native
    # 1.18-1.34x up to 128, 1.00-1.11x from 256 to 8192), native from 16384 (0.93x; 0.90x at
    # 32768).
    Preference("cuda", "paged_attention", ("triton",), evidence=_NATIVE_VS_TRITON),
    Preference("cuda", "reshape_and_cache", ("triton",), max_tokens=16384, evidence=_NATIVE_WRITER),
    Preference("cuda", "reshape_and_cache", ("native",), min_tokens=16384, evidence=_NATIVE_WRITER),
    # Ours is faster at every measured size.
    Preference("cuda", "rope_and_cache", ("triton",), evidence=_WRITERS_RUN1),
    # Ours measured 1.2-4x faster up to 4096 tokens; no other GPU provider takes the op.
    Preference("cuda", "qk_norm_rope_and_cache", ("triton",), max_tokens=16384, evidence=_WRITERS_RUN1),
)


def platform_of(device_type: str) -> str:
    """The platform a device type runs on: "cuda" tensors are "rocm" on a ROCm build of torch."""
    return "rocm" if device_type == "cuda" and torch.version.hip is not None else device_type


def preference_order(op: str, *, platform: str, num_tokens: int | None = None) -> tuple[str, ...]:
    """Provider names in the order they are tried for this call."""
    first: tuple[str, ...] = ()
    for rule in PREFERENCES:
        if rule.matches(platform, op, num_tokens):
            first = rule.first
            break
    return first + tuple(name for name in REGISTRY if name not in first)


def _token_bounds(platform: str, op: str) -> tuple[int, ...]:
    bounds = set()
    for rule in PREFERENCES:
        if rule.platform == platform and rule.op == op:
            bounds.add(rule.min_tokens)
            if rule.max_tokens is not None:
                bounds.add(rule.max_tokens)
    bounds.discard(0)
    return tuple(sorted(bounds))


# (device type, op) -> token counts where the preference may change; ops without any are absent.
_TOKEN_BOUNDS = {
    (device_type, op): bounds
    for device_type in ("cpu", "cuda")
    for op in OPS
    if (bounds := _token_bounds(platform_of(device_type), op))
}


# Ops whose provider choice may depend on the token count on some platform.
SIZED_OPS = frozenset(op for _, op in _TOKEN_BOUNDS)
_BOUNDS_BY_DEVICE: dict[tuple[str, torch.device | str], tuple[int, ...]] = {}  # memo of _TOKEN_BOUNDS


def token_bucket(op: str, device: torch.device | str, num_tokens: int) -> int:
    """Index of the token range ``num_tokens`` falls in: calls in one range choose alike.

    Callers that cache a kernel per call signature put this index in the signature. Sits on
    the per-step path: memoised per (op, device) because ``torch.device.type`` is slow.
    """
    bounds = _BOUNDS_BY_DEVICE.get((op, device))
    if bounds is None:
        bounds = _TOKEN_BOUNDS.get((getattr(device, "type", device), op), ())
        _BOUNDS_BY_DEVICE[(op, device)] = bounds
    return bisect.bisect_right(bounds, num_tokens) if bounds else 0


def choose(
    op: str,
    *,
    platform: str,
    num_tokens: int | None = None,
    exclude: tuple[str, ...] = (),
    unavailable: Mapping[str, str | None] | None = None,
    **query,
) -> str:
    """Name of the first provider, in preference order, that may be chosen for this call.

    Pure apart from availability, which ``unavailable`` (name -> reason or None) overrides
    for the providers it names; the others ask their record. ``query`` is the keyword
    arguments of ``Provider.supports``. Raises NotImplementedError naming every provider
    and why it was passed over.
    """
    device = getattr(query["device"], "type", query["device"])
    reasons = []
    for name in preference_order(op, platform=platform, num_tokens=num_tokens):
        provider = REGISTRY[name]
        if name in exclude:
            why = "excluded by the caller"
        else:
            why = provider.supports(op, **query)
        if why is None and not provider.chosen_on(device):
            why = (f"chosen only on {provider.dispatch_devices}, not {device} (a call there "
                   "without a kernel of its own is an error, not a slow fallback)")
        if why is None:
            why = (unavailable[name] if unavailable is not None and name in unavailable
                   else provider.unavailable_reason())
        if why is None:
            return name
        reasons.append(f"{name}: {why}")
    raise NotImplementedError(f"rocm_attn.{op}: no provider supports this call ({'; '.join(reasons)})")


# --- per-call selection (cached) ------------------------------------------------------------


def kv_cache_dtype_of(cache: torch.Tensor, model_dtype: torch.dtype | None = None) -> str:
    """The kv_cache_dtype string that describes an allocated cache for a ``model_dtype`` model.

    A 16-bit cache of another dtype than the model is named by its dtype ("float16",
    "bfloat16"), not "auto": a provider may take only some of them (aiter writes no fp16 cache).
    """
    if is_fp8_dtype(cache.dtype):
        return "fp8_e5m2" if "e5m2" in str(cache.dtype) else "fp8_e4m3"
    if model_dtype is not None and cache.dtype != model_dtype:
        return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(cache.dtype, "auto")
    return "auto"


@functools.lru_cache(maxsize=4096)
def _select(op: str, device: str, head_size: int, dtype: torch.dtype, block_size, layout,
            kv_cache_dtype: str, interleaved_v: bool, features: tuple[str, ...],
            exclude: tuple[str, ...], num_tokens: int | None):
    name = choose(
        op, platform=platform_of(device), num_tokens=num_tokens, exclude=exclude, device=device,
        head_size=head_size, dtype=dtype, block_size=block_size, layout=layout,
        kv_cache_dtype=kv_cache_dtype, interleaved_v=interleaved_v, features=features,
    )
    return name, REGISTRY[name].load(op)


def select(
    op: str,
    *,
    device: torch.device,
    head_size: int,
    dtype: torch.dtype,
    kv_cache: torch.Tensor | None = None,
    interleaved_v: bool = False,
    features: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    num_tokens: int | None = None,
):
    """(provider name, kernel function) for one call; raises NotImplementedError with reasons.

    ``num_tokens`` lets ``PREFERENCES`` pick by size; calls in one token range share a
    cache entry (the range's lower bound stands for all of them).
    """
    block_size = layout = None
    kv_dtype = "auto"
    if kv_cache is not None:
        block_size = kv_cache.shape[2]
        layout = cache_layout_of(kv_cache)
        kv_dtype = kv_cache_dtype_of(kv_cache, dtype)
    if num_tokens is not None:
        bounds = _TOKEN_BOUNDS.get((device.type, op), ())
        i = bisect.bisect_right(bounds, num_tokens)
        num_tokens = bounds[i - 1] if i else 0
    return _select(op, device.type, head_size, dtype, block_size, layout, kv_dtype,
                   interleaved_v, features, exclude, num_tokens)


def attention_features(*, causal: bool, sliding_window: int, alibi_slopes, sinks,
                       logits_soft_cap: float, output_scale,
                       max_query_len: int | None = None) -> tuple[str, ...]:
    """The capability features a paged/encoder attention call needs. ``max_query_len`` None
    (unknown) or > 1 adds "prefill": only a call known to be decode-only omits it."""
    feats = []
    if sliding_window > 0:
        feats.append("sliding_window")
    if alibi_slopes is not None:
        feats.append("alibi")
    if sinks is not None:
        feats.append("sinks")
    if logits_soft_cap > 0:
        feats.append("logits_soft_cap")
    if output_scale is not None:
        feats.append("output_scale")
    if not causal:
        feats.append("non_causal")
    if max_query_len is None or max_query_len > 1:
        feats.append("prefill")
    return tuple(feats)
