# pagedq worker image. Build from the repository root:
#   docker build -f docker/worker-gpu.Dockerfile -t pagedq-worker .
# The CUDA base brings the driver-facing libraries; the torch wheel brings its own CUDA runtime. The two must be
# the same CUDA major.minor: change CUDA_VERSION and TORCH_CUDA together (PyTorch's CUDA 12.4 wheels stop at torch
# 2.6, below the project's torch>=2.11, hence 12.8). TORCH_VERSION is the version CI tests (.ci/setup).
ARG CUDA_VERSION=12.8.1
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu22.04
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# Triton compiles its kernel launcher with the system C compiler at the first kernel launch: gcc, the C library
# headers and Python.h (python3.11-dev) must be in the image, or the GPU worker fails at its first step.
# Apt packages are not version-pinned: jammy's archive drops superseded versions; the base image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev python3-pip \
        gcc libc6-dev ca-certificates tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv \
 && useradd --create-home --uid 10001 pagedq
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
# torch first, from PyTorch's index for this CUDA build (the default index's wheel may target another CUDA);
# the project install below then finds torch satisfied and leaves it.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY .ci/constraints.txt ./.ci/
COPY pagedq ./pagedq
# The project itself: its dependency ranges are pyproject.toml's, at the versions CI tests (.ci/constraints.txt,
# the lock .ci/setup installs from; the torch above satisfies its torch pin).
RUN pip install -c .ci/constraints.txt ".[worker,structured]"

# Run as the unprivileged user made above (uid 10001); the model folder is mounted read-only at /models/model.
# Triton caches the launcher it compiled under $HOME/.triton.
USER 10001
# Metrics are on by default, on all of the container's interfaces (nothing is reachable from outside until a
# port is published). PAGEDQ_WORKER_NAME is the consumer name: it must stay the same across a container's
# re-creation (a restarted worker re-reads its own pending jobs) and differ between workers; compose sets one
# per service. Unset (a plain `docker run`), the container's hostname is used, which changes on re-creation.
ENV PAGEDQ_REDIS_URL=redis://redis:6379/0 PAGEDQ_MODEL=/models/model \
    PAGEDQ_METRICS_PORT=9100 PAGEDQ_METRICS_ADDR=0.0.0.0
EXPOSE 9100

# /health is the worker's liveness (200 while its loop turns, metrics.py); loading a large checkpoint takes a
# while, so failures in the first 10 minutes do not count. The gateway service overrides this with its own.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ['PAGEDQ_METRICS_PORT'], timeout=4)"]

# tini forwards SIGTERM to the worker, which drains in-flight jobs and exits 0
# (compose's stop_grace_period must exceed --drain-timeout). The flags are spelled out on the command line, except the
# Redis URL: it holds a password, and a process's arguments are visible in ps, so the worker reads PAGEDQ_REDIS_URL.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["sh", "-c", "exec pagedq worker --model \"$PAGEDQ_MODEL\" --device cuda --name \"${PAGEDQ_WORKER_NAME:-$(hostname)}\" --metrics-port \"$PAGEDQ_METRICS_PORT\" --metrics-addr \"$PAGEDQ_METRICS_ADDR\""]
