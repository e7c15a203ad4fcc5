# syntax=docker/dockerfile:1
# toolchord image: one image for the worker, Flower and the orchestrator (the command picks the role).
# Build: docker build -t toolchord .   Run: see docker-compose.yml and docs/deployment.md.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . .
# A virtualenv under /opt keeps the install in one directory that the runtime stage copies whole,
# readable by every uid (the sandbox's dropped uid included) and writable by none of them.
RUN python -m venv /opt/toolchord \
    && /opt/toolchord/bin/pip install . \
    && /opt/toolchord/bin/python -m compileall -q /opt/toolchord

FROM python:3.11-slim
# libseccomp2: the sandbox loads its per-call seccomp filter through pyseccomp, which needs it.
# tini: PID 1 that forwards SIGTERM (Celery's warm shutdown) and reaps orphaned sandbox children.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libseccomp2 tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 toolchord \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin toolchord
COPY --from=build /opt/toolchord /opt/toolchord
ENV PATH=/opt/toolchord/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TOOLCHORD_LOG_DIR=/tmp/toolchord/logs \
    TOOLCHORD_SANDBOX_DIRECT_FORK=refuse
# /tmp is the only place the processes write (per-call sandbox workspaces, embedded logs); the
# deployments mount a tmpfs/emptyDir there and keep the root filesystem read-only.
WORKDIR /tmp
# Numeric uid so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["toolchord", "worker"]
