"""Kernels by provider: ``reference`` (PyTorch, any device), ``triton`` (GPU), ``aiter`` (ROCm).

Every provider module exposes the functions of ``reference`` with the same signatures.
"""
