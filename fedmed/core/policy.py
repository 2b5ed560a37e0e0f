"""A site's policy: what a job may make this site run, read and send — decided by the site, never by the job.

A hospital's IT team writes it once, next to the site's data setting (``local/fedmed_policy.json`` in the site's
FLARE startup kit, or the file ``FEDMED_SITE_POLICY`` names); a site without one runs the defaults below. A job can
only tighten it: a job asking for more (a module, network or encoder the policy does not list, a weights file
outside the site's weights folder, DP weaker than the policy's ceiling or none where the policy requires it) is
refused at the site in one line naming the setting; a job's ``privacy.k_min`` below the site's floor is raised to
the floor (and the site says so). The effective values are recorded in the run's record (``site_policies``).

The file (JSON; every key optional)::

    {"modules": [],                  # user modules a job's model.arch "package.module:Class" may import ("*": any)
     "architectures": null,          # null: every fedmed and MONAI network; or the names allowed
     "encoders": null,               # null: every fedmed encoder; or the names allowed
     "weights_dir": null,            # the folder weight files come from (a job names a file in it, never a path)
     "k_min": 5,                     # the smallest group an aggregate may describe
     "dp_required": false,           # every signature must be released with differential privacy
     "max_epsilon": null,            # ceiling on the epsilon this site spends in one run (all signatures composed)
     "max_delta": 1e-05,             # ceiling on a job's privacy.dp_delta whenever it releases with DP (1: none)
     "allow_per_image": false,       # may per-image values/embeddings leave (004_'s paper form)?
     "allow_pixel_signatures": false,# may a raw-pixel signature (PACFL's "pixels") leave without DP?
     "max_image_pixels": 100000000,  # a 2D image larger than this is refused (decompression bombs)
     "max_volume_voxels": 268435456, # a 3D volume larger than this is refused
     "max_file_bytes": 2147483648,   # an input file larger than this is refused
     "max_task_bytes": 4294967296,   # the decoded data one task holds in memory at most (all its images or volumes)
     "tracking": []}                 # where this party's metrics may go besides its own workspace ("*": anywhere)

Nothing here imports a module a job names: :meth:`SitePolicy.allows_module` is asked first
(``fedmed.nn.models.resolve_arch``).
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePosixPath, PureWindowsPath

__all__ = ["ANY", "POLICY_FILE", "PolicyError", "ReadLimits", "SitePolicy", "kit_file", "load_policy",
           "tracking_destinations", "weights_ref"]

POLICY_FILE = "fedmed_policy.json"
ANY = "*"  # in "modules": any module
DEFAULT_K_MIN = 5  # fedmed's default privacy.k_min: what a site without a policy requires


class PolicyError(FedmedError, ValueError):
    """A job asks for something this site's policy does not allow, or the policy file is wrong; one line naming the
    setting (and no path of the site)."""


@dataclass(frozen=True)
class ReadLimits:
    """What a site reads at most (``fedmed.data``): bigger inputs are refused before they are decoded."""

    max_image_pixels: int = 100_000_000
    max_volume_voxels: int = 2**28
    max_file_bytes: int = 2 * 1024**3
    max_task_bytes: int = 4 * 1024**3


DEFAULT_MAX_DELTA = 1e-5  # fedmed's default privacy.dp_delta: a site without a policy accepts no weaker DP

_KEYS = {"modules", "architectures", "encoders", "weights_dir", "k_min", "dp_required", "max_epsilon", "max_delta",
         "allow_per_image", "allow_pixel_signatures", "max_image_pixels", "max_volume_voxels", "max_file_bytes",
         "max_task_bytes", "tracking"}


def tracking_destinations(tracking: dict) -> list[str]:
    """Where a run's tracking settings (``fedmed.config.TrackingConfig``, as a dict) send metrics besides the server's
    own workspace: an MLflow ``tracking_uri`` (a server, a database or a ``file:`` store the job names), ``wandb:online``
    (W&B's servers), a W&B folder the job names (``file:<folder>``). ``[]``: TensorBoard, MLflow's and W&B's stores in
    the run's own folder only — what every party allows."""
    out = []
    if tracking.get("mlflow") and tracking.get("mlflow_uri"):
        out.append(str(tracking["mlflow_uri"]))
    if tracking.get("wandb"):
        if tracking.get("wandb_mode", "offline") != "offline":
            out.append("wandb:online")
        if tracking.get("wandb_dir"):
            out.append(f"file:{tracking['wandb_dir']}")
    return out


@dataclass(frozen=True)
class SitePolicy:
    modules: tuple = ()
    architectures: tuple | None = None
    encoders: tuple | None = None
    weights_dir: Path | None = None
    k_min: int = DEFAULT_K_MIN
    dp_required: bool = False
    max_epsilon: float | None = None
    max_delta: float = DEFAULT_MAX_DELTA
    allow_per_image: bool = False
    allow_pixel_signatures: bool = False
    limits: ReadLimits = field(default_factory=ReadLimits)
    tracking: tuple = ()
    source: str = "default"  # which file it came from (its name), for the lines that name a setting

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, doc, source: str = POLICY_FILE, base: Path | None = None) -> "SitePolicy":
        """The policy of a parsed file; ``weights_dir`` relative to ``base``. Raises :class:`PolicyError` naming the
        key for anything it cannot take."""
        if not isinstance(doc, dict):
            raise PolicyError(f"{source} should be a JSON object")
        unknown = sorted(set(doc) - _KEYS)
        if unknown:
            raise PolicyError(f"{source} has unknown keys {unknown} (known: {sorted(_KEYS)})")

        def names(key, allow_null):
            v = doc.get(key, None if allow_null else [])
            if v is None and allow_null:
                return None
            if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
                raise PolicyError(f"{source}: {key} should be a list of names{' or null' if allow_null else ''}")
            return tuple(v)

        def positive_int(key, default):
            v = doc.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PolicyError(f"{source}: {key} should be a positive integer, got {v!r}")
            return v

        def flag(key):
            v = doc.get(key, False)
            if not isinstance(v, bool):
                raise PolicyError(f"{source}: {key} should be true or false, got {v!r}")
            return v

        eps = doc.get("max_epsilon")
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps)
                                or eps <= 0):
            raise PolicyError(f"{source}: max_epsilon should be a number > 0 or null, got {eps!r}")
        delta = doc.get("max_delta", DEFAULT_MAX_DELTA)
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta) \
                or not 0 < delta <= 1:
            raise PolicyError(f"{source}: max_delta should be a number above 0 and at most 1 (1: no ceiling), got "
                              f"{delta!r}")
        wd = doc.get("weights_dir")
        if wd is not None and (not isinstance(wd, str) or not wd.strip()):
            raise PolicyError(f"{source}: weights_dir should be a folder or null, got {wd!r}")
        if wd is not None:
            wd = Path(wd) if Path(wd).is_absolute() or base is None else Path(base) / wd
        return cls(modules=names("modules", False), architectures=names("architectures", True),
                   encoders=names("encoders", True), weights_dir=wd, k_min=positive_int("k_min", DEFAULT_K_MIN),
                   dp_required=flag("dp_required"), max_epsilon=None if eps is None else float(eps),
                   max_delta=float(delta),
                   allow_per_image=flag("allow_per_image"), allow_pixel_signatures=flag("allow_pixel_signatures"),
                   limits=ReadLimits(positive_int("max_image_pixels", ReadLimits.max_image_pixels),
                                     positive_int("max_volume_voxels", ReadLimits.max_volume_voxels),
                                     positive_int("max_file_bytes", ReadLimits.max_file_bytes),
                                     positive_int("max_task_bytes", ReadLimits.max_task_bytes)),
                   tracking=names("tracking", False),
                   source=source)

    @classmethod
    def from_file(cls, path) -> "SitePolicy":
        p = Path(path)
        if not p.is_file():
            raise PolicyError(f"the site policy file {p.name} does not exist")
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise PolicyError(f"the site policy {p.name} is not valid JSON ({type(e).__name__})") from None
        return cls.from_dict(doc, p.name, p.parent)

    def to_dict(self) -> dict:
        """The policy as its file writes it (``weights_dir`` absolute)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("limits", "source")}
        d.update(asdict(self.limits))
        for k in ("modules", "architectures", "encoders", "tracking"):
            d[k] = None if d[k] is None else list(d[k])
        d["weights_dir"] = None if self.weights_dir is None else str(self.weights_dir)
        return d

    def write(self, path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1))
        return p

    def with_site_settings(self, *, k_min: int | None = None, allow_per_image: bool = False) -> "SitePolicy":
        """The policy with the older ``fedmed_site.json`` keys applied: its ``k_min`` raises the floor, its
        ``allow_per_image`` allows per-image data."""
        return replace(self, k_min=max(self.k_min, int(k_min or 0)),
                       allow_per_image=self.allow_per_image or bool(allow_per_image))

    @classmethod
    def simulating(cls, k_min: int, *, weights_dir=None, allow_per_image: bool = False) -> "SitePolicy":
        """The policy of sites that are the experimenter's own (``fedmed experiment``, the in-process federation):
        the config's author decides for every site, so the config's ``k_min`` is the floor, its modules may run, its
        weights come from ``weights_dir``. Never the policy of a real site."""
        return cls(modules=(ANY,), k_min=int(k_min), weights_dir=Path(weights_dir) if weights_dir else None,
                   allow_per_image=allow_per_image, allow_pixel_signatures=True, tracking=(ANY,), max_delta=1.0,
                   source="simulation")

    # ------------------------------------------------------------------ what a job may do here
    def _setting(self, key: str) -> str:
        return f"{self.source}: {key}" if self.source not in ("default", "simulation") else \
            f"{key} of this site's policy ({self.source}; local/{POLICY_FILE} sets it)"

    def allows_module(self, module: str) -> bool:
        return any(m == ANY or module == m or module.startswith(m + ".") for m in self.modules)

    def check_arch(self, arch: str, what: str = "model.arch") -> None:
        """Refuse a network this site does not run (before anything is imported); ``what`` names where the job asks
        for it (``model.arch``, or the network a kind of task builds whatever model.arch says)."""
        if ":" in arch:
            mod = arch.partition(":")[0]
            if not self.allows_module(mod):
                raise PolicyError(f"{what} {arch!r} imports module {mod!r}, which this site does not allow "
                                  f"({self._setting('modules')}: {list(self.modules)})")
        elif self.architectures is not None and arch not in self.architectures:
            raise PolicyError(f"{what} {arch!r} is not among the networks this site runs "
                              f"({self._setting('architectures')}: {list(self.architectures)})")

    def check_encoder(self, name: str, *, dp: bool) -> None:
        if self.encoders is not None and name not in self.encoders:
            raise PolicyError(f"encoder {name!r} is not among the encoders this site runs "
                              f"({self._setting('encoders')}: {list(self.encoders)})")
        if name == "pixels" and not dp and not self.allow_pixel_signatures:
            raise PolicyError(f"a raw-pixel signature (encoder 'pixels') without differential privacy is close to an "
                              f"average image of each class; this site does not send one "
                              f"({self._setting('allow_pixel_signatures')}: false; set privacy.dp_epsilon)")

    def check_dp(self, epsilon: float | None, delta: float | None = None) -> None:
        """A job's ``privacy.dp_epsilon`` and ``privacy.dp_delta`` for a signature against this site's
        ``dp_required`` / ``max_epsilon`` / ``max_delta`` (an (ε, δ) guarantee is only as strong as its δ: δ near 1
        makes any ε meaningless)."""
        if epsilon is None and self.dp_required:
            raise PolicyError(f"this site sends signatures only with differential privacy "
                              f"({self._setting('dp_required')}: true) and the job has privacy.dp_epsilon: null")
        if epsilon is not None and self.max_epsilon is not None and epsilon > self.max_epsilon:
            raise PolicyError(f"the job's privacy.dp_epsilon={epsilon:g} is above this site's ceiling "
                              f"({self._setting('max_epsilon')}: {self.max_epsilon:g})")
        if epsilon is not None and delta is not None and delta > self.max_delta * (1 + 1e-9):
            raise PolicyError(f"the job's privacy.dp_delta={delta:g} is above this site's ceiling "
                              f"({self._setting('max_delta')}: {self.max_delta:g})")

    def check_budget(self, spent: float, epsilon: float) -> None:
        """Refuse a release that would take this run's composed epsilon above the ceiling."""
        if self.max_epsilon is not None and spent + epsilon > self.max_epsilon * (1 + 1e-9):
            raise PolicyError(f"this release (epsilon {epsilon:g}) would bring this run's epsilon at this site to "
                              f"{spent + epsilon:g}, above its ceiling ({self._setting('max_epsilon')}: "
                              f"{self.max_epsilon:g})")

    def check_task_sizes(self, data) -> None:
        """A job's (or a checkpoint's) image and volume sizes against what this site reads at most, before anything
        is allocated: ``image_size`` squared times the channels within ``max_image_pixels``, each of ``shape`` and
        ``roi`` times the channels within ``max_volume_voxels`` (``data``: the task's ``data`` section, a dict or
        :class:`~fedmed.core.schema.DataSection`)."""
        d = data if isinstance(data, dict) else data.model_dump()
        ch = max(int(d.get("channels") or 1), int(d.get("in_channels") or 1))
        size = d.get("image_size")
        if size is not None:
            if int(size) < 1:
                raise PolicyError(f"data.image_size should be a positive number of pixels, got {size}")
            if int(size) ** 2 * ch > self.limits.max_image_pixels:
                raise PolicyError(f"data.image_size {int(size)} ({ch} channel(s)) is {int(size) ** 2 * ch} values per "
                                  f"image, more than this site allocates ({self._setting('max_image_pixels')}: "
                                  f"{self.limits.max_image_pixels})")
        for key in ("shape", "roi"):
            dims = d.get(key)
            if dims is None:
                continue
            if any(int(v) < 1 for v in dims):
                raise PolicyError(f"data.{key} {list(dims)} should be positive sizes")
            n = math.prod(int(v) for v in dims) * ch
            if n > self.limits.max_volume_voxels:
                raise PolicyError(f"data.{key} {'x'.join(str(int(v)) for v in dims)} ({ch} channel(s)) is {n} values "
                                  f"per volume, more than this site allocates ({self._setting('max_volume_voxels')}: "
                                  f"{self.limits.max_volume_voxels})")

    def check_task_bytes(self, n_items: int, values_per_item: int, what: str) -> None:
        """The decoded data a task would hold (``n_items`` images or volumes of ``values_per_item`` float32 values
        each: the whole of what it decodes, not one image) against ``max_task_bytes``, before anything is decoded."""
        need = int(n_items) * int(values_per_item) * 4
        if need > self.limits.max_task_bytes:
            raise PolicyError(f"{what}: {n_items} item(s) of {values_per_item} values decode to {need / 2**30:.2f} "
                              f"GiB, more than this site holds for one task ({self._setting('max_task_bytes')}: "
                              f"{self.limits.max_task_bytes / 2**30:.2f} GiB); a smaller data.image_size (or roi) fits")

    def refused_tracking(self, destinations) -> str | None:
        """The first of a job's tracking ``destinations`` (:func:`tracking_destinations`) this party does not let its
        metrics go to, as one line; None when every one is allowed (``[]``, the run's own folder, always is)."""
        for d in destinations or ():
            if ANY not in self.tracking and str(d) not in self.tracking:
                what = "W&B's servers" if d == "wandb:online" else f"{_scheme(str(d))} destination"
                return (f"the job sends metrics to {what}, which this party's policy does not allow "
                        f"({self._setting('tracking')}; the stores in its own workspace are always allowed)")
        return None

    def effective_k_min(self, job_k_min: int) -> int:
        return max(int(job_k_min), self.k_min)

    def weights_path(self, ref) -> Path:
        """The file a job's weights reference (``{"name", "sha256"}``: :class:`fedmed.core.schema.WeightsRef`) names in
        this site's weights folder. A path (absolute, with a folder, ``..``, a drive) is refused without touching the
        file; the file must be a regular file in the folder with the coordinator's SHA-256."""
        ref = dict(ref) if isinstance(ref, dict) else ref.model_dump()
        name, sha256 = str(ref["name"]), str(ref["sha256"])
        if not _bare_name(name):
            raise PolicyError(f"a job names a weights file by its name in the site's weights folder, not by a path "
                              f"(got a {_path_kind(name)}); this site reads weights only from its weights folder")
        if self.weights_dir is None:
            raise PolicyError(f"the job needs the weights file {name} and this site keeps no weights folder "
                              f"({self._setting('weights_dir')}: null)")
        p = Path(self.weights_dir) / name
        if not p.is_file():
            raise PolicyError(f"the weights file {name} is not in this site's weights folder ({self._setting('weights_dir')})")
        digest = file_sha256(p)
        if digest != sha256:
            raise PolicyError(f"the weights file {name} in this site's weights folder is not the coordinator's "
                              f"(sha256 {digest[:12]} here, {sha256[:12]} in the job)")
        return p

    def summary(self) -> dict:
        """The effective values a run records for this site (no path)."""
        return {"source": self.source, "k_min": self.k_min, "dp_required": self.dp_required,
                "max_epsilon": self.max_epsilon, "max_delta": self.max_delta, "allow_per_image": self.allow_per_image,
                "allow_pixel_signatures": self.allow_pixel_signatures, "modules": list(self.modules),
                "architectures": None if self.architectures is None else list(self.architectures),
                "encoders": None if self.encoders is None else list(self.encoders),
                "weights_dir": self.weights_dir is not None, "tracking": list(self.tracking), **asdict(self.limits)}


def _scheme(uri: str) -> str:
    """A destination's kind, never its address (a refusal that leaves a party names no host or path)."""
    head = uri.split(":", 1)[0] if ":" in uri else ""
    return f"a '{head}:'" if head.replace("+", "").isalnum() else "a"


def _bare_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and PurePosixPath(name).name == name \
        and PureWindowsPath(name).name == name and not name.startswith("~") and "\x00" not in name


def _path_kind(name: str) -> str:
    if name.startswith(("/", "\\")) or PureWindowsPath(name).drive:
        return "absolute path"
    if name.startswith("~"):
        return "home-relative path"
    return "path with folders" if ".." not in name else "path with '..'"


_DIGESTS: dict = {}


def file_sha256(path) -> str:
    """SHA-256 of a file (hex), remembered per (path, size, mtime)."""
    import hashlib

    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def weights_ref(path) -> dict:
    """How a job names the weights file ``path`` (the coordinator's copy): ``{"name", "sha256"}``."""
    p = Path(path)
    return {"name": p.name, "sha256": file_sha256(p)}


def kit_file(start, name: str) -> Path | None:
    """``local/<name>`` of the FLARE startup kit ``start`` is in (the job process's working directory is inside the
    kit: the kit is ``start`` or a parent of it; the search stops at the kit's root), or ``None``."""
    start = Path(start)
    for d in (start, *start.parents):
        cand = d / "local" / name
        if cand.is_file():
            return cand
        if (d / "startup").is_dir():  # the kit's root: stop here
            return None
    return None


def load_policy(*, settings_file=None, env=None, cwd=None) -> SitePolicy:
    """This site's policy: the file ``FEDMED_SITE_POLICY`` names, else ``fedmed_policy.json`` beside the site's
    settings file (``settings_file``), else the startup kit's ``local/fedmed_policy.json`` (found from ``cwd``), else
    the defaults."""
    env = os.environ if env is None else env
    if env.get("FEDMED_SITE_POLICY"):
        return SitePolicy.from_file(env["FEDMED_SITE_POLICY"])
    if settings_file is not None and (Path(settings_file).parent / POLICY_FILE).is_file():
        return SitePolicy.from_file(Path(settings_file).parent / POLICY_FILE)
    f = kit_file(cwd or os.getcwd(), POLICY_FILE)
    return SitePolicy.from_file(f) if f is not None else SitePolicy()
