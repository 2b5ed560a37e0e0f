"""Every site gets the model that serves it best, chosen on its own validation data (issue #57): the plan job.

The job carries finished runs' models (built by :func:`fedmed.run.jobspec.plan_spec`): under ``plan/global/`` the
reference — the global model of a FedAvg-family run (``global.pt``) — and under ``plan/<name>/`` each candidate run's
final models as it saved them (``cluster<c>.pt``, each naming the sites that trained it; or one ``global.pt`` that
every site may be served; or, from an onboarding run, the model it assigned each new site, ``<site>.pt``: the plan
then decides for a newcomer between the global model and its assigned cluster's). A FedBN run's ``global.pt`` names
the key under which each site kept its own batch-norm layers (``personal_key``): that candidate is, at each site, the
run's model with the site's own layers — FedBN's personal model, scored and served there, never pooled across sites
and never written to ``models/`` (it stays at its site). Algorithm box:

1. (``serve_score``) each site is sent the global model and its own candidates — the model of its cluster in each
   candidate run — and scores them on its **validation** split; with ``finetune`` it also fine-tunes the global model
   on its training split and scores that (``finetuned``; the model never leaves it). It replies with paired
   aggregates against the global model (items and, from a classifier, the sums of the per-item proper-score
   differences and of their squares; wins and losses only where no count is below ``k_min`` — never a per-image
   value; nothing for a model blind to the image or one that differs from another on fewer than ``k_min`` items:
   docs/privacy.md, "The serving plan's replies").
2. The server picks per site (:func:`fedmed.algorithms.serving.plan`): the global model unless a candidate beats it
   beyond the validation noise (a one-sided paired test — ``test``: the t-test on the proper-score differences, or
   the exact sign test — Bonferroni over the site's candidates, ``alpha`` fixed before any number is seen); a
   cluster model is judged on its cluster's pooled aggregates (``pool``). The plan is
   recorded (``plan``), written as ``plan.md`` / ``plan.json``, and the served model of each site as
   ``models/<site>.pt`` — except a fine-tuned one, which stays at its site.
3. (``served``) every site scores the model it is served on its validation and test splits (a fine-tuned model is
   made again at the site with the same seed and round: the same model), and (``global``) the global model, the
   reference row. The test split is read only here, after the choice.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from fedmed.core import jobfiles
from fedmed.core.packing import pack_models
from fedmed.site.served import served_path
from fedmed.workflows.base import Workflow
from fedmed.workflows.federation import RunFailed

__all__ = ["Plan", "REFERENCE", "candidate_models", "candidate_name_ok", "personal_key"]

REFERENCE = "global"  # the reference's folder and name
FINETUNED = "finetuned"  # the global model fine-tuned at the site (serve_score's name for it)
LOCAL = "local"  # the site's own model, trained on its data alone from the run's starting model (#85)
AT_SITE = (FINETUNED, LOCAL)  # models made at the site, which never leave it


def candidate_name_ok(name: str) -> bool:
    """A candidate's name names its folder in the job and its metrics: a word (letters, digits, ``_-.``) other than
    the reference's and the fine-tuned model's."""
    return name not in (REFERENCE, *AT_SITE) and name.replace("_", "").replace("-", "").replace(".", "").isalnum()


def candidate_models(folder: Path) -> list[tuple[Path, list | None]]:
    """``(file, sites)`` of each model a run saved in ``folder``: its cluster models (each with the sites that trained
    it), else its ``global.pt`` (``sites`` None: every site may be served it), else the models an onboarding run
    assigned its new sites (``<site>.pt``: that site's)."""
    import torch

    files = sorted(folder.glob("cluster*.pt"), key=lambda p: int(p.stem[len("cluster"):])) or \
        [p for p in [folder / "global.pt"] if p.is_file()]
    if not files:  # an onboarding run: each new site's assigned model
        return [(p, [p.stem]) for p in sorted(folder.glob("*.pt"))]
    out = []
    for p in files:
        ck = torch.load(p, map_location="cpu", weights_only=True)
        out.append((p, None if p.stem == "global" else list(ck.get("sites") or [])))
    return out


def personal_key(found: list) -> str | None:
    """The key of a run whose sites keep their own layers (a FedBN run's ``global.pt`` names it): each site is then
    scored, and served, with the run's model and its own layers (``serve_personal``), a model that stays at the site."""
    import torch

    if len(found) != 1 or found[0][1] is not None:
        return None
    return torch.load(found[0][0], map_location="cpu", weights_only=True).get("personal_key")


def _params(path: Path) -> dict:
    import torch

    return {k: v.numpy() for k, v in torch.load(path, map_location="cpu", weights_only=True)["state_dict"].items()}


class Plan(Workflow):
    """The serving plan (see the module notes).

    Args:
        candidates: the candidate runs' names, in order (their folders under the job's ``plan/``).
        finetune: ``{"epochs", "lr_scale"}``: also the global model fine-tuned at each site (``finetune_local``'s
            options); None: not.
        alpha: the family-wise rate at a site of serving a candidate that is no better than the global model.
        pool: a cluster model is judged on its cluster's pooled evidence (else each site's own).
        test: ``"score"`` (the paired t-test on proper-score differences where the sites send them, else the sign
            test) or ``"sign"`` (:data:`fedmed.algorithms.serving.TESTS`).
    """

    record_name = "Plan"

    def __init__(self, num_rounds: int, task_config: dict, candidates=(), finetune: dict | None = None,
                 alpha: float | None = None, pool: bool = True, test: str | None = None, local: bool = False, **kw):
        from fedmed.algorithms.serving import ALPHA, TESTS

        super().__init__(num_rounds, task_config, **kw)
        self.candidates = [str(c) for c in candidates]
        bad = [c for c in self.candidates if not candidate_name_ok(c)]
        if bad or len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"plan: candidate names must be distinct words other than {REFERENCE!r}, "
                             f"{FINETUNED!r} and {LOCAL!r}, got {self.candidates}")
        self.finetune = dict(finetune) if finetune else None
        self.local = bool(local)  # each site's own model is a candidate too (train.rounds blocks, train.stop)
        self.alpha = ALPHA if alpha is None else float(alpha)
        self.pool = bool(pool)
        self.personal: dict = {}  # candidate -> the key its sites keep their own layers under (models())
        self.test = "score" if test is None else str(test)
        if self.test not in TESTS:
            raise ValueError(f"plan: test should be one of {TESTS}, got {test!r}")

    @property
    def root(self) -> Path:
        return Path(self.job_files or ".") / jobfiles.PLAN

    def models(self) -> tuple[Path, dict]:
        """The reference file and, per candidate, ``{file: sites}`` (None: every site)."""
        ref = self.root / REFERENCE / "global.pt"
        if not ref.is_file():
            raise RunFailed(f"the job carries no global model ({jobfiles.PLAN}/{REFERENCE}/global.pt)")
        out = {}
        self.personal = {}
        for name in self.candidates:
            found = candidate_models(self.root / name)
            if not found:
                raise RunFailed(f"the job carries no model of candidate {name!r} ({jobfiles.PLAN}/{name}/)")
            out[name] = dict(found)
            key = personal_key(found)
            if key:
                self.personal[name] = key
        return ref, out

    def run(self):
        from fedmed.algorithms.serving import Paired, plan, plan_table

        ref, cands = self.models()
        # each site's candidates: per run, the model that names it (or the run's one model)
        own = {s: {name: next((f for f, sites in files.items() if sites is None or s in sites), None)
                   for name, files in cands.items()} for s in self.sites}
        own = {s: {n: f for n, f in c.items() if f is not None} for s, c in own.items()}
        groups: dict = {}
        for s in self.sites:
            groups.setdefault(tuple(sorted((n, str(f)) for n, f in own[s].items())), []).append(s)
        cache = {str(ref): _params(ref)}
        start = self.initial_params() if self.local else None  # the run's starting model: each site's own from it
        messages = {}
        for i, (key, sites) in enumerate(sorted(groups.items(), key=lambda kv: kv[1])):
            names = [n for n in self.candidates if n in dict(key)]
            files = [ref, *(Path(dict(key)[n]) for n in names)]
            packed = pack_models([cache.setdefault(str(f), _params(f)) for f in files] + ([start] if start else []))
            opts = {"names": [REFERENCE, *names], **({"finetune": self.finetune} if self.finetune else {}),
                    **({"local": True} if self.local else {}),
                    **({"personal": {n: self.personal[n] for n in names if n in self.personal}}
                       if any(n in self.personal for n in names) else {})}
            messages[f"g{i}"] = (self.task(packed, 0, method_options=opts), sites)
        replies = self.send_groups("serve_score", messages)
        ok = self.record_rows(0, [r for rows in replies.values() for r in rows], "serve_score")
        counts = {r.site: {n: None if c is None else Paired(**c) for n, c in r.meta["serving"].items()} for r in ok}
        if not counts:
            raise RunFailed("no site scored its candidates: " + "; ".join(self.recorder.recent_errors(3)))
        # a cluster model is shared by its cluster's sites: they pool their evidence for it (a personal model is not)
        shared = {n: {s: str(own[s][n]) for s in counts if n in own[s]} for n in self.candidates
                  if n not in self.personal} if self.pool else {}
        choices = plan(counts, groups=shared, alpha=self.alpha, reference=REFERENCE, test=self.test,
                       withheld={r.site: r.meta.get("not_scored") or {} for r in ok})
        for s, c in sorted(choices.items()):
            self.info(f"{s} is served {c.served}: {c.reason}")
        doc = {s: {"served": c.served, "reason": c.reason, "p": c.p, "threshold": c.threshold,
                   "file": (None if c.served in AT_SITE or c.served in self.personal else
                            Path(str(ref) if c.served == REFERENCE else str(own[s][c.served])).name),
                   "evidence": {n: None if v is None else v.message() for n, v in counts[s].items()}}
               for s, c in choices.items()}
        self.recorder.note("plan", {"sites": doc, "alpha": self.alpha, "pool": self.pool, "test": self.test,
                                    "candidates": self.candidates, "finetune": self.finetune, "local": self.local})
        (self.out_dir / "plan.md").write_text(plan_table(choices))
        self.write_site_models(choices, ref, own)
        key = hashlib.sha256(json.dumps([hashlib.sha256(ref.read_bytes()).hexdigest(),  # the same plan, the same key
                                         sorted((s, v["served"], v["file"]) for s, v in doc.items()), self.finetune],
                                        default=str).encode()).hexdigest()[:16]
        kept = self.score_served(choices, ref, own, cache, key, start)
        for s, v in doc.items():  # where each site keeps the model it is served (relative to its own workspace)
            v["served_at"] = served_path(key) if s in kept else None
        (self.out_dir / "plan.json").write_text(json.dumps(doc, indent=1, default=float))
        missing = sorted(set(doc) - kept)
        if missing:
            self.warning(f"the served model is not kept at {', '.join(missing)} (no workspace folder there)")

    def write_site_models(self, choices: dict, ref: Path, own: dict) -> None:
        """``models/<site>.pt``: the served model's file as its run saved it (none for a model fine-tuned at the
        site, which never leaves it)."""
        out = self.out_dir / "models"
        out.mkdir(parents=True, exist_ok=True)
        for s, c in choices.items():
            if c.served not in AT_SITE and c.served not in self.personal:  # those stay at their sites
                shutil.copy(ref if c.served == REFERENCE else own[s][c.served], out / f"{s}.pt")

    def score_served(self, choices: dict, ref: Path, own: dict, cache: dict, key: str, start=None) -> set:
        """Round 1 (``served``): every site scores the model it is served (validation and test) and keeps it in its
        own workspace (``serve_keep``: :func:`fedmed.site.served.keep_served`); round 2 (``global``): the global
        model, the reference row. Returns the sites that kept their model."""
        by_file: dict = {}
        tuned, alone = [], []
        for s, c in choices.items():
            if c.served == FINETUNED:
                tuned.append(s)
            elif c.served == LOCAL:
                alone.append(s)
            else:
                f = str(ref if c.served == REFERENCE else own[s][c.served])
                by_file.setdefault((f, self.personal.get(c.served)), []).append(s)
        groups = {f"m{i}": (self.task(cache.setdefault(f, _params(Path(f))), 0, serve_keep=key,
                                      **({"serve_personal": pk} if pk else {})), sites)
                  for i, ((f, pk), sites) in enumerate(sorted(by_file.items(),
                                                              key=lambda kv: (kv[0][0], kv[0][1] or "")))}
        replies = self.send_groups("validate", groups) if groups else {}
        rows = [r for rs in replies.values() for r in rs]
        if tuned:  # the same fine-tuning as in serve_score: the same seed, round and settings
            rows += self.send("finetune_local", self.task(cache[str(ref)], 0, method_options=self.finetune,
                                                          serve_keep=key), targets=sorted(tuned))
        if alone:  # each site's own model made again, as serve_score made it: the same blocks from the same seed
            rows += self.send("local_model", self.task(start, 0, serve_keep=key), targets=sorted(alone))
        self.record_rows(1, rows, "served")
        kept = {r.site for r in rows if (r.meta or {}).get("served_kept")}
        self.record_rows(2, self.send("validate", self.task(cache[str(ref)], 0), targets=sorted(choices)), REFERENCE)
        return kept
