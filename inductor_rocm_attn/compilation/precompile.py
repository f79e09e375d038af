"""Compile the Triton kernels a capture will launch, in parallel, before capturing.

The first launch of each Triton kernel variant compiles it (MLIR, LLVM, ptxas: 0.2-2 s on
the H200's host). Graph capture warms each captured step up before capturing it, so those
compiles used to run one after another inside the warm-ups: the 28-layer model's cold
capture of 13 whole-step graphs took 32 s, nearly all of it compiles (decode and reduce
kernels per split count, prefill, verify and writer variants of the mixed shapes).

Triton compiles with the GIL released, and its async compile mode
(``triton.runtime._async_compile.AsyncCompileMode``) hands every compile of a launch made
with ``warmup=True`` to an executor, keyed by the compile's cache key (so the same variant
launched by 28 layers compiles once), and installs the results in each kernel's cache when
the mode exits. :func:`parallel_compiles` runs a block in that mode with every launch of
this package's Triton kernels turned into a compile-only one (other libraries' kernels run:
one may be autotuned, and timing launches that do not run would pick an arbitrary config).
The runner runs each step it will capture once inside it (our kernels' outputs are not
written: nothing reads them before the real warm-up), then warms up and captures as
before, finding every variant compiled.

Measured on the 2-core CPU machine (sm_90 compiles of the benchmark shapes' 14 launches):
14.9 s serially, 8.5 s on two threads.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

__all__ = ["default_compile_threads", "parallel_compiles", "available"]


def default_compile_threads() -> int:
    """One thread a CPU core, at most 16 (ptxas and LLVM are the work; more threads than
    cores only queue)."""
    return max(1, min(16, os.cpu_count() or 1))


def available() -> str | None:
    """None when parallel compiles can run here, else why not."""
    try:
        from triton.runtime import _async_compile  # noqa: F401
        from triton.runtime.jit import JITFunction  # noqa: F401
    except ImportError as e:
        return f"this Triton has no async compile mode ({e})"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "TRITON_INTERPRET=1: kernels are interpreted, nothing compiles"
    return None


_compiling = threading.local()  # .active: this thread's launches of our kernels only compile
_OUR_PACKAGE = __name__.split(".")[0] + "."


@contextlib.contextmanager
def parallel_compiles(threads: int) -> Iterator[dict]:
    """Within the block, a launch of one of this package's Triton kernels made by this thread
    only submits the kernel's compile to a pool of ``threads`` threads, and launches nothing;
    leaving the block waits for every compile and installs the kernels. Other kernels launch
    as usual. Yields a dict whose ``"kernels"`` is, after the block, the number of distinct
    compiles submitted and ``"compiles"`` one ``(kernel name, start s, seconds)`` each (start
    from the block's entry; a compile that failed is left out), which tells the compile that
    bounds the block.

    Other threads launch as usual meanwhile (the flag is thread-local, and Triton's async
    compile mode is a context variable). Not reentrant. A compile that fails is left to
    fail again, with its own error, at the kernel's first real launch."""
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    if getattr(_compiling, "active", False):
        raise RuntimeError("parallel_compiles: already inside a parallel_compiles block")
    run = JITFunction.run

    def run_or_compile(self, *args, grid, warmup, **kwargs):
        # Our kernels only: another library's kernel may be autotuned, and timing launches
        # that do not run would cache an arbitrary config. It runs (and compiles) as usual.
        ours = getattr(self, "module", "").startswith(_OUR_PACKAGE)
        warmup = warmup or (ours and getattr(_compiling, "active", False))
        _compiling.kernel = getattr(self, "__name__", "?")  # names what this launch submits
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    result: dict = {"kernels": 0, "compiles": []}
    t0 = time.perf_counter()
    with _TimedPool(threads, result["compiles"], t0) as pool:
        mode = AsyncCompileMode(pool, ignore_errors=True)
        JITFunction.run = run_or_compile
        try:
            with mode:
                _compiling.active = True
                try:
                    yield result
                finally:
                    _compiling.active = False  # before the wait: nothing else is compile-only
        finally:
            if JITFunction.run is run_or_compile:  # else another block replaced it since
                JITFunction.run = run
            result["kernels"] = len(mode.future_kernels)


class _TimedPool(ThreadPoolExecutor):
    """The compile pool; each compile it runs appends ``(kernel, start, seconds)`` to
    ``times`` (the kernel named by the submitting launch, ``_compiling.kernel``)."""

    def __init__(self, threads: int, times: list, t0: float):
        super().__init__(max_workers=threads, thread_name_prefix="triton-compile")
        self._times, self._t0 = times, t0

    def submit(self, fn, /, *args, **kwargs):
        name = getattr(_compiling, "kernel", "?")

        def timed():
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._times.append((name, round(start - self._t0, 3), round(time.perf_counter() - start, 3)))
            return out

        return super().submit(timed)
