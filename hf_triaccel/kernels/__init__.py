"""Triton kernels of hf_triaccel, installed as ``hf_triaccel.kernels``.

Importing a submodule imports Triton; the rest of the package imports these lazily,
only when :func:`hf_triaccel.dispatch.resolve_impl` picks ``"triton"``.
"""
