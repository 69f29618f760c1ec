"""Differentiation: the gradient of one micro-batch and rematerialisation."""
