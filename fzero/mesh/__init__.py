"""Meshes, collectives and per-rank randomness."""
