"""Data prep: raw dataset -> sharded splits with a manifest, cached by config.

``prepare`` is what workflows call. It compiles, at run time, to ``prepare_on_ray`` (image sources: a Ray task per
shard; text: tokenising in Ray tasks; on a RayJob sized from ``data.prep_num_workers``) or ``prepare_data``
(digits, synthetic and user datasets, in the task's own process). Both are cached by the same version.
"""

from __future__ import annotations

from datetime import timedelta

from flytekit import Cache, FlyteContextManager, Resources, dynamic, task
from flytekit.types.directory import FlyteDirectory

from tasks.artifacts import read_attempt_record, write_attempt_record
from tasks.logs import show_task_logs
from tasks.ray_config import prep_ray_job_config, text_prep_resources
from tasks.types import PreparedData
from training_core.config import DataConfig, WorkloadConfig

# Bump when the shard format or split logic changes, so cached outputs are not reused.
# 5: images the loader's decoder does not read as 8-bit (BMP, 16-bit PNG) stored as 8-bit PNGs, 16-bit statistics
# scaled; loader-only DataConfig fields and the model factory out of the key (for_prep); 4: Parquet shards of encoded
# images (cifar10, image_folder), manifest v4; 3: manifest v3 (workload, arrays); 2: label ranges; CIFAR checked at
# read
PREPARE_DATA_CACHE_VERSION = "5"

PREP_TASK_ARGS = {
    "cache": Cache(version=PREPARE_DATA_CACHE_VERSION),
    "retries": 2,
    "interruptible": True,  # idempotent and cached: a preempted attempt is redone (only its missing shards)
    "requests": Resources(cpu="1", mem="2Gi"),
    "limits": Resources(cpu="2", mem="8Gi"),
}


@task(timeout=timedelta(hours=2), **PREP_TASK_ARGS)
def prepare_data(config: DataConfig, workload: WorkloadConfig = WorkloadConfig()) -> PreparedData:
    """Read the dataset, split it into train/val/test and write each split as shards plus a manifest, in this
    task's process (digits, synthetic and user datasets; text called here is tokenised on this pod's threads),
    straight to the run's raw-output location (s3:// on a cluster). A retry writes into its predecessor's directory
    and rewrites only the shard files that are missing or hold other bytes.

    :param config: Which dataset, where its raw files are, split fractions, shard count, image size or text
        tokenizer and sequence length. Outputs are cached per distinct config and workload.
    :param workload: Which workload prepares the data: a built-in (image_classification, causal_lm) or user code.
    :return: The shard directory and the manifest's split counts, classes and input shape.
    """
    return _prepared(config, workload, _attempt_directory())


# The default config's RayJob; ``prepare`` overrides it with the launched config's.
@task(task_config=prep_ray_job_config(DataConfig()), timeout=timedelta(hours=24), **PREP_TASK_ARGS)
def prepare_on_ray(config: DataConfig, workload: WorkloadConfig = WorkloadConfig()) -> PreparedData:
    """Prepare a source on this task's Ray cluster, written straight to the run's raw-output location (s3:// on a
    cluster): an image source (``cifar10``, ``image_folder``) as Parquet shards of encoded images, one Ray task
    per shard; text (``causal_lm``) tokenised in Ray tasks, ``data.prep_num_workers`` at a time, and packed here. A
    retry (Flyte's next attempt) writes into its predecessor's directory and rewrites only the shards that are
    missing or do not match their records.

    :param config: The source, split fractions, shard count, image size or tokenizer, and ``prep_num_workers``.
    :param workload: The built-in workload (user datasets go to ``prepare_data``).
    :return: The shard directory and the manifest's split counts, classes and input shape.
    """
    return _prepared(config, workload, _attempt_directory())


def _attempt_directory() -> str:
    """Where this attempt writes its shards: its predecessor's directory on a retry (Flyte hands it the previous
    attempt's record), else a fresh one under the run's raw-output location, recorded for the next attempt."""
    previous = read_attempt_record()
    if previous:
        return previous["out_dir"]
    out_dir = FlyteContextManager.current_context().file_access.get_random_remote_directory()
    write_attempt_record({"out_dir": out_dir})
    return out_dir


def _prepared(config: DataConfig, workload: WorkloadConfig, out_dir: str) -> PreparedData:
    from training_core.workloads import resolve_workload

    show_task_logs()
    manifest = resolve_workload(workload).prepare_data(config, out_dir)
    return PreparedData(
        # Already where Flyte keeps outputs (the raw-output location): passed on as it is, never copied.
        directory=FlyteDirectory(out_dir, remote_directory=False),
        workload=manifest.workload,
        dataset=manifest.dataset,
        num_classes=manifest.num_classes,
        input_shape=list(manifest.input_shape),
        split_counts=manifest.split_counts(),
    )


@dynamic(interruptible=True)
def prepare(config: DataConfig, workload: WorkloadConfig = WorkloadConfig()) -> PreparedData:
    """Data prep where it belongs: an image or text source on a RayJob of ``data.prep_num_workers`` prep workers
    (each ``data.prep_memory_per_worker_gib``), compiled at run time so the RayJob follows the launched config;
    digits, synthetic and user datasets in ``prepare_data``'s own pod (a user's text: a pod of ``prep_num_workers``
    CPUs).

    :param config: The data config.
    :param workload: The workload that prepares it.
    :return: The prepared shards.
    """
    from training_core.workloads import prep_uses_ray

    # Cached by what changes the shards: tuning the loader or swapping the model re-runs no prep.
    config, workload = config.for_prep(), workload.for_prep()
    if workload.name == "causal_lm" and workload.dataset_source:
        # A user's text is tokenised in this pod's tokenizer threads (training_core.text.tokenizer_threads).
        resources = text_prep_resources(config)
        return prepare_data(config=config, workload=workload).with_overrides(requests=resources, limits=resources)
    if not prep_uses_ray(config, workload):
        return prepare_data(config=config, workload=workload)
    # A wrong source fails here, before a RayJob is started for it.
    if workload.name == "causal_lm":
        from training_core.text import check_text_source

        check_text_source(config)
    else:
        from training_core.image_shards import check_source

        check_source(config)
    return prepare_on_ray(config=config, workload=workload).with_overrides(task_config=prep_ray_job_config(config))
