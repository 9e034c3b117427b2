import pytest
import torch

from training_core.models import build_model
from training_core.registry import IMAGE_MODELS


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize("input_shape", [(1, 8, 8), (3, 32, 32)])
def test_every_registered_model_adapts_to_the_input_and_class_count(name, input_shape):
    torch.manual_seed(0)
    model = build_model(name, num_classes=7, input_shape=input_shape)
    with torch.no_grad():
        logits = model.eval()(torch.randn(2, *input_shape))
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()


def test_large_inputs_keep_the_imagenet_stem():
    model = build_model("resnet18", num_classes=5, input_shape=(3, 96, 96))
    assert model.conv1.kernel_size == (7, 7) and not isinstance(model.maxpool, torch.nn.Identity)
    small = build_model("resnet18", num_classes=5, input_shape=(3, 32, 32))
    assert small.conv1.kernel_size == (3, 3) and isinstance(small.maxpool, torch.nn.Identity)


def test_unknown_model_and_non_square_inputs_are_refused():
    with pytest.raises(ValueError, match="model.name='alexnet' is invalid: choose one of small_cnn"):
        build_model("alexnet", num_classes=2, input_shape=(3, 32, 32))
    with pytest.raises(ValueError, match="not square; set data.image_size"):
        build_model("resnet18", num_classes=2, input_shape=(3, 32, 16))
