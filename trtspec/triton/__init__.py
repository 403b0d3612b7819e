"""Triton Inference Server: the model repository, the server process, and the code that runs inside it."""
