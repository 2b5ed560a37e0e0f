"""Networks and their training: the networks a site trains (models), frozen foundation-model encoders (encoders), local classifier training (train), Fed-MAE's ViT (mae), the 3D U-Net's training, inference and metrics (seg), saved models and `fedmed predict` (predict).

Every name below is importable from ``fedmed.nn`` (loaded on first use)."""

from fedmed.core.faces import lazy_face

_PUBLIC = {
    "ArchError": "models",
    "BUILTIN_ARCHS": "models",
    "DeviceImages": "resident",
    "ENCODERS": "encoders",
    "Encoder": "encoders",
    "EncoderError": "encoders",
    "EncoderSpec": "encoders",
    "ModelFileError": "predict",
    "ResNet9": "models",
    "VIT_SMALL": "mae",
    "ViTClassifier": "mae",
    "augment_batch": "train",
    "build_encoder": "encoders",
    "build_model": "models",
    "check_arch": "models",
    "check_weights": "encoders",
    "dice_scores": "seg",
    "encoder_state": "mae",
    "evaluate": "train",
    "extract_features": "encoders",
    "get_params": "train",
    "import_timm": "encoders",
    "keep_largest_component": "seg",
    "layerwise_param_groups": "mae",
    "load_init_weights": "models",
    "load_model": "predict",
    "load_weights": "encoders",
    "mae_loss": "mae",
    "mae_model": "mae",
    "make_optimizer": "train",
    "model_from_config": "models",
    "network": "models",
    "normalize_images": "encoders",
    "patchify": "mae",
    "predict_images": "predict",
    "predict_masks": "seg",
    "predict_volume": "predict",
    "preprocess_volume": "encoders",
    "resolve_arch": "models",
    "save_model": "predict",
    "scheduled_lr": "mae",
    "score_masks": "seg",
    "seg_loss": "seg",
    "seg_metrics": "seg",
    "seg_model": "seg",
    "seg_model_from_config": "models",
    "set_params": "train",
    "site_embeddings": "encoders",
    "train_local": "train",
    "train_mae_local": "mae",
    "train_seg_local": "seg",
    "user_code_files": "models",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_face(__name__, _PUBLIC)
