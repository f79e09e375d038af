"""Gluon kernels (NVIDIA Hopper, sm_90 only; opt-in): the warp-specialized prefix prefill
(``prefix_prefill.py``), which the Triton provider's ``paged_attention`` runs for eligible
launches when ``ROCM_ATTN_PREFILL_KERNEL=gluon`` (``eligibility.py`` says which)."""
