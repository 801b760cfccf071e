"""Triton kernels of the memory path, each beside its pure-torch reference."""
