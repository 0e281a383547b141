# pagedq gateway (`pagedq serve`, OpenAI's API over the queue): no torch, no CUDA. Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t pagedq-gateway .
# The gateway and `pagedq status|dlq|bulk` import no torch (tests/test_settings_env.py), so this image installs
# the `worker` extra, numpy and transformers (torch-free, for /tokenize) (docker/requirements.py), then the
# project with --no-deps. The build stage holds the source tree; the runtime stage takes only the virtualenv.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE} AS build
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY docker/requirements.py ./docker/
# At the versions CI tests: .ci/constraints.txt, the lock .ci/setup installs from.
COPY .ci/constraints.txt ./.ci/
RUN python docker/requirements.py gateway > /tmp/requirements.txt \
 && pip install -c .ci/constraints.txt -r /tmp/requirements.txt
COPY pagedq ./pagedq
# --no-deps: the rest of the engine's dependencies (torch, triton) stays out: never imported here.
RUN pip install --no-deps .

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN useradd --create-home --uid 10001 pagedq
USER 10001
ENV PAGEDQ_REDIS_URL=redis://redis:6379/0
EXPOSE 8000
# /health: 200 while Redis answers (the gateway can take jobs in), else 503.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=5 \
    CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
# uvicorn handles SIGTERM itself (it finishes open responses, then exits); the process is PID 1 (exec form).
CMD ["pagedq", "serve", "--host", "0.0.0.0", "--port", "8000"]
