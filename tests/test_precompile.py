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
