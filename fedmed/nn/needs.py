"""What building and training a task config's network imports, read from the config alone — this module imports
neither torch nor MONAI, so the job runner can ask before it starts the simulator's site template (which then
preloads MONAI once, for the server and every site, when the job needs it)."""

from __future__ import annotations

__all__ = ["MONAI_FREE_ARCHS", "uses_monai"]

# classifiers of fedmed's own that build and train with torch (and timm) alone: ResNet-9 and the EfficientNet-Lite
# releases (fedmed.nn.models.PRETRAINED_ARCHS); resnet18 and vit_small are MONAI's networks underneath
MONAI_FREE_ARCHS = ("resnet9", "efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2")


def uses_monai(task_config) -> bool:
    """Whether a site building and training this task config's network imports MONAI (~9 s on two cores): every
    segmentation and MAE task, a MONAI network or ``model.preprocessing`` (MONAI transforms), fedmed's ResNet-18 and
    ViT. Not fedmed's ResNet-9 or the EfficientNet-Lite releases; a user's class (``package.module:Class``) may or may
    not, and is not preloaded for."""
    from fedmed.core.schema import task_config as typed

    t = typed(task_config)
    if t.task != "classification" or t.model.preprocessing:
        return True
    return not (t.model.arch in MONAI_FREE_ARCHS or ":" in t.model.arch)
