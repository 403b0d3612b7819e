"""Engines: the backend-neutral build, manifests, checks, and the torch and trtllm backends."""
