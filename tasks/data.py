"""Data prep: raw dataset -> sharded splits with a manifest, cached by config and by a fingerprint of what it reads.

``prepare`` is what workflows call. It compiles, at run time, to three nodes: ``fingerprint_inputs`` (uncached:
the data's files or objects, the tokenizer and the user code that prepares data, hashed or listed in seconds), then
``prepare_on_ray`` (image sources: a Ray task per shard; text: tokenising in Ray tasks; on a RayJob sized from
``data.prep_num_workers``) or ``prepare_data`` (digits, synthetic and user datasets, in the task's own process),
both cached by the same version and keyed on the fingerprint, so data or code replaced at the same path re-prepares;
then ``note_prepared``, which says in the run's log which prepared data the run uses and whether it came from the
cache.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime, timedelta, timezone
from typing import NamedTuple

from flytekit import Cache, FlyteContextManager, Resources, dynamic, task
from flytekit.types.directory import FlyteDirectory

from tasks.artifacts import artifact_location, read_attempt_record, write_attempt_record
from tasks.logs import show_task_logs
from tasks.ray_config import prep_ray_job_config, text_prep_resources
from tasks.types import PreparedData, PrepProvenance
from training_core.config import DataConfig, WorkloadConfig
from training_core.redact import redact
from training_core.registry import SHARED_SOURCES

# Bump when the shard format or split logic changes, so cached outputs are not reused.
# 7: image shards of format 3 (every image decodes with the loader's own decoder: what it would not read, or a PNG
# that fails the structural check, re-encoded; the source file recorded per sample); 6: keyed on the fingerprint of
# what prep reads (inputs_fingerprint; the run's token kept out of the key), the output records it
# (PreparedData.provenance); 5: images the loader's decoder does not read as 8-bit (BMP, 16-bit
# PNG) stored as 8-bit PNGs, 16-bit statistics scaled; loader-only DataConfig fields and the model factory out of
# the key (for_prep); 4: Parquet shards of encoded images (cifar10, image_folder), manifest v4; 3: manifest v3
# (workload, arrays); 2: label ranges; CIFAR checked at read
PREPARE_DATA_CACHE_VERSION = "7"

PREP_TASK_ARGS = {
    # The run's token says which run prepared the data (note_prepared): it must not make every run miss the cache.
    "cache": Cache(version=PREPARE_DATA_CACHE_VERSION, ignored_inputs=("run_token",)),
    "retries": 2,
    "interruptible": True,  # idempotent and cached: a preempted attempt is redone (only its missing shards)
    "requests": Resources(cpu="1", mem="2Gi"),
    "limits": Resources(cpu="2", mem="8Gi"),
}


@task(timeout=timedelta(hours=2), **PREP_TASK_ARGS)
def prepare_data(
    config: DataConfig, workload: WorkloadConfig = WorkloadConfig(), inputs_fingerprint: str = "", run_token: str = ""
) -> PreparedData:
    """Read the dataset, split it into train/val/test and write each split as shards plus a manifest, in this
    task's process (digits, synthetic and user datasets; text called here is tokenised on this pod's threads),
    straight to the run's raw-output location (s3:// on a cluster). A retry writes into its predecessor's directory
    and rewrites only the shard files that are missing or hold other bytes.

    :param config: Which dataset, where its raw files are, split fractions, shard count, image size or text
        tokenizer and sequence length. Outputs are cached per distinct config, workload and inputs fingerprint.
    :param workload: Which workload prepares the data: a built-in (image_classification, causal_lm) or user code.
    :param inputs_fingerprint: sha256 of what prep reads (``fingerprint_inputs``): part of the cache key, so data
        or user code replaced at the same path prepares again. Empty: keyed on the config alone.
    :param run_token: The pipeline run's random token (``fingerprint_inputs``), recorded in the output and kept out
        of the cache key: ``note_prepared`` tells from it whether this run prepared the data.
    :return: The shard directory, the manifest's split counts, classes and input shape, and its provenance.
    """
    return _prepared(config, workload, _attempt_directory(), inputs_fingerprint, run_token)


# The default config's RayJob; ``prepare`` overrides it with the launched config's.
@task(task_config=prep_ray_job_config(DataConfig()), timeout=timedelta(hours=24), **PREP_TASK_ARGS)
def prepare_on_ray(
    config: DataConfig, workload: WorkloadConfig = WorkloadConfig(), inputs_fingerprint: str = "", run_token: str = ""
) -> PreparedData:
    """Prepare a source on this task's Ray cluster, written straight to the run's raw-output location (s3:// on a
    cluster): an image source (``cifar10``, ``image_folder``) as Parquet shards of encoded images, one Ray task
    per shard; text (``causal_lm``) tokenised in Ray tasks, ``data.prep_num_workers`` at a time, and packed here. A
    retry (Flyte's next attempt) writes into its predecessor's directory and rewrites only the shards that are
    missing or do not match their records.

    :param config: The source, split fractions, shard count, image size or tokenizer, and ``prep_num_workers``.
    :param workload: The built-in workload (user datasets go to ``prepare_data``).
    :param inputs_fingerprint: sha256 of what prep reads (``fingerprint_inputs``), part of the cache key.
    :param run_token: The pipeline run's random token, recorded in the output and kept out of the cache key.
    :return: The shard directory, the manifest's split counts, classes and input shape, and its provenance.
    """
    return _prepared(config, workload, _attempt_directory(), inputs_fingerprint, run_token)


def _attempt_directory() -> str:
    """Where this attempt writes its shards: its predecessor's directory on a retry (Flyte hands it the previous
    attempt's record), else a fresh one under the run's raw-output location, recorded for the next attempt."""
    previous = read_attempt_record()
    if previous:
        return previous["out_dir"]
    out_dir = FlyteContextManager.current_context().file_access.get_random_remote_directory()
    write_attempt_record({"out_dir": out_dir})
    return out_dir


def _prepared(
    config: DataConfig, workload: WorkloadConfig, out_dir: str, inputs_fingerprint: str, run_token: str
) -> PreparedData:
    from training_core.workloads import resolve_workload

    show_task_logs()
    manifest = resolve_workload(workload).prepare_data(config, out_dir)
    provenance = PrepProvenance(
        inputs_fingerprint=inputs_fingerprint,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        run_token=run_token,
    )
    return PreparedData(
        # Already where Flyte keeps outputs (the raw-output location): passed on as it is, never copied.
        directory=FlyteDirectory(out_dir, remote_directory=False),
        workload=manifest.workload,
        dataset=manifest.dataset,
        num_classes=manifest.num_classes,
        input_shape=list(manifest.input_shape),
        split_counts=manifest.split_counts(),
        provenance=provenance,
    )


PrepInputs = NamedTuple("PrepInputs", [("fingerprint", str), ("run_token", str)])


@task(
    timeout=timedelta(hours=1),
    retries=2,
    interruptible=True,
    # Listing a million objects holds their keys: a few hundred MB.
    requests=Resources(cpu="1", mem="1Gi"),
    limits=Resources(cpu="1", mem="4Gi"),
)
def fingerprint_inputs(config: DataConfig, workload: WorkloadConfig = WorkloadConfig()) -> PrepInputs:
    """Fingerprint what data prep will read, every run (never cached): the data's local files (paths, sizes, and
    their bytes while cheap, else modification times) or ``s3://`` objects (keys, sizes, ETags: listed, never
    downloaded), a ``tokenizer.json``, and the files of the user package that prepares the data.

    :param config: The data config prep is given (``DataConfig.for_prep``): ``data.path`` and ``data.tokenizer``.
    :param workload: The workload prep is given: user code named by ``workload.name`` or ``dataset_source``.
    :return: The fingerprint (sha256 hex) prep is keyed on, and a random token for this run.
    """
    from training_core.data.fingerprint import fingerprint_prep_inputs

    found = fingerprint_prep_inputs(config, workload)
    print(redact(found.describe()), flush=True)
    return PrepInputs(fingerprint=found.digest, run_token=uuid.uuid4().hex)


@task(
    timeout=timedelta(minutes=10),
    retries=2,
    interruptible=True,
    requests=Resources(cpu="100m", mem="512Mi"),
    limits=Resources(cpu="1", mem="1Gi"),
)
def note_prepared(data: PreparedData, run_token: str) -> PreparedData:
    """Say which prepared data this run uses: its samples, where it is, its inputs' fingerprint, when it was
    created, and whether this run prepared it or took it from Flyte's cache.

    :param data: The output of ``prepare_data`` or ``prepare_on_ray``, prepared by this run or an earlier one.
    :param run_token: This run's token (``fingerprint_inputs``); prep recorded the token of the run that ran it.
    :return: ``data`` with ``provenance.cache_hit`` set.
    """
    noted = dataclasses.replace(
        data, provenance=dataclasses.replace(data.provenance, cache_hit=data.provenance.run_token != run_token)
    )
    print(describe_prepared(noted), flush=True)
    return noted


def describe_prepared(data: PreparedData) -> str:
    """One line for the run's log: ``prepared data    : train N, val N, test N samples at <dir>; <provenance>``."""
    counts = ", ".join(f"{name} {count}" for name, count in data.split_counts.items())
    where = redact(artifact_location(data.directory))
    return f"prepared data    : {counts} samples ({data.workload}) at {where}; {data.provenance.describe()}"


@dynamic(interruptible=True)
def prepare(config: DataConfig, workload: WorkloadConfig = WorkloadConfig()) -> PreparedData:
    """Data prep where it belongs: an image or text source on a RayJob of ``data.prep_num_workers`` prep workers
    (each ``data.prep_memory_per_worker_gib``), compiled at run time so the RayJob follows the launched config;
    digits, synthetic and user datasets in ``prepare_data``'s own pod (a user's text: a pod of ``prep_num_workers``
    CPUs). Either is keyed on the fingerprint of what it reads, computed every run by ``fingerprint_inputs``, and
    followed by ``note_prepared``, which logs which prepared data the run uses and whether it came from the cache.

    :param config: The data config.
    :param workload: The workload that prepares it.
    :return: The prepared shards, with their provenance (fingerprint, created when, cache hit or not).
    """
    from training_core.workloads import prep_uses_ray

    # Cached by what changes the shards: tuning the loader or swapping the model re-runs no prep.
    config, workload = config.for_prep(), workload.for_prep()
    inputs = fingerprint_inputs(config=config, workload=workload)
    keys = {
        "config": config,
        "workload": workload,
        "inputs_fingerprint": inputs.fingerprint,
        "run_token": inputs.run_token,
    }
    if SHARED_SOURCES.get(workload.name, workload.name) == "causal_lm" and workload.dataset_source:
        # A user's text is tokenised in this pod's tokenizer threads (training_core.data.text.tokenizer_threads).
        resources = text_prep_resources(config)
        prepared = prepare_data(**keys).with_overrides(requests=resources, limits=resources)
    elif not prep_uses_ray(config, workload):
        prepared = prepare_data(**keys)
    else:
        # A wrong source fails here, before a RayJob is started for it.
        from training_core.registry import SOURCE_CHECKS, load

        load(SOURCE_CHECKS[workload.name])(config)
        prepared = prepare_on_ray(**keys).with_overrides(task_config=prep_ray_job_config(config))
    return note_prepared(data=prepared, run_token=inputs.run_token)
