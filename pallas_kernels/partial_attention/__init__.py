"""Partial-token (and chunked-prefill) attention: query rows at arbitrary absolute positions."""
