"""Triton kernels of the native engine (GPU; the tests also run them on CPU under ``TRITON_INTERPRET=1``).

Its modules import triton: callers import them lazily, only on the Triton path.
"""
