"""The Inductor plugin switch: install our pass manager (and lowerings) for torch.compile.

``enable()`` makes our ``PassManager`` Inductor's ``post_grad_custom_post_pass``, wrapping
(and still running) a post pass the user had installed; ``disable()`` puts that pass back.
``plugin()`` does both around a block. Setting ``ROCM_ATTN_PLUGIN=1`` in the environment
enables the plugin when ``inductor_rocm_attn`` is imported, so a program runs with it
unchanged. ``fusion_report()`` returns the report of every candidate the passes examined.

>>> import inductor_rocm_attn as ira
>>> ira.enable()                      # or: with ira.plugin(): ...
>>> compiled = torch.compile(model)   # backend="inductor"
>>> print(ira.fusion_report())
"""

from __future__ import annotations

import contextlib
import logging

from inductor_rocm_attn.validation import check_bool

logger = logging.getLogger(__name__)

ENV_VAR = "ROCM_ATTN_PLUGIN"

_manager = None  # the installed PassManager, or None
_report = None
_saved_specialize_float = None  # dynamo's specialize_float before enable(), restored by disable()


def fusion_report():
    """The ``FusionReport`` shared by every enable (print it; ``.clear()`` it)."""
    global _report
    if _report is None:
        from inductor_rocm_attn.passes.report import FusionReport

        _report = FusionReport(receives_replays=True)  # graphs served from Inductor's cache too
    return _report


def is_enabled() -> bool:
    from torch._inductor import config

    return _manager is not None and config.post_grad_custom_post_pass is _manager


def _check_flags(op: str, flags: dict, *, keywords: bool = True) -> None:
    """Every flag names a fusion pass and is True or False, checked before any is applied (a
    string such as "false" would otherwise turn a pass on). ``keywords``: the flags came as
    keyword arguments (``enable``, ``plugin``), so an unknown one is a ``TypeError`` as for any
    function; a pass name given as a value (``set_pass_flag``) is a ``KeyError``."""
    from inductor_rocm_attn.passes.pass_manager import PASS_CLASSES

    names = [cls.name for cls in PASS_CLASSES]
    for name, on in flags.items():
        if name not in names:
            if keywords:
                raise TypeError(f"{op}() got an unexpected keyword argument {name!r}; its options are the fusion "
                                f"passes: {', '.join(sorted(names))} (each True or False)")
            raise KeyError(f"{op}: unknown pass {name!r}; passes: {sorted(names)}")
        check_bool(op, name, on)


def enable(**flags: bool):
    """Install the pass manager; ``flags``: pass name -> enabled. Returns the manager.

    Also sets ``torch._dynamo.config.specialize_float = True`` (restored by ``disable()``):
    under ``dynamic=True`` Dynamo otherwise turns module floats such as an RMSNorm's eps
    into graph inputs, whose value a compile-time pass cannot read, and the QK-norm fusion
    (whose kernel takes eps as a constant) could not fire. A float that changes between
    calls then recompiles instead.
    """
    global _manager, _saved_specialize_float
    import torch._dynamo.config as dynamo_config
    from torch._inductor import config

    from inductor_rocm_attn import lowering
    from inductor_rocm_attn.passes.pass_manager import PassManager

    _check_flags("enable", flags)
    lowering.register()
    current = config.post_grad_custom_post_pass
    if _manager is not None and current is _manager:
        for name, on in flags.items():
            _manager.set_flag(name, on)
        return _manager
    _manager = PassManager(user_pass=current, flags=flags, report=fusion_report())
    config.post_grad_custom_post_pass = _manager
    if _saved_specialize_float is None:
        _saved_specialize_float = dynamo_config.specialize_float
    dynamo_config.specialize_float = True
    logger.info("rocm_attn plugin enabled (passes: %s)", _manager.flags)
    return _manager


def disable() -> None:
    """Remove the pass manager, putting back the post pass installed before ``enable()``."""
    global _manager, _saved_specialize_float
    import torch._dynamo.config as dynamo_config
    from torch._inductor import config

    if _manager is not None and config.post_grad_custom_post_pass is _manager:
        config.post_grad_custom_post_pass = _manager.user_pass
    _manager = None
    if _saved_specialize_float is not None:
        dynamo_config.specialize_float = _saved_specialize_float
        _saved_specialize_float = None


def set_pass_flag(name: str, enabled: bool) -> None:
    """Turn one pass on or off (the manager's uuid changes, so the next compile recompiles).
    An unknown name is refused first, whether or not the plugin is on."""
    _check_flags("set_pass_flag", {name: enabled}, keywords=False)
    if _manager is None:
        raise RuntimeError(f"rocm_attn: set_pass_flag({name!r}, {enabled!r}): the plugin is not enabled; "
                           f"call enable() first (enable({name}={enabled!r}) sets the flag as it enables)")
    _manager.set_flag(name, enabled)


@contextlib.contextmanager
def plugin(**flags: bool):
    """``with plugin(): torch.compile(...)(...)``: the plugin on for the block only, and
    ``flags`` for the block only (an enabled plugin gets its own flags back after it)."""
    _check_flags("plugin", flags)  # before the flags are read back (an unknown one: a bare KeyError)
    was = is_enabled()
    before = {name: _manager.flags[name] for name in flags} if was else {}
    manager = enable(**flags)
    try:
        yield manager
    finally:
        if not was:
            disable()
        for name, on in before.items():
            manager.set_flag(name, on)


def enable_from_env() -> bool:
    """``ROCM_ATTN_PLUGIN`` on: enable the plugin (any value other than an on/off spelling
    raises, ``validation.env_switch``)."""
    from inductor_rocm_attn.validation import env_switch

    if env_switch(ENV_VAR):
        enable()
        return True
    return False

