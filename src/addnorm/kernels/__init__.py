"""Fused kernels implementing the contract of :mod:`addnorm.reference` (one module per kernel family)."""
