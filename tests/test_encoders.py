import numpy as np
import pytest
import torch

from fedmed.encoders import EncoderError, build_encoder, extract_features


def test_random_mode_is_seeded_and_reported():
    a = build_encoder("random_cnn", seed=3, in_channels=1)
    b = build_encoder("random_cnn", seed=3, in_channels=1)
    x = torch.rand(5, 1, 16, 16)
    np.testing.assert_array_equal(extract_features(a, x), extract_features(b, x))
    assert "random init (seed=3)" in a.description


def test_local_weights_roundtrip_and_wrapped(tmp_path):
    src = build_encoder("random_cnn", seed=1, in_channels=1)
    f = tmp_path / "w.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in src.module.state_dict().items()}}, f)
    enc = build_encoder("random_cnn", weights=str(f), seed=99, in_channels=1)
    x = torch.rand(3, 1, 16, 16)
    np.testing.assert_allclose(extract_features(enc, x), extract_features(src, x))
    # the description leaves the site in signature replies: file name and content hash, never the folder
    import hashlib

    assert f"w.pt (sha256 {hashlib.sha256(f.read_bytes()).hexdigest()[:12]})" in enc.description
    assert str(tmp_path) not in enc.description


def test_mismatched_weights_named(tmp_path):
    f = tmp_path / "bad.pt"
    torch.save({"net.0.weight": torch.zeros(3, 3), "extra.bias": torch.zeros(1)}, f)
    with pytest.raises(EncoderError, match=r"bad.pt does not match the architecture: .*missing keys.*unexpected keys "
                                           r"\['extra.bias'\].*shape mismatches \['net.0.weight"):
        build_encoder("random_cnn", weights=str(f), in_channels=1)
    with pytest.raises(EncoderError, match="weights file .*none.pt not found"):
        build_encoder("random_cnn", weights=str(tmp_path / "none.pt"))
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(EncoderError, match="cannot read weights file"):
        build_encoder("random_cnn", weights=str(tmp_path / "junk.pt"))


def test_unknown_encoder_suggests():
    with pytest.raises(EncoderError, match="did you mean 'vit_tiny'"):
        build_encoder("vit-tiny")


@pytest.mark.parametrize("name, dim", [("vit_tiny", 192), ("ctranspath", 768)])
def test_foundation_architectures(name, dim):
    enc = build_encoder(name, image_size=64 if name == "vit_tiny" else 224)
    f = extract_features(enc, torch.rand(2, 1, 32, 32))
    assert f.shape == (2, dim) and np.isfinite(f).all()


def test_medicalnet_layout_loads_monai_state(tmp_path):
    enc = build_encoder("medicalnet_resnet18")
    state = {k[len("net."):]: v for k, v in enc.module.state_dict().items()}  # a bare MedicalNet-style checkpoint
    f = tmp_path / "resnet_18.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, f)
    loaded = build_encoder("medicalnet_resnet18", weights=str(f))
    x = torch.rand(1, 1, 16, 16, 16)
    with torch.no_grad():
        assert loaded.module(x).shape == (1, 512)
