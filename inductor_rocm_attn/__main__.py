"""Command line: ``python -m inductor_rocm_attn {demo,info,build-native}``."""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys

import torch


def _info() -> int:
    from . import providers

    print(f"inductor_rocm_attn {__import__('inductor_rocm_attn').__version__}")
    print(f"platform: {platform.platform()}, Python {platform.python_version()}")
    triton_version = "not installed"
    if importlib.util.find_spec("triton") is not None:
        import triton

        triton_version = triton.__version__
    gpu = "none"
    if torch.cuda.is_available():
        backend = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        gpu = f"{torch.cuda.get_device_name()} ({backend})"
    print(f"torch {torch.__version__}, triton {triton_version}, GPU: {gpu}")
    print("providers (in default order of preference):")
    for provider in providers.REGISTRY.values():
        why = provider.unavailable_reason()
        caps = provider.caps
        status = "usable" if why is None else f"unavailable: {why}"
        print(f"  {provider.name:<10} {status}")
        print(f"  {'':<10} {provider.summary}; kernels in {provider.module}")
        print(f"  {'':<10} ops: {', '.join(caps.ops)}; head sizes {caps.head_sizes}; "
              f"block sizes {caps.block_sizes or 'any multiple of 16'}")
    print(f"prefill kernel (Triton provider): {_prefill_kernel()}")
    print("measured preferences (elsewhere the order above):")
    for r in providers.PREFERENCES:
        upper = "" if r.max_tokens is None else f" < {r.max_tokens}"
        tokens = "any tokens" if r.min_tokens == 0 and not upper else f"{r.min_tokens} <= tokens{upper}"
        print(f"  {r.platform}: {r.op}, {tokens}: {', '.join(r.first)} first ({r.evidence})")
    return 0


def _prefill_kernel() -> str:
    """Which prefill kernel the Triton provider's ``paged_attention`` runs here
    (``ROCM_ATTN_PREFILL_KERNEL``, design.md "The Gluon prefill"); reads no Triton kernel."""
    import os

    from .kernels.gluon import eligibility

    choice = os.environ.get("ROCM_ATTN_PREFILL_KERNEL", "auto")
    if choice not in ("auto", "gluon", "triton"):
        return (f"ROCM_ATTN_PREFILL_KERNEL={choice!r} is not one of auto, gluon, triton: the Triton kernels "
                f"raise ValueError when imported")
    if choice == "triton":
        return "the Triton prefill (ROCM_ATTN_PREFILL_KERNEL=triton)"
    if not torch.cuda.is_available():
        why = "no CUDA GPU visible to torch"
    else:
        why = eligibility.unavailable_reason("cuda", torch.cuda.current_device())
    if why is None and choice == "auto":
        why = eligibility.auto_problem(eligibility.AUTO_BLOCK_SIZES[0])  # the Triton release
    if why is not None:
        return f"the Triton prefill (ROCM_ATTN_PREFILL_KERNEL={choice}; the Gluon prefill: {why})"
    blocks = "/".join(map(str, eligibility.AUTO_BLOCK_SIZES)) if choice == "auto" else "any it covers"
    return (f"the Gluon prefill where it covers the launch (16-bit caches, head "
            f"{'/'.join(map(str, eligibility.HEAD_SIZES))}, block sizes {blocks}, causal, no window, soft cap, "
            f"ALiBi, sinks or output scale; its context K through registers and V by TMA for the standard V "
            f"interior at blocks 16/32/64, K and V through registers for the interleaved one, both gathered by "
            f"cp.async otherwise), the Triton prefill elsewhere "
            f"(ROCM_ATTN_PREFILL_KERNEL={choice})")


def _demo(args) -> int:
    import functools

    from .demo import run_model_demo

    compile_ = not args.eager
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    result = run_model_demo(args.model, compile=compile_, device=args.device, dtype=dtype,
                            out=functools.partial(print, flush=True))
    return 0 if result["ok"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inductor_rocm_attn")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="serve a small model through the paged path, compare with dense attention")
    demo.add_argument("--model", default="tiny", choices=["tiny", "qwen3", "llama", "mistral", "gemma2"],
                      help="tiny: this package's small Qwen3-style model (default); the others: that "
                           "transformers architecture from config, random weights (needs transformers; "
                           "tiny without it), compiled piecewise with the plugin")
    demo.add_argument("--eager", action="store_true", help="skip torch.compile")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    demo.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    sub.add_parser("info", help="platform, versions and which providers are usable here")
    sub.add_parser("build-native", add_help=False,
                   help="build the native (csrc) kernels ahead of time (--force, --quiet)")
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "build-native":  # its own options: kernels/native.py build_native_cli
        from .kernels.native import build_native_cli

        return build_native_cli(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "demo" and args.device is not None:
        why = _device_problem(args.device)
        if why:
            parser.error(why)
    return _info() if args.cmd == "info" else _demo(args)


def _device_problem(device: str) -> str | None:
    """Why ``--device`` cannot be used here, or None."""
    kind = device.split(":")[0]
    supported = "supported: cpu, cuda (cuda:N; ROCm GPUs are cuda too)"
    if kind not in ("cpu", "cuda"):
        return f"--device {device!r} is not supported; {supported}"
    try:  # "cuda:x", "cpu:" would fail later, as a traceback from inside the demo
        parsed = torch.device(device)
    except RuntimeError:
        return f"--device {device!r} is not a device string; {supported}"
    if kind == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None and torch.version.hip is None else "a GPU build"
        return (f"--device {device}: this torch build has no usable CUDA/ROCm GPU (torch {torch.__version__}, "
                f"{build}); use --device cpu")
    if kind == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        return f"--device {device}: there are {torch.cuda.device_count()} GPUs here (cuda:0 ...)"
    return None


if __name__ == "__main__":
    sys.exit(main())
