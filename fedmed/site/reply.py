"""The one reply loop every federation runs at a site (the FLARE site executor and the in-process federation):
:func:`answer` makes the site's runner at its first task (classification, segmentation or Fed-MAE) and answers each
task with the runner's reply, or with a one-line error that carries no path and no name of the site's data."""

from __future__ import annotations

import numpy as np

from fedmed.core.schema import task_config
from fedmed.site.runner import SiteRunner
from fedmed.site.settings import redact, redact_strings
from fedmed.site.tasks import Reply

__all__ = ["Reply", "answer", "local_message", "make_runner", "scrubbed", "to_meta"]


# ---------------------------------------------------------------------- one reply loop, for every federation
def make_runner(site: str, settings, cfg: dict) -> SiteRunner:
    """The runner of the site tasks ``cfg`` asks for (image classification, Fed-MAE, 3D or 2D segmentation)."""
    task = task_config(cfg).task
    if task == "mae":
        from fedmed.site.mae import MAESiteRunner

        return MAESiteRunner(site, settings)
    if task == "segmentation" and task_config(cfg).data.spatial_dims == 2:
        from fedmed.site.seg2d import Seg2DSiteRunner

        return Seg2DSiteRunner(site, settings)
    if task == "segmentation":
        from fedmed.site.seg import SegSiteRunner

        return SegSiteRunner(site, settings)
    return SiteRunner(site, settings)


def to_meta(d: dict) -> dict:
    """Arrays travel in the reply's meta as lists (NVFlare: ``FLModel.meta``)."""
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}


def scrubbed(site: str, runner: SiteRunner | None, err: Exception, allow=()) -> str:
    """The one-line error a site sends for ``err``: named by the site, its public text (the position and the kind of
    problem: ``DataError.public``) with every path and every name of the site's datalist redacted
    (:func:`fedmed.site.settings.redact`)."""
    text = getattr(err, "public", None) or _text(err)
    msg = text if text.startswith(site) else f"{site}: {type(err).__name__}: {text}"
    msg = " ".join(msg.split())  # one line
    return redact(msg, runner.private_tokens if runner is not None else (), allow)


def local_message(site: str, runner: SiteRunner | None, err: Exception) -> str:
    """The same error as the site's own log has it: files named relative to the data root (never sent)."""
    msg = _text(err) if _text(err).startswith(site) else f"{site}: {type(err).__name__}: {_text(err)}"
    return runner.settings.scrub(msg) if runner is not None else msg


def _text(err: Exception) -> str:
    """An error's message; a pydantic validation error (a task's options) as one line per bad key, never its dump
    and web address (:func:`fedmed.core.schema.error_lines`)."""
    from pydantic import ValidationError

    from fedmed.core.schema import error_lines

    return "; ".join(error_lines(err)) if isinstance(err, ValidationError) else str(err)


def answer(site: str, runner: SiteRunner | None, task: str, params: dict, cfg: dict, round_: int,
           settings=None, workspace=None) -> tuple[SiteRunner | None, Reply, str | None]:
    """One task at one site, as every federation runs it: ``(runner, reply, log)`` — the site's runner (its state,
    kept for the next task), its :class:`~fedmed.site.tasks.Reply` to the server, and ``log``, what only the site's
    own log gets.

    The runner is made at the site's first task (``settings``: its :class:`~fedmed.site.settings.SiteSettings` or a
    folder holding ``<site>.json``; by default what :func:`~fedmed.site.settings.resolve_site_settings` finds). A
    task the site cannot do is answered with ``meta = {"error": message}`` naming the site, the split and position and
    the kind of problem (:func:`scrubbed`); every string of a reply is redacted of paths and of the names in the site's
    datalist. ``error`` is the site's own one-line message (files named relative to the data root), then the
    traceback on the lines after it, for the site's own log only — the line at error level, the traceback at debug
    level (``log``; ``None`` when the task succeeded)."""
    import traceback

    known = [site]  # the site's own name, which the server knows: never redacted (a job's class names grant nothing:
    # a datalist's label written as a class name is no private token, an id of the same text is; settings.private_tokens)
    try:
        t = task_config(cfg)  # validated once for this task; the runner and the task read the typed config
        if runner is None:
            if settings is None:  # the site's own settings (FEDMED_* variables or its startup kit)
                from fedmed.site.settings import resolve_site_settings

                settings = resolve_site_settings(site)
                if workspace is not None:  # the process's own site folder (FLARE's) where the settings name none
                    settings = settings.in_workspace(workspace)
            runner = make_runner(site, settings, t)
        reply = runner.handle(task, params or {}, t, round_)
        meta = redact_strings(reply.meta, runner.private_tokens, known)  # no path, no name in any text
    except Exception as e:  # reported to the server by name; the federation goes on
        msg = scrubbed(site, runner, e, known)
        return runner, Reply(site, {"failed": 1.0}, {"error": msg, "task": task}, {}), \
            f"{local_message(site, runner, e)}\n{traceback.format_exc()}"
    meta = to_meta({**meta, "task": task, "round": round_, "cluster": meta.get("cluster", t.cluster)})
    return runner, Reply(site, reply.metrics, meta, reply.params), None
