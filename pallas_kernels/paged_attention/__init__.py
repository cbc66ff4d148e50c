"""Paged decode attention: one query token per sequence over its pages."""
