# CPU image for backend: torch specs: trtspec installed exactly as `make install` installs it
# (a venv, the pinned CPU torch from the Makefile, the serve/dev/deploy extras, and the
# nvidia-pytriton wheel whose bundled tritonserver `trtspec serve` runs).
#   docker build -f docker/cpu.Dockerfile -t trtspec-cpu:0.1.0 .
# Point pip at another index (a mirror, or PyTorch's CPU wheel index so torch stays small):
#   docker build --build-arg PIP_EXTRA_INDEX_URL=<index> ...
FROM python:3.11-slim-bookworm

ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
RUN apt-get update \
 && apt-get install -y --no-install-recommends make libstdc++6 zlib1g libjemalloc2 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/trtspec
COPY Makefile pyproject.toml README.md ./
COPY trtspec ./trtspec
COPY engine_specs ./engine_specs
RUN PIP_INDEX_URL="${PIP_INDEX_URL}" PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL}" \
    make install VENV=/opt/trtspec/.venv \
 && rm -rf /root/.cache

# The pod runs as uid 1000 with a read-only root filesystem: everything it writes goes to
# volumes (model repository, trtspec cache, /tmp, /dev/shm), see trtspec/deploy/k8s.py.
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp trtspec
ENV PATH=/opt/trtspec/.venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 1000:1000
EXPOSE 8000 8001 8002
CMD ["trtspec", "--help"]
