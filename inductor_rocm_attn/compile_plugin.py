"""Deprecated import path, kept for one release: use ``inductor_rocm_attn.compilation``
(``enable``, ``disable``, ``plugin``, ``fusion_report``, ``is_enabled``, ``set_pass_flag``)
or ``inductor_rocm_attn.compilation.plugin``."""

from .compilation.plugin import (  # noqa: F401
    ENV_VAR,
    disable,
    enable,
    enable_from_env,
    fusion_report,
    is_enabled,
    plugin,
    set_pass_flag,
)
