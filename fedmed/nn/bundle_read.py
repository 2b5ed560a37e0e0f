"""A MONAI bundle brought in (``model.bundle``): read as data — its network, weights, inputs and outputs, loss and
preprocessing — and checked against the experiment it is to serve, before any party runs it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fedmed.nn.bundle import BundleExportError

__all__ = ["check_bundle_fits", "read_bundle"]


# MONAI's id separators: "::" (and the older "#")
_ID_SEP = ("::", "#")


# a bundle's preprocessing steps that fedmed's own reading does (loading, channels first, types, resizing to the
# federation's size, orientation, spacing, the brain crop): not applied a second time
_READ_BY_FEDMED = ("LoadImage", "EnsureChannelFirst", "AddChannel", "AsChannelFirst", "EnsureType", "ToTensor",
                   "CastToType", "Resize", "Orientation", "Spacing", "CropForeground", "Identity", "ToDevice",
                   "SqueezeDim", "RepeatChannel")
# arguments of a dictionary transform that say which keys, not what it does to the image
_KEY_ARGS = ("keys", "allow_missing_keys", "dtype", "meta_keys", "meta_key_postfix")


# a bundle's loss (its train.json "loss") -> fedmed's segmentation loss (train.seg.loss); classification trains with
# cross-entropy
_SEG_LOSSES = {"DiceFocalLoss": "dice_focal", "DiceLoss": "dice", "DiceCELoss": "dice_bce"}
_CLS_LOSSES = ("CrossEntropyLoss",)


def read_bundle(path) -> dict:
    """What fedmed takes from a MONAI bundle folder (``model.bundle``): its network (``network_def`` of
    ``configs/inference.json``, else ``configs/train.json``: a network of ``monai.networks.nets`` with its arguments),
    its weights (``models/model.pt``, when there: a state dict), the inputs and outputs its ``configs/metadata.json``
    declares, and the loss of its ``train.json``.

    A bundle is read as **data**: its files are parsed as JSON (or YAML without tags) and nothing in them is ever
    evaluated. A value fedmed reads may be a plain value or an ``@id`` reference to one; a ``$`` expression, a ``%``
    macro or a reference that leads to one is refused in one line naming the key, before anything runs. Every file
    fedmed reads is a regular file inside the bundle folder (no symbolic link), and ``models/model.pt`` must load as
    a state dict (``weights_only``) before it is shipped to any party.

    Returns ``{"arch", "args", "init_weights", "inputs", "outputs", "loss", "name", "preprocessing"}``.

    Raises:
        BundleExportError: one line naming the bundle and what does not fit (no configs, a network that is not a
            MONAI network fedmed can name, an expression or macro, a file outside the bundle, weights that are no
            state dict, a loss fedmed cannot drive, anything else that does not read).
    """
    try:
        return _read_bundle(path)
    except BundleExportError:
        raise
    except Exception as e:  # a bundle of an unexpected shape (a section that is not a mapping, ...): one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise BundleExportError(f"model.bundle {Path(path).name}: cannot be read as a MONAI bundle "
                                f"({type(e).__name__}: {first:.120})") from None


def _read_bundle(path) -> dict:
    root = Path(path)
    where = f"model.bundle {root.name}"
    if not root.is_dir():
        raise BundleExportError(f"model.bundle {root.name}: no such bundle folder")
    configs = [root / "configs" / f for f in ("inference.json", "train.json", "inference.yaml", "train.yaml")]
    found = [c for c in configs if c.is_file() or c.is_symlink()]
    meta_file = root / "configs" / "metadata.json"
    if not found or not (meta_file.is_file() or meta_file.is_symlink()):
        if (root / "configs").is_symlink():
            raise BundleExportError(f"{where}: configs is a symbolic link; a bundle's files must be regular files "
                                    f"inside its folder")
        raise BundleExportError(f"{where}: a MONAI bundle has configs/metadata.json and configs/inference.json (or "
                                f"train.json); found {sorted(p.name for p in (root / 'configs').glob('*'))}"
                                if (root / "configs").is_dir() else f"{where}: no configs/ folder (not a MONAI bundle)")
    meta = _bundle_data(root, meta_file, where)
    if not isinstance(meta, dict):
        raise BundleExportError(f"{where}: configs/metadata.json is not a JSON object")
    parsers = []
    for c in found:
        cfg = _bundle_data(root, c, where)
        if not isinstance(cfg, dict):
            raise BundleExportError(f"{where}: configs/{c.name} is not a mapping of ids to values")
        parsers.append((c.name, cfg))
    file, cfg = next(((f, p) for f, p in parsers if "network_def" in p), (None, None))
    if cfg is None:
        raise BundleExportError(f"{where}: no network_def in {', '.join(c.name for c in found)}")
    own = meta.get("fedmed") if isinstance(meta.get("fedmed"), dict) else {}
    if own.get("network_def") == "torchscript" and isinstance(own.get("model"), dict):
        raise BundleExportError(_own_export_line(root, where, own["model"]))
    net_cfg = _plain(cfg, cfg["network_def"], "network_def", f"{where} ({file})")
    target = net_cfg.get("_target_") if isinstance(net_cfg, dict) else None
    import monai.networks.nets as nets

    name = str(target or "").split(".")[-1]
    if not target or not (str(target).startswith("monai.networks.nets.") or "." not in str(target)) \
            or not hasattr(nets, name):
        raise BundleExportError(f"{where}: its network_def ({target or net_cfg!r:.80}) is not a network of "
                                f"monai.networks.nets, which fedmed's sites build by name (a bundle's own network "
                                f"code is not run)")
    args = {k: v for k, v in net_cfg.items() if not k.startswith("_")}
    weights = root / "models" / "model.pt"
    init = None
    if os.path.lexists(weights) or (root / "models").is_symlink():  # there in any form: it must be the weights
        _inside(root, weights, where)
        _check_state_dict(weights, where)
        init = str(weights)
    loss = None
    train = dict(parsers).get("train.json")
    if train is not None and isinstance(train.get("loss"), (dict, str)):
        lc = _plain(train, train["loss"], "loss", f"{where} (train.json)")
        if isinstance(lc, dict):
            loss = str(lc.get("_target_", "")).split(".")[-1]
    fmt = meta.get("network_data_format") or {}
    if not isinstance(fmt, dict) or not all(isinstance(fmt.get(k, {}), dict) for k in ("inputs", "outputs")):
        raise BundleExportError(f"{where}: configs/metadata.json's network_data_format should map inputs and outputs "
                                f"to their descriptions")
    steps = _preprocessing(parsers, where)
    return {"name": str(meta.get("name") or root.name), "arch": name, "args": args,
            "init_weights": init, "inputs": fmt.get("inputs") or {}, "outputs": fmt.get("outputs") or {},
            "loss": loss, "preprocessing": steps}


def _own_export_line(root: Path, where: str, model: dict) -> str:
    """The refusal of a bundle fedmed itself exported with its network as TorchScript (fedmed's own networks, which no
    MONAI ``network_def`` names), with the settings that train from its weights instead."""
    from fedmed.core.schema import ModelSection

    default = ModelSection.model_validate({"arch": model.get("arch", "resnet9")}).model_dump()
    keys = [k for k, v in model.items() if k not in ("init_weights", "bundle", "preprocessing") and
            (k == "arch" or v != default.get(k))]
    sets = " ".join(f"--set model.{k}={json.dumps(model[k]) if not isinstance(model[k], str) else model[k]}"
                    for k in keys)
    return (f"{where}: a bundle fedmed exported, its network fedmed's own as TorchScript, which a site does not "
            f"train from; start from its weights instead: --set model.bundle=null {sets} "
            f"--set model.init_weights={root / 'models' / 'model.pt'}")


def _inside(root: Path, f: Path, where: str) -> None:
    """``f`` is a regular file of the bundle folder: no symbolic link on its way, nothing outside ``root``."""
    rel = f.relative_to(root)
    p = root
    for part in rel.parts:
        p = p / part
        if p.is_symlink():
            raise BundleExportError(f"{where}: {rel.as_posix()} is a symbolic link; a bundle's files must be regular "
                                    f"files inside its folder")
    if not f.is_file():
        raise BundleExportError(f"{where}: {rel.as_posix()} is not a regular file")


def _bundle_data(root: Path, f: Path, where: str):
    """A bundle's config file as plain data: JSON, or YAML without tags (nothing constructed, nothing evaluated)."""
    _inside(root, f, where)
    text = f.read_text()
    try:
        if f.suffix == ".json":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise BundleExportError(f"{where}: configs/{f.name} does not parse ({type(e).__name__}: {first:.120})") \
            from None


def _check_state_dict(f: Path, where: str) -> None:
    """``models/model.pt`` loads as a state dict (string keys, tensors; ``weights_only``: no pickle runs)."""
    from fedmed.nn.encoders import EncoderError, check_weights_file

    try:
        check_weights_file(f, where, shown="models/model.pt")
    except EncoderError as e:
        raise BundleExportError(str(e)) from None


def _id_parts(ref: str) -> list[str]:
    return [p for p in ref.replace("#", "::").split("::")]


def _plain(cfg: dict, value, key: str, where: str, *, _seen: tuple = ()):
    """``value`` (at ``key`` of the bundle config ``cfg``) as plain data: ``@id`` references to plain values
    resolved, anything MONAI would evaluate refused (a component's ``_target_`` stays a name; nothing is built)."""
    if isinstance(value, str):
        if value.startswith("$"):
            raise BundleExportError(f"{where}: {key} is a Python expression ({value:.60}); fedmed reads a bundle as "
                                    f"data and evaluates nothing: give a plain value")
        if value.startswith("%"):
            raise BundleExportError(f"{where}: {key} is a macro ({value:.60}); fedmed reads a bundle as data and "
                                    f"expands no macro: give a plain value")
        if value.startswith("@"):
            ref = value[1:]
            if not ref or ref.startswith(_ID_SEP):
                raise BundleExportError(f"{where}: {key} is a relative reference ({value:.60}); fedmed resolves "
                                        f"only whole-id references (@id) to plain values")
            if ref in _seen:
                raise BundleExportError(f"{where}: {key} refers to itself through @{ref}")
            node = cfg
            for part in _id_parts(ref):
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    raise BundleExportError(f"{where}: {key} refers to @{ref:.60}, which the bundle does not define")
            return _plain(cfg, node, f"{key} (@{ref})", where, _seen=_seen + (ref,))
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise BundleExportError(f"{where}: {key} has a key {k!r} that is not a string")
            out[k] = _plain(cfg, v, f"{key}#{k}", where, _seen=_seen)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(cfg, v, f"{key}#{i}", where, _seen=_seen)
                for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    raise BundleExportError(f"{where}: {key} is a {type(value).__name__}, not a plain value")


def _preprocessing(parsers: list, where: str) -> list | None:
    """``model.preprocessing`` from the bundle's ``preprocessing`` (``inference.json``; else ``validate#preprocessing``
    of ``train.json``; ``parsers``: ``[(file name, its data)]``): its intensity transforms
    (``fedmed.core.schema.INPUT_TRANSFORMS``) on the image, with their arguments as plain values (:func:`_plain`);
    the steps fedmed's own reading does (:data:`_READ_BY_FEDMED`) and steps on other keys left out. None: no
    preprocessing."""
    from fedmed.core.schema import INPUT_TRANSFORMS

    for file, p in parsers:
        w = f"{where} ({file})"
        for key in ("preprocessing", "validate#preprocessing"):
            node = p
            for part in _id_parts(key):
                node = node.get(part) if isinstance(node, dict) else None
                if isinstance(node, str):  # a reference (or an expression: refused, naming the key)
                    node = _plain(p, node, key, w)
            if isinstance(node, dict) and "transforms" in node:
                transforms = node["transforms"]
                if isinstance(transforms, str):
                    transforms = _plain(p, transforms, f"{key}#transforms", w)
                if not isinstance(transforms, list):
                    raise BundleExportError(f"{w}: {key}#transforms should be a list of transforms, got "
                                            f"{transforms!r:.60}")
                break
        else:
            continue
        steps = []
        for i, t in enumerate(transforms):
            at = f"{key}#transforms#{i}"
            if isinstance(t, str) and t.startswith("@"):
                t = _plain(p, t, at, w)
            target = _plain(p, t.get("_target_"), f"{at}#_target_", w) if isinstance(t, dict) else None
            name = str(target or t).split(".")[-1]
            base = name[:-1] if name.endswith("d") and name[:-1] in INPUT_TRANSFORMS + _READ_BY_FEDMED else name
            if base in _READ_BY_FEDMED:
                continue
            if base not in INPUT_TRANSFORMS:
                raise BundleExportError(
                    f"{where}: its preprocessing step {name:.60} ({file}) is not one fedmed's sites apply: they read, "
                    f"resize and crop images themselves and apply the intensity transforms {', '.join(INPUT_TRANSFORMS)}")
            if name != base:  # a dictionary transform: only the image's counts (not a label's, a mask's)
                keys = _plain(p, t.get("keys"), f"{at}#keys", w)
                if "image" not in ([keys] if isinstance(keys, str) else list(keys or [])):
                    continue
            args = {}
            for k in t:
                if k.startswith("_") or k in _KEY_ARGS:
                    continue
                v = _plain(p, t[k], f"{at}#{k}", w)
                if isinstance(v, dict):
                    raise BundleExportError(f"{where}: its preprocessing step {name} has argument {k} = {v!r:.60}, "
                                            f"not a plain value the sites can rebuild it from")
                args[k] = v
            steps.append({"name": base, "args": args})
        return steps
    return None


def check_bundle_fits(b: dict, *, task: str, channels: int, size, n_out: int | None, where: str) -> str | None:
    """The first thing of a bundle (:func:`read_bundle`) that does not fit the federation's data, as one line; None when
    it fits. ``size``: the image size (2D) or ROI (3D) fedmed trains at; ``n_out``: classes, or the segmentation
    outputs (None: not known yet)."""
    def count(d: dict, side: str):  # a count metadata.json declares: a whole number, never an expression
        v = d.get("num_channels")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise BundleExportError(f"{where}: configs/metadata.json's network_data_format.{side}.num_channels should "
                                    f"be a positive whole number, got {v!r:.60}")
        return v

    inputs = list(b["inputs"].items())
    outputs = list(b["outputs"].items())
    for side, items in (("inputs", inputs), ("outputs", outputs)):
        for name, d in items:
            if not isinstance(d, dict):
                raise BundleExportError(f"{where}: configs/metadata.json's network_data_format.{side}.{name} should "
                                        f"describe it (a mapping), got {d!r:.60}")
            count(d, f"{side}.{name}")
    inputs, outputs = [d for _, d in inputs], [d for _, d in outputs]
    if inputs:
        i = inputs[0]
        if i.get("num_channels") is not None and int(i["num_channels"]) != int(channels):
            return (f"{where}: its input has {i['num_channels']} channel(s) (metadata.json), the federation's images "
                    f"{channels}")
        shape = i.get("spatial_shape")
        if shape and all(isinstance(v, int) for v in shape) and list(shape) != list(size):
            return (f"{where}: its input is {'x'.join(map(str, shape))} (metadata.json), the federation trains at "
                    f"{'x'.join(map(str, size))}")
    if outputs and n_out is not None:
        o = outputs[0]
        if task == "classification" and o.get("format") not in (None, "classes"):
            return f"{where}: its output is '{o.get('format')}', not classes: a bundle of another task"
        if task == "segmentation" and o.get("format") == "classes":
            return f"{where}: its output is classes: a classification bundle, not a segmentation one"
        if o.get("num_channels") is not None and int(o["num_channels"]) != int(n_out):
            what = "classes" if task == "classification" else "output channels"
            return f"{where}: its output has {o['num_channels']} channel(s) (metadata.json), the federation {n_out} {what}"
    loss = b.get("loss")
    if loss:
        if task == "classification" and loss not in _CLS_LOSSES:
            return f"{where}: its loss {loss} is not one fedmed trains a classifier with (cross-entropy)"
        if task == "segmentation" and loss not in _SEG_LOSSES:
            return (f"{where}: its loss {loss} is not one fedmed drives (DiceLoss, DiceFocalLoss, DiceCELoss: "
                    f"train.seg.loss)")
    return None
