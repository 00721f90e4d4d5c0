"""Fused kernels: cpu (numba) and triton."""
