"""Integrations with model libraries, each loaded only when its library is.

``transformers`` (module ``integrations.transformers``): registers
``attn_implementation="rocm_attn"`` with transformers' ``AttentionInterface`` and provides
``PagedCache``. ``transformers_runner``: ``compile_transformers``, piecewise compile and
graph capture of a transformers model on its own paged cache (and ``EagerRunner``, the same
path uncompiled); ``batching``: greedy continuous batching of ragged prompts over such a
runner; ``transformers_configs``: tiny configs per architecture and released models' shapes. Importing transformers' attention registry costs seconds, so
``import inductor_rocm_attn`` does not do it: ``install()`` registers at once when
``transformers.modeling_utils`` (where the registry lives) is already imported, and
otherwise leaves a post-import hook on ``sys.meta_path`` that registers right after
transformers imports that module (whichever package the user imports first), then removes
itself. Nothing is installed when transformers is not installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["install"]

_TRANSFORMERS_REGISTRY = "transformers.modeling_utils"


def _register_transformers() -> None:
    module = importlib.import_module(f"{__name__}.transformers")
    # Run in the middle of that module's own import (it imports transformers.modeling_utils),
    # ``register`` is not defined yet: the module registers itself when its import completes.
    if hasattr(module, "register"):
        module.register()


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for one module name it wraps the spec another finder returns so
    that ``callback`` runs once, right after the module has executed."""

    def __init__(self, fullname: str, callback):
        self.fullname, self.callback = fullname, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CallbackLoader(spec.loader, self)
        return spec

    def fire(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            self.callback()
        except Exception as e:  # never break the user's import of transformers
            warnings.warn(f"inductor_rocm_attn: transformers integration not registered: {e!r}", stacklevel=2)


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader; calls the hook after ``exec_module``."""

    def __init__(self, loader, hook: _PostImportHook):
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._hook.fire()

    def __getattr__(self, name):  # get_source, get_code, get_filename, ...
        return getattr(self._loader, name)


def install() -> None:
    """Register the transformers integration now or right after transformers loads its
    attention registry; a no-op without transformers. Idempotent."""
    if _TRANSFORMERS_REGISTRY in sys.modules:
        _register_transformers()
        return
    if any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        return
    if importlib.util.find_spec("transformers") is None:
        return
    sys.meta_path.insert(0, _PostImportHook(_TRANSFORMERS_REGISTRY, _register_transformers))
