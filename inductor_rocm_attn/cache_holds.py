"""The KV caches a running ``generate()`` holds (``integrations.batching``).

While a generate runs, the blocks of its caches belong to its sequences. A step planned on
those caches by anyone else (a second generate, a direct ``runner.prepare`` /
``runner(...)`` from ``on_step`` or another thread, another runner over the same caches)
would write into blocks a running sequence has cached, and generate would go on reading
them, silently. ``hold(layers)`` is the context generate holds its caches in and
``own_step()`` marks its own steps (on its thread); a runner's ``prepare`` and a cache
binding (``bind_kv_caches``, ``layer.kv_cache = ...``) call ``check_free``, which costs one
read of a global set while no generate runs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable

__all__ = ["hold", "own_step", "check_free"]

_HELD: set[int] = set()  # data pointers of the held caches
_LOCK = threading.Lock()
_STEPPING = threading.local()  # .on: this thread is inside a holding generate's own step


def _pointers(layers: Iterable) -> set[int]:
    return {layer.kv_cache.data_ptr() for layer in layers} - {0}


@contextlib.contextmanager
def hold(layers: Iterable):
    """Hold the caches of ``layers`` for one generate; refused while another holds any."""
    ptrs = _pointers(layers)
    with _LOCK:
        if ptrs & _HELD:
            raise RuntimeError("generate: another generate() is running on this runner's KV caches (called from "
                               "on_step, another thread, or a runner over the same caches); both would write the "
                               "same cache blocks: run them one after the other")
        _HELD.update(ptrs)
    try:
        yield
    finally:
        with _LOCK:
            _HELD.difference_update(ptrs)


@contextlib.contextmanager
def own_step():
    """A holding generate's own step (its prepare and run) on this thread."""
    _STEPPING.on = True
    try:
        yield
    finally:
        _STEPPING.on = False


def check_free(who: str, layers: Iterable, *, rebind: bool = False) -> None:
    """Raise if a generate holds any cache of ``layers`` and this is not its own step
    (``rebind``: the caller replaces the caches rather than stepping on them)."""
    if not _HELD or getattr(_STEPPING, "on", False):
        return
    if _pointers(layers) & _HELD:
        harm = ("binding another cache would drop the tokens generate's sequences cached there" if rebind else
                "the step would write cache blocks that generate's sequences hold")
        raise RuntimeError(f"{who}: a running generate() holds these KV caches (this call comes from its on_step, "
                           f"another thread, or another runner over the same caches); {harm}: run it after "
                           "generate returns")
