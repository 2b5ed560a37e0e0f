"""What makes a run the same run: the fingerprint ``--resume`` matches before it reuses a saved one."""

from __future__ import annotations

import hashlib
import json
import os



# config settings added after runs were made, as (section, key, default): left out of a run's fingerprint at their
# default, so that --resume still reuses the runs made before the setting existed (which trained as its default does)
ADDED_AT_DEFAULT = (("train", "lr_schedule", "constant"), ("train", "norm_recalibrate", False))


def run_fingerprint(exp, method, seed: int, paths: str | None = None) -> str:
    """What determines one (seed, method) run: the resolved config (less the other methods, the seed list,
    the sweep block, the serving plan and the reporting and tracking choices; :func:`fingerprinted_config`), the
    method's settings and the seed. ``--resume`` reuses a run only when this matches. The files under
    ``dataset.path`` are not hashed: a dataset replaced in place needs a run without ``--resume``. ``paths``: the
    config's file paths as given (None), or each written ``absolute`` or ``relative`` to the working folder
    (:func:`same_run`)."""
    import hashlib

    blob = json.dumps({"config": fingerprinted_config(exp, paths),
                       "method": method.model_dump(mode="json") if method is not None else None,
                       "seed": seed}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def fingerprinted_config(exp, paths: str | None = None) -> dict:
    """The part of ``exp`` a run's fingerprint hashes; a setting of :data:`ADDED_AT_DEFAULT` at its default is left
    out. ``paths``: ``absolute`` or ``relative`` rewrites the data and weights paths so, from the working folder."""
    import os

    from fedmed.run.taskconfig import model_exclude

    skip = {k: True for k in ("methods", "seeds", "sweep", "name", "selection", "references", "tracking", "serving")}
    cfg = exp.model_dump(mode="json", exclude={**skip, "model": model_exclude(exp.model)})  # a bundle: its arch, weights
    for section, key, default in ADDED_AT_DEFAULT:
        if cfg.get(section, {}).get(key, default) == default:
            cfg.get(section, {}).pop(key, None)
    for s in (cfg.get("dataset") or {}).get("sources") or []:  # added later (#89): at its default, out of the hash
        if not s.get("drop_sites"):
            s.pop("drop_sites", None)
    if paths is not None:
        def rewrite(box: dict, key: str) -> None:
            v = box.get(key)
            if isinstance(v, str) and v and not v.startswith("builtin:"):
                full = os.path.abspath(os.path.expanduser(v))
                box[key] = full if paths == "absolute" else os.path.relpath(full)

        d = cfg.get("dataset") or {}
        rewrite(d, "path")
        for s in d.get("sources") or []:
            rewrite(s, "path")
        for key in ("init_weights", "bundle"):
            rewrite(cfg.get("model") or {}, key)
    return cfg


def run_fingerprints(exp, method, seed: int) -> set:
    """The fingerprints a saved run of this (seed, method) may carry: the config as given, or with its data and
    weights paths written the other way (absolute, or relative to the working folder) — the same files, named from
    here. A weights file named ``.venv/...`` once and ``/work/.../.venv/...`` the next time is not a new run."""
    return {run_fingerprint(exp, method, seed, p) for p in (None, "absolute", "relative")}


def same_run(saved_fingerprint, exp, method, seed: int) -> bool:
    """A saved run's fingerprint is this (seed, method)'s (:func:`run_fingerprints`)."""
    return bool(saved_fingerprint) and saved_fingerprint in run_fingerprints(exp, method, seed)
