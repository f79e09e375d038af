"""Triton kernels (the GPU provider): one launcher per op, with the signature of the same
function in ``kernels.reference``. Tuned launch configs: ``configs.py``; shared attention
pieces: ``attention_common.py``; decode kernels: ``paged_decode.py``; the prefill kernel:
``prefix_prefill.py``; the launcher choosing them: ``paged_attention.py``."""

from .qk_norm_rope_and_cache import qk_norm_rope_and_cache  # noqa: F401  (cache writers)
from .qk_norm_rope_cos_sin_and_cache import qk_norm_rope_cos_sin_and_cache  # noqa: F401
from .reshape_and_cache import reshape_and_cache  # noqa: F401
from .rope_and_cache import rope_and_cache  # noqa: F401
from .rope_cos_sin_and_cache import rope_cos_sin_and_cache  # noqa: F401
from .rotary_embedding import rotary_embedding  # noqa: F401
from .encoder_attention import encoder_attention  # noqa: F401  (attention)
from .paged_attention import paged_attention  # noqa: F401
