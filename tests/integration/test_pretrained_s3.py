"""Pretrained weights on an object store (the session's S3 server): read as from a local path, with the same hash."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from training_core.pretrained import read_pretrained


def test_weights_on_s3_read_as_the_local_copy_and_a_missing_object_names_the_field(s3_server, tmp_path):
    import s3fs

    state = {"fc.weight": torch.arange(12.0).view(3, 4), "fc.bias": torch.ones(3)}
    local = tmp_path / "model"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    save_file(state, local / "model.safetensors")
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server["endpoint"]}, skip_instance_cache=True)
    fs.put(str(local), "flyte/pretrained/model", recursive=True)
    fs.put(str(local / "model.safetensors"), "flyte/pretrained/weights.safetensors")

    for remote, local_source in (
        ("s3://flyte/pretrained/model", local),
        ("s3://flyte/pretrained/weights.safetensors", local / "model.safetensors"),
    ):
        found, expected = read_pretrained(remote), read_pretrained(str(local_source))
        assert found.sha256 == expected.sha256 and found.kind == expected.kind
        assert found.state_dict.keys() == state.keys()
        assert all(torch.equal(found.state_dict[key], state[key]) for key in state)

    with pytest.raises(ValueError) as raised:
        read_pretrained("s3://flyte/pretrained/missing.safetensors")
    assert "model.pretrained='s3://flyte/pretrained/missing.safetensors'" in str(raised.value)
    assert "nothing exists there" in str(raised.value)
