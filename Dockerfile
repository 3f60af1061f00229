# The image the Kubernetes manifests name (ghcr.io/pdcluster/pdcluster:<version>): the package and its `pdcluster`
# entry point, CPU torch by default (build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 and a
# CUDA base for GPUs), and the embedded default model generated at build time so pods start offline.
FROM python:3.11-slim AS build
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
RUN python -m venv /opt/venv
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
RUN pip install .

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home pdcluster
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PDCLUSTER_CACHE_DIR=/opt/pdcluster/cache
RUN mkdir -p /opt/pdcluster/cache \
    && python -c "from common.model_gen.make_model import default_model_path; print(default_model_path())" \
    && chown -R pdcluster /opt/pdcluster
USER pdcluster
WORKDIR /home/pdcluster
EXPOSE 30100 30101 31000 31001 31002 32000 32002
ENTRYPOINT []
CMD ["pdcluster", "--help"]
