"""The networks a site trains: fedmed's own (ResNet-9, MONAI's ResNet-18, a small ViT, a 3D U-Net), any MONAI network
by name, or the user's own class.

``model.arch`` (:func:`model_from_config`, :func:`seg_model_from_config`):

* ``resnet9`` | ``resnet18`` | ``vit_small`` — fedmed's 2D classifiers (for segmentation: fedmed's 3D U-Net with
  ``model.channels``);
* ``efficientnet_lite0`` | ``1`` | ``2`` — EfficientNet-Lite (:class:`EfficientNetLiteClassifier`), which
  ``model.init_weights`` may start from the ImageNet release file as shipped (transfer learning);
* a class of ``monai.networks.nets`` by name (``DenseNet121``, ``EfficientNetBN``, ``SegResNet``, ``SwinUNETR``,
  ``DynUNet``, ...) with ``model.args``; fedmed fills what the task fixes when the constructor takes it —
  ``spatial_dims`` (2 or 3), the input channels (``in_channels`` / ``n_input_channels`` / ``in_chans``) and the
  outputs (``out_channels`` / ``num_classes``: the classes, or 3 regions WT/TC/ET);
* ``package.module:Class`` — the user's own ``nn.Module`` (importable where the job is built; the job carries the
  module's source to the sites, :func:`user_code_files`).

``model.init_weights`` starts the network from a local state-dict file (:func:`load_init_weights`: wrappers and
``module.`` prefixes unwrapped, otherwise strict). **Nothing is downloaded and nothing is read from a path a config
names**: a constructor's ``pretrained`` is set to ``False`` when the config leaves it out (MONAI's ``EfficientNetBN``
defaults to ``True``), a true ``pretrained`` and any argument that is a URL or a path are refused, and the network is
built with every download function of torch and MONAI refused (:func:`no_downloads`).

Which user modules may be imported is the caller's to say (``modules``: the site's policy,
:class:`fedmed.core.policy.SitePolicy`; ``("*",)`` any): a module is never imported before that check.
Every problem is an :class:`ArchError` of one line naming the arch, the argument or the file.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import contextlib
import re

import torch
from torch import nn

from fedmed.core.jobfiles import USER_CODE_DIR  # noqa: F401  (re-exported: where a job carries a user's class)
from fedmed.core.schema import ModelSection

__all__ = ["ArchError", "BUILTIN_ARCHS", "EfficientNetLiteClassifier", "PRETRAINED_ARCHS", "ResNet9", "build_model", "check_arch",
           "load_init_weights", "model_from_config", "network", "resolve_arch", "seg_model_from_config",
           "user_code_files"]

BUILTIN_ARCHS = ("resnet9", "resnet18", "vit_small")


class ArchError(FedmedError, ValueError):
    """A network that cannot be built: unknown arch, a bad argument, a weights file that does not fit."""


def _norm(kind: str, ch: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(ch)
    groups = 8
    while ch % groups:
        groups //= 2
    return nn.GroupNorm(groups, ch)


def _conv_bn(cin, cout, pool=False, norm="batch"):
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), _norm(norm, cout), nn.ReLU(inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    def __init__(self, ch, norm="batch"):
        super().__init__()
        self.body = nn.Sequential(_conv_bn(ch, ch, norm=norm), _conv_bn(ch, ch, norm=norm))

    def forward(self, x):
        return x + self.body(x)


class ResNet9(nn.Module):
    """The DAWNBench ResNet-9 (prep, 3 pooled stages, 2 residual blocks) with width ``w``.

    Channels are ``w, 2w, 4w, 8w`` (``w = 64`` is the original; fedmed defaults to 16 for CPU).
    ``norm="group"`` replaces BatchNorm by GroupNorm (up to 8 groups): batch statistics of FL's tiny,
    label-skewed local batches are noisy and BatchNorm's running statistics average badly across
    sites (Hsieh et al. 2020). ``forward_features`` returns the pooled ``8w``-dimensional latent
    (Flux's final hidden layer).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16, norm: str = "batch"):
        super().__init__()
        if norm not in ("batch", "group"):
            raise ValueError(f"norm should be 'batch' or 'group', got {norm!r}.")
        w = width
        self.features = nn.Sequential(
            _conv_bn(in_channels, w, norm=norm), _conv_bn(w, 2 * w, pool=True, norm=norm), _Residual(2 * w, norm),
            _conv_bn(2 * w, 4 * w, pool=True, norm=norm), _conv_bn(4 * w, 8 * w, pool=True, norm=norm),
            _Residual(8 * w, norm), nn.AdaptiveMaxPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8 * w, num_classes)

    def forward_features(self, x):
        return self.features(x)

    def forward(self, x):
        return self.fc(self.features(x))


class EfficientNetLiteClassifier(nn.Module):
    """EfficientNet-Lite0 (timm ``tf_efficientnet_lite0``, the encoder :mod:`fedmed.nn.encoders` names
    ``efficientnet_lite0``) as a site's classifier. fedmed feeds every classifier ``(x - 0.5) / 0.5`` of its [0, 1]
    images (:mod:`fedmed.nn.train`), which is the release's own preprocessing (TF's ``(x - 127) / 128``), so the network
    takes its input as it comes (until this was seen the input was scaled a second time, to [-3, 1]: the ImageNet
    features were fed off their range). ``model.init_weights`` may be the released ImageNet file as shipped
    (:func:`load_init_weights` converts its ``efficientnet_pytorch`` names and leaves the new head as initialised):
    transfer learning from ImageNet."""

    def __init__(self, in_channels: int, num_classes: int, variant: int = 0):
        super().__init__()
        if in_channels != 3:
            raise ArchError(f"model.arch efficientnet_lite{variant} takes RGB images (its release is ImageNet's): set "
                            f"dataset.channels: 3 (got {in_channels})")
        from fedmed.nn.encoders import import_timm

        self.net = import_timm().create_model(f"tf_efficientnet_lite{variant}", pretrained=False,
                                              num_classes=num_classes)

    def forward_features(self, x):
        return self.net.forward_head(self.net.forward_features(x), pre_logits=True)  # x: already (x - 0.5) / 0.5

    def forward(self, x):
        return self.net.classifier(self.forward_features(x))


PRETRAINED_ARCHS = {  # fedmed's networks with a released file
    f"efficientnet_lite{n}": (lambda c, k, n=n: EfficientNetLiteClassifier(c, k, variant=n)) for n in (0, 1, 2)}


class _MonaiResNet18(nn.Module):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        from monai.networks.nets import resnet18

        self.net = resnet18(spatial_dims=2, n_input_channels=in_channels, num_classes=num_classes)

    def forward_features(self, x):
        n = self.net
        x = n.maxpool(n.act(n.bn1(n.conv1(x))))
        x = n.layer4(n.layer3(n.layer2(n.layer1(x))))
        return torch.flatten(n.avgpool(x), 1)

    def forward(self, x):
        return self.net.fc(self.forward_features(x))


def build_model(arch: str, in_channels: int, num_classes: int, *, width: int = 16, seed: int = 0,
                norm: str = "batch") -> nn.Module:
    """A freshly initialised classifier; the same seed gives the same weights everywhere."""
    if in_channels not in (1, 3):
        raise ValueError(f"in_channels should be 1 or 3, got {in_channels}.")
    if num_classes < 2:
        raise ValueError(f"num_classes should be >= 2, got {num_classes}.")
    if arch not in ("resnet9", "resnet18", "vit_small"):
        raise ValueError(f"arch should be 'resnet9', 'resnet18' or 'vit_small', got {arch!r}.")
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG state
        torch.manual_seed(seed)
        if arch == "resnet9":
            return ResNet9(in_channels, num_classes, width, norm)
        if arch == "vit_small":
            from fedmed.nn.mae import ViTClassifier

            return ViTClassifier(in_channels, num_classes)
        return _MonaiResNet18(in_channels, num_classes)


def _monai_names() -> list[str]:
    import monai.networks.nets as nets

    return sorted(n for n in dir(nets) if isinstance(getattr(nets, n), type) and issubclass(getattr(nets, n), nn.Module))


from fedmed.core.plugins import module_allowed  # noqa: E402  (one rule for networks and plugins)


def resolve_arch(arch: str, modules=()) -> type:
    """The network class ``arch`` names: a MONAI network (``DenseNet121``) or ``package.module:Class`` — the latter only
    when its module is among ``modules`` (checked before anything is imported)."""
    import importlib

    if ":" in arch:
        mod, _, name = arch.partition(":")
        if not module_allowed(mod, modules):
            raise ArchError(f"model.arch {arch!r}: module {mod!r} may not be imported here (this site's policy lists "
                            f"the user modules a job may name: fedmed_policy.json 'modules')")
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            raise ArchError(f"model.arch {arch!r}: cannot import module {mod!r} ({e}); it must be importable where "
                            f"the job is built (PYTHONPATH)") from None
        cls = getattr(module, name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ArchError(f"model.arch {arch!r}: {mod} has no torch.nn.Module class {name!r}")
        return cls
    import monai.networks.nets as nets

    cls = getattr(nets, arch, None)
    if isinstance(cls, type) and issubclass(cls, nn.Module):
        return cls
    import difflib

    hint = difflib.get_close_matches(arch, _monai_names() + list(BUILTIN_ARCHS) + list(PRETRAINED_ARCHS), n=1)
    raise ArchError(f"model.arch {arch!r} is not fedmed's ({', '.join(BUILTIN_ARCHS)}), a network of "
                    f"monai.networks.nets, or package.module:Class" + (f"; did you mean {hint[0]!r}?" if hint else ""))


_IN = ("in_channels", "n_input_channels", "in_chans")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|^www\\.", re.I)


def _path_like(v) -> bool:
    return isinstance(v, str) and (bool(_URL.search(v)) or "/" in v or "\\" in v or v.startswith("~"))


def _refuse_reaching_out(arch: str, args: dict, where: str = "model.args") -> None:
    """No argument of a network may be a URL or a path (a download, or a file of the site's host read)."""
    for k, v in args.items():
        if isinstance(v, dict) and "_target_" in v:
            raise ArchError(f"{where}.{k}: a component to build ({{'_target_': {str(v['_target_'])!r:.60}}}, a MONAI "
                            f"bundle's form); a site builds nothing a job's arguments name: give {arch} a plain value "
                            f"(a number, a name, a list)")
        for x in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, (dict, list, tuple)):
                _refuse_reaching_out(arch, {k: x}, where)
            elif _path_like(x):
                raise ArchError(f"{where}.{k}: {arch} would be given a URL or a path; a site downloads nothing and reads "
                                f"no file a job names (start the network from model.init_weights, a file the "
                                f"coordinator ships)")


@contextlib.contextmanager
def no_downloads():
    """While building a network: every download function of torch.hub, MONAI and urllib raises instead of
    reaching the network (a constructor that tries anyway fails in one line)."""
    import urllib.request

    import torch.hub

    def refuse(*a, **k):
        raise ArchError("a network constructor tried to download (model.args); nothing is downloaded at a site")

    targets = [(torch.hub, n) for n in ("load_state_dict_from_url", "download_url_to_file", "load")]
    targets.append((urllib.request, "urlopen"))
    try:
        import monai.apps.utils as mau

        targets.append((mau, "download_url"))
    except ImportError:
        pass
    saved = [(mod, n, getattr(mod, n)) for mod, n in targets if hasattr(mod, n)]
    for mod, n, _ in saved:
        setattr(mod, n, refuse)
    try:
        yield
    finally:
        for mod, n, f in saved:
            setattr(mod, n, f)
_OUT = ("out_channels", "num_classes", "n_classes")


def network(arch: str, args: dict | None, *, spatial_dims: int, in_channels: int, out_channels: int,
            seed: int = 0, modules=()) -> nn.Module:
    """Build ``arch`` (see the module notes) with ``args``, seeded; what the task fixes is filled in; ``modules``: the
    user modules that may be imported (:func:`resolve_arch`)."""
    import inspect

    args = dict(args or {})
    _refuse_reaching_out(arch, args)
    if args.get("pretrained"):
        raise ArchError(f"model.args.pretrained: {arch} would download weights, and nothing is downloaded here; give "
                        f"a local file as model.init_weights")
    cls = resolve_arch(arch, modules)
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    kw = dict(args)
    if "spatial_dims" in params and "spatial_dims" not in kw:
        kw["spatial_dims"] = spatial_dims
    for names, value in ((_IN, in_channels), (_OUT, out_channels)):
        name = next((n for n in names if n in params), None)
        if name is not None and not any(n in kw for n in names):
            kw[name] = value
    if "pretrained" in params and "pretrained" not in kw:
        kw["pretrained"] = False  # e.g. MONAI's EfficientNetBN defaults to True (a download)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(k for k in args if params and k not in params and not var_kw)
    if unknown:
        raise ArchError(f"model.args: {arch} takes no argument(s) {unknown} (it takes "
                        f"{', '.join(n for n in params if n not in ('self', 'args', 'kwargs'))})")
    with torch.random.fork_rng(devices=[]), no_downloads():
        torch.manual_seed(seed)
        try:
            return cls(**kw)
        except ArchError:
            raise
        except Exception as e:  # a constructor's own check of its arguments
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ArchError(f"model.arch {arch} with model.args {args}: {type(e).__name__}: {msg}") from None


def _load_init(model: nn.Module, m: ModelSection, root=None) -> nn.Module:
    """Start ``model`` from ``model.init_weights``. ``root``: the job's files at the server (``fedmed_files``): the
    path is then one of the job's own files — relative, inside ``root``, a regular file — and any other path (absolute,
    ``..`` out of it, a symbolic link) is refused with the same line whether or not such a file exists."""
    path = m.init_weights
    if path:
        from pathlib import Path

        p = Path(path)
        if root is not None:
            p = _job_file(Path(root), path)
        load_init_weights(model, p)
    return model


def _job_file(root, path: str):
    """``path`` as a file the job carries (inside ``root``), else :class:`ArchError` — one line for every refusal, so
    that the answer says nothing of the server's own files."""
    from pathlib import Path, PurePosixPath

    rel = PurePosixPath(str(path).replace("\\", "/"))
    ok = not rel.is_absolute() and ".." not in rel.parts and rel.parts
    p = Path(root).joinpath(*rel.parts) if ok else None
    if ok:
        q = Path(root)
        for part in rel.parts:  # no symbolic link on the way
            q = q / part
            if q.is_symlink():
                ok = False
                break
    if not ok or not p.is_file() or not p.resolve().is_relative_to(Path(root).resolve()):
        raise ArchError(f"model.init_weights: {rel.name or path!s:.80} is not a file this job carries (the server "
                        f"starts the model only from the job's own files, {Path(root).name}/)")
    return p


def load_init_weights(model: nn.Module, path) -> None:
    """Start ``model`` from a local weights file (a state dict, possibly wrapped or with ``module.`` prefixes)."""
    from pathlib import Path

    from fedmed.nn.encoders import EncoderError, _read, _unwrap

    p = Path(path)
    try:
        state = _unwrap(_read(p, "model.init_weights"))
    except EncoderError as e:
        raise ArchError(str(e)) from None
    own = model.state_dict()
    new_head: set = set()
    if isinstance(model, EfficientNetLiteClassifier) and any(k.startswith("_conv_stem.") for k in state):
        from fedmed.nn.releases import effnet_lite_key

        stages = [len(b) for b in model.net.blocks]  # the release as shipped: its names as timm's, its head dropped
        head = sorted(k for k in state if k.startswith("_fc."))
        state = {"net." + effnet_lite_key(k, stages): v for k, v in state.items() if not k.startswith("_fc.")}
        state.update({k: v for k, v in own.items() if k.startswith("net.classifier.")})
        new_head = {k for k in own if k.startswith("net.classifier.")}
        print(f"[fedmed] model.init_weights: {p.name} is the EfficientNet-Lite release; its ImageNet head {head} "
              f"dropped; the classifier for the job's classes starts as train.head_init says (zero under the "
              f"transfer recipe, fedmed.nn.recipe)", flush=True)
    from fedmed.nn.recipe import head_keys

    head = set(head_keys(model))
    shapes = [k for k in sorted(set(own) & set(state)) if tuple(own[k].shape) != tuple(state[k].shape)]
    if shapes and set(shapes) <= head and not (set(own) - set(state)) - head:  # a head for other classes: new one
        print(f"[fedmed] model.init_weights: {p.name}'s classifier {sorted(shapes)} is for another number of classes: "
              f"dropped; the job's starts as train.head_init says", flush=True)
        state = {k: v for k, v in state.items() if k not in head}
        state.update({k: v for k, v in own.items() if k in head})
        new_head, shapes = set(head), []
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected or shapes:
        raise ArchError(f"model.init_weights: {p.name} does not fit the network: {len(missing)} missing "
                        f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}, {len(shapes)} mis-shaped "
                        f"{shapes[:3]}")
    model.load_state_dict(state)
    model.fedmed_new_head = sorted(new_head)  # the head keys the file did not give (fedmed.nn.recipe.prepared)


def model_from_config(model_cfg: dict, in_channels: int, num_classes: int, seed: int = 0, *, init_root=None,
                      modules=()) -> nn.Module:
    """The 2D classifier of a config's ``model`` section (a dict): fedmed's (:func:`build_model`), a MONAI network or
    the user's class (its module among ``modules``); started from ``model.init_weights`` when set (relative to
    ``init_root``)."""
    m = ModelSection.model_validate(dict(model_cfg))  # what the section leaves out: the schema's defaults
    if m.arch in BUILTIN_ARCHS:
        model = build_model(m.arch, in_channels, num_classes, width=m.width, seed=seed, norm=m.norm)
    elif m.arch in PRETRAINED_ARCHS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = PRETRAINED_ARCHS[m.arch](in_channels, num_classes)
    else:
        model = network(m.arch, m.args, spatial_dims=2, in_channels=in_channels, out_channels=num_classes, seed=seed,
                        modules=modules)
    from fedmed.nn.preprocessing import with_preprocessing

    return with_preprocessing(_load_init(model, m, init_root), m.preprocessing, scaled=True)


def seg_model_from_config(model_cfg: dict, in_channels: int, seed: int = 0, *, init_root=None,
                          modules=(), spatial_dims: int = 3) -> nn.Module:
    """The segmentation network: 3D with 3 sigmoid outputs (WT, TC, ET), or 2D (``spatial_dims=2``) with one (the
    lesion); fedmed's U-Net (``model.channels``) unless ``model.arch`` names a MONAI network or a user class."""
    m = ModelSection.model_validate(dict(model_cfg))  # what the section leaves out: the schema's defaults
    out = 3 if spatial_dims == 3 else 1
    if m.arch in BUILTIN_ARCHS or m.arch == "unet":
        if spatial_dims == 2:
            from fedmed.nn.seg2d import seg2d_model

            model = seg2d_model(in_channels, channels=m.channels, seed=seed)
        else:
            from fedmed.nn.seg import seg_model

            model = seg_model(in_channels, channels=m.channels, seed=seed)
    else:
        model = network(m.arch, m.args, spatial_dims=spatial_dims, in_channels=in_channels, out_channels=out,
                        seed=seed, modules=modules)
    from fedmed.nn.preprocessing import with_preprocessing

    # a 2D image is the network's whole input; a 3D volume reaches it in patches and windows, so its preprocessing is
    # applied to each whole case where it is read (fedmed.nn.preprocessing.case_transform), not here
    return with_preprocessing(_load_init(model, m, init_root), m.preprocessing if spatial_dims == 2 else None,
                              scaled=False)


def check_arch(model_cfg: dict, *, task: str, in_channels: int, n_out: int, size, modules=("*",)) -> None:
    """Build the configured network once and run one input through it (before any job runs, on the coordinator's
    machine, whose own modules these are): an unknown arch, a bad argument or an output of the wrong shape is one line
    here, not an error at every site."""
    if model_cfg["arch"] in BUILTIN_ARCHS and task == "classification":
        return
    if task == "segmentation":
        if ModelSection.model_validate(dict(model_cfg)).arch in BUILTIN_ARCHS + ("unet",):
            return
        net = seg_model_from_config({**model_cfg, "init_weights": None}, in_channels, modules=modules,
                                    spatial_dims=len(size))
        x = torch.zeros(1, in_channels, *size)
        want = (1, n_out, *size)
    else:
        net = model_from_config({**model_cfg, "init_weights": None}, in_channels, n_out, modules=modules)
        x = torch.zeros(2, in_channels, size, size)
        want = (2, n_out)
    net.eval()
    try:
        with torch.no_grad():
            out = net(x)
    except Exception as e:
        raise ArchError(f"model.arch {model_cfg['arch']}: a {tuple(x.shape)} input fails "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    out = out[0] if isinstance(out, (list, tuple)) else out
    if tuple(out.shape) != want:
        raise ArchError(f"model.arch {model_cfg['arch']}: output shape {tuple(out.shape)} for a {tuple(x.shape)} "
                        f"input, expected {want} ({'classes' if task == 'classification' else 'WT, TC, ET regions' if n_out == 3 else 'the lesion'})")


def user_code_files(arch: str) -> list:
    """``[(path, name)]``: the source a job carries for a user's ``package.module:Class`` (the top-level package's
    folder, or the module file); empty for fedmed's and MONAI's networks."""
    import importlib.util
    from pathlib import Path

    if ":" not in arch:
        return []
    top = arch.partition(":")[0].split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        raise ArchError(f"model.arch {arch!r}: cannot find module {top!r} to carry it in the job")
    origin = Path(spec.origin)
    return [(origin.parent, top)] if origin.name == "__init__.py" else [(origin, origin.name)]
