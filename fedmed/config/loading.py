"""Reading an experiment config: the YAML file (and the configs it extends) read as data, ``--set`` overrides applied,
its relative paths anchored to its own folder, and the result validated into an :class:`ExperimentConfig`, every
error one line naming the file and the key."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from fedmed.config import (_PATH_KEY, MAX_CONFIG_VALUES, RELEASE, WORKFLOWS, ConfigError, ExperimentConfig,
                           method_options)
from fedmed.core.schema import error_lines
from fedmed.methods import PluginError, load_plugins

__all__ = ["apply_overrides", "load_config", "load_raw", "shipped_or_given"]


def _method_hint(err: dict, raw: dict) -> str | None:
    """'omega' on an FMCL method: name the method, the workflow(s) the option belongs to and what it takes."""
    loc = err["loc"]
    if err["type"] != "extra_forbidden" or len(loc) < 4 or loc[0] != "methods":
        return None
    idx, workflow, opt = loc[1], loc[2], loc[-1]
    try:
        name = raw["methods"][idx].get("name", idx)
    except (KeyError, IndexError, TypeError, AttributeError):
        name = idx
    owners = sorted(w for w, m in WORKFLOWS.items() if opt in m.model_fields)
    where = f" (an option of {', '.join(owners)})" if owners else ""
    return (f"methods.{name}: option {opt!r}{where} does not apply to workflow {workflow!r}; it takes "
            f"{', '.join(method_options(workflow))}")


def _format(e: ValidationError, source: str, raw: dict | None = None) -> str:
    lines = []
    for err in e.errors():
        hint = _method_hint(err, raw or {})
        if hint:
            lines.append(hint)
            continue
        lines += error_lines([err])
    if len(lines) == 1:
        return f"{source}: invalid configuration: {lines[0]}"
    return f"{source}: invalid configuration\n" + "\n".join(f"  {x}" for x in lines)


def _key(cur, key: str, dotted: str):
    """``key`` as it indexes ``cur``: a mapping key, or a list index given as a number or an item's ``name``."""
    if not isinstance(cur, list):
        return key
    if key.lstrip("-").isdigit() and -len(cur) <= int(key) < len(cur):
        return int(key)
    names = [x.get("name") for x in cur if isinstance(x, dict)]
    if key in names:
        return names.index(key)
    raise ConfigError(f"override {dotted!r}: no list item {key!r} (names: {names}, or an index < {len(cur)})")


def _set_path(d: dict, dotted: str, value):
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        k = _key(cur, k, dotted)
        if isinstance(cur, dict) and (k not in cur or not isinstance(cur[k], (dict, list))):
            cur[k] = {}
        cur = cur[k]
    cur[_key(cur, keys[-1], dotted)] = value


def apply_overrides(raw: dict, overrides: list[str] | None) -> dict:
    """``["train.rounds=5", "seeds=[0,1]", "methods.IFCA.n_clusters=2"]`` -> updated copy (values parsed as YAML
    scalars/lists; list items are addressed by index or by their ``name``)."""
    import copy

    import yaml

    out = copy.deepcopy(raw)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} should look like key.path=value")
        k, v = item.split("=", 1)
        if not v.strip() and _PATH_KEY.match(k.strip()):  # an unset shell variable: never read as "no file"
            raise ConfigError(f"override {k.strip()}= is empty (an unset shell variable?): give the file, or "
                              f"{k.strip()}=null to leave it out")
        _set_path(out, k.strip(), yaml.safe_load(v))
    return out


def _path_slots(raw: dict):
    """The file and folder paths a config names, as ``(container, key, dotted name)``: ``dataset.path``,
    ``dataset.sources[i].path``, ``model.bundle``, ``model.init_weights`` and each method's ``encoder_weights``."""
    d = raw.get("dataset")
    if isinstance(d, dict):
        yield d, "path", "dataset.path"
        for i, s in enumerate(d.get("sources") or []):
            if isinstance(s, dict):
                yield s, "path", f"dataset.sources.{i}.path"
    m = raw.get("model")
    if isinstance(m, dict):
        yield m, "bundle", "model.bundle"
        yield m, "init_weights", "model.init_weights"
    for i, meth in enumerate(raw.get("methods") or []):
        if isinstance(meth, dict):
            yield meth, "encoder_weights", f"methods.{meth.get('name', i)}.encoder_weights"


def _anchor_paths(raw: dict, folder: Path, origins: dict) -> dict:
    """Paths written in a config file are relative to **that file's folder** (as its ``plugins`` are): each relative
    one becomes the same file named from the working folder, and ``origins`` remembers what was written and where
    (for an error that says both). A path given on the command line (``--set``) stays relative to the working
    folder; ``builtin:`` datasets and absolute paths are kept as written."""
    import os
    import re

    def anchored(v):
        if not isinstance(v, str) or not v or v.startswith("builtin:") or Path(v).expanduser().is_absolute() \
                or v.strip().lower() == RELEASE:
            return v
        out = os.path.relpath(folder / v)
        origins[out] = (v, folder)
        return out

    for box, key, _ in _path_slots(raw):
        if key in box:
            box[key] = anchored(box[key])
    slot = _PATH_KEY
    for case in raw.get("sweep") or []:  # a sweep case's --set lines are written in the file too
        if isinstance(case, dict) and isinstance(case.get("set"), list):
            case["set"] = [f"{k}={anchored(v)}" if isinstance(item, str) and slot.match(k := item.split("=", 1)[0])
                           and (v := item.split("=", 1)[1]) not in ("", "null", "~") else item
                           for item in case["set"]]
    return raw


def load_config(path_or_dict, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read and validate an experiment config (YAML/JSON file or dict).

    Paths in a config file (``dataset.path``, ``dataset.sources[].path``, ``model.bundle``, ``model.init_weights``,
    ``encoder_weights``, ``plugins``) are relative to the file's folder; paths in ``overrides`` and in a dict config
    to the working folder.

    Raises:
        ConfigError: missing/unreadable file, or a validation error naming each bad key.
    """
    import yaml

    path = None
    origins: dict = {}
    if isinstance(path_or_dict, dict):
        raw, source = path_or_dict, "config"
    else:
        path = shipped_or_given(Path(path_or_dict))
        source = str(path_or_dict)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            text = path.read_text()
            raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except Exception as e:
            raise ConfigError(f"{path}: cannot parse ({type(e).__name__}: {e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level should be a mapping, got {type(raw).__name__}")
        base = raw.pop("extends", None)
        _anchor_paths(raw, path.resolve().parent, origins)
        if base:
            parent = (path.parent / base)
            raw = _merge(load_raw(parent, origins), raw)
    raw = apply_overrides(raw, overrides)
    _check_expansion(raw, source)
    base = path.resolve().parent if not isinstance(path_or_dict, dict) else Path.cwd()
    if isinstance(raw.get("plugins"), list):  # before the methods are read: a plugin registers its own
        try:
            load_plugins(raw["plugins"], base)
        except PluginError as e:
            raise ConfigError(f"{source}: {e}") from None
    try:
        exp = ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format(e, source, raw)) from None
    exp._base_dir = base
    exp._path_origins = {k: v for k, v in origins.items() if k in {b.get(key) for b, key, _ in _path_slots(raw)}}
    return exp


def _check_expansion(raw, source: str) -> None:
    """Refuse a config whose YAML anchors and aliases expand to more than :data:`MAX_CONFIG_VALUES` values (a
    430-byte "billion laughs" file is tiny as parsed — aliases share their objects — and huge as soon as anything
    prints or copies it), before anything else reads it."""
    memo: dict = {}

    def size(v, depth=0):
        if depth > 200:
            raise ConfigError(f"{source}: nests deeper than 200 levels")
        if not isinstance(v, (dict, list)):
            return 1
        if id(v) in memo:
            return memo[id(v)]
        items = v.values() if isinstance(v, dict) else v
        n = 1
        for x in items:
            n += size(x, depth + 1)
            if n > MAX_CONFIG_VALUES:
                break
        memo[id(v)] = n
        return n

    n = size(raw)
    if n > MAX_CONFIG_VALUES:
        raise ConfigError(f"{source}: expands to more than {MAX_CONFIG_VALUES} values (YAML anchors and aliases "
                          f"nested into each other?); a config holds a few hundred")


def shipped_or_given(path: Path) -> Path:
    """``path`` as given (relative to the caller's folder); a relative ``app_configs/<name>`` that is not there is
    the config shipped with fedmed (``fedmed.core.resources``), so the shipped configs can be named from any folder
    and in an installed fedmed."""
    if path.is_file() or path.is_absolute() or not path.parts or path.parts[0] != "app_configs":
        return path
    from fedmed.core.resources import ResourceError, project_root

    try:
        shipped = project_root() / path
    except ResourceError:
        return path
    return shipped if shipped.is_file() else path


def load_raw(path: Path, origins: dict | None = None) -> dict:
    import yaml

    if not path.is_file():
        raise ConfigError(f"{path}: base config (extends) not found")
    raw = yaml.safe_load(path.read_text())
    base = raw.pop("extends", None)
    _anchor_paths(raw, path.resolve().parent, {} if origins is None else origins)
    return _merge(load_raw(path.parent / base, origins), raw) if base else raw


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
