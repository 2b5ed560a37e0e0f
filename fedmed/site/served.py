"""What a site keeps of the serving plan: the model it is served, in its own workspace (``served/<key>/model.pt`` and
its MONAI bundle), a checkpoint ``fedmed predict`` runs on; never sent."""

from __future__ import annotations

from pathlib import Path

from fedmed.core.schema import TaskConfig, task_config


SERVED_DIR = "served"  # a site's served models, in its own workspace: served/<key>/model.pt (+ bundle/)


def served_path(key: str) -> str:
    """Where a site keeps the model a serving plan ``key`` serves it, relative to its workspace."""
    return f"{SERVED_DIR}/{key}/model.pt"


def keep_served(runner, model, cfg: TaskConfig) -> dict:
    """A serving plan's task (``serve_keep``): the site keeps ``model`` — the one it is served, shared or made at the
    site — in its own workspace (a kit's ``local/``, the simulator's site folder: ``runner.settings.workspace``) as
    :func:`served_path`, a checkpoint ``fedmed predict`` runs on, with the model's MONAI bundle beside it; never sent.
    Returns ``{"served_kept": True}`` (the server knows the path from the key), or ``{}`` with a note where the site
    has no workspace folder."""
    cfg = task_config(cfg)
    if not cfg.serve_keep:
        return {}
    ws = getattr(runner.settings, "workspace", None)
    if ws is None:
        runner.notes.append(f"{runner.site}: it has no workspace folder to keep the model it is served in")
        return {}
    from fedmed.nn.predict import save_model
    from fedmed.nn.train import get_params

    path = Path(ws) / served_path(cfg.serve_keep)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(path, get_params(model), cfg.model_dump(), workflow="serving plan")
    if cfg.task == "classification":
        from fedmed.nn.bundle import export_bundle

        try:
            export_bundle(path, path.parent / "bundle", policy=runner.policy)
        except Exception as e:  # the checkpoint is there; the bundle is a convenience
            runner.notes.append(f"{runner.site}: its served model's bundle was not written ({type(e).__name__})")
    return {"served_kept": True}
