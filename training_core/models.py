"""The image models: torchvision classifiers and a small CNN, adapted to the data's shape.

``build_model(name, num_classes=..., input_shape=(C, H, W))`` returns a randomly initialised
``nn.Module`` mapping ``N x C x H x W`` float inputs to ``N x num_classes`` logits, built by the function
:data:`training_core.registry.IMAGE_MODELS` names for ``name``.
"""

from __future__ import annotations

import torch
from torch import nn

from training_core.registry import IMAGE_MODELS, load

# Below this side length the ImageNet stem (7x7 stride-2 conv + max-pool) would shrink the image to
# nothing, so small inputs get a 3x3 stride-1 stem, as CIFAR ResNets do.
SMALL_INPUT_MAX_SIDE = 64


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head; no BatchNorm, so DDP and accumulation checks are exact."""

    def __init__(self, *, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(2 * width * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def resnet(name: str, *, in_channels: int, num_classes: int, side: int) -> nn.Module:
    """torchvision's ResNet of that ``name`` (``resnet18`` ... ``resnet152``)."""
    import torchvision

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    if side <= SMALL_INPUT_MAX_SIDE:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def vit_b_16(name: str, *, in_channels: int, num_classes: int, side: int) -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    # ViT-B/16 geometry; the patch shrinks for small images so there are at least 4x4 patches.
    patch = 16
    while patch > 1 and (side % patch or side // patch < 4):
        patch //= 2
    model = VisionTransformer(
        image_size=side,
        patch_size=patch,
        num_layers=12,
        num_heads=12,
        hidden_dim=768,
        mlp_dim=3072,
        num_classes=num_classes,
    )
    if in_channels != 3:
        model.conv_proj = nn.Conv2d(in_channels, 768, kernel_size=patch, stride=patch)
    return model


def small_cnn(name: str, *, in_channels: int, num_classes: int, side: int) -> nn.Module:
    return SmallCNN(in_channels=in_channels, num_classes=num_classes)


def build_model(name: str, *, num_classes: int, input_shape: tuple[int, int, int] | list[int]) -> nn.Module:
    if name not in IMAGE_MODELS:
        raise ValueError(f"model.name={name!r} is invalid: choose one of {', '.join(IMAGE_MODELS)}")
    channels, height, width = input_shape
    if height != width:
        raise ValueError(f"input_shape={tuple(input_shape)} is not square; set data.image_size to resize images")
    return load(IMAGE_MODELS[name])(name, in_channels=channels, num_classes=num_classes, side=height)
