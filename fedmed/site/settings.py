"""A site's own settings: where its data is and what it allows — never decided by the job.

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
     "k_min": 10,                        # optional: raise the job's minimum group size at this site
     "device": "cuda:1",                 # optional: this site's device (overrides the job's train.device)
     "device_data_gb": 12,               # optional: GiB of its images a GPU site keeps on the device (default:
                                         #   half the device memory free at first use; 0: pinned host memory)
     "cache_dir": "/scratch/fedmed"}     # optional: where decoded data is cached (false: no cache; default
                                         #   FEDMED_CACHE_DIR, else fedmed_cache/ beside this file — a kit's
                                         #   local/fedmed_cache/; fedmed.site.cache)

``FEDMED_ALLOW_PER_IMAGE=1`` is the environment form of ``allow_per_image`` (simulations), ``FEDMED_DEVICE`` of
``device``. What a job may make the site do — modules, networks, encoders, weights files, the privacy floor and DP —
is the site's policy (:mod:`fedmed.core.policy`: ``fedmed_policy.json`` beside this file or in the kit's ``local/``,
or ``FEDMED_SITE_POLICY``); ``k_min`` and ``allow_per_image`` here feed into it.

Messages for the site's own log go through :func:`scrub` (absolute paths relative to the site's data root); every
text that leaves a site goes through :func:`redact`: no path of any form and no name of the site's datalist.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from fedmed.core.policy import POLICY_FILE, PolicyError, SitePolicy, kit_file, load_policy

__all__ = ["NAME_MARK", "PATH_MARK", "SETTINGS_FILE", "SiteConfigError", "SiteSettings", "path_spans",
           "private_tokens", "redact", "redact_strings", "resolve_site_settings", "scrub"]

SETTINGS_FILE = "fedmed_site.json"
_KEYS = {"datalist", "data_root", "allow_per_image", "k_min", "device", "device_data_gb", "cache_dir"}


class SiteConfigError(FedmedError, ValueError):
    """A site whose settings are missing or wrong; the message names the site and the setting."""


@dataclass
class SiteSettings:
    site: str
    datalist: Path
    data_root: Path
    source: str = ""
    roots: list[Path] = field(default_factory=list)  # folders whose absolute paths are scrubbed from messages
    device: str | None = None  # this site's train.device (overrides the job's)
    device_data_gb: float | None = None  # GiB of images kept on a GPU (fedmed.nn.resident); None: the default
    cache_dir: object = None  # decoded-data cache root (fedmed.site.cache): None = default, False = off, or a folder
    workspace: Path | None = None  # the site's own folder (its settings file's; a kit's local/): the default cache
    policy: SitePolicy = field(default_factory=SitePolicy)  # what a job may make this site do (fedmed.core.policy)

    def in_workspace(self, folder) -> "SiteSettings":
        """These settings with ``folder`` as the site's own workspace where they name none (a simulated site: the
        simulator's site folder; an in-process one: its folder beside the run's) — where it keeps the model it is
        served. Naming a workspace never turns a data cache on: without a configured one it stays as it was."""
        import os
        from dataclasses import replace

        if self.workspace is not None:
            return self
        off = self.cache_dir is None and not os.environ.get("FEDMED_CACHE_DIR") and \
            os.environ.get("FEDMED_CACHE", "1").lower() not in ("0", "false", "no", "off")
        return replace(self, workspace=Path(folder), cache_dir=False if off else self.cache_dir)

    @property
    def allow_per_image(self) -> bool:
        return self.policy.allow_per_image

    def display(self, path) -> str:
        """``path`` as the site's own log names it (relative to the data root, else its name; what leaves the site
        names positions only: :func:`redact`); a file outside the data root says so."""
        p = Path(path)
        try:
            p.resolve().relative_to(Path(self.data_root).resolve())
        except (ValueError, OSError, RuntimeError):
            return f"{p.name} (outside the data folder)"
        return _relative(p, self.data_root)

    @property
    def scrub_roots(self) -> list:
        return [self.data_root, self.datalist.parent, *self.roots]

    def scrub(self, message: str) -> str:
        """``message`` for the site's own log: absolute paths relative to its roots (:func:`scrub`)."""
        return scrub(message, self.scrub_roots)


def _relative(p: Path, root: Path) -> str:
    try:
        return str(p.resolve().relative_to(root.resolve()))
    except (ValueError, OSError, RuntimeError):  # RuntimeError: a symbolic link that loops
        return p.name


_OPENERS = frozenset(" \t\r\n'\"([{=:,;<")  # what may stand right before an absolute path in a message
_QUOTES = "'\""
_NAME_STOP = frozenset(" \t\r\n'\"),;]}>")  # what ends the file name of an unquoted path
_NEXT_PATH = re.compile(r"\s['\"]?~?/")  # where the next absolute path of a line starts
_URL_SCHEME = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*:$")  # "https:" right before "//"


def _closing_quote(text: str, q: str, start: int, line_end: int) -> int:
    """Where a path opened by quote ``q`` ends: the first ``q`` followed by a non-word character (an apostrophe
    inside a folder name, ``O'Brien``, is followed by a letter); the end of the line when there is none."""
    k = text.find(q, start, line_end)
    while k >= 0:
        if k + 1 >= len(text) or not (text[k + 1].isalnum() or text[k + 1] == "_"):
            return k
        k = text.find(q, k + 1, line_end)
    return line_end


def path_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every absolute path (``/...`` or ``~/...``) in ``text``, whatever characters its
    folders hold (spaces, parentheses, commas, quotes, non-ASCII).

    A path in quotes runs to its closing quote (or further, when a ``/`` follows that quote). An unquoted path runs to its last ``/`` before the end of the
    line or the next absolute path (a blank followed by ``/``), then through the file name (up to a blank, a
    quote or ``),;]}>``); trailing ``.:,;`` are left out. The rule is greedy on purpose: a message that has a
    ``/`` later on the same line loses the text in between, rather than leaving a folder name behind."""
    spans = []
    i, n = 0, len(text)
    while i < n:
        j = text.find("/", i)
        if j < 0:
            break
        start = j
        if j + 1 >= n or text[j + 1] in " \t\r\n":  # a division sign ("(x - 0.5) / 0.25"), not a path
            i = j + 1
            continue
        url = _URL_SCHEME.search(text[max(0, j - 32):j]) if text.startswith("//", j) else None
        if url is not None:  # scheme://host/...: the address whole, scheme included (never "https:<path>")
            start = j - len(url.group(0))
        elif j > 0 and text[j - 1] == "~" and (j == 1 or text[j - 2] in _OPENERS):
            start = j - 1
        elif j > 0 and text[j - 1] not in _OPENERS:
            i = j + 1
            continue
        line_end = text.find("\n", j)
        line_end = n if line_end < 0 else line_end
        m = _NEXT_PATH.search(text, j + 1, line_end)
        stop = m.start() if m else line_end
        end = text.rfind("/", j, stop) + 1
        while end < stop and text[end] not in _NAME_STOP:
            end += 1
        while end > j + 1 and text[end - 1] in ".:,;":
            end -= 1
        opener = text[start - 1] if start > 0 else ""
        if opener and opener in _QUOTES:  # to its closing quote, unless a "/" comes after that quote (a quote in a
            end = max(end, _closing_quote(text, opener, j, line_end))  # folder's name): then the longer span
        spans.append((start, end))
        i = max(end, j + 1)
    return spans


def _shown(path: str, roots) -> str:
    """What a message may show of ``path``: relative to the first root that holds it, else its last name."""
    p = Path(os.path.expanduser(path)) if path.startswith("~") else Path(path)
    for r in roots:
        try:
            return str(p.relative_to(r)) if p != r else "."
        except ValueError:
            try:
                rel = p.resolve().relative_to(r.resolve())
                return str(rel) if str(rel) != "." else "."
            except (ValueError, OSError, RuntimeError):
                continue
    return p.name or "/"


def scrub(message: str, roots) -> str:
    """``message`` with every absolute path replaced whole (:func:`path_spans`): under one of ``roots`` by the
    path relative to it, else by the file's name. Nothing of a folder outside the roots is left."""
    text = str(message)
    roots = sorted((Path(r) for r in roots if r), key=lambda r: -len(str(r)))
    out, last = [], 0
    for a, b in path_spans(text):
        out.append(text[last:a])
        out.append(_shown(text[a:b], roots))
        last = b
    out.append(text[last:])
    return "".join(out)


# ------------------------------------------------------------------ what leaves a site: no name at all
PATH_MARK = "<path>"  # what a path of any form becomes in a text that leaves a site
NAME_MARK = "<name>"  # what a name taken from the site's datalist becomes

_WINDOWS_START = re.compile(r"(?<![\w\\])(?:[A-Za-z]:[\\/]|\\\\[^\\\s]+\\)")  # C:\ or C:/ or \\server\
# a quoted text holding a separator; the quotes must be quotes, not apostrophes ("this site's policy (local/...): ['x']")
_QUOTED = re.compile(r"(?<![A-Za-z0-9])'[^'\n]*[/\\][^'\n]*'(?![A-Za-z0-9])|(?<![A-Za-z0-9])\"[^\"\n]*[/\\][^\"\n]*\"(?![A-Za-z0-9])")
_TOKEN = re.compile(r"[^\s'\"()\[\]{}<>,;]+")
_STOP = frozenset({"training", "validation", "test", "image", "images", "label", "labels", "mask", "masks", "data",
                   "train", "val", "valid", "png", "jpg", "jpeg", "nii", "dcm", "tif", "tiff", "bmp", "npz", "json",
                   "site", "case", "cases", "subject", "region", "whole", "left", "right"})


def _windows_spans(text: str) -> list[tuple[int, int]]:
    """Windows paths (``C:\\PACS export\\x.png``, ``C:/...``, ``\\\\server\\share\\...``): like :func:`path_spans`, to
    the last separator of the line, then through the file name."""
    spans = []
    for m in _WINDOWS_START.finditer(text):
        j = m.start()
        if spans and j < spans[-1][1]:
            continue
        line_end = text.find("\n", j)
        line_end = len(text) if line_end < 0 else line_end
        last = max(text.rfind("\\", j, line_end), text.rfind("/", j, line_end))
        end = last + 1
        while end < line_end and text[end] not in _NAME_STOP:
            end += 1
        while end > last + 1 and text[end - 1] in ".:,;":
            end -= 1
        spans.append((j, end))
    return spans


def _is_relative_path(token: str) -> bool:
    """A token such as ``images/site-2/x.png`` or ``Doe_Jane\\scan.png`` (not a ratio like ``1/3``, not ``WT/TC/ET``)."""
    parts = [q for q in re.split(r"[/\\]", token) if q]
    seps = len(re.findall(r"[/\\]", token))
    if not seps or all(q.isdigit() for q in parts) or all(len(q) <= 3 and q.isupper() for q in parts):
        return False
    if not any(re.search(r"[A-Za-z]", q) for q in parts):
        return False
    # a file (an extension), a folder chain (two separators or more), or ./ ../ — not "slope/intercept"
    return bool(re.search(r"\.[A-Za-z0-9]{1,6}$", parts[-1])) or seps >= 2 or token.startswith(("./", "../", ".\\"))


_WORDS: set = set()


def fedmed_words() -> set:
    """Every word of fedmed's own source (its messages among them), lower-cased: a datalist name that is also one of
    these (a file called ``corrupt.png``) is not blanked in fedmed's messages, which carry no name of their own."""
    if not _WORDS:
        root = Path(__file__).resolve().parents[1]
        for f in root.rglob("*.py"):
            _WORDS.update(w.lower() for w in re.findall(r"[A-Za-z]{3,}", f.read_text(errors="ignore")))
    return _WORDS


_PATHS: set = set()


def fedmed_paths() -> set:
    """The relative paths fedmed's own messages name (``local/fedmed_policy.json``, ``models/model.pt``, …): every
    path-like token of a string literal of fedmed's code (docstrings left out). A message naming one of these is
    fedmed's own text and is never redacted; any other relative path is."""
    if not _PATHS:
        import ast

        root = Path(__file__).resolve().parents[1]
        for f in root.rglob("*.py"):
            try:
                tree = ast.parse(f.read_text(errors="ignore"))
            except SyntaxError:
                continue
            docs = {id(n.body[0].value) for n in ast.walk(tree)
                    if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                    and isinstance(n.body[0], ast.Expr) and isinstance(getattr(n.body[0], "value", None), ast.Constant)}
            for n in ast.walk(tree):
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                    _PATHS.update(t.rstrip(".:,;") for t in _TOKEN.findall(n.value) if _is_relative_path(t))
        from fedmed.site.cache import WORKSPACE_CACHE

        # the kit files fedmed's messages name through a constant (f"local/{POLICY_FILE}")
        _PATHS.update({f"local/{POLICY_FILE}", f"local/{SETTINGS_FILE}", f"local/{WORKSPACE_CACHE}"})
        _PATHS.add("")  # computed
    return _PATHS


def private_tokens(doc, classes=()) -> set:
    """The names a datalist holds — every folder and file name of its paths (and their stems), every other value of
    its entries (labels as written, ids, extra fields) and its keys that are not splits — that no text leaving the
    site may show (:func:`redact`). Short or generic words are left out (they would blank fedmed's own words); a
    label written as one of the job's ``classes`` tells nothing the job does not know and is left out too — the
    same text as an id, a file name or any other field is not (a job's class names grant nothing)."""
    out: set = set()
    job_classes = {str(c) for c in classes or ()}

    def add(v):
        if isinstance(v, bool) or v is None:
            return
        if isinstance(v, (int, float)):
            v = str(v)
            if len(v) < 5:  # a small number (a class id, a count) is not a name
                return
        if not isinstance(v, str):
            return
        for part in re.split(r"[/\\]", v):
            for t in {part, part.split(".")[0], part.rsplit(".", 1)[0] if "." in part else part}:
                t = t.strip()
                if len(t) >= 3 and t.lower() not in _STOP and not t.startswith("~") and not re.fullmatch(r"\d{1,4}", t):
                    out.add(t)

    if isinstance(doc, dict):
        for key, entries in doc.items():
            if key not in ("training", "validation", "test", "site"):
                add(key)
            if isinstance(entries, list):
                for e in entries:
                    if isinstance(e, dict):
                        for k, v in e.items():
                            if k == "label" and isinstance(v, str) and v in job_classes:
                                continue
                            for x in (v if isinstance(v, list) else [v]):
                                add(x)
                    else:
                        add(e)
    return out


def redact(text: str, tokens=(), allow=()) -> str:
    """``text`` as it may leave a site: every path of any form (POSIX or Windows absolute, UNC, ``~``, relative with
    folders) becomes :data:`PATH_MARK`, and every name of the site's datalist (``tokens``, :func:`private_tokens`;
    except those in ``allow``, e.g. the job's class names) becomes :data:`NAME_MARK`. What stays names a split, a
    position (``training[17]``) and the kind of problem."""
    text = str(text)
    for finder in (path_spans, _windows_spans):
        spans = finder(text)
        for a, b in reversed(spans):
            text = text[:a] + PATH_MARK + text[b:]
    text = _QUOTED.sub(lambda m: m.group(0) if m.group(0)[1:-1] in fedmed_paths() else PATH_MARK, text)
    text = _TOKEN.sub(lambda m: PATH_MARK if _is_relative_path(m.group(0)) and m.group(0).rstrip(".:,;") not in
                      fedmed_paths() else m.group(0), text)
    names = _names_pattern(frozenset(tokens or ()), frozenset(str(a) for a in allow or ()))
    return names.sub(NAME_MARK, text) if names is not None else text


_PATTERNS: dict = {}


def _names_pattern(tokens: frozenset, allowed: frozenset):
    """One compiled alternation of the names to blank (longest first), made once per set of names: a site's datalist
    of 2,000 images holds ~8,000 names, and a pattern per name per reply cost ~1.4 s a reply."""
    key = (tokens, allowed)
    if key not in _PATTERNS:
        words = fedmed_words() if tokens else set()
        names = sorted((t for t in tokens if t not in allowed and t.lower() not in words), key=len, reverse=True)
        if len(_PATTERNS) > 16:  # a process serves one site (a few sets of names); the in-process federation a few
            _PATTERNS.clear()
        _PATTERNS[key] = re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join(map(re.escape, names)) + r")(?![A-Za-z0-9])") \
            if names else None
    return _PATTERNS[key]


def redact_strings(obj, tokens=(), allow=()):
    """A reply's meta with :func:`redact` applied to every string in it."""
    if isinstance(obj, str):
        return redact(obj, tokens, allow)
    if isinstance(obj, dict):
        return {k: redact_strings(v, tokens, allow) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_strings(v, tokens, allow) for v in obj)
    return obj


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

    def policy(settings_file=None, k_min=None, per_image=False):
        try:
            return load_policy(settings_file=settings_file, env=env, cwd=cwd).with_site_settings(
                k_min=k_min, allow_per_image=per_image or per_image_env)
        except PolicyError as e:
            raise SiteConfigError(f"{site}: {e}") from None

    if env.get("FEDMED_DATALIST"):
        dl = Path(env["FEDMED_DATALIST"])
        source = "FEDMED_DATALIST"
        settings = SiteSettings(site, dl, dl.parent, source, policy=policy())
    elif env.get("FEDMED_DATALIST_DIR"):
        dl = Path(env["FEDMED_DATALIST_DIR"]) / f"{site}.json"
        settings = SiteSettings(site, dl, dl.parent, "FEDMED_DATALIST_DIR", policy=policy())
    else:
        f = Path(env["FEDMED_SITE_CONFIG"]) if env.get("FEDMED_SITE_CONFIG") else kit_file(cwd, SETTINGS_FILE)
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
        device = doc.get("device")
        if device is not None:
            import re

            from fedmed.core.device import DEVICE_PATTERN

            if not isinstance(device, str) or not re.match(DEVICE_PATTERN, device):
                raise SiteConfigError(f"{site}: {source} device should be auto, cpu, cuda or cuda:N, got {device!r}")
        gb = doc.get("device_data_gb")
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or gb < 0):
            raise SiteConfigError(f"{site}: {source} device_data_gb should be a number of GiB >= 0, got {gb!r}")
        cache_dir = doc.get("cache_dir")
        if cache_dir is not None and cache_dir is not False and not isinstance(cache_dir, str):
            raise SiteConfigError(f"{site}: {source} cache_dir should be a folder or false, got {cache_dir!r}")
        if isinstance(cache_dir, str) and not Path(cache_dir).is_absolute():
            cache_dir = str(f.parent / cache_dir)
        settings = SiteSettings(site, dl, root, source, roots=[f.parent], device=device, cache_dir=cache_dir,
                                device_data_gb=gb,
                                workspace=f.parent,
                                policy=policy(f, k_min, bool(doc.get("allow_per_image", False))))
    if settings.device is None and env.get("FEDMED_DEVICE"):
        settings.device = env["FEDMED_DEVICE"]
    from fedmed.data.images import file_problem

    problem = file_problem(settings.datalist)
    if problem:
        raise SiteConfigError(f"{site}: the datalist named by {settings.source} "
                              f"{'does not exist' if problem == 'not found' else problem} "
                              f"({settings.display(settings.datalist)})")
    return settings


def settings_for_dir(site: str, datalist_dir, policy: SitePolicy | None = None) -> SiteSettings:
    """Settings of a site whose datalist is ``<datalist_dir>/<site>.json`` (simulations, tests), with ``policy`` (by
    default the one ``FEDMED_SITE_POLICY`` names, else the defaults)."""
    dl = Path(datalist_dir) / f"{site}.json"
    if policy is None:
        f = os.environ.get("FEDMED_SITE_POLICY")
        policy = SitePolicy.from_file(f) if f else SitePolicy()
    per_image = _truthy(os.environ.get("FEDMED_ALLOW_PER_IMAGE"))
    return SiteSettings(site, dl, dl.parent, "datalist dir", policy=policy.with_site_settings(allow_per_image=per_image))
