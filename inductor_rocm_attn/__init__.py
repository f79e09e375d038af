"""inductor_rocm_attn: a paged-attention backend (ROCM_ATTN design) for torch.compile.

Importing registers the ``rocm_attn`` ops and, where transformers is installed, the name
``attn_implementation="rocm_attn"`` (when transformers loads its attention registry: this
import does not import transformers; see ``integrations``). Nothing else: no tracing,
builds, files or device queries.
"""

from . import ops  # noqa: F401  (registers torch.ops.rocm_attn.*)
from .backend import RocmAttentionBackend, RocmAttentionImpl
from .block_allocator import BlockAllocator
from .capabilities import AttentionType
from .forward_context import get_forward_context, profiling_run, set_forward_context
from .layer import Attention, attention_layers, bind_kv_caches
from .layout import CacheLayout, KVCacheSpec, allocate_kv_cache
from .metadata import AttentionMetadata, MetadataBuffers, build_attention_metadata
from .compilation.plugin import disable, enable, fusion_report, plugin

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionMetadata",
    "AttentionType",
    "BlockAllocator",
    "CacheLayout",
    "KVCacheSpec",
    "MetadataBuffers",
    "RocmAttentionBackend",
    "RocmAttentionImpl",
    "allocate_kv_cache",
    "attention_layers",
    "bind_kv_caches",
    "build_attention_metadata",
    "get_forward_context",
    "set_forward_context",
    "profiling_run",
    "enable",
    "disable",
    "plugin",
    "fusion_report",
]

from .compilation.plugin import enable_from_env as _enable_from_env

_enable_from_env()  # ROCM_ATTN_PLUGIN=1: turns the plugin on at import
del _enable_from_env

from .integrations import install as _install_integrations

_install_integrations()  # transformers: registers "rocm_attn" now or once transformers loads it
del _install_integrations
