"""Speculative decoding: the one loop, drafters, verifier, request rules and metrics."""
