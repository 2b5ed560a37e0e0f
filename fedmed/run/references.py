"""Reference rows of classification tables: what a federated number has to be read against.

* :func:`majority_rows` — the constant predictor answering the majority class of all sites' pooled
  training labels.
* :func:`cluster_majority_rows` — for a clustered method's run, the constant predictor answering, at
  every site, the majority class of its cluster's pooled training labels. A clustered method that does
  not beat this row has learned nothing beyond "which classes does my cluster hold".
* :func:`centralized_rows` — one model trained on all sites' pooled training data with the same recipe
  and budget (``rounds x local_epochs`` epochs, the same optimizer, batch size and augmentation),
  evaluated after every ``local_epochs`` epochs like a federated round, scored on every site's
  validation and test splits.
* :func:`alone_rows` — the same per source of a natural federation (each source alone: what a hospital or scanner
  gets without federating), or per site elsewhere; each site scored with its own source's model.

(FedAvg on an IID federation is the fourth reference; ``fedmed experiment`` runs it as a federated job.)
These are computed by the experimenter from the simulated federation's datalists — they are
references for a study, not something a deployed federation computes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from fedmed.algorithms.metrics import site_metrics
from fedmed.report.record import summarize_sites

__all__ = ["alone_rows", "centralized_rows", "cluster_majority_rows", "majority_rows"]


def _labels(datalists: Path, site: str) -> dict:
    doc = json.loads((Path(datalists) / f"{site}.json").read_text())
    return {k: np.asarray([e["label"] for e in doc.get(k, [])], dtype=np.int64) for k in ("training", "validation", "test")}


def _row(method: str, seed: int, per_site: dict, round_=None) -> dict:
    """A result row from ``{site: site_metrics(...) of test, and of validation prefixed val_}``."""
    summ = summarize_sites(per_site)
    mean, std, pooled = summ["mean"], summ["std"], summ.get("pooled") or {}
    row = {"method": method, "kind": "reference", "seed": seed, "round": round_, "task": "reference",
           "n_sites": len(per_site), "n_failed": 0, "n_test": int(sum(v.get("n_test", 0) for v in per_site.values()))}
    for m in ("accuracy", "macro_f1", "auc"):
        row[m], row[f"{m}_std"], row[f"pooled_{m}"] = mean.get(m), std.get(m), pooled.get(m)
    row["val_accuracy"] = mean.get("val_accuracy")
    row["pooled_val_accuracy"] = (summ.get("pooled_val") or {}).get("accuracy")
    row["pooled_val_auc"] = (summ.get("pooled_val") or {}).get("auc")
    return row


def _constant(y, cls: int, n_classes: int) -> dict:
    prob = np.zeros((y.size, n_classes))
    prob[:, cls] = 1.0
    return site_metrics(y, prob, n_classes)


def _site_entry(y_test, y_val, cls, n_classes) -> dict:
    e = {}
    for pre, y in (("", y_test), ("val_", y_val)):
        if y.size:
            r = _constant(y, cls, n_classes)
            e.update({pre + k: r[k] for k in ("accuracy", "macro_f1", "auc")})
            e.update({pre + "n_test": r["n_test"], pre + "confusion": r["confusion"], pre + "score_hist": r["score_hist"]})
    return e


def majority_rows(datalists, sites: list[str], n_classes: int, seed: int) -> list[dict]:
    labels = {s: _labels(datalists, s) for s in sites}
    pooled = np.concatenate([labels[s]["training"] for s in sites])
    cls = int(np.bincount(pooled, minlength=n_classes).argmax())
    per_site = {s: _site_entry(labels[s]["test"], labels[s]["validation"], cls, n_classes) for s in sites}
    return [_row("Majority class", seed, per_site)]


def cluster_majority_rows(method: str, datalists, clusters: list[list[str]], n_classes: int, seed: int) -> list[dict]:
    per_site = {}
    for members in clusters:
        labels = {s: _labels(datalists, s) for s in members}
        if not members:
            continue
        pooled = np.concatenate([labels[s]["training"] for s in members])
        cls = int(np.bincount(pooled, minlength=n_classes).argmax())
        per_site.update({s: _site_entry(labels[s]["test"], labels[s]["validation"], cls, n_classes) for s in members})
    return [_row(f"{method}: cluster-majority", seed, per_site)]


def run_clusters(doc: dict) -> list[list[str]]:
    """The clusters a run's sites were finally served from (its final round's ``cluster`` of each site)."""
    last = doc["rounds"][-1]["sites"] if doc.get("rounds") else {}
    groups: dict = {}
    for s, v in last.items():
        groups.setdefault(v.get("cluster") if v.get("cluster") is not None else 0, []).append(s)
    return [sorted(v) for _, v in sorted(groups.items(), key=lambda kv: str(kv[0]))]


def _pooled_training(exp, data: dict, members: list[str], seed: int, gseed: int, n_classes: int, *,
                     log=None, what: str = "centralized reference") -> list[dict]:
    """Train one model on ``members``' pooled training data (the recipe and budget of a federated run: ``rounds x
    local_epochs`` epochs, one optimizer) and score it on each member's test and validation splits after every
    ``local_epochs`` epochs; one ``{site: entry}`` per 'round' 0..rounds. The network starts and trains as the
    recipe says (:mod:`fedmed.nn.recipe`: its head, learning rates and batch norm; one optimizer throughout) and its
    learning rate follows ``train.lr_schedule`` over the ``rounds`` epoch blocks. ``log``: a progress line per block
    (``what``, the block, its seconds and the members' validation accuracy), so a long reference is never silent."""
    import time

    import torch

    from fedmed.core.device import resolve_device
    from fedmed.nn.models import model_from_config
    from fedmed.nn.train import make_optimizer, predict_proba, train_local

    x = torch.cat([data[s].train[0] for s in members])
    y = torch.cat([data[s].train[1] for s in members])
    from fedmed.nn.recipe import prepared, resolved, round_schedule

    t = exp.train
    model = prepared(model_from_config(exp.model.model_dump(), exp.dataset.channels, n_classes, seed=seed,
                                       modules=("*",)), t, exp.model).to(
        resolve_device(t.device, where="the centralized reference"))
    opt = make_optimizer(model, t.model_dump(), exp.model.model_dump())
    frozen = resolved(t, exp.model)["norm_stats"] == "frozen"
    g = torch.Generator()
    g.manual_seed(gseed)
    per_round = []
    stop, halted = _stopper(exp), False  # train.stop, as a federated run: one more block after the one that ends it
    for r in range(t.rounds + 1):
        t0 = time.perf_counter()
        if r > 0:
            train_local(model, x, y, epochs=t.local_epochs, batch_size=t.batch_size, optimizer=opt, generator=g,
                        augment=t.augment, precision=t.precision, frozen_norm=frozen,
                        lr_at=round_schedule(t, r - 1))  # train.lr_schedule over the epoch blocks, as a site's rounds
        per_site = {}
        for s in members:
            e = {}
            for pre, (xs, ys) in (("", data[s].test), ("val_", data[s].val)):
                if xs.shape[0]:
                    res = site_metrics(ys.numpy(), predict_proba(model, xs, precision=t.precision), n_classes)
                    e.update({pre + k: res[k] for k in ("accuracy", "macro_f1", "auc")})
                    e.update({pre + "n_test": res["n_test"], pre + "confusion": res["confusion"],
                              pre + "score_hist": res["score_hist"]})
            per_site[s] = e
        per_round.append(per_site)
        if log is not None and r > 0:
            accs = [e["val_accuracy"] for e in per_site.values() if "val_accuracy" in e]
            val = f", validation accuracy {100 * float(np.mean(accs)):.1f}% (site mean)" if accs else ""
            log(f"    {what}: epochs {(r - 1) * t.local_epochs + 1}-{r * t.local_epochs} of "
                f"{t.rounds * t.local_epochs} in {time.perf_counter() - t0:.0f} s{val}")
        if halted:
            break
        halted = _halts(stop, r, per_site, t.rounds)
    return per_round


def _as_sent(entry: dict, k_min: int) -> dict:
    """A site's test record as its ``validate`` task sends it: the confusion matrix with class rows below ``k_min``
    zeroed (``withheld`` counts them) and the AUC."""
    conf = np.asarray(entry.get("confusion", []), dtype=np.int64)
    small = (conf.sum(axis=1) < k_min) if conf.size else np.zeros(0, bool)
    withheld = int(conf[small].sum()) if conf.size else 0
    if conf.size:
        conf[small] = 0
    auc = entry.get("auc")
    return {"confusion": conf.tolist(), "auc": None if auc is None or auc != auc else float(auc), "withheld": withheld}


def _site_data(exp, datalists, sites):
    from fedmed.site.runner import SiteRunner

    return {s: SiteRunner(s, datalists).data(exp.dataset.image_size, exp.dataset.channels) for s in sites}


def centralized_rows(exp, datalists, sites: list[str], seed: int, log=print) -> list[dict]:
    """Train one model on the pooled training data (same recipe and budget); one row per 'round'."""
    data = _site_data(exp, datalists, sites)
    per_round = _pooled_training(exp, data, list(sites), seed, int(seed) * 7919 + 11, len(exp.dataset.classes),
                                 log=log)
    rows = [_row("Centralized", seed, per_site, round_=r) for r, per_site in enumerate(per_round)]
    n = sum(int(data[s].train[0].shape[0]) for s in sites)
    log(f"    centralized reference: {n} pooled training images, {len(per_round) - 1} x {exp.train.local_epochs} epochs "
        f"(of {exp.train.rounds}: train.stop), "
        f"final test accuracy {100 * rows[-1]['accuracy']:.2f}% (site mean)")
    return rows


def alone_rows(exp, datalists, sites: list[str], seed: int, sources: dict | None = None, log=print) -> list[dict]:
    """**Each source alone** (``sources``: site -> source, a natural federation's): per source one model on its sites'
    pooled training data, with the recipe and budget of a federated run; every site scored with its source's model.
    Without ``sources``, **each site alone**: every site trains only on its own data. One row per 'round', the mean
    over sites as the federated rows."""
    data = _site_data(exp, datalists, sites)
    groups: dict = {}
    for s in sites:
        groups.setdefault((sources or {}).get(s, s), []).append(s)
    n_classes = len(exp.dataset.classes)
    per_round: list[dict] = [{} for _ in range(exp.train.rounds + 1)]
    name = "Each source alone" if sources else "Each site alone"
    t0 = time.perf_counter()
    ends = 0
    for k, (g, members) in enumerate(groups.items()):
        trained = _pooled_training(exp, data, members, seed, int(seed) * 7919 + 11 + 101 * (k + 1), n_classes,
                                   log=log, what=f"{name.lower()} reference, {g}")
        ends = max(ends, len(trained))
        for r in range(len(per_round)):  # a group its stop rule ended keeps its last model's scores
            per_round[r].update(trained[min(r, len(trained) - 1)])
        # a line per source (or site): the reference trains the federation's whole budget once per group
        log(f"    {name.lower()} reference: {g} trained ({k + 1}/{len(groups)}, {len(members)} site(s), "
            f"{time.perf_counter() - t0:.0f} s so far)")
    per_round = per_round[:ends]  # every group stopped: the rows end where the last group's did
    rows = [_row(name, seed, {s: per_site[s] for s in sites}, round_=r) for r, per_site in enumerate(per_round)]
    k_min = exp.privacy.k_min
    for row, per_site in zip(rows, per_round):  # per-site records for per-source tables, as a site would send them
        row["sites"] = {s: _as_sent(per_site[s], k_min) for s in sites}
    final = per_round[-1]
    log(f"    {name.lower()} reference: final test accuracy " + ", ".join(
        f"{g} {100 * np.mean([final[s]['accuracy'] for s in m if 'accuracy' in final[s]]):.1f}%"
        for g, m in groups.items() if any("accuracy" in final[s] for s in m)))
    return rows


# --------------------------------------------------------------------------------------------- segmentation

def _stopper(exp):
    """The run's stop rule (``train.stop``, :mod:`fedmed.workflows.stopping`), as a federated run of ``exp`` reads it."""
    from fedmed.workflows.stopping import Stopper, stop_metric

    return Stopper.from_config(exp.train, metric=stop_metric(exp.train.stop, exp.dataset.task, exp.selection))


def _halts(stop, r: int, per_site: dict, rounds: int) -> bool:
    """After block ``r``'s scores: does the stop rule end the training (one more block is then trained and scored,
    as a federated run's final round)?"""
    from fedmed.workflows.stopping import val_score

    return stop.observe(r, val_score(per_site, stop.metric)) and r < rounds


def _seg_row(method: str, seed: int, per_site: dict, round_) -> dict:
    summ = summarize_sites(per_site)
    row = {"method": method, "kind": "reference", "seed": seed, "round": round_, "task": "reference",
           "n_sites": len(per_site), "n_failed": 0}
    row.update({k: v for k, v in summ["mean"].items()})
    row["sites"] = {s: dict(v) for s, v in per_site.items()}
    return row


def seg_reference_rows(exp, datalists, sites: list[str], seed: int, log=print) -> list[dict]:
    """Segmentation references, scored on the common test subjects like the federated methods:

    * **Centralized**: one U-Net trained on all sites' pooled training cases, ``rounds x local_epochs`` epochs with
      the same recipe (one optimizer for the whole run); evaluated after every ``local_epochs`` epochs.
    * **Each site alone**: every site trains only on its own cases with the same budget; the row is the mean over
      sites of each site's own model (per-site columns: that site's model).

    Under ``selection: validation``, where the sites have validation subjects, every row also has their Dice
    (``val_dice_mean``), as the federated runs' rounds do.
    """
    from fedmed.core.device import resolve_device
    from fedmed.nn.models import seg_model_from_config
    from fedmed.nn.seg import seg_metrics
    from fedmed.site.seg import SegSiteRunner
    from fedmed.nn.train import make_optimizer

    from fedmed.methods import FedAvgMethod
    from fedmed.run.taskconfig import build_task_config

    cfg = build_task_config(exp, seed, FedAvgMethod(name="Centralized"), sites)  # the task config a job's sites get
    runners = {s: SegSiteRunner(s, datalists) for s in sites}
    cases = {s: r.cases(cfg) for s, r in runners.items()}
    test = cases[sites[0]][1]
    roi = tuple(exp.dataset.roi)
    t = exp.train
    rows: list[dict] = []

    def train(model, opt, data, seed_):
        from fedmed.nn.seg import train_seg_local

        return train_seg_local(model, data, epochs=t.local_epochs, optimizer=opt, roi=roi,
                               patches=t.seg.patches_per_volume, pos_fraction=t.seg.pos_fraction, loss=t.seg.loss,
                               seed=seed_, precision=t.precision, workers=t.workers)

    device = resolve_device(exp.train.device, where="the centralized reference")
    pooled = [c for s in sites for c in cases[s][0]]
    model = seg_model_from_config(exp.model.model_dump(), cfg["data"]["in_channels"], seed=seed, modules=("*",)).to(device)
    opt = make_optimizer(model, cfg["train"])
    # the sites' validation subjects, scored only where a round is selected on them (`selection: validation`)
    val = {s: runners[s].validation_cases(cfg) if exp.selection == "validation" else [] for s in sites}

    def scored(model, which):  # the common test subjects, and each site's validation subjects where it has them
        m = seg_metrics(model, test, roi)
        return {s: {**m, **({"val_dice_mean": seg_metrics(model, val[s], roi)["dice_mean"]} if val[s] else {})}
                for s in which}

    stop, halted = _stopper(exp), False  # train.stop, as the federated runs (their validation Dice)
    for r in range(t.rounds + 1):
        if r:
            train(model, opt, pooled, seed * 1000 + r)
        rows.append(_seg_row("Centralized", seed, scored(model, sites), r))
        if halted:
            break
        halted = _halts(stop, r, rows[-1]["sites"], t.rounds)
    log(f"    centralized reference: {len(pooled)} pooled training cases, final WT Dice {100 * rows[-1]['dice_wt']:.1f}%")
    alone: dict = {}
    per_round: list[dict] = [{} for _ in range(t.rounds + 1)]
    for k, s in enumerate(sites):
        model = seg_model_from_config(exp.model.model_dump(), cfg["data"]["in_channels"], seed=seed, modules=("*",)).to(device)
        opt = make_optimizer(model, cfg["train"])
        for r in range(t.rounds + 1):
            if r:
                train(model, opt, cases[s][0], seed * 1000 + 100 * k + r)
            if r == t.rounds or r == 0:
                per_round[r][s] = scored(model, [s])[s]
        alone[s] = per_round[t.rounds][s]
    rows += [_seg_row("Each site alone", seed, per_round[r], r) for r in (0, t.rounds)]
    log(f"    each-site-alone reference: final WT Dice per site "
        + ", ".join(f"{s} {100 * v['dice_wt']:.1f}%" for s, v in alone.items()))
    return rows


def _seg2d_each_source(exp, seed: int, by_source: dict, fresh, pooled, scores) -> list[dict]:
    """The 2D each-source-alone reference: per source one U-Net on its sites' pooled training images (``fresh()``:
    a new model and optimizer; ``pooled(sites)``: their images; ``scores(model, sites)``), scored after every
    ``local_epochs`` epochs; a source its stop rule ended keeps its last model's scores. Each round's scores by site."""
    import torch

    from fedmed.nn.seg2d import train_seg2d_local

    t = exp.train
    per_round: list[dict] = [{} for _ in range(t.rounds)]
    ends = 0
    for k, (src, members) in enumerate(by_source.items()):
        model, opt = fresh()
        x, y = pooled(members)
        g = torch.Generator().manual_seed(seed * 1000 + 100 * (k + 1))
        stop, halted, got = _stopper(exp), False, []
        for r in range(t.rounds):
            train_seg2d_local(model, x, y, epochs=t.local_epochs, batch_size=t.batch_size, optimizer=opt,
                              loss=t.seg.loss, generator=g, precision=t.precision)
            got.append(scores(model, members))
            if halted:
                break
            halted = _halts(stop, r + 1, got[-1], t.rounds)
        ends = max(ends, len(got))
        for r in range(t.rounds):  # a source its stop rule ended keeps its last model's scores
            per_round[r].update(got[min(r, len(got) - 1)])
    per_round = per_round[:ends]
    return per_round


def seg2d_reference_rows(exp, datalists, sites: list[str], seed: int, groups: dict | None = None,
                         log=print) -> list[dict]:
    """2D lesion-segmentation references (:mod:`fedmed.site.seg2d`), each site scored on its own test split like the
    federated methods:

    * **Centralized**: one U-Net on all sites' pooled training images, ``rounds x local_epochs`` epochs with the same
      recipe (one optimizer for the whole run), scored after every ``local_epochs`` epochs;
    * **Each source alone**: per source (``groups``: site -> source; else per site) one U-Net on that source's sites'
      pooled training images with the same budget; each site scored with its source's model, after every
      ``local_epochs`` epochs too.

    Every row also has each site's validation Dice (``val_dice_mean``), so that ``selection: validation`` picks these
    rows' round on validation data as it does the federated runs'.
    """
    import torch

    from fedmed.core.device import resolve_device
    from fedmed.methods import FedAvgMethod
    from fedmed.nn.models import seg_model_from_config
    from fedmed.nn.seg2d import seg2d_metrics, train_seg2d_local
    from fedmed.nn.train import make_optimizer
    from fedmed.run.taskconfig import build_task_config
    from fedmed.site.seg2d import Seg2DSiteRunner

    cfg = build_task_config(exp, seed, FedAvgMethod(name="Centralized"), sites)
    cases = {s: Seg2DSiteRunner(s, datalists).cases(cfg) for s in sites}
    t = exp.train
    device = resolve_device(t.device, where="the 2D segmentation references")

    def fresh():
        m = seg_model_from_config(exp.model.model_dump(), exp.dataset.channels, seed=seed, modules=("*",),
                                  spatial_dims=2).to(device)
        return m, make_optimizer(m, cfg["train"])

    def scores(model, which):
        out = {}
        for s in which:
            out[s] = seg2d_metrics(model, *cases[s]["test"])
            if len(cases[s]["validation"][0]):
                out[s]["val_dice_mean"] = seg2d_metrics(model, *cases[s]["validation"])["dice_mean"]
        return out

    def pooled(which):
        return (torch.cat([cases[s]["training"][0] for s in which]), torch.cat([cases[s]["training"][1] for s in which]))

    rows: list[dict] = []
    model, opt = fresh()
    x, y = pooled(sites)
    g = torch.Generator().manual_seed(seed * 1000)
    stop, halted = _stopper(exp), False  # train.stop, as the federated runs (their validation Dice)
    for r in range(t.rounds + 1):
        if r:
            train_seg2d_local(model, x, y, epochs=t.local_epochs, batch_size=t.batch_size, optimizer=opt,
                              loss=t.seg.loss, generator=g, precision=t.precision)
        rows.append(_seg_row("Centralized", seed, scores(model, sites), r))
        if halted:
            break
        halted = _halts(stop, r, rows[-1]["sites"], t.rounds)
    log(f"    centralized reference: {int(x.shape[0])} pooled training images, final lesion Dice "
        f"{100 * rows[-1]['dice_mean']:.1f}% (site mean)")
    by_source: dict = {}
    for s in sites:
        by_source.setdefault((groups or {}).get(s, s), []).append(s)
    per_round = _seg2d_each_source(exp, seed, by_source, fresh, pooled, scores)
    rows += [_seg_row("Each source alone", seed, per_round[r], r + 1) for r in range(len(per_round))]
    final = per_round[-1]
    log("    each-source-alone reference: final lesion Dice " + ", ".join(
        f"{src} {100 * np.nanmean([final[s]['dice_mean'] for s in m]):.1f}%" for src, m in by_source.items()))
    return rows
