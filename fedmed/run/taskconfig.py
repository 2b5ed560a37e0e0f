"""The task config: what a job sends to the sites (and its server workflow reads) for one method and seed.

A plain dict built from the experiment config alone — no site's data or paths — so the same job runs anywhere.
``fedmed_flare.build`` builds FLARE jobs around it; :func:`fedmed.workflows.fedavg_in_process` and the references run
the same site code with it.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError



class BuildError(FedmedError, ValueError):
    """A job that cannot be built from this config; the message names the key or file."""


def min_clients(configured: int, sites: list[str] | None) -> int:
    """The quorum of a job: ``federation.min_clients``, lowered to the number of sites when the job is aimed at
    fewer named sites (a resumed run without a dead site); FLARE's job meta gets the same number."""
    return min(int(configured), len(sites)) if sites else int(configured)


def model_exclude(model) -> set:
    """What of the model section stays out of a task config and a run's fingerprint: the bundle (its arch, args and
    weights are there) and an unset preprocessing (so a run without one is the run it was before the field)."""
    return {"bundle"} | ({"preprocessing"} if model.preprocessing is None else set())


def build_task_config(exp, seed: int, method, sites: list[str] | None) -> dict:
    """The plain-dict config that travels to sites in each task's ``meta['task_config']`` (and to the server): the
    experiment's sections, and what the method adds (:meth:`fedmed.methods.Method.task_options`)."""
    fed = exp.federation
    common = {"seed": int(seed), "model": exp.model.model_dump(exclude=model_exclude(exp.model)), "train": exp.train.model_dump(),
              "privacy": exp.privacy.model_dump(), "plugins": plugin_modules(exp, method),
              "federation": {"sites": sites, "min_clients": min_clients(fed.min_clients, sites),
                             "task_timeout": fed.task_timeout, "startup_timeout": fed.startup_timeout}}
    from fedmed.core.policy import tracking_destinations

    dests = tracking_destinations(exp.tracking.model_dump())
    if dests:  # where the server's receivers send metrics besides its workspace: each site consents or sends none
        common["tracking"] = dests
    from fedmed.workflows.stopping import stop_metric

    common["train"]["stop"]["metric"] = stop_metric(exp.train.stop, exp.dataset.task, exp.selection)  # as selected
    if exp.dataset.task == "segmentation" and exp.dataset.sources:  # 2D lesion masks (fedmed.site.seg2d)
        cfg = {"task": "segmentation", **common,
               "data": {"spatial_dims": 2, "image_size": exp.dataset.image_size, "in_channels": exp.dataset.channels}}
    elif exp.dataset.task == "segmentation":
        if not exp.dataset.modalities:
            raise BuildError("dataset.modalities is empty: a segmentation job needs the modality names")
        cfg = {"task": "segmentation", **common,
               "data": {"shape": exp.dataset.shape, "roi": exp.dataset.roi, "modalities": list(exp.dataset.modalities),
                        "in_channels": len(exp.dataset.modalities)}}
    else:
        if not exp.dataset.classes:
            raise BuildError("dataset.classes is not set: a job is built from the config alone, so the config must "
                             "name the classes (fedmed experiment fills it from the data it partitions)")
        cfg = {"task": "classification", **common, "classes": list(exp.dataset.classes),
               "data": {"image_size": exp.dataset.image_size, "channels": exp.dataset.channels,
                        "n_classes": len(exp.dataset.classes)}}
    opts = method.site_options(exp, seed)
    if opts:  # a method's own site options (a plugin's): its model checks them here, and again at the site
        model = type(method).site_options_model
        if model is None:
            raise BuildError(f"method {method.name!r}: site_options without a site_options_model")
        try:
            cfg["method_options"] = model.model_validate(opts).model_dump(mode="json")
        except ValueError as e:
            raise BuildError(f"method {method.name!r}: site options: {str(e).splitlines()[0]}") from None
    for key, value in method.task_options(exp, seed).items():  # a section it adds, or keys of one it completes
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    if method.site_weights:  # a file every site holds (a server's own file is not named here: Method.server_files)
        _name_weights(cfg, method.site_weights)
    return cfg


def plugin_modules(exp, method=None) -> list[str]:
    """The module names of the config's plugins and of the method's own module (what every party imports before a
    task: a built-in method registers its site tasks and signature kind there, as a plugin does)."""
    from fedmed.core.plugins import OWN_METHODS
    from fedmed.methods import plugin_module

    own = type(method).__module__ if method is not None else ""
    return [plugin_module(str(p), exp.base_dir)[0] for p in exp.plugins] + (
        [own] if own.startswith(OWN_METHODS + ".") else [])


def _name_weights(cfg: dict, weights: str | None) -> None:
    """The encoder's weights file as a job names it: its file name and SHA-256 — every site reads its own copy from
    its weights folder (``fedmed.core.policy``); the file never travels."""
    if weights:
        from pathlib import Path

        from fedmed.core.policy import weights_ref

        if not Path(weights).is_file():
            raise BuildError(f"encoder_weights: file {weights} not found")
        cfg["encoder_weights"] = weights_ref(weights)


