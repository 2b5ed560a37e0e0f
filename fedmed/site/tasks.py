"""A classification site's tasks, as functions of (the site's runner — its data, models and optimizers —, the
params it is served, the typed task config, the round) -> :class:`Reply`.

* ``train``: score the served model on the local validation and test splits, train it locally, return the update
  with the served model's metrics. ``validate``: score the served model only.
* ``validate_ensemble``, ``serve_score``, ``local_model``, ``norm_stats``, ``finetune_local``: see each function.
* a method's own tasks (FMCL's ``signature``, Flux's ``latent_bounds`` / ``descriptor``, ``ifca``, PreP-WFL's
  ``class_set``) live in its module of ``fedmed.methods``, registered with :func:`register_task` as a plugin's are.
* a task's own options (the serving plan's, the ensemble's weights, IFCA's K) travel in the task config's
  ``method_options``, each read through the task's own model (:class:`ServeScoreOptions`, :class:`EnsembleOptions`).

What a reply carries: parameters (training tasks), metric values over at least ``k_min`` samples, and aggregates
(confusion matrices and score histograms with rows of fewer than ``k_min`` samples zeroed, sample counts,
signatures of classes with at least ``k_min`` samples). Never images, labels or per-sample outputs
(docs/privacy.md). The runner (:class:`fedmed.site.runner.SiteRunner`) holds the state between tasks; segmentation
and Fed-MAE sites have their own task tables (:mod:`fedmed.site.seg`, :mod:`fedmed.site.mae`).
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import zlib
from pathlib import Path
from typing import Annotated, NamedTuple

import numpy as np
from pydantic import Field, StringConstraints

from fedmed.core.packing import unpack_model, unpack_models
from fedmed.core.schema import Strict, TaskConfig, task_config
from fedmed.site.served import keep_served

__all__ = ["CLASSIFICATION", "PLUGIN_TASKS", "Reply", "TaskError", "finetune_config", "norm_stats", "pseudo_labelled", "register_task", "serve_score", "served_metrics", "served_model", "serving_reply", "task_seed", "train", "train_locally", "validate", "validate_ensemble"]


def task_seed(cfg: dict, site: str, round_: int | None = None, *, salt: int = 0) -> int:
    """The one seed rule of every site task: from the run's seed, the site's name and — for what changes every round
    (training batches, augmentation, patches) — the round; ``salt`` keeps a site's one-off draws apart (signatures,
    descriptors, assessments). Deterministic across processes (``zlib.crc32``, not ``hash``)."""
    seed, crc = task_config(cfg).seed, zlib.crc32(site.encode())
    if round_ is not None:
        return seed * 1_000_003 + int(round_) * 7919 + crc
    return (seed * 7919 + crc + int(salt)) % (2**32)


class TaskError(FedmedError, RuntimeError):
    """A task this site cannot perform; the message says why (names files where relevant)."""


class Reply(NamedTuple):
    """A site's reply to one task — the one shape from a site task to the workflow: what every site task returns, what
    :func:`fedmed.site.reply.answer` hands its federation (FLARE's ``FLModel`` carries its fields) and each row a
    workflow reads (``for site, metrics, meta, params in rows``). ``meta`` holds the aggregates the task releases; a
    site that could not do the task sends its one-line reason as ``meta["error"]`` (:attr:`error`) and no
    parameters."""

    site: str
    metrics: dict
    meta: dict
    params: dict

    @property
    def error(self) -> str | None:
        return self.meta.get("error")


def _eval_sets(runner, cfg):
    """(name, x, y) of what the served model is scored on: validation and test splits; an unseen
    site that never trained is scored on all its data."""
    import torch

    s = runner.splits(cfg)
    if task_config(cfg).evaluate_on == "all":
        return [("test", torch.cat([s.train[0], s.val[0], s.test[0]]), torch.cat([s.train[1], s.val[1], s.test[1]]))]
    return [("val", *s.val), ("test", *s.test)]


def _metrics_of(runner, prob_fn, cfg):
    """Metrics of the served model (``prob_fn(x) -> (n, C)`` probabilities) on each evaluation set:
    test metrics under their plain names, validation metrics prefixed ``val_``."""
    from fedmed.algorithms.metrics import site_metrics

    metrics, meta = {}, {}
    k = runner.k_min(cfg)
    n_classes = task_config(cfg).data.n_classes
    for name, x, y in _eval_sets(runner, cfg):
        if x.shape[0] == 0:
            continue
        res = site_metrics(y.numpy(), prob_fn(runner.on_device(x, cfg)), n_classes, k_min=k)
        pre = "" if name == "test" else "val_"
        metrics.update({pre + m: res[m] for m in ("accuracy", "macro_f1", "macro_acc", "auc")})
        meta.update({pre + "n_test": res["n_test"], pre + "confusion": res["confusion"],
                     pre + "score_hist": res["score_hist"], pre + "withheld": res["withheld"]})
    return metrics, meta


def served_metrics(runner, model, cfg):
    from fedmed.nn.train import predict_proba

    return _metrics_of(runner, lambda x: predict_proba(model, x, precision=runner.precision(cfg)), cfg)


def served_model(runner, params: dict, cfg: TaskConfig):
    """The model the site serves: the server's ``params``; under FedBN (``train.local_norm``) with the site's own
    batch-norm layers once it has trained them (the first round takes the server's)."""
    from fedmed.nn.train import set_params

    model = runner.model(cfg)
    set_params(model, params)
    c = task_config(cfg)
    if c.serve_personal:  # a serving plan: the run's model with this site's own layers, as the run served it
        apply_personal(runner, model, c.serve_personal)
        return model
    own = runner.local_norm.get(c.cluster) if c.train.local_norm else None
    if own:
        _set_state(model, own)
    return model


def _set_state(model, values: dict) -> None:
    import torch

    state = model.state_dict()
    with torch.no_grad():
        for k, v in values.items():
            state[k].copy_(torch.as_tensor(v))


def apply_personal(runner, model, key: str) -> None:
    """Load into ``model`` the layers this site kept under ``key`` (:meth:`SiteRunner.personal_file`: a FedBN run's
    batch-norm layers after its last round). Raises :class:`TaskError` when the site has none (another site's run, a
    run before personal models were kept, a cleared cache)."""
    import torch

    f = runner.personal_file(key)
    if f is None or not f.is_file():
        raise TaskError(f"{runner.site}: holds no personal model {key} (a FedBN run's own batch-norm layers: kept in "
                        f"the site's cache folder by runs since they were; run it again)")
    own = torch.load(f, map_location="cpu", weights_only=True)
    names = set(model.state_dict())
    if not own or set(own) - names:
        raise TaskError(f"{runner.site}: its personal model {key} does not fit this network")
    _set_state(model, own)


def _keep_local_norm(runner, model, cfg) -> None:
    """FedBN: after local training the site keeps its batch-norm layers for the next round's model; with
    ``personal_key`` also on disk, for a serving plan after the run (:func:`apply_personal`)."""
    c = task_config(cfg)
    if c.train.local_norm:
        from fedmed.nn.train import norm_keys

        state = model.state_dict()
        own = {k: state[k].detach().clone().cpu() for k in norm_keys(model)}
        runner.local_norm[c.cluster] = own
        f = runner.personal_file(c.personal_key) if c.personal_key else None
        if c.personal_key and f is None and "personal_noted" not in runner.state:
            runner.state["personal_noted"] = True
            runner.notes.append(f"{runner.site}: runs without a cache folder: its personal batch-norm layers are not "
                                f"kept for a serving plan")
        if f is not None:
            import os

            import torch

            try:
                f.parent.mkdir(parents=True, exist_ok=True)
                tmp = f.with_suffix(f".{os.getpid()}.tmp")
                torch.save(own, tmp)
                os.replace(tmp, f)
            except OSError as e:
                runner.notes.append(f"{runner.site}: its personal batch-norm layers were not kept ({type(e).__name__})")


def _personal(runner, cfg):
    """Ditto (Li et al. 2021; ``ditto_lambda``): the site's personal model, kept in its runner between rounds and
    started from the first global model it received; ``None`` without Ditto."""
    import copy

    if not task_config(cfg).ditto_lambda:
        return None
    if "personal" not in runner.state:
        runner.state["personal"] = copy.deepcopy(runner.model(cfg))
    return runner.state["personal"]


def validate(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    model = served_model(runner, params, cfg)
    personal = _personal(runner, cfg)
    metrics, meta = served_metrics(runner, personal if personal is not None else model, cfg)
    meta.update(keep_served(runner, personal if personal is not None else model, cfg))
    return Reply(runner.site, metrics, meta, {})


def _finetune_optimizer(model, cfg: TaskConfig):
    """001_ fine-tuning: AdamW with layer-wise lr decay groups."""
    import torch

    from fedmed.nn.mae import layerwise_param_groups

    from fedmed.core.device import fused_kwargs

    return torch.optim.AdamW(layerwise_param_groups(model, cfg.finetune.layer_decay), lr=cfg.train.lr,
                             weight_decay=cfg.train.weight_decay, **fused_kwargs(model))


def _finetune_schedule(cfg: TaskConfig, round_: int):
    """001_ fine-tuning: warm-up then cosine over the whole federated run, as a function of the fraction of this
    round's local steps; None without fine-tuning (constant lr)."""
    ft = cfg.finetune
    if not ft:
        return None
    from fedmed.nn.mae import scheduled_lr

    return lambda f: scheduled_lr(cfg.train.lr, (round_ + f) / ft.rounds, ft.warmup)


def train_locally(runner, model, cfg, round_, key, *, mu=None, anchor=None) -> dict:
    """Local training of the served model (the recipe's optimizer kept per served model; fine-tuning's own); ``mu``
    and ``anchor``: a proximal term toward ``anchor`` instead of FedProx's (Ditto's personal model)."""
    from fedmed.nn.recipe import resolved, round_schedule
    from fedmed.nn.train import train_local

    s = runner.splits(cfg)
    runner.require_k_min(int(s.train[0].shape[0]), "training images", cfg, "training")
    cfg = task_config(cfg)
    t = cfg.train
    make = (lambda: _finetune_optimizer(model, cfg)) if cfg.finetune else None
    out = train_local(model, runner.on_device(s.train[0], cfg), s.train[1], epochs=t.local_epochs,
                      batch_size=t.batch_size,
                      optimizer=runner.optimizer(model, cfg, key, make=make),
                      mu=mu if mu is not None else t.fedprox_mu, anchor=anchor,
                      class_weights=cfg.class_weights, generator=runner.generator(cfg, round_),
                      augment=t.augment, lr_at=_finetune_schedule(cfg, round_) or round_schedule(t, round_),
                      precision=runner.precision(cfg), frozen_norm=resolved(t, cfg.model)["norm_stats"] == "frozen")
    if not np.isfinite(out["loss"]):
        raise TaskError(f"{runner.site}: training diverged (loss {out['loss']}) in round {round_}")
    runner.skipped_note(out, cfg)
    return {"n_train": int(s.train[0].shape[0]), "train_loss": out["loss"], "steps": out["steps"]}


def train(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    from fedmed.nn.train import get_params

    model = served_model(runner, params, cfg)
    personal = _personal(runner, cfg)
    metrics, meta = served_metrics(runner, personal if personal is not None else model, cfg)
    anchor = [p.detach().clone() for p in model.parameters()] if personal is not None else None
    meta.update(train_locally(runner, model, cfg, round_, task_config(cfg).cluster))
    if personal is not None:  # Ditto: the personal model trained on the same data, pulled toward this round's global
        train_locally(runner, personal, cfg, round_, "personal", mu=task_config(cfg).ditto_lambda, anchor=anchor)
    _keep_local_norm(runner, model, cfg)
    metrics["train_loss"] = meta["train_loss"]
    return Reply(runner.site, metrics, meta, get_params(model))


def norm_stats(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """``train.norm_recalibrate``: the batch-norm running statistics of the served model (``params`` as sent) over
    this site's training images — per layer the per-channel mean and variance, a cumulative average over its batches
    (:func:`fedmed.nn.train.norm_statistics`) — and the number of batches. Aggregates over at least ``k_min`` images;
    nothing is sent under differential privacy."""
    from fedmed.nn.train import norm_statistics, set_params

    c = task_config(cfg)
    if c.privacy.dp_epsilon:
        raise TaskError(f"{runner.site}: batch-norm statistics are not sent under differential privacy "
                        f"(privacy.dp_epsilon)")
    s = runner.splits(cfg)
    n = int(s.train[0].shape[0])
    runner.require_k_min(n, "training images", cfg, "batch-norm statistics")
    model = runner.model(cfg)
    set_params(model, params)
    stats, n_batches = norm_statistics(model, runner.on_device(s.train[0], cfg), c.train.batch_size)
    return Reply(runner.site, {"n_batches": float(n_batches)}, {"n_train": n, "n_batches": n_batches}, stats)


def pseudo_labelled(runner, params: dict, cfg):
    """The classes the served model (``params``) predicts for all the site's images (training, validation, test)."""
    import torch

    from fedmed.nn.train import predict_proba

    s = runner.splits(cfg)
    x = torch.cat([s.train[0], s.val[0], s.test[0]])
    model = served_model(runner, params, cfg)
    return predict_proba(model, runner.on_device(x, cfg), precision=runner.precision(cfg)).argmax(axis=1)

class EnsembleOptions(Strict):
    """``validate_ensemble``'s options (the task config's ``method_options``): a weight per packed model."""

    weights: list[float] = Field(min_length=1)


def validate_ensemble(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """Score the weighted average of K models' class probabilities (how the Flux paper gives
    baselines without test-time assignment a prediction on unseen sites)."""
    from fedmed.nn.train import predict_proba, set_params

    model = runner.model(cfg)
    weights = np.asarray(EnsembleOptions.model_validate(task_config(cfg).method_options).weights, dtype=np.float64)
    weights = weights / weights.sum()

    def prob(x):
        out = 0.0
        for k, w in enumerate(weights):
            set_params(model, unpack_model(params, k))
            out = out + w * predict_proba(model, x, precision=runner.precision(cfg))
        return out

    metrics, meta = _metrics_of(runner, prob, cfg)
    return Reply(runner.site, metrics, meta, {})


class FinetuneLocalOptions(Strict):
    """``finetune_local``'s site options (the task config's ``method_options``; ``fedmed.methods.FinetuneLocalMethod``):
    local epochs, and the learning rate as a share of ``train.lr``."""

    epochs: int = Field(2, ge=1)
    lr_scale: float = Field(0.1, gt=0, le=1)


FINETUNE_ROUND = 0  # the seed stream of a site's fine-tuning: the same whatever round the task comes in


def finetune_at_site(runner, model, cfg: TaskConfig, opts) -> dict:
    """The one fine-tuning of a served model at its site (#86): the ``finetune_local`` method's last round, the serving
    plan's ``finetuned`` candidate and its remake in the plan's served round are the same model from the same seed —
    ``opts.epochs`` at ``opts.lr_scale`` x ``train.lr``, a fresh optimizer, the data order of :data:`FINETUNE_ROUND`."""
    return train_locally(runner, model, finetune_config(cfg, opts), FINETUNE_ROUND, "finetune")


def finetune_config(cfg: TaskConfig, opts: FinetuneLocalOptions) -> TaskConfig:
    """The task config of a site's own fine-tuning: ``opts.epochs`` at ``opts.lr_scale`` x ``train.lr`` (constant,
    whatever the run's ``lr_schedule``), a fresh optimizer."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={
        "lr": cfg.train.lr * opts.lr_scale, "local_epochs": opts.epochs, "keep_optimizer_state": False,
        "lr_schedule": "constant"})})


def finetune_local(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """The served model fine-tuned at the site: the final global model trained ``epochs`` more on the site's own
    training split at ``lr_scale`` x ``train.lr`` (a fresh optimizer), then scored on its validation and test splits
    — the site's model, which never leaves it (only its metrics do)."""
    cfg = task_config(cfg)
    opts = FinetuneLocalOptions.model_validate(cfg.method_options)
    model = served_model(runner, params, cfg)
    out = finetune_at_site(runner, model, cfg, opts)
    metrics, meta = served_metrics(runner, model, cfg)
    metrics["train_loss"] = out["train_loss"]
    meta.update(out)
    meta.update(keep_served(runner, model, cfg))
    return Reply(runner.site, metrics, meta, {})


LOCAL_ROUND = 100_000  # the seed stream of a site's own model (serving's "local"): block b trains with round LOCAL_ROUND+b


def train_site_model(runner, model, cfg: TaskConfig) -> dict:
    """The serving plan's ``local`` candidate (#85): the site's own model — ``model`` (the run's starting model)
    trained only on this site's training split, in blocks of ``train.local_epochs`` epochs (a fresh optimizer each, as
    a federated round's), up to ``train.rounds`` blocks, ended by the run's stop rule (``train.stop``) on this site's
    validation accuracy, one more block after the one that ends it; the final model (not the best block's: the plan
    then compares it with the global model on the same validation items). The same model from the same seed wherever
    it is made (its data order: :data:`LOCAL_ROUND`). Never sent."""
    from fedmed.nn.train import predict_proba
    from fedmed.algorithms.stopping import Stopper

    cfg = task_config(cfg)
    local = cfg.model_copy(update={"train": cfg.train.model_copy(update={"keep_optimizer_state": False})})
    stop = Stopper.from_config(cfg.train, metric="val_accuracy")
    xv, yv = runner.splits(cfg).val
    halted, out, blocks = False, {}, 0
    for b in range(cfg.train.rounds):
        out = train_locally(runner, model, local, LOCAL_ROUND + b, "local")
        blocks += 1
        if halted:
            break
        acc = float((np.asarray(predict_proba(model, runner.on_device(xv, cfg))).argmax(1) == yv.numpy()).mean()) \
            if len(yv) else float("nan")
        halted = stop.observe(b, acc)
    return {"train_loss": out.get("train_loss"), "local_blocks": blocks}


def local_model(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """A serving plan's served round for a site served its own model: ``params`` (the run's starting model) trained
    again exactly as ``serve_score`` trained it (:func:`train_site_model`), scored on the site's validation and test
    splits and kept in its workspace (``serve_keep``); only its metrics leave the site."""
    cfg = task_config(cfg)
    model = served_model(runner, params, cfg)
    out = train_site_model(runner, model, cfg)
    metrics, meta = served_metrics(runner, model, cfg)
    metrics["train_loss"] = out["train_loss"]
    meta.update(out)
    meta.update(keep_served(runner, model, cfg))
    return Reply(runner.site, metrics, meta, {})


class ServeScoreOptions(Strict):
    """``serve_score``'s site options (the task config's ``method_options``): the names of the packed models, the
    first the reference (the global model), and optionally that model fine-tuned at the site as one more candidate
    (``finetuned``; :class:`FinetuneLocalOptions`)."""

    names: list[str] = Field(min_length=1)
    finetune: FinetuneLocalOptions | None = None
    personal: dict[str, Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]] = Field(
        default_factory=dict, description="candidates scored with this site's own layers kept under a key (a FedBN "
        "run's personal model; apply_personal): name -> key")
    local: bool = Field(False, description="one more packed model, after the named ones: the run's starting model, "
                        "trained here on this site's data alone and scored as 'local' (train_site_model)")


def _score_candidates(runner, cfg, opts, models: dict, item_scores, finetune, local):
    """Each packed model scored per validation item at the site (and the reference fine-tuned there, and the site's
    own model, when asked): (scores, proper scores, meta, why a model was not scored)."""
    from fedmed.nn.train import set_params

    model = runner.model(cfg)
    scores, proper, meta, withheld = {}, {}, {}, {}

    def keep(name, got):
        if isinstance(got, tuple):
            got, proper[name] = got[0], np.asarray(got[1], dtype=np.float64)
        scores[name] = np.asarray(got, dtype=np.float64)

    for i, name in enumerate(opts.names):
        set_params(model, models[i])
        try:
            if name in opts.personal and i > 0:
                apply_personal(runner, model, opts.personal[name])
            keep(name, item_scores(model))
        except TaskError as e:  # no evidence for it here (no personal model; a model blind to the image)
            runner.notes.append(f"{e}; {name} is not scored here")
            withheld[name] = str(e).removeprefix(f"{runner.site}: ")
    if opts.finetune is not None:
        set_params(model, models[0])
        try:
            got, extra = finetune(model, opts.finetune)
            keep("finetuned", got)
            meta.update(extra)
        except TaskError as e:
            runner.notes.append(f"{e}; finetuned is not scored here")
            withheld["finetuned"] = str(e).removeprefix(f"{runner.site}: ")
    if opts.local:  # the site's own model, from the run's starting model (packed after the named ones)
        set_params(model, models[len(opts.names)])
        try:
            got, extra = local(model)
            keep("local", got)
            meta.update(extra)
        except TaskError as e:
            runner.notes.append(f"{e}; local is not scored here")
            withheld["local"] = str(e).removeprefix(f"{runner.site}: ")
    return scores, proper, meta, withheld


def _withhold_unsafe(runner, cfg, opts, scores: dict, proper: dict, withheld: dict, k: int):
    """Candidates whose comparison would say too little or too much are withheld (fewer patients than MIN_PATIENTS
    behind the validation items; two models differing on fewer than k_min items, whose replies could be differenced):
    (the reference's name, each item's patient or None, the scored models in order)."""
    from fedmed.algorithms.serving import MIN_PATIENTS, differing_items

    ref = opts.names[0]
    units = runner.val_units(cfg)  # each validation item's patient, where the datalist names them (#86)
    n_units = len(set(map(str, units))) if units is not None else None
    if n_units is not None and n_units == len(units):  # a patient per item: the items are the units
        units = n_units = None
    if n_units is not None and n_units < MIN_PATIENTS:  # slices of one patient are one unit of evidence
        withheld.update({n: f"its validation items come from {n_units} patient(s), fewer than {MIN_PATIENTS}: too "
                            f"few patients to decide" for n in [*opts.names[1:], "finetuned", "local"] if n in scores})
    # two models whose items differ on 1..k_min-1 items: their replies could be differenced to single those items out
    order = [n for n in [*opts.names, "finetuned", "local"] if n in scores]
    for j, b in enumerate(order):
        for a in order[:j]:
            if a in withheld or b in withheld:
                continue
            m = differing_items(np.column_stack([scores[a], proper.get(a, scores[a])]),
                                np.column_stack([scores[b], proper.get(b, scores[b])]))
            if 0 < m < k:
                withheld[b] = (f"its scores differ from {a}'s on fewer than k_min validation items: replies that "
                               f"could be differenced are not sent")
    return ref, units, order


def serving_reply(runner, params: dict, cfg: TaskConfig, item_scores, metric: str, finetune=None, local=None) -> Reply:
    """What a site's ``serve_score`` sends, whatever it scores: each packed model (the first the reference) is loaded
    into the site's network and scored per validation item by ``item_scores(model)`` (higher is better; NaN: not
    scored); ``finetune(model)`` — the reference loaded — may add the model fine-tuned at the site as ``finetuned``
    (returning its scores and meta). ``item_scores`` may return a pair ``(scores, proper)``: then ``proper`` is each
    item's proper score (a classifier's negative Brier score), whose paired differences the site sums too. Sends per
    candidate only its paired aggregates against the reference (:func:`fedmed.algorithms.serving.paired_counts`:
    counts and score sums; nothing under ``k_min`` items) and each model's mean ``val_<metric>/<name>`` — never a
    per-item value."""
    from fedmed.algorithms.serving import paired_counts

    opts = ServeScoreOptions.model_validate(cfg.method_options)
    if {"finetuned", "local"} & set(opts.names[1:]) or len(set(opts.names)) != len(opts.names):
        raise TaskError(f"{runner.site}: serve_score: candidate names must be distinct and not 'finetuned' or "
                        f"'local', got {opts.names}")
    if opts.finetune is not None and finetune is None:
        raise TaskError(f"{runner.site}: serve_score: fine-tuning at the site is not available for {runner.KIND}")
    if opts.local and local is None:
        raise TaskError(f"{runner.site}: serve_score: a site's own model is not available for {runner.KIND}")
    models = unpack_models(params)
    if sorted(models) != list(range(len(opts.names) + int(opts.local))):
        raise TaskError(f"{runner.site}: serve_score: {len(opts.names)} model name(s) for {len(models)} packed model(s)")
    k = runner.k_min(cfg)
    scores, proper, meta, withheld = _score_candidates(runner, cfg, opts, models, item_scores, finetune, local)
    ref, units, order = _withhold_unsafe(runner, cfg, opts, scores, proper, withheld, k)
    if ref in withheld:  # nothing is compared with a reference that was not scored
        withheld.update({n: f"the reference ({ref}) was not scored: {withheld[ref]}" for n in order if n != ref})
    counts = {name: None if name in withheld else
              paired_counts(scores[ref], v, k_min=k, reference_proper=proper.get(ref), candidate_proper=proper.get(name),
                            units=units)
              for name, v in scores.items() if name != ref}
    counts.update({name: None for name in withheld if name != ref})
    meta["serving"] = {name: None if c is None else c.message() for name, c in counts.items()}
    meta["not_scored"] = {n: why for n, why in withheld.items() if n != ref}
    meta["reference"] = ref
    metrics = {}
    for name, v in scores.items():
        v = v[np.isfinite(v)]
        right = int(np.sum(v > 0.5)) if metric == "accuracy" else None  # a mean of 0/1 is a count: both sides >= k
        small = v.size < k or name in withheld or (right is not None and min(right, v.size - right) < k)
        metrics[f"val_{metric}/{name}"] = float("nan") if small else float(v.mean())
    return Reply(runner.site, metrics, meta, {})


def serve_score(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """#57's serving plan at a site (:func:`serving_reply`): every packed model's correctness and negative Brier
    score on the site's **validation** images. With ``finetune`` the site also fine-tunes the reference on its own
    training split (as ``finetune_local`` does) and scores that model, which never leaves it, as ``finetuned``. The
    test split is not read."""
    from fedmed.nn.train import predict_proba

    cfg = task_config(cfg)
    xv, yv = runner.splits(cfg).val
    x, y = runner.on_device(xv, cfg), yv.numpy()

    def correct(m) -> tuple[np.ndarray, np.ndarray]:
        if y.size == 0:
            return np.zeros(0), np.zeros(0)
        prob = np.asarray(predict_proba(m, x, precision=runner.precision(cfg)), dtype=np.float64)
        distinct = len(np.unique(np.round(prob, 12), axis=0))
        if distinct < min(runner.k_min(cfg), y.size):  # its scores would be a function of the labels alone: sums of
            # them are per-class counts (a constant model's); such a model is not scored
            raise TaskError(f"{runner.site}: a model blind to the image (fewer than k_min distinct answers on the "
                            f"validation images) is not scored")
        onehot = np.eye(prob.shape[1])[y]
        return (prob.argmax(axis=1) == y).astype(np.float64), -np.sum((prob - onehot) ** 2, axis=1)

    def finetune(model, options):
        loss = finetune_at_site(runner, model, cfg, options)["train_loss"]
        return correct(model), {"finetune_train_loss": loss}

    def local(model):
        out = train_site_model(runner, model, cfg)
        return correct(model), {"local_train_loss": out["train_loss"], "local_blocks": out["local_blocks"]}

    return serving_reply(runner, params, cfg, correct, "accuracy", finetune, local)


# the tasks every classification site serves, whatever the method; a method's own tasks (FMCL's signature, Flux's
# descriptor, IFCA's) its module registers (register_task), as a plugin's does
CLASSIFICATION = {"train": train, "validate": validate, "finetune_local": finetune_local,
                  "validate_ensemble": validate_ensemble, "serve_score": serve_score, "norm_stats": norm_stats,
                  "local_model": local_model}

PLUGIN_TASKS: dict = {"classification": {}, "segmentation": {}, "segmentation_2d": {}, "mae": {}}  # a plugin method's own site tasks


def register_task(name: str, fn, *, task: str = "classification"):
    """Add a site task of a method (a module of ``fedmed.methods``, or a plugin's): ``fn(runner, params, cfg, round_)
    -> Reply`` served by the runners of ``task`` ("classification", "segmentation" or "mae"); what it reads of its
    own it reads from the task config's ``method_options`` through a model of its own. A name taken by another is
    refused."""
    builtin = {"classification": CLASSIFICATION}.get(task, {})
    if task not in PLUGIN_TASKS:
        raise ValueError(f"register_task: task should be one of {sorted(PLUGIN_TASKS)}, got {task!r}")
    if name in builtin or PLUGIN_TASKS[task].get(name, fn) is not fn:
        raise ValueError(f"register_task: site task {name!r} is taken")
    PLUGIN_TASKS[task][name] = fn
    return fn
