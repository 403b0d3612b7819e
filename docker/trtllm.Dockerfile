# GPU image for backend: trtllm specs: NVIDIA's Triton TensorRT-LLM image plus trtspec (its
# orchestrator models are Python-backend models importing trtspec).
#   docker build -f docker/trtllm.Dockerfile -t trtspec-trtllm:0.1.0 .
# The TensorRT-LLM release is the image's (25.12 ships 1.1.0 per NVIDIA's compatibility
# matrix); engines must be built with that same release: build them in this image.
ARG TRITON_TRTLLM_IMAGE=nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3
FROM ${TRITON_TRTLLM_IMAGE}

# The checkpoint converters (convert_checkpoint.py) come from the TensorRT-LLM source tree of
# the release inside the image.
ARG TRTLLM_GIT_REF=v1.1.0
RUN git clone --depth 1 --branch "${TRTLLM_GIT_REF}" https://github.com/NVIDIA/TensorRT-LLM /opt/TensorRT-LLM \
 && rm -rf /opt/TensorRT-LLM/.git
ENV TRTSPEC_TRTLLM_EXAMPLES=/opt/TensorRT-LLM/examples

COPY . /opt/trtspec/src
# --no-deps: the image's torch, transformers and tensorrt_llm stay as NVIDIA built them
# (TensorRT-LLM pins its transformers; trtspec's own requirement would replace it). The
# packages trtspec needs that the image lacks are installed by name.
RUN python3 -m pip install --no-cache-dir --no-deps /opt/trtspec/src \
 && python3 -m pip install --no-cache-dir "typer>=0.12" "rich>=13" "gguf>=0.10" "tritonclient[grpc,http]>=2.40"

# tritonserver runs with jemalloc when installed (trtspec's allocator choice, operations.md: memory).
RUN apt-get update && apt-get install -y --no-install-recommends libjemalloc2 && rm -rf /var/lib/apt/lists/*
RUN id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --user-group --no-create-home --home-dir /tmp trtspec
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
EXPOSE 8000 8001 8002
CMD ["trtspec", "--help"]
