# The runtime image of every task: Flyte task pods (`pyflyte-execute` / `pyflyte-fast-execute`) and the KubeRay head,
# worker and submitter pods of the train task's RayJob (`ray start`, `ray job submit`). Build and push it with
# `make image IMAGE=registry.example.com/ml/flyte-ray-training:<tag>`, then `make package` with the same IMAGE.
#
# CUDA 13.0 matches the torch 2.14.1 wheels in requirements.lock (they bring their own nvidia-* CUDA libraries;
# the base adds the NVIDIA container runtime's environment). Ubuntu 22.04 ships Python 3.11 as a distro package.
# The tag is exact; pin its digest too (`docker buildx imagetools inspect <tag>`) once a registry is reachable:
# it was not from where this file was written, and an unverified digest would only break the build.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu22.04

# Python 3.11 and what both stages share. The builder's virtualenv points at /usr/bin/python3.11, so the runtime
# stage must start from this very stage for that path to exist there.
FROM ${BASE_IMAGE} AS python
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# tini reaps the zombies Ray's many subprocesses leave; wget is what KubeRay's injected readiness and liveness
# probes run (`wget ... /api/local_raylet_healthz | grep success`); ca-certificates for S3 and MLflow over TLS.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates tini wget \
 && rm -rf /var/lib/apt/lists/*

# Everything that compiles lives here only: a package in the lock without a wheel for this platform builds here.
FROM python AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential python3.11-dev \
 && rm -rf /var/lib/apt/lists/*
# /opt/venv is flytekit's default interpreter location (`pyflyte package --python-interpreter`). The distro's
# ensurepip brings an old pip: install the one `make lock` ran with.
ARG PIP_VERSION=26.3
RUN python3.11 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir pip==${PIP_VERSION}
ENV PATH=/opt/venv/bin:$PATH
# The committed lock, and only it: exact versions, no resolution at build time (--no-deps), then a consistency
# check. Regenerate it with `make lock`.
COPY requirements.lock /tmp/requirements.lock
RUN pip install --no-cache-dir --no-deps -r /tmp/requirements.lock \
 && pip check

FROM python AS runtime
COPY --from=builder /opt/venv /opt/venv
# /root is flytekit's default in-container source path: `make package` (`--copy none`) imports the code baked in
# here, and `--copy all` makes pyflyte-fast-execute unpack the registered code into it, so the runtime user must be
# able to write there. Group 0 gets the owner's rights, for clusters that run images under an arbitrary UID in
# group 0.
COPY --chown=10001:0 training_core /root/training_core
COPY --chown=10001:0 tasks /root/tasks
COPY --chown=10001:0 workflows /root/workflows
# User code the configs name by import path (`workload.name: examples.tabular_mlp.workload:TabularMLP`): in the image
# for `--copy none`, as `--copy all` brings it in the tarball.
COPY --chown=10001:0 examples /root/examples
RUN chown -R 10001:0 /root && chmod -R g=u /root \
 && useradd --uid 10001 --gid 0 --home-dir /root --no-create-home --shell /bin/bash flyte
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONPATH=/root \
    HOME=/root \
    TMPDIR=/tmp \
    RAY_USAGE_STATS_ENABLED=0 \
    MPLCONFIGDIR=/tmp/matplotlib
# The platform's Ray settings (training_core/parallel/ray_settings.py, PROCESS_ENV; a test keeps them equal) for every
# container of this image, also Ray pods that are not the platform's RayJobs (deployment/kustomize/examples): Ray
# workers at nice 0, and glibc's malloc keeping a training step's freed memory mapped.
ENV RAY_worker_niceness=0 \
    MALLOC_ARENA_MAX=1 \
    MALLOC_MMAP_THRESHOLD_=134217728 \
    MALLOC_TRIM_THRESHOLD_=536870912 \
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S=5 \
    RAY_kill_worker_timeout_milliseconds=1000
WORKDIR /root
USER 10001
# Fails the build if the code does not import or the entry points are missing: the imports below are the ones
# `pyflyte-execute ... -- task-module tasks.train task-name train` and `ray start` make.
RUN python -c "import tasks.train, workflows.training, training_core.config, examples.tabular_mlp.workload" \
 && pyflyte-execute --help >/dev/null \
 && ray --version
# tini passes every argument through, so Flyte's command (`pyflyte-fast-execute ...` / `pyflyte-execute ...`) and
# KubeRay's (`/bin/bash -c -- ray start ...`) run unchanged; with no command the container opens a shell.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["/bin/bash"]
