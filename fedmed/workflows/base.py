"""The base of every server workflow: its config, the model it starts from, and the calls it makes on its
:class:`~fedmed.workflows.federation.Federation`."""

from __future__ import annotations

import copy
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

from fedmed.site.tasks import Reply

__all__ = ["Reply", "Workflow", "initial_params", "round_mean"]


def round_mean(rows, key: str):
    """The mean over the sites' replies of a metric (its finite values; NaN when none is finite), None when no reply
    has it — what the round's record summarises, read from the replies themselves."""
    import math

    vals = [r.metrics[key] for r in rows if key in r.metrics]
    if not vals:
        return None
    finite = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def initial_params(cfg: dict, job_files=None, modules=()) -> dict:
    """The model every site starts from (the seeded network, or ``model.init_weights``, which the job carries to the
    server: ``job_files``); ``modules``: the user modules the server's policy lets it import."""
    from fedmed.core.schema import task_config
    from fedmed.nn.train import get_params

    t = task_config(cfg)
    m, d = t.model.model_dump(), t.data
    if t.task == "mae":
        from fedmed.nn.mae import mae_model
        from fedmed.site.mae import MAEOptions

        ratio = MAEOptions.model_validate(t.method_options).mask_ratio
        return get_params(mae_model(d.channels, mask_ratio=ratio, seed=t.seed))
    if t.task == "segmentation":
        from fedmed.nn.models import seg_model_from_config

        return get_params(seg_model_from_config(m, d.in_channels, seed=t.seed, init_root=job_files, modules=modules,
                                                spatial_dims=d.spatial_dims))
    from fedmed.nn.models import model_from_config
    from fedmed.nn.recipe import prepared

    return get_params(prepared(model_from_config(m, d.channels, d.n_classes, seed=t.seed, init_root=job_files,
                                                 modules=modules), t.train, t.model))


def screen(rows: list) -> list:
    """Replies as a workflow may use them: a site whose parameters hold NaN or inf (a diverged local training) is
    turned into an error reply of that site — it sits out the round with its reason, as any site that failed a task,
    instead of poisoning every model it would be averaged into."""
    import numpy as np

    out = []
    for site, metrics, meta, params in rows:
        bad = [k for k, v in (params or {}).items()
               if np.asarray(v).dtype.kind in "fc" and not np.isfinite(np.asarray(v)).all()]
        if bad and not meta.get("error"):
            meta = {**meta, "error": f"{site}: its update has NaN or infinite values in {len(bad)} parameter "
                    f"tensor(s) (e.g. {bad[0]}); left out of this round"}
            metrics, params = {"failed": 1.0}, {}
        out.append(Reply(site, metrics, meta, params))
    return out


class Workflow:
    """One method's server algorithm. Subclasses implement :meth:`run` (their paper's algorithm box) with the calls
    below, all answered by the federation the workflow is run on (``Federation.run(workflow)``).

    Args:
        num_rounds: training rounds R (a final ``validate`` round R follows).
        task_config: the task config every task carries to the sites (:func:`fedmed.run.taskconfig.build_task_config`).
        aggregator: how updates become a model (``fedmed.workflows.aggregators``; FedAvg's weighted average).
        **args: the workflow's own options (its method's ``workflow_options``, ``fedmed.methods``).
    """

    record_name = "Workflow"  # what the run's record, checkpoint and saved models call this workflow
    earlier_record_names: tuple = ()  # names earlier fedmed versions recorded for it (still read back)
    stable_cluster_ids = True  # a cluster id names the same model in every round (CFL renumbers when it splits)
    fed = None  # the Federation it runs on

    # a new site after this workflow's run (fedmed.workflows.onboard.Onboard dispatches to the training workflow)
    onboard_label_free = False  # its assignment uses no labels (the new site is scored on all its data)
    onboard_pseudo_labels = False  # without labels it can assign by the served models' predicted classes
    onboard_needs_labels = ""  # why it cannot assign a new site without labels (empty: it can)
    onboard_needs_state = True  # the run's onboarding.json (Workflow.save_onboarding)

    @classmethod
    def assign_new_sites(cls, ob, state: dict, models: dict) -> dict:
        """new site -> cluster id, asked through the onboarding workflow ``ob`` (its ``task``, ``send``,
        ``_replies``, ``labels``, ``root``), from what the run kept (``state``: ``onboarding.json``) and its final
        ``models``."""
        raise NotImplementedError(f"{cls.__name__} gives a new site no model")

    @classmethod
    def onboard_is_label_free(cls, state: dict) -> bool:
        return cls.onboard_label_free

    @classmethod
    def after_onboarding(cls, ob, models: dict, sizes: dict) -> None:
        """Scored after the assigned models (IFCA: the ensemble)."""

    @classmethod
    def onboarding_state_problem(cls, state: dict) -> str | None:
        """Why a finished run's onboarding state cannot assign a new site (None: it can)."""
        return None

    def __init__(self, num_rounds: int, task_config: dict, aggregator=None, **args):
        from fedmed.workflows.aggregators import WeightedAverage

        self.aggregator = aggregator if aggregator is not None else WeightedAverage()
        self.num_rounds = int(num_rounds)
        self._cfg = copy.deepcopy(dict(task_config))
        self.task_extra: dict = {}  # what this run adds to every task it sends (e.g. PreP-WFL's class weights)
        if args:
            raise TypeError(f"{type(self).__name__}: unknown option(s) {sorted(args)}")

    def run(self) -> None:
        raise NotImplementedError

    @cached_property
    def task_cfg(self):
        """The task config, typed (:class:`~fedmed.core.schema.TaskConfig`): validated once, at its first use (the
        config a run was given never changes: :attr:`cfg` is read-only)."""
        from fedmed.core.schema import task_config

        return task_config(self._cfg)

    @property
    def cfg(self) -> MappingProxyType:
        """The task config this run was given, read-only: a run adds to its tasks (:attr:`task_extra`, ``extra`` of
        :meth:`task`) and never changes the config."""
        return MappingProxyType(self._cfg)

    # ------------------------------------------------------------------ the federation's calls
    @property
    def sites(self) -> list:
        return self.fed.sites

    @property
    def recorder(self):
        return self.fed.recorder

    @property
    def resumed(self) -> dict:
        return self.fed.resumed

    @property
    def min_clients(self) -> int:
        return self.fed.min_clients

    @property
    def out_dir(self) -> Path:
        return self.fed.out_dir

    @property
    def job_files(self):
        return self.fed.job_files

    def task(self, params: dict, round_: int, **extra):
        """The message of one task: ``params`` and the task config (with ``extra`` entries, e.g. ``cluster``)."""
        return self.fed.message(params, round_, {**copy.deepcopy(self._cfg), **self.task_extra, **extra})

    def _in_site_order(self, rows: list) -> list:
        """Replies in the federation's site order, not the order they arrived in: every sum of the server's math then
        runs in one order, on any machine under any load (#88; an in-process federation's order is this one)."""
        order = {s: i for i, s in enumerate(self.sites)}
        return sorted(rows, key=lambda r: (order.get(r[0], len(order)), str(r[0])))

    def send(self, task_name: str, data, targets=None) -> list:
        rows = screen(self._in_site_order(self.fed.send(task_name, data, targets)))
        self.recorder.account(rows)  # the sites' policies and the epsilon they released (Recorder.account)
        return rows

    def send_groups(self, task_name: str, groups: dict) -> dict:
        out = {k: screen(self._in_site_order(rows)) for k, rows in self.fed.send_groups(task_name, groups).items()}
        self.recorder.account([r for rows in out.values() for r in rows])
        return out

    def record_rows(self, round_, rows, task) -> list:
        return self.fed.record_rows(round_, rows, task)

    # ------------------------------------------------------------------ steps a workflow is made of
    def gather(self, task_name: str, message, what: str, *, targets=None, round_: int = -1,
               who: str = "site", consequence: str = "is left out") -> dict:
        """Step: one statistic from each site (a signature, an assessment, a descriptor, latent bounds): the
        replies of the sites that sent it, by site. A site that could not is recorded and named in the log ("site X
        sent no <what> and <consequence>: reason"); notes a reply carries go to the log."""
        got = {}
        for reply in self.send(task_name, message, targets):
            if reply.error:
                self.recorder.error(round_, reply.site, task_name, reply.error)
                self.error(f"{who} {reply.site} sent no {what} and {consequence}: {reply.error}")
                continue
            got[reply.site] = reply
            for note in reply.meta.get("notes", []) or []:
                self.warning(f"{who} {reply.site}: {note}")
        return got

    def cluster_round(self, round_: int, task_name: str, models: dict, members: dict, held: dict | None = None,
                      **extra) -> dict:
        """Step: one round of a per-cluster workflow — cluster c's model to its members, the round recorded — the
        replies of the sites that answered, by cluster. ``held``: clusters whose training has stopped (their stop
        rule): their members score their model (``validate``) in the same round, so every round's record holds every
        site."""
        replies = self.send_groups(task_name, {c: (self.task(models[c], round_, cluster=c, **extra), sites)
                                               for c, sites in members.items() if sites})
        if held:
            replies.update(self.send_groups("validate", {c: (self.task(models[c], round_, cluster=c, **extra), sites)
                                                         for c, sites in held.items() if sites}))
        ok = {r.site for r in self.record_rows(round_, [r for rows in replies.values() for r in rows], task_name)}
        return {c: [r for r in rows if r.site in ok] for c, rows in replies.items()}

    def train_clusters(self, clusters: list, *, warmup: int = 0, **state) -> list:
        """Step: one model per cluster — FedAvg inside each cluster from the start round to R (resumed from a
        checkpoint), then every site scores its cluster's model, and each cluster's final model is saved
        (``cluster<c>``). ``warmup`` W > 0: FedAvg of the whole federation for rounds 0..W-1 first, every cluster
        model starting from it. ``state``: what a resumed run needs besides the clusters (kept in each checkpoint).
        Returns the clusters (of the federation's sites)."""
        clusters = [[s for s in c if s in self.sites] for c in clusters]
        saved = self.resumed_models()
        start = self.start_round()
        if start < warmup:  # FedAvg of the whole federation first; every cluster model starts from it
            theta0 = saved.get("global") or self.initial_params()
            for r in range(start, warmup):
                rows = self.record_rows(r, self.send("train", self.task(theta0, r), targets=sorted(
                    {s for c in clusters for s in c})), "train")
                theta0 = self.next_model(rows, theta0, r)
                self.checkpoint(r + 1, {"global": theta0}, clusters=clusters, **state)
            self.info(f"FedAvg warm-up of {warmup} round(s) done; cluster models start from it")
            saved, start = {"global": theta0}, warmup
        theta = {c: saved.get(f"cluster{c}") or saved.get("global") or self.initial_params() for c in range(len(clusters))}
        stops = {c: self.stopper(f"cluster{c}") for c in range(len(clusters))}  # each cluster its own stop rule
        active = {c for c, st in stops.items() if st.stopped_at is None and clusters[c]}
        last = self.num_rounds
        for r in range(start, self.num_rounds + 1):
            final = r == self.num_rounds or not active
            task = "validate" if final else "train"
            members = {c: m for c, m in enumerate(clusters) if final or c in active}
            replies = self.cluster_round(r, task, theta, members, held=None if final else
                                         {c: m for c, m in enumerate(clusters) if c not in active})
            for c in members:
                if self.observe(stops[c], r, replies.get(c) or [], theta[c]) and not final:
                    stops[c].stopped_at = r
            if final:
                last = r
                break
            for c, good in replies.items():
                if good and c in active:
                    theta[c] = self.next_model(good, theta[c], r, key=f"cluster{c}")
            active -= {c for c in active if stops[c].stopped_at is not None}
            self.checkpoint(r + 1, {f"cluster{c}": t for c, t in theta.items()}, clusters=clusters,
                            stoppers={f"cluster{c}": st for c, st in stops.items()}, **state)
        for c, sites in enumerate(clusters):
            if sites:
                self.save_final(theta[c], name=f"cluster{c}", sites=sites, cluster=c, rounds=last,
                                decision=self.decision(stops[c].last_hist))
        self.save_selected({f"cluster{c}": st for c, st in stops.items() if clusters[c]}, last)
        return clusters

    def next_model(self, rows, base: dict, round_: int, key: str = "global", targets=None) -> dict:
        """Step, for every workflow's loop: the served model ``key``'s parameters after round ``round_`` from the sites'
        updates ``rows`` — the aggregator's average, the server optimizer's step from ``base`` (``train.server_opt``)
        and the batch-norm statistics re-estimated over the sites that trained it (``train.norm_recalibrate``;
        ``targets``, default the rows' sites). Every loop takes its models from here, so none of the three is skipped
        (#88: IFCA's and CFL's own loops skipped the re-estimate)."""
        return self.recalibrated(self.aggregate(rows, base=base, key=key), round_ + 1,
                                 targets=sorted(x.site for x in rows) if targets is None else targets)

    def recalibrated(self, theta: dict, round_: int, targets=None) -> dict:
        """Step (``train.norm_recalibrate``): ``theta`` with its batch-norm running statistics re-estimated over the
        training images of ``targets`` (default: every site) — each site sends its layers' statistics of one pass of
        ``theta`` over its batches (the ``norm_stats`` task), the server weights them by batches
        (:func:`fedmed.algorithms.aggregation.pooled_norm_stats`). FedAvg's averaged statistics are the sites' models'
        statistics averaged, not those of the averaged model. ``theta`` as it is when the option is off, the network
        has no batch norm, or no site sent its statistics (the log says so)."""
        if getattr(self, "_recalibrate", None) is None:  # read once: the config never changes during a run
            self._recalibrate = bool(self.task_cfg.train.norm_recalibrate) and self.task_cfg.task == "classification" \
                and any(k.endswith("running_mean") for k in theta)
        if not self._recalibrate:
            return theta
        from fedmed.algorithms.aggregation import pooled_norm_stats

        got = self.gather("norm_stats", self.task(theta, round_), "batch-norm statistics", targets=targets,
                          round_=round_, consequence="is left out of the re-estimate")
        if not got:
            self.warning(f"round {round_}: no site sent batch-norm statistics; the model keeps its averaged ones")
            return theta
        stats = pooled_norm_stats([r.params for r in got.values()], [int(r.meta["n_batches"]) for r in got.values()])
        return {**theta, **{k: v for k, v in stats.items() if k in theta}}

    def aggregate(self, rows, base: dict | None = None, key: str = "global") -> dict:
        """The new model from the sites' updates: the workflow's aggregator (FedAvg's weighted average unless one is
        passed in, as FLARE's ModelAggregator is); with a server optimizer (``train.server_opt``, FedOpt) and the
        model the sites started from (``base``), the server's step from ``base`` along the averaged update, with the
        optimizer state of the served model ``key`` (``global``, ``cluster<c>``)."""
        avg = self.aggregator.aggregate(rows)
        return avg if base is None else self.server_step(base, avg, key)

    def server_step(self, base: dict, avg: dict, key: str = "global") -> dict:
        """The served model ``key``'s next parameters from ``base`` and the sites' average ``avg``: ``avg`` itself
        (FedAvg), or a FedOpt step (``train.server_opt``; :func:`fedmed.algorithms.aggregation.server_opt_step`)."""
        if getattr(self, "_server_opt", None) is None:  # read once: the config never changes during a run
            self._server_opt = self.task_cfg.train.server_opt
        opt = self._server_opt
        if opt.kind == "none":
            return avg
        from fedmed.algorithms.aggregation import server_opt_step

        import numpy as np

        from fedmed.workflows.federation import RunFailed

        state = self._server_opt_state().setdefault(key, {})
        new = server_opt_step(base, avg, state, kind=opt.kind, lr=opt.lr, beta1=opt.beta1, beta2=opt.beta2,
                              tau=opt.tau)
        bad = [k for k, v in new.items() if np.asarray(v).dtype.kind == "f" and not np.isfinite(v).all()]
        if bad and all(np.isfinite(np.asarray(v)).all() for v in avg.values() if np.asarray(v).dtype.kind == "f"):
            raise RunFailed(f"the server's optimizer step (train.server_opt: {opt.kind}, lr {opt.lr:g}, tau {opt.tau:g}) "
                            f"made {len(bad)} of {len(new)} tensors of the {key} model non-finite from the sites' "
                            f"finite average; nothing was sent to the sites (lower train.server_opt.lr)")
        return new

    def move_server_opt(self, keys: dict) -> None:
        """After the served models are renumbered (CFL's split): ``keys`` new key -> the old key whose FedOpt state
        it continues (a split's two halves both continue their parent's)."""
        import copy

        st = self._server_opt_state()
        new = {k: copy.deepcopy(st[old]) for k, old in keys.items() if old in st}
        st.clear()
        st.update(new)

    SERVER_OPT = "server_opt:"  # the checkpoint's names of the server optimizer's moments
    SELECTED = "selected:"  # the checkpoint's names of each trained model's selected round (fedmed.workflows.stopping)

    # ------------------------------------------------------------------ train to convergence (#85)
    def stopper(self, key: str = "global"):
        """The stop rule of the trained model ``key`` (``train.stop``; :class:`fedmed.workflows.stopping.Stopper`),
        continuing a resumed run's."""
        from fedmed.workflows.stopping import Stopper

        resumed = self.resumed if self.fed is not None else {}
        st = Stopper.from_config(self.task_cfg.train, ((resumed.get("state") or {}).get("stop") or {}).get(key))
        st.params = (resumed.get("models") or {}).get(f"{self.SELECTED}{key}") if st.selected is not None else None
        return st

    def observe(self, stop, round_: int, rows, params) -> bool:
        """Round ``round_``'s replies into the stop rule ``stop`` (its validation score as the rule reads it, and the
        pooled validation histograms a decision threshold is chosen from); True: stop after this round."""
        from fedmed.workflows.stopping import val_histograms

        return stop.observe(round_, self.round_score(rows, stop.metric), params, val_histograms(rows))

    def round_score(self, rows, metric: str) -> float:
        """The round's validation score ``metric`` (the stop rule's), from the sites' replies."""
        from fedmed.workflows.stopping import reply_entries, val_score

        return val_score(reply_entries(rows), metric)

    def decision(self, hist) -> dict | None:
        """A classifier's decision threshold chosen on the pooled validation histograms ``hist`` (binary models;
        :func:`fedmed.algorithms.metrics.decision_threshold`), which travels with the saved model."""
        if hist is None or self.task_cfg.task != "classification":
            return None
        from fedmed.algorithms.metrics import decision_threshold

        return decision_threshold(hist)

    def save_selected(self, stoppers: dict, last: int) -> None:
        """After the final round: the run record's ``stop`` note (why and when each trained model stopped) and, per
        model, ``models/selected_<key>.pt`` — its model at the round the selection rule reports (the serving plan's
        reference, #86)."""
        note = {k: st.record(last) for k, st in stoppers.items()}
        self.recorder.note("stop", note)
        for k, st in stoppers.items():
            self.info(f"[fedmed] {k}: {note[k]['why']}")
            if st.params is not None:
                self.fed.save_final(st.params, f"selected_{k}", sites=list(self.sites), rounds=st.selected,
                                    bundle=False, decision=self.decision(st.hist))

    def _server_opt_state(self) -> dict:
        """served model -> its FedOpt moments (``{"m": {...}, "v": {...}}``), restored from a resumed run's
        checkpoint (FedOpt's state lives at the server, never at a site)."""
        if getattr(self, "_fedopt", None) is None:
            self._fedopt = {}
            for name, arrays in (self.resumed.get("models", {}) if self.fed is not None else {}).items():
                if name.startswith(self.SERVER_OPT):
                    key, _, moment = name[len(self.SERVER_OPT):].rpartition(":")
                    self._fedopt.setdefault(key, {})[moment] = dict(arrays)
        return self._fedopt

    def checkpoint(self, next_round: int, models: dict, stoppers: dict | None = None, **state):
        if stoppers:  # each model's stop rule and its selected round's model
            state = {**state, "stop": {k: st.state() for k, st in stoppers.items()}}
            models = {**models, **{f"{self.SELECTED}{k}": st.params for k, st in stoppers.items()
                                   if st.params is not None}}
        if getattr(self, "_fedopt", None):
            models = {**models, **{f"{self.SERVER_OPT}{key}:{moment}": arrays for key, st in self._fedopt.items()
                                   for moment, arrays in st.items() if arrays}}
        self.fed.checkpoint(next_round, models, **state)

    def save_final(self, params: dict, name: str = "global", *, sites=None, cluster=None, rounds=None,
                   decision=None):
        self.fed.save_final(params, name, sites=sites, cluster=cluster, rounds=rounds, decision=decision)

    def save_onboarding(self, mode: str, clusters: dict, arrays: dict | None = None, **state):
        """What a new site needs to be given the cluster model that fits it after this run
        (:class:`fedmed.workflows.onboard.Onboard`): the ``mode`` of assignment, ``clusters`` (cluster id -> its
        training sites) and the method's ``state`` (aggregates the sites already sent: signatures, assessments, a
        split tree) in ``onboarding.json``, arrays in ``onboarding.npz``. Written only by a run that finished."""
        import json

        import numpy as np

        from fedmed.core.io import json_default

        doc = {"mode": mode, "workflow": self.record_name, "clusters": {str(c): list(s) for c, s in clusters.items()},
               "state": state}
        (self.out_dir / "onboarding.json").write_text(json.dumps(doc, default=json_default))
        if arrays:
            np.savez(self.out_dir / "onboarding.npz", **{k: np.asarray(v) for k, v in arrays.items()})

    def sample(self, round_: int, share: float) -> list:
        """Step: the sites taking part in round ``round_`` — a ``share`` of the federation drawn with the run's seed
        and the round (the same draw in every federation and on a resumed run)."""
        import numpy as np

        k = max(1, int(round(share * len(self.sites))))
        rng = np.random.default_rng(self.task_cfg.seed * 100_003 + round_)
        return sorted(rng.choice(self.sites, size=k, replace=False).tolist())

    def start_round(self) -> int:
        return int(self.resumed.get("next_round", 0))

    def resumed_models(self) -> dict:
        """The models a resumed run's checkpoint holds (the server optimizer's state and the selected rounds' models
        left out)."""
        return {k: v for k, v in self.resumed.get("models", {}).items()
                if not k.startswith((self.SERVER_OPT, self.SELECTED))}

    def initial_params(self, cfg: dict | None = None) -> dict:
        """The model every site starts from, built at the server under the server's policy: a network it may not
        build (a module its policy does not list, an argument that would download) fails the run in one line."""
        from fedmed.core.policy import PolicyError
        from fedmed.nn.models import ArchError

        from fedmed.workflows.federation import RunFailed

        cfg = cfg or self._cfg
        try:
            self.fed.policy.check_arch(self.task_cfg.model.arch)
            return initial_params(cfg, self.job_files, self.fed.policy.modules)
        except (PolicyError, ArchError) as e:
            raise RunFailed(f"the server cannot build the model: {e}") from None

    def info(self, msg: str) -> None:
        self.fed.info(msg)

    def warning(self, msg: str) -> None:
        self.fed.warning(msg)

    def error(self, msg: str) -> None:
        self.fed.error(msg)
