"""The images the manifests run, and where they come from (docker/*.Dockerfile).

CPU (backend torch): built from this checkout by `make install` inside python:3.11, the
same install as a developer machine. TensorRT-LLM (backend trtllm): NVIDIA's Triton
TensorRT-LLM image with trtspec added; engines must be built by the same TensorRT-LLM release
that serves them, so build them in this image (or with --engines-from build).
"""

from __future__ import annotations

CPU_BASE_IMAGE = "python:3.11-slim-bookworm"
# NVIDIA's Triton release -> the TensorRT-LLM release inside its trtllm-python-py3 image,
# as NVIDIA's release compatibility matrix lists them.
TRTLLM_IN_TRITON = {"25.10": "1.0.0", "25.11": "1.0.3", "25.12": "1.1.0"}
TRITON_RELEASE = "25.12"
TRTLLM_BASE_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_RELEASE}-trtllm-python-py3"
