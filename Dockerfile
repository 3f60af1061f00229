# The image the Kubernetes manifests name (deploy/cluster_spec.yaml `images`): the package and its `pdcluster`
# entry point, and the embedded default model generated at build time so pods start offline. Two builds:
#
#   CPU (torch's CPU wheel on python:3.11-slim):
#     docker build -t ghcr.io/pdcluster/pdcluster:0.1.0 .
#   GPU (a CUDA 13.0 runtime base; torch==2.13.0 from PyPI is the CUDA 13.0 build on linux x86_64: its wheel
#   requires cuda-toolkit==13.0.3 and nvidia-cudnn-cu13, which pip installs beside it):
#     docker build --build-arg BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://pypi.org/simple -t ghcr.io/pdcluster/pdcluster:0.1.0-cu130 .
#
# Both stages start from BASE_IMAGE so the virtualenv's interpreter is the runtime's. The process runs as the
# numeric non-root UID/GID 10001 (Kubernetes runAsNonRoot can verify a numeric USER).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The CUDA bases have no Python: the distribution's python3 and venv.
RUN command -v python3 >/dev/null 2>&1 || (apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv && rm -rf /var/lib/apt/lists/*)
WORKDIR /src
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1
RUN pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY common common
COPY kvtransfer kvtransfer
COPY prefill_node prefill_node
COPY decode_node decode_node
COPY router router
COPY deploy deploy
COPY benchmarks benchmarks
COPY proto proto
RUN pip install ".[mooncake]"

FROM ${BASE_IMAGE}
# libibverbs1: the Mooncake transfer engine (--kv-transfer-backend mooncake) links it, even over TCP.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 \
    && (command -v python3 >/dev/null 2>&1 || apt-get install -y --no-install-recommends python3) \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 pdcluster && useradd --uid 10001 --gid 10001 --create-home pdcluster
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PDCLUSTER_CACHE_DIR=/opt/pdcluster/cache
RUN mkdir -p /opt/pdcluster/cache \
    && python -c "from common.model_gen.make_model import default_model_path; print(default_model_path())" \
    && chown -R 10001:10001 /opt/pdcluster
USER 10001:10001
WORKDIR /home/pdcluster
# Replica 0's ports of deploy/cluster_spec.yaml (a test checks them).
EXPOSE 30100 30101 31000 31001 31002 31004 32000 32002 32004
ENTRYPOINT []
CMD ["pdcluster", "--help"]
