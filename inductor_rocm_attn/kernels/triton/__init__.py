"""Triton kernels (GPU provider). Same signatures as kernels.reference."""
