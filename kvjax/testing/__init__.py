"""Tiny models, an independent numpy forward and fixtures shared by tests and notebooks."""
