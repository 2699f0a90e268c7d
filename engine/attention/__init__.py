"""Paged attention backends: torch (any device) and Triton (CUDA)."""
