"""Kernels behind fzero, imported as ``fzero.ops``.

Triton kernels for CUDA live here as they are written; every kernel has a torch fallback that is the
CPU execution path (Triton runs on CPU only under its ~100x slower interpreter, see DESIGN.md §4).
"""
