"""Shared helpers of the benchmarks: CUDA-graph timing and the result JSON.

Every ``bench_*.py`` times through ``graph_time_us`` and writes its results with
``write_json``, whose ``meta`` records how and where the numbers were taken: the command,
the machine (host, CPUs, GPU name and SM count), the torch / triton / python versions and
the UTC time the run started. Run a bench as ``python benchmarks/<bench>.py``; its
directory is then on ``sys.path`` and ``from common import ...`` finds this module.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys

import torch

_STARTED = datetime.datetime.now(datetime.timezone.utc)


def _capture(fn, calls: int, warmup_calls: int):
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (warmed up on a side stream)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return g


def graph_time_us(fn, *, calls: int = 1, warmup_calls: int = 2, flush_l2: bool = True,
                  warmup_ms: int = 25, rep_ms: int = 200, replays: int = 15) -> float:
    """Median microseconds of one call of ``fn``, replayed from a CUDA graph of ``calls``
    captured calls (launch gaps are those of a captured model step).

    ``flush_l2``: ``triton.testing.do_bench`` over the replays (it flushes L2 before each;
    ``warmup_ms``/``rep_ms`` its budgets), the median. Else ``replays`` back-to-back replays
    timed with CUDA events, the median: for kernels small enough that the flush would dominate.
    """
    g = _capture(fn, calls, warmup_calls)
    if flush_l2:
        import triton.testing

        t = triton.testing.do_bench(g.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3
    else:
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        t = statistics.median(times)
    del g
    return t / calls


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - not installed or broken: recorded as None
        return None


def run_meta(**extra) -> dict:
    """How and where this run took its numbers (``extra``: the bench's own settings)."""
    gpu = torch.cuda.is_available()
    meta = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": _STARTED.isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name() if gpu else (platform.processor() or platform.machine()),
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "gpu_sms": torch.cuda.get_device_properties(0).multi_processor_count if gpu else None,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
    }
    meta.update(extra)
    return meta


def stamp() -> str:
    """The run's start time for file names: ``YYYYmmdd_HHMM`` (UTC)."""
    return _STARTED.strftime("%Y%m%d_%H%M")


def write_json(path: str, data: dict, **meta) -> dict:
    """Write ``{"meta": run_meta(**meta), **data}`` to ``path`` (directories created);
    ``data["meta"]``, if present, adds to the run's meta. Returns what was written."""
    data = dict(data)
    record = {"meta": run_meta(**{**data.pop("meta", {}), **meta}), **data}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return record


def launched_kernels(jit_fn, fn) -> list:
    """Call ``fn`` and return the compiled kernels it launched through the Triton ``@jit``
    function ``jit_fn``, in order (empty: none; None entries in Triton's interpreter)."""
    got = []
    orig = jit_fn.run

    def run(*args, **kwargs):
        kernel = orig(*args, **kwargs)
        got.append(kernel)
        return kernel

    jit_fn.run = run  # an instance attribute: kernel[grid](...) looks it up on the object
    try:
        fn()
    finally:
        del jit_fn.run
    return got


def residency(kernel) -> dict:
    """Registers, shared memory and how many programs of ``kernel`` (a launched Triton
    ``CompiledKernel``) one SM holds at once, from the driver's occupancy calculator
    (``cuOccupancyMaxActiveBlocksPerMultiprocessor``); None fields where unavailable."""
    info = {"regs": getattr(kernel, "n_regs", None), "shared_bytes": None, "per_sm": None}
    if kernel is None:
        return info
    info["shared_bytes"] = kernel.metadata.shared
    try:
        import ctypes

        cuda = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        err = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), ctypes.c_void_p(kernel.function),
            ctypes.c_int(kernel.metadata.num_warps * 32), ctypes.c_size_t(kernel.metadata.shared))
        if err == 0:
            info["per_sm"] = n.value
    except Exception:  # noqa: BLE001 - no driver library (CPU) or another driver
        pass
    return info
