"""The config: one typed tree for a training run (:mod:`~training_core.config.sections`) and the one way it is read
from YAML and the environment (:mod:`~training_core.config.loading`). Import their public names from here."""

from training_core.config.loading import (  # noqa: F401
    AUTO,
    build_dataclass,
    coerce,
    load_layers,
    merge,
    overlay,
    parse_yaml,
    read_yaml_mapping,
)
from training_core.config.sections import (  # noqa: F401
    DDP_DEFAULT_BUCKET_CAP_MB,
    IMPORT_PATH_FIX,
    LOADER_FIELDS,
    METRIC_DIRECTIONS,
    SHM_SHARE,
    CheckpointConfig,
    DataConfig,
    EvaluationConfig,
    LoopConfig,
    LoraConfig,
    ModelConfig,
    ObservabilityConfig,
    OptimizerConfig,
    PrecisionConfig,
    ScalingConfig,
    ScheduleConfig,
    SyncConfig,
    Toleration,
    TrackingConfig,
    TrainingConfig,
    WorkloadConfig,
    is_better,
    is_import_path,
    load_config,
    no_training_samples_error,
)
from training_core.messages import (  # noqa: F401
    clip,
    invalid,
    is_plain_file_name,
    quote,
)
