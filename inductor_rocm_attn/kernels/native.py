"""The native (csrc) provider: HIP/CUDA paged decode built on first use.

Not built yet in this version: ``unavailable_reason`` says so, and the provider's record in
``providers.REGISTRY`` asks it, which keeps the provider out of dispatch until a build exists.
"""

from __future__ import annotations


def unavailable_reason() -> str | None:
    return "native csrc kernels are not built in this version (csrc/ holds no kernels yet; see csrc/README.md)"


def paged_attention(*args, **kwargs):  # pragma: no cover - never selected while unavailable
    raise NotImplementedError(unavailable_reason())
