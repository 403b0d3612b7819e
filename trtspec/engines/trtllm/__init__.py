"""TensorRT-LLM backend: checkpoint conversion, engine builds and their checks.

Nothing here imports tensorrt_llm: commands are generated from typed data and run as
subprocesses inside NVIDIA's TensorRT-LLM / Triton containers, so plans, checks and tests
work on any machine. The targeted release is :data:`families.TRTLLM_RELEASE`.
"""
