# One image for every ddiloco service: checkpoint store, syncer, learner, evaluator, and the
# `ddiloco status` client. The entrypoint is the `ddiloco` console script, which dispatches to
# the services (`ddiloco syncer` runs the same code as `python -m ddiloco.services.syncer`; the
# wheel ships the repository's services/ folder as `ddiloco.services`, see setup.py), so compose
# files and `docker run` say what to run in one readable word:
#
#   docker build -t ddiloco:local .
#   docker run --rm ddiloco:local syncer --help
#   docker run --rm --network host ddiloco:local status --target 127.0.0.1:50051
#
# Every flag --x-y of a service is also the environment variable DDILOCO_<SERVICE>_X_Y.
#
# Build arguments:
#   BASE_IMAGE   an image with Python 3.11+ (python3 -m venv must work). The default is the
#                official slim image; CI passes a Debian bookworm image built locally with
#                debootstrap (python3 is /usr/bin/python3 there), see scripts/docker_env.sh.
#   PIP_OFFLINE  1: install only from the wheels in dist/docker-wheels (downloaded on the host by
#                scripts/docker_env.sh), never from an index. 0 (default): from PyPI, with any
#                wheels in dist/docker-wheels preferred.
#   JAX_ACCELERATOR  cpu (default): the CPU jaxlib only. cuda12 or cuda13: also the CUDA plugin
#                of the same JAX version, `jax[cuda12]` / `jax[cuda13]`, whose wheels bundle CUDA
#                and cuDNN (~3 GB more; the host needs only the NVIDIA driver and the container
#                toolkit). Needs PIP_OFFLINE=0 (scripts/docker_env.sh downloads CPU wheels only).
#                JAX_PLATFORMS stays cpu in every image, so the syncer, store and evaluator run on
#                CPU; GPU learners set JAX_PLATFORMS=cuda (the Helm chart's learners.gpu does):
#                  docker build --build-arg JAX_ACCELERATOR=cuda12 -t ddiloco:cuda12 .
#                  docker run --gpus all -e JAX_PLATFORMS=cuda ddiloco:cuda12 learner ...
#
# Layers: the dependencies (large: jax, jaxlib, scipy) are installed in their own layer, which
# stays cached until pyproject.toml or the wheels change; a code change rebuilds only the small
# project layer (/opt/ddiloco), in the builder and in the final image. The final stage holds the
# base image, a virtual environment without pip or setuptools, the installed project, and nothing
# else: no compilers, no build tools, no sources.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- deps: a virtual environment with the dependencies ----------------------------------------
FROM ${BASE_IMAGE} AS deps
ARG PIP_OFFLINE=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INDEX=${PIP_OFFLINE} \
    PIP_FIND_LINKS=/wheels/docker-wheels \
    PIP_NO_WARN_SCRIPT_LOCATION=1
RUN python3 -m venv /opt/venv
# pyproject.toml always exists, so this COPY succeeds whether or not dist/ does (a wildcard that
# matches nothing is allowed next to a source that matches); .dockerignore lets only
# dist/docker-wheels into the context, which lands in /wheels/docker-wheels. The requirements are
# the project's dependencies plus its `server` extra (TLS certificates, numba kernels, etcd), the
# same list scripts/docker_env.sh downloads; no plots, examples or dev tools.
COPY pyproject.toml scripts/image_requirements.py dis[t] /wheels/
RUN python3 /wheels/image_requirements.py /wheels/pyproject.toml > /tmp/requirements.txt \
    && /opt/venv/bin/pip install --no-cache-dir --requirement /tmp/requirements.txt
# The accelerator plugin, pinned to the JAX just installed, in a layer of its own (the CPU layer
# above stays cached when only this argument changes).
ARG JAX_ACCELERATOR=cpu
RUN case "$JAX_ACCELERATOR" in \
      cpu) echo "JAX_ACCELERATOR=cpu: CPU jaxlib only" ;; \
      cuda12|cuda13) /opt/venv/bin/pip install --no-cache-dir \
          "jax[$JAX_ACCELERATOR]==$(/opt/venv/bin/python -c 'import jax; print(jax.__version__)')" ;; \
      *) echo "JAX_ACCELERATOR=$JAX_ACCELERATOR is not one of cpu, cuda12, cuda13" >&2; exit 2 ;; \
    esac

# ---- runtime-venv: the same environment without pip and setuptools ---------------------------
FROM deps AS runtime-venv
RUN /opt/venv/bin/python -m pip uninstall --yes --quiet pip setuptools

# ---- project: the ddiloco package, services/ as ddiloco.services (built into a wheel here) ----
# Installed into their own directory, so the final image gets them as a small layer of their
# own on top of the (large, cached) dependency layer. setuptools lives only in pip's isolated
# build environment.
FROM deps AS project
COPY pyproject.toml setup.py README.md /src/
COPY ddiloco /src/ddiloco
COPY services /src/services
# The commit this image is built from (`--build-arg GIT_COMMIT=$(git rev-parse HEAD)`): `--version`,
# the start log lines and TrainingState.build_commit report it (ddiloco/build_info.py).
ARG GIT_COMMIT=unknown
RUN echo "$GIT_COMMIT" > /src/ddiloco/BUILD_COMMIT
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --target /opt/ddiloco /src \
    && PYTHONPATH=/opt/ddiloco /opt/venv/bin/python -c \
       "import ddiloco.healthcheck, ddiloco.cli.main, ddiloco.services.syncer.config, ddiloco.services.learner.config, ddiloco.services.checkpoint.config" \
    && test ! -e /opt/ddiloco/services

# ---- final: the runtime ---------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG JAX_ACCELERATOR=cpu
LABEL org.opencontainers.image.title="ddiloco" io.ddiloco.jax-accelerator="${JAX_ACCELERATOR}"
# A fixed, unprivileged uid/gid, so volume ownership is predictable. /var/lib/ddiloco is where the
# checkpoint store keeps its data (mount a named volume there); it is created owned by that user,
# so a fresh named volume inherits the ownership.
RUN groupadd --system --gid 10001 ddiloco \
    && useradd --system --uid 10001 --gid ddiloco --home-dir /home/ddiloco --create-home \
       --shell /usr/sbin/nologin ddiloco \
    && mkdir -p /var/lib/ddiloco \
    && chown ddiloco:ddiloco /var/lib/ddiloco
COPY --from=runtime-venv /opt/venv /opt/venv
COPY --from=project /opt/ddiloco /opt/ddiloco
ENV PATH=/opt/ddiloco/bin:/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/ddiloco \
    PYTHONUNBUFFERED=1 \
    JAX_PLATFORMS=cpu \
    DDILOCO_CHECKPOINT_ROOT=/var/lib/ddiloco
USER ddiloco
WORKDIR /home/ddiloco
# 50051: syncer, 50052: checkpoint store (their default --bind ports); 8083: a learner's health
# service (its default --health-bind).
EXPOSE 50051 50052 8083
# Calls the standard gRPC health service of the server in this container (ddiloco/healthcheck.py).
# DDILOCO_HEALTH_PORT selects the port (50051 syncer, 50052 checkpoint store, 8083 a learner, whose
# health says whether its training loop still steps); the evaluator serves nothing, so compose
# files disable the check for it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD python -m ddiloco.healthcheck --quiet --timeout-s 3 --target "127.0.0.1:${DDILOCO_HEALTH_PORT:-50051}"
ENTRYPOINT ["ddiloco"]
CMD ["--help"]
