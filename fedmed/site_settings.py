"""A site's own settings: where its data is and what it allows to leave — never decided by the job.

A job carries no path to anyone's data. Each site finds its datalist through a site-local setting,
looked up in this order (the first that is set wins):

1. ``FEDMED_DATALIST``: the datalist file itself;
2. ``FEDMED_DATALIST_DIR``: a folder holding ``<site>.json`` (the simulator's generated federations);
3. ``FEDMED_SITE_CONFIG``: a settings file, or FLARE's convention, the site's startup kit
   ``local/fedmed_site.json`` (the kit is the job process's working directory or a parent of it).

The settings file (JSON)::

    {"datalist": "hospital-a.json",      # relative to this file, or absolute
     "data_root": "/data/imaging",       # optional: relative image paths resolve here (default: the
                                         #   datalist's folder); messages name files relative to it
     "allow_per_image": false,           # optional: may per-image values/embeddings leave (004_ paper form)?
     "k_min": 10}                        # optional: raise the job's minimum group size at this site

``FEDMED_ALLOW_PER_IMAGE=1`` is the environment form of ``allow_per_image`` (simulations).

Messages that leave a site go through :func:`scrub`: absolute paths become paths relative to the
site's data root, or just the file name when outside it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SETTINGS_FILE", "SiteConfigError", "SiteSettings", "resolve_site_settings", "scrub"]

SETTINGS_FILE = "fedmed_site.json"
_KEYS = {"datalist", "data_root", "allow_per_image", "k_min"}


class SiteConfigError(ValueError):
    """A site whose settings are missing or wrong; the message names the site and the setting."""


@dataclass
class SiteSettings:
    site: str
    datalist: Path
    data_root: Path
    allow_per_image: bool = False
    k_min: int | None = None
    source: str = ""
    roots: list[Path] = field(default_factory=list)  # folders whose absolute paths are scrubbed from messages

    def display(self, path) -> str:
        """``path`` as a message that leaves the site may name it (relative to the data root, else its name)."""
        return _relative(Path(path), self.data_root)

    def scrub(self, message: str) -> str:
        return scrub(message, [self.data_root, self.datalist.parent, *self.roots])


def _relative(p: Path, root: Path) -> str:
    try:
        return str(p.resolve().relative_to(root.resolve()))
    except (ValueError, OSError):
        return p.name


_ABS = re.compile(r"(?<![\w.~])(/[^\s'\"(),:;]+)")


def scrub(message: str, roots) -> str:
    """Replace absolute paths in ``message``: under one of ``roots`` -> relative to it, else the file name."""
    roots = [Path(r) for r in roots if r]

    def repl(m):
        p = Path(m.group(1))
        for r in roots:
            try:
                return str(p.relative_to(r)) if p != r else "."
            except ValueError:
                try:
                    return str(p.resolve().relative_to(r.resolve()))
                except (ValueError, OSError):
                    continue
        return p.name or "/"

    return _ABS.sub(repl, str(message))


def _kit_settings(start: Path) -> Path | None:
    for d in (start, *start.parents):
        cand = d / "local" / SETTINGS_FILE
        if cand.is_file():
            return cand
        if (d / "startup").is_dir():  # the kit's root: stop here
            return None
    return None


def _truthy(v: str | None) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def resolve_site_settings(site: str, *, cwd=None, env=None) -> SiteSettings:
    """The settings of ``site`` (see the module notes for the lookup order).

    Raises:
        SiteConfigError: no setting names the site's data, the settings file is unreadable or has
            unknown keys, or the datalist it names does not exist — naming the site and the setting.
    """
    env = os.environ if env is None else env
    cwd = Path(cwd or os.getcwd())
    per_image_env = _truthy(env.get("FEDMED_ALLOW_PER_IMAGE"))
    if env.get("FEDMED_DATALIST"):
        dl = Path(env["FEDMED_DATALIST"])
        source = "FEDMED_DATALIST"
        settings = SiteSettings(site, dl, dl.parent, per_image_env, None, source)
    elif env.get("FEDMED_DATALIST_DIR"):
        dl = Path(env["FEDMED_DATALIST_DIR"]) / f"{site}.json"
        settings = SiteSettings(site, dl, dl.parent, per_image_env, None, "FEDMED_DATALIST_DIR")
    else:
        f = Path(env["FEDMED_SITE_CONFIG"]) if env.get("FEDMED_SITE_CONFIG") else _kit_settings(cwd)
        if f is None:
            raise SiteConfigError(
                f"{site}: no data configured for this site: put local/{SETTINGS_FILE} (with a 'datalist' entry) in "
                f"the site's startup kit, or set FEDMED_SITE_CONFIG, FEDMED_DATALIST or FEDMED_DATALIST_DIR")
        source = "FEDMED_SITE_CONFIG" if env.get("FEDMED_SITE_CONFIG") else f"local/{SETTINGS_FILE}"
        if not f.is_file():
            raise SiteConfigError(f"{site}: {source} names a settings file that does not exist ({f.name})")
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise SiteConfigError(f"{site}: {source} ({f.name}) is not valid JSON ({type(e).__name__})") from None
        if not isinstance(doc, dict) or "datalist" not in doc:
            raise SiteConfigError(f"{site}: {source} ({f.name}) should be an object with a 'datalist' entry")
        unknown = sorted(set(doc) - _KEYS)
        if unknown:
            raise SiteConfigError(f"{site}: {source} ({f.name}) has unknown keys {unknown} (known: {sorted(_KEYS)})")
        dl = Path(doc["datalist"])
        dl = dl if dl.is_absolute() else (f.parent / dl)
        root = Path(doc["data_root"]) if doc.get("data_root") else dl.parent
        root = root if root.is_absolute() else (f.parent / root)
        k_min = doc.get("k_min")
        if k_min is not None and (isinstance(k_min, bool) or not isinstance(k_min, int) or k_min < 1):
            raise SiteConfigError(f"{site}: {source} k_min should be a positive integer, got {k_min!r}")
        settings = SiteSettings(site, dl, root, bool(doc.get("allow_per_image", False)) or per_image_env, k_min,
                                source, roots=[f.parent])
    if not settings.datalist.is_file():
        raise SiteConfigError(f"{site}: the datalist named by {settings.source} does not exist "
                              f"({settings.display(settings.datalist)})")
    return settings


def settings_for_dir(site: str, datalist_dir) -> SiteSettings:
    """Settings of a site whose datalist is ``<datalist_dir>/<site>.json`` (simulations, tests)."""
    dl = Path(datalist_dir) / f"{site}.json"
    return SiteSettings(site, dl, dl.parent, _truthy(os.environ.get("FEDMED_ALLOW_PER_IMAGE")), None, "datalist dir")
