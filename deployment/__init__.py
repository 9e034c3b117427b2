"""Getting the pipelines onto a Flyte cluster: registration, launches, schedules (``python -m deployment.remote``)."""
