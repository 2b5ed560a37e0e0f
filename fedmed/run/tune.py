"""``fedmed tune CONFIG --budget N``: the recipe chosen on the federation's own validation data (#85).

fedmed's shipped recipes were chosen by hand on one federation; on another they stop while still learning or decide
badly. ``tune`` searches, for the config's first seed and its FedAvg-family reference, over

* ``local_epochs`` (1, 2, 4, 8 and the config's) and the learning rate (log-uniform within a factor of 10 of the
  config's ``train.lr``),
* the start — the weights the config names (``model.init_weights``) or scratch — where it names some,
* the server's optimizer (``train.server_opt``: none, FedAvgM, FedAdam) and its learning rate (Reddi et al.'s
  ranges: 0.1-1 for FedAvgM, 1e-3-1e-1 for FedAdam),
* batch-norm handling (FedAvg, or FedBN: each site keeps its own) for a ResNet with batch norm,

the config's own recipe first (trial 0: the choice is never one its validation data rate below what the user wrote),
then Optuna's TPE sampler, with **successive halving** (Optuna's ``SuccessiveHalvingPruner``, rounds as the resource,
reduction factor 3): every trial is an in-process federated run reporting its sites' validation score after each
round, and a trial behind its rung's best third is stopped there. The budget is ``N`` full runs of the config's recipe,
counted in local epochs (``rounds x local_epochs`` each): trials start while less than that was spent, and a trial
that reaches it is stopped there (pruned: a trial is chosen only having run its rounds or its stop rule's). The
objective is the validation score the config's round selection reads (``train.stop.metric``), at the trial's best
round.

**No test data is read**: the sites of a trial see datalists whose ``test`` split is empty (``tuning_data/``). The
study lives in ``<out>/tuning.db`` (SQLite; ``--storage`` an RDB URL lets several machines share it), so a tuning
resumes where it stopped and a larger ``--budget`` continues it; a trial killed with its process (a stopped tuning, a
machine lost) is failed once its heartbeat is older than ``GRACE_S`` and run again with the same recipe (Optuna's
heartbeat and its stale-trial retry callback), so the config's own trial 0 is never lost to a kill. The chosen recipe is written as ``tuned.yaml`` (the
config extended, ``fedmed experiment tuned.yaml`` starts from it) and every trial's validation evidence as
``tuning.md`` / ``tuning.csv``, with the cost (wall time, full runs spent).
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import csv
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path

__all__ = ["TuneError", "space", "tune", "tuning_datalists"]

EPOCHS = (1, 2, 4, 8)
SERVER_LR = {"avgm": (0.1, 1.0), "adam": (1e-3, 1e-1)}
REDUCTION = 3
FAILS_IN_A_ROW = 3  # trials failing one after another: the federation or config is broken, the tuning stops
HEARTBEAT_S, GRACE_S = 30, 120  # a running trial's heartbeat; a trial silent for longer was killed and is run again


class TuneError(FedmedError, ValueError):
    """A tuning that cannot start or chose nothing (the message says why)."""


def tuning_datalists(data: Path, out: Path) -> Path:
    """Copies of a federation's datalists with an empty ``test`` split (what a tuning's sites see: no test image is
    ever read) and its ``dataset.json``."""
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(data).glob("*.json")):
        doc = json.loads(f.read_text())
        if f.name != "dataset.json" and isinstance(doc, dict) and "training" in doc:
            doc["test"] = []
            for k in ("training", "validation"):  # relative image paths stay relative to the original folder
                for e in doc.get(k, []):
                    for key in ("image", "label", "mask"):  # a file (a label may be a mask file or a class)
                        if isinstance(e.get(key), str) and not os.path.isabs(e[key]) and (key != "label" or
                                                                                           (Path(data) / e[key]).exists()):
                            e[key] = str((Path(data) / e[key]).resolve())
        (out / f.name).write_text(json.dumps(doc, indent=1))
    return out


def space(trial, exp) -> dict:
    """One trial's recipe: ``{config key path: value}`` (see the module notes)."""
    t = exp.train
    out = {"train.local_epochs": trial.suggest_categorical("local_epochs", sorted({*EPOCHS, t.local_epochs})),
           "train.lr": trial.suggest_float("lr", t.lr / 10, t.lr * 10, log=True)}
    if exp.model.init_weights:
        if trial.suggest_categorical("start", ["weights", "scratch"]) == "scratch":
            out["model.init_weights"] = None
    kind = trial.suggest_categorical("server_opt", ["none", "avgm", "adam"])
    out["train.server_opt.kind"] = kind
    if kind != "none":
        lo, hi = SERVER_LR[kind]
        out["train.server_opt.lr"] = trial.suggest_float(f"server_lr_{kind}", lo, hi, log=True)
    if exp.dataset.task == "classification" and exp.model.arch in ("resnet9", "resnet18") and exp.model.norm == "batch":
        out["method"] = trial.suggest_categorical("norm", ["FedAvg", "FedBN"])
    return out


def config_recipe(exp) -> dict:
    """The config's own recipe as a trial's parameters (:func:`space`'s names): the tuning's first trial, so that it
    never chooses a recipe its validation data rate below the one the user wrote."""
    t = exp.train
    out = {"local_epochs": t.local_epochs, "lr": t.lr, "server_opt": "none"}
    lo_hi = SERVER_LR.get(t.server_opt.kind)
    if lo_hi and lo_hi[0] <= t.server_opt.lr <= lo_hi[1]:
        out.update({"server_opt": t.server_opt.kind, f"server_lr_{t.server_opt.kind}": t.server_opt.lr})
    if exp.model.init_weights:
        out["start"] = "weights"
    if exp.dataset.task == "classification" and exp.model.arch in ("resnet9", "resnet18") and exp.model.norm == "batch":
        out["norm"] = "FedAvg"
    return out


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        d = out
        *head, last = key.split(".")
        for k in head:
            d = d.setdefault(k, {})
        d[last] = v
    return out


def _method(name: str) -> dict:
    return {"name": name, "workflow": "fedbn" if name == "FedBN" else "fedavg"}


def _study(optuna, exp, url: str, seed: int):
    """The Optuna study of this config's tuning in ``url`` (a resumed one continues with fresh draws), with the
    config's own recipe as its first trial: successive halving over rounds, TPE over the recipe space."""
    st = optuna.storages
    with warnings.catch_warnings():  # Optuna calls its heartbeat experimental; fedmed relies on it knowingly
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = ({"heartbeat_stale_trial_callback": st.RetryHeartbeatStaleTrialCallback(max_retry=2)}  # Optuna >= 4.9
                 if hasattr(st, "RetryHeartbeatStaleTrialCallback") else
                 {"failed_trial_callback": st.RetryFailedTrialCallback(max_retry=2)})
        storage_ = st.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, **retry)
    name = f"fedmed-{exp.name}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=name, storage=storage_, direction="maximize", load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, exp.train.rounds // REDUCTION ** 2),
                                                      reduction_factor=REDUCTION))
    study.sampler = optuna.samplers.TPESampler(seed=seed * 1009 + len(study.trials))  # a resumed study: fresh draws
    if not study.trials:  # the config's own recipe first: the choice is never below it on validation
        study.enqueue_trial(config_recipe(exp))
    return study


def _objective(optuna, exp, config, base: list, tuning: Path, seed: int, metric: str, full: int, budget: float,
               out: Path, spent):
    """A trial: the recipe Optuna draws, run in this process on the tuning datalists (test splits emptied), reported
    each round (pruned behind its rung, or before it would overspend the budget); its best validation score."""
    from fedmed.config import ConfigError, load_config
    from fedmed.run.experiment import with_classes
    from fedmed.run.jobspec import job_spec, run_spec_in_process
    from fedmed.workflows.stopping import summary_score

    def objective(trial):
        recipe = space(trial, exp)
        method = recipe.pop("method", "FedAvg")
        sets = base + [f"{k}={json.dumps(v)}" for k, v in recipe.items()] + [f"methods={json.dumps([_method(method)])}"]
        try:
            e = with_classes(load_config(config, sets), tuning)  # a natural federation's sites come from its data
        except ConfigError as err:
            raise TuneError(f"trial {trial.number}: {err}") from None
        trial.set_user_attr("recipe", {**recipe, "method": method})
        for k in ("epochs", "rounds", "why", "selected_round"):  # a killed trial's rerun carries its attributes
            trial.set_user_attr(k, 0 if k == "epochs" else None)
        epochs = e.train.local_epochs
        seen = {"rounds": 0, "best": -math.inf, "round": None}

        def on_round(entry):
            if entry["task"] == "train":
                seen["rounds"] += 1
                trial.set_user_attr("epochs", seen["rounds"] * epochs)
                trial.set_user_attr("rounds", seen["rounds"])
            v = summary_score(entry["summary"], metric)
            if math.isfinite(v) and v > seen["best"]:
                seen["best"], seen["round"] = v, entry["round"]
                trial.set_user_attr("selected_round", entry["round"])
            if math.isfinite(v):
                trial.report(v, entry["round"])
                if entry["task"] == "train" and trial.should_prune():
                    trial.set_user_attr("why", f"behind its rung at round {entry['round']}")
                    raise optuna.TrialPruned(trial.user_attrs["why"])
            if entry["task"] == "train" and seen["rounds"] < e.train.rounds and spent() + epochs / full > budget + 1e-9:
                trial.set_user_attr("why", f"its next round would overspend the budget, at round {entry['round']}")
                raise optuna.TrialPruned(trial.user_attrs["why"])

        if spent() + epochs / full > budget + 1e-9:  # not one round of it fits: never started
            trial.set_user_attr("why", "not one round fits in what is left of the budget")
            raise optuna.TrialPruned(trial.user_attrs["why"])
        folder = out / "trials" / f"trial{trial.number:03d}"
        shutil.rmtree(folder, ignore_errors=True)
        status, fed = run_spec_in_process(job_spec(e, e.methods[0], seed), tuning, folder, log=None, on_round=on_round)
        trial.set_user_attr("rounds", seen["rounds"])
        if status != "finished":
            why = f"trial {trial.number} {status}: {fed.recorder.doc.get('reason')}"
        elif not math.isfinite(seen["best"]):
            why = f"trial {trial.number}: no validation score ({metric}; federation.val_fraction)"
        else:
            return seen["best"]
        trial.set_user_attr("why", why)
        raise RuntimeError(why)

    return objective


def tune(config, out, budget: float, *, storage: str | None = None, datalists=None, overrides=None, log=print) -> dict:
    """Tune ``config``'s recipe within ``budget`` full runs (see the module notes); returns ``{"best", "trials",
    "tuned", "runs_spent", "seconds"}``. ``datalists``: a federation already written (else the config's first seed's
    is); its ``test`` splits are never read."""
    try:
        import optuna
    except ImportError:
        raise TuneError("fedmed tune needs Optuna: pip install 'fedmed[tune]' (make setup installs it)") from None

    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.workflows.stopping import stop_metric

    if not budget > 0:
        raise TuneError(f"--budget should be a positive number of full runs, got {budget}")
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    exp = load_config(config, overrides)
    if exp.dataset.task != "classification":
        raise TuneError("fedmed tune chooses a classifier's recipe (this config's task: "
                        f"{exp.dataset.task}); segmentation is not tuned yet")
    seed = exp.seeds[0]
    data = Path(datalists) if datalists is not None else prepare_federation(exp, seed, out / "data")
    tuning = tuning_datalists(data, out / "tuning_data")
    base = list(overrides or []) + classes_override(data, exp)
    if getattr(exp, "serving", None) is not None:
        base.append("serving=null")  # the trials run one FedAvg-family method; the plan is not tuned
    metric = stop_metric(exp.train.stop, exp.dataset.task, exp.selection)
    full = exp.train.rounds * exp.train.local_epochs  # one full run of the config's recipe, in local epochs
    url = storage or f"sqlite:///{(out / 'tuning.db').resolve()}"
    study = _study(optuna, exp, url, seed)

    def spent() -> float:
        return sum(float(t.user_attrs.get("epochs", 0)) for t in study.trials) / full

    objective = _objective(optuna, exp, config, base, tuning, seed, metric, full, budget, out, spent)

    log(f"[fedmed] tuning {exp.name}: budget {budget:g} full run(s) of {exp.train.rounds} round(s) x "
        f"{exp.train.local_epochs} epoch(s); {spent():.2f} spent before; study {url}")
    cap = len(study.trials) + 50 * max(1, math.ceil(budget))
    while spent() + 1.0 / full <= budget + 1e-9 and len(study.trials) < cap:  # while one epoch-round still fits
        study.optimize(objective, n_trials=1, catch=(RuntimeError,))
        tr = study.trials[-1]
        val = "" if tr.value is None else f", validation {metric} {tr.value:.4f}"
        log(f"[fedmed] trial {tr.number} {tr.state.name.lower()}: {tr.user_attrs.get('recipe')}{val}; "
            f"{spent():.2f} of {budget:g} full run(s) spent")
        last = study.trials[-FAILS_IN_A_ROW:]
        if len(last) == FAILS_IN_A_ROW and all(t.state == optuna.trial.TrialState.FAIL for t in last):
            raise TuneError(f"{FAILS_IN_A_ROW} trials in a row failed (a broken federation or config, not a bad "
                            f"recipe); the last: {tr.user_attrs.get('why')}. Every trial: {out / 'trials'}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not done:
        raise TuneError(f"no trial finished ({len(study.trials)} tried): see {out / 'trials'}")
    best = max(done, key=lambda t: (t.value, -t.number))
    seconds = time.perf_counter() - t0
    tuned = _write_tuned(config, out, best, metric, study, spent(), seconds)
    _write_table(out, study, metric, best, spent(), seconds, budget)
    log(f"[fedmed] chose trial {best.number}: {best.user_attrs['recipe']} (validation {metric} {best.value:.4f}); "
        f"{len(study.trials)} trial(s), {spent():.2f} full run(s), {seconds:.0f} s; {tuned}")
    return {"best": best.user_attrs["recipe"], "value": best.value, "trials": len(study.trials), "tuned": tuned,
            "runs_spent": spent(), "seconds": seconds}


def _write_tuned(config, out: Path, best, metric: str, study, runs: float, seconds: float) -> Path:
    import yaml

    recipe = dict(best.user_attrs["recipe"])
    method = recipe.pop("method")
    doc = {"extends": os.path.relpath(Path(config).resolve(), out.resolve()), **_nested(recipe)}
    if method == "FedBN":
        doc["methods"] = [_method("FedBN")]
    head = (f"# Chosen by `fedmed tune` on the federation's own validation data ({metric} {best.value:.4f}, trial "
            f"{best.number} of {len(study.trials)}; {runs:.2f} full runs, {seconds:.0f} s; test data never read).\n"
            f"# Every trial: tuning.md. Start from it: fedmed experiment {out / 'tuned.yaml'}\n")
    path = out / "tuned.yaml"
    path.write_text(head + yaml.safe_dump(doc, sort_keys=False))
    return path


def _write_table(out: Path, study, metric: str, best, runs: float, seconds: float, budget: float) -> None:
    keys = sorted({k for t in study.trials for k in (t.user_attrs.get("recipe") or {})})
    rows = []
    for t in study.trials:
        r = t.user_attrs.get("recipe") or {}
        state = t.state.name.lower() + (f" ({t.user_attrs['why']})" if t.user_attrs.get("why") else "")
        # a pruned trial's value is its last reported score: its best round's is what the column promises
        top = max(t.intermediate_values.values()) if t.intermediate_values else t.value
        cells = {k: r.get(k, "") for k in keys}
        if "model.init_weights" in cells:  # the start: scratch (None) or the config's weights (not overridden)
            cells["model.init_weights"] = "scratch" if "model.init_weights" in r else "the config's"
        rows.append({"trial": t.number, "state": state, **cells,
                     "rounds": t.user_attrs.get("rounds", ""), "selected_round": t.user_attrs.get("selected_round", ""),
                     f"best_{metric}": "" if top is None else f"{top:.4f}"})
    with (out / "tuning.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [f"## fedmed tune: {study.study_name}", "",
             f"Every trial's validation evidence ({metric} at its best round; pruned trials stopped by successive "
             f"halving at a rung; test data never read). Chosen: trial {best.number}. Cost: {runs:.2f} full run(s) "
             f"of the config's recipe (budget {budget:g}), {seconds:.0f} s in this invocation.", "",
             "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell(v) for v in r.values()) + " |" for r in rows]
    (out / "tuning.md").write_text("\n".join(lines) + "\n")
