"""Code that runs inside tritonserver's Python backend: the engine and orchestrator models."""
