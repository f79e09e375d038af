"""Kernels by provider: ``reference`` (PyTorch, any device), ``triton`` (GPU), ``aiter`` (AMD
AITER, optional), ``native`` (csrc, built on demand).

Every provider module exposes, for each op it supports, a function with the signature of
the same function in ``reference``. ``providers.REGISTRY`` declares each provider (what it
supports, which module here holds its kernels, whether it runs on this machine).
"""
