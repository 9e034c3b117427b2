"""Hostile config input: every defect of issue 16's "Config input" fails as a ``ValueError`` that names the field
(or the file or environment variable), the value quoted bounded in size, and the fix."""

import pytest

from training_core.config import TrainingConfig

MAX_MESSAGE_CHARS = 4096


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as excinfo:
        call(*args, **kwargs)
    message = str(excinfo.value)
    assert len(message) < MAX_MESSAGE_CHARS, message[:500]
    return message


def test_a_value_of_a_billion_items_is_quoted_in_a_few_hundred_characters():
    # Ten levels of nine shared references: 9**10 strings, a repr() of some 24 GB.
    bomb = ["lol"] * 9
    for _ in range(9):
        bomb = [bomb] * 9
    message = _error(TrainingConfig.from_dict, {"model": {"name": bomb}})
    assert message.startswith("model.name=[[[[...], [...], ")
    assert message.endswith("is invalid: expected a string")
    assert len(message) < 300


def test_a_huge_string_or_integer_is_quoted_by_its_ends_or_its_size():
    message = _error(TrainingConfig.from_dict, {"model": {"name": "resnet" + "x" * 1_000_000}})
    assert message.startswith("model.name='resnetxxx") and "..." in message and "choose one of small_cnn" in message
    message = _error(TrainingConfig.from_dict, {"tracking": {"experiment_name": 10**5000}})
    assert message == "tracking.experiment_name=<int of about 5001 digits> is invalid: expected a string"


@pytest.mark.parametrize(
    ("raw", "where", "key"),
    [
        ({1: 2}, "config", "1 (int)"),
        ({"loop": {5: 1}}, "loop", "5 (int)"),
        ({"loop": {None: 1, "epochs": 2}}, "loop", "None (NoneType)"),
        ({"scaling": {(1, 2): 1}}, "scaling", "(1, 2) (tuple)"),
    ],
)
def test_a_key_that_is_not_a_string_is_named_with_its_section_and_the_valid_fields(raw, where, key):
    message = _error(TrainingConfig.from_dict, raw)
    assert message.startswith(f"{where} has unknown field(s) {key}: field names are strings; valid fields are ")


def test_many_unknown_fields_are_listed_up_to_ten_each_clipped():
    raw = {"loop": {f"field_{i:03d}_" + "y" * 1000: 1 for i in range(500)}}
    message = _error(TrainingConfig.from_dict, raw)
    assert message.startswith("loop has unknown field(s) field_000_yyy")
    assert "and 490 more: valid fields are batch_size, epochs," in message
