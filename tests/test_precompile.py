"""``compilation.precompile``: Triton launches turned into compile-only ones inside
``parallel_compiles``, for the thread that entered it only, and put back after.

The compiles themselves need a GPU driver: the GPU test
``test_graph_capture.py::test_capture_compiles_every_triton_kernel_before_the_first_launch``
checks that a capture compiles every kernel before its first launch. Here ``JITFunction.run``
is replaced by a recorder, so the hook's own rules are checked on any machine."""

from __future__ import annotations

import threading
import types

import pytest

triton_jit = pytest.importorskip("triton.runtime.jit")

from inductor_rocm_attn.compilation import precompile  # noqa: E402


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def run(self, *args, grid, warmup, **kwargs):
        calls.append((threading.current_thread().name, warmup))

    monkeypatch.setattr(triton_jit.JITFunction, "run", run)
    return calls, run


OURS = types.SimpleNamespace(module="inductor_rocm_attn.kernels.triton.paged_decode")
THEIRS = types.SimpleNamespace(module="some_library.kernels")  # e.g. an autotuned kernel


def _launch(kernel=OURS):
    triton_jit.JITFunction.run(kernel, grid=(1,), warmup=False)


def test_launches_of_this_thread_only_compile(recorded):
    calls, run = recorded
    with precompile.parallel_compiles(2) as done:
        _launch()
        other = threading.Thread(target=_launch, name="other")
        other.start()
        other.join()
    _launch()
    assert calls == [("MainThread", True), ("other", False), ("MainThread", False)]
    assert triton_jit.JITFunction.run is run  # put back
    assert done["kernels"] == 0  # the recorder submitted nothing


def test_other_libraries_kernels_run(recorded):
    """Only this package's kernels become compile-only: another library's may be autotuned,
    and benchmarking launches that do not run would cache an arbitrary config."""
    calls, _ = recorded
    with precompile.parallel_compiles(2):
        _launch(THEIRS)
        _launch(OURS)
    assert calls == [("MainThread", False), ("MainThread", True)]


def test_hook_is_put_back_when_the_block_raises(recorded):
    _, run = recorded
    with pytest.raises(ZeroDivisionError):
        with precompile.parallel_compiles(2):
            1 / 0
    assert triton_jit.JITFunction.run is run


def test_not_reentrant(recorded):
    _, run = recorded
    with precompile.parallel_compiles(2):
        with pytest.raises(RuntimeError, match="parallel_compiles: already inside"):
            with precompile.parallel_compiles(2):
                pass
    assert triton_jit.JITFunction.run is run


def test_default_threads_and_availability(monkeypatch):
    assert 1 <= precompile.default_compile_threads() <= 16
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET=1" in precompile.available()


def test_each_compile_is_timed_under_its_kernels_name(monkeypatch):
    """``done["compiles"]``: one (kernel name, start, seconds) per distinct compile submitted
    (the launch that submits names it), so a cold capture can say which compile bounds it."""
    import time

    from triton.runtime._async_compile import active_mode

    def run(self, *args, grid, warmup, **kwargs):  # what Triton's run does in async mode
        mode = active_mode.get()
        assert warmup and mode is not None
        mode.submit(("key", self.__name__, kwargs.get("v")), lambda: time.sleep(0.05) or self.__name__,
                    lambda kernel: None)

    monkeypatch.setattr(triton_jit.JITFunction, "run", run)
    a = types.SimpleNamespace(module=OURS.module, __name__="_decode_kernel")
    b = types.SimpleNamespace(module=OURS.module, __name__="_reduce_kernel")
    with precompile.parallel_compiles(2) as done:
        for kernel, v in ((a, 1), (b, 1), (a, 1), (a, 2)):  # (a, 1) again: compiled once
            triton_jit.JITFunction.run(kernel, grid=(1,), warmup=False, v=v)
    assert done["kernels"] == 3
    names = sorted(name for name, _, _ in done["compiles"])
    assert names == ["_decode_kernel", "_decode_kernel", "_reduce_kernel"]
    for _, start, seconds in done["compiles"]:
        assert 0 <= start < 5 and 0.04 <= seconds < 5


@pytest.mark.parametrize("device, warms", [("cuda", True), ("cpu", False)])
def test_gpu_compiles_start_inductors_workers_before_the_trace(monkeypatch, device, warms):
    """Our backend calls compile_fx directly, and Inductor compiles in the calling process
    until its worker pool is ready: a runner of a GPU model starts the pool before it traces
    (a CPU one does not: measured slower on a 2-core machine). Without it the cold build
    compiled the first piece's kernels one after another."""
    import torch
    import torch._inductor.async_compile as async_compile

    from inductor_rocm_attn.compilation import build

    order = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: order.append("warm"))
    monkeypatch.setattr(build, "_compile_model", lambda runner, t: order.append("trace"))
    runner = types.SimpleNamespace(device=torch.device(device), max_num_tokens=8)
    build.compile_model(runner)
    assert order == (["warm", "trace"] if warms else ["trace"])
