"""Gluon kernels (NVIDIA Hopper, sm_90 only): the warp-specialized prefix prefill
(``prefix_prefill.py``), which the Triton provider's ``paged_attention`` runs for the launches
it covers (``eligibility.py`` says which) unless ``ROCM_ATTN_PREFILL_KERNEL=triton``."""
