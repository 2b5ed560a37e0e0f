"""Workflow verbs of the CLI: ``data``, ``experiment``, ``job``, ``plan``, ``predict``, ``bundle`` (``demo``: cli/demo.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fedmed.cli.assess import register_assess
from fedmed.cli.demo import DEMO_PARTS, cmd_demo


def positive_int(text: str) -> int:
    """An argument that is a whole number of at least 1 (argparse names the option when it is not)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"should be at least 1, got {v}")
    return v


def cmd_data(a):
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation

    overrides = list(a.set)
    if a.dataset:
        overrides.append(f"dataset.path={a.dataset}")
    for flag, key in ((a.sites, "federation.sites"), (a.partition, "federation.partition"), (a.alpha, "federation.alpha")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    if a.config:
        exp = load_config(a.config, overrides)
    else:
        if not a.dataset:
            raise ValueError("give --config CONFIG or --dataset PATH")
        exp = load_config({"name": "data", "dataset": {"path": a.dataset}}, overrides)
    out = prepare_federation(exp, a.seed, a.out)
    import json

    meta = json.loads((out / "dataset.json").read_text())
    print(f"wrote {len(meta['sites'])} site datalists to {out}")
    if meta.get("task") == "segmentation":
        for s in meta["sites"]:
            vols = meta.get("site_volumes_mm3", {}).get(s)
            print(f"  {s}: samples {meta['site_samples'][s]}" + (f", {meta['region']} volumes (mm^3) {vols}" if vols else ""))
        return
    for s in meta["sites"] + meta.get("unseen_sites", []):
        doc = json.loads((out / f"{s}.json").read_text())
        counts = {}
        for e in doc["training"] + doc["validation"] + doc["test"]:
            counts[e["label"]] = counts.get(e["label"], 0) + 1
        print(f"  {s}: {len(doc['training'])} train / {len(doc['validation'])} validation / {len(doc['test'])} test, "
              f"classes {dict(sorted(counts.items()))}")


def cmd_check_data(a):
    """``fedmed check-data``: 0 when the site is ready to join, 1 when its report lists problems."""
    import json

    from fedmed.core.io import json_default
    from fedmed.site.check import check_datalist, format_report

    task, classes, size, channels, k_min = "classification", None, 32, 1, 1
    if a.config:
        from fedmed.config import load_config

        exp = load_config(a.config)
        task, classes = exp.dataset.task, exp.dataset.classes
        size, channels, k_min = exp.dataset.image_size, exp.dataset.channels, exp.privacy.k_min
    k_min = a.k_min if a.k_min is not None else k_min
    datalist, root, policy = Path(a.datalist), None, None
    try:
        doc = json.loads(datalist.read_text()) if datalist.is_file() else None
    except (OSError, ValueError):
        doc = None
    if isinstance(doc, dict) and "datalist" in doc and "training" not in doc:  # a site's local/fedmed_site.json
        from fedmed.site.settings import SiteConfigError, resolve_site_settings

        try:
            s = resolve_site_settings("this site", env={"FEDMED_SITE_CONFIG": str(datalist)}, cwd=datalist.parent)
        except SiteConfigError as e:
            print(f"fedmed check-data: {e}")
            return 1
        datalist, root, policy = s.datalist, s.data_root, s.policy
        if s.policy.k_min > k_min:
            print(f"the site's floor k_min={s.policy.k_min} applies (the job's is {k_min})")
            k_min = s.policy.k_min
    if policy is None:  # the site's own policy where it has one (FEDMED_SITE_POLICY, its kit), else the defaults
        from fedmed.core.policy import PolicyError, load_policy

        try:
            policy = load_policy(cwd=datalist.parent)
        except PolicyError as e:
            print(f"fedmed check-data: {e}")
            return 1
    rep = check_datalist(datalist, task=a.task or task, classes=a.classes or classes,
                         image_size=a.image_size or size, channels=a.channels or channels, k_min=k_min, root=root,
                         policy=policy)
    print(format_report(rep))
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1, default=json_default))
    return 1 if rep["problems"] else 0


def cmd_cache(a):
    from fedmed.site.cache import SiteCache, cache_root

    root = Path(a.dir) if a.dir else cache_root()
    if root is None:
        off = os.environ.get("FEDMED_CACHE", "1").lower() in ("0", "false", "no", "off")
        print("the cache is off (FEDMED_CACHE=0)" if off else
              "no cache folder given: a site's cache is in its workspace (a kit's local/fedmed_cache, fedmed "
              "experiment's <out>/cache); name it with --dir or FEDMED_CACHE_DIR")
        return 0
    sites = [a.site] if a.site else sorted(d.name for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
    for s in sites:
        c = SiteCache(root, s)
        files = list(c.dir.rglob("*.npz")) if c.dir.is_dir() else []
        if a.action == "clear":
            print(f"{s}: removed {c.clear()} cached entr{'y' if len(files) == 1 else 'ies'} from {c.dir}")
        else:
            print(f"{s}: {len(files)} entries, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB in {c.dir}")
    if not sites:
        print(f"no cached data in {root}")
    return 0


def cmd_experiment(a):
    from fedmed.run.experiment import run_experiment

    out = a.out or str(Path("results") / Path(a.config).stem)
    try:
        run_experiment(a.config, out, overrides=a.set, methods=a.methods, resume=a.resume, in_process=a.in_process)
    finally:
        if (Path(out) / "summary.md").is_file():
            print((Path(out) / "summary.md").read_text())


def _help():
    from fedmed.core.helpformat import HELP

    return HELP


def cmd_job(a):
    """``fedmed job build|run ARGS``: the job builder and runner installed with fedmed (``fedmed_flare.build``,
    ``fedmed_flare.run``; a clone's ``jobs/build.py`` and ``jobs/run.py``), from any folder; their arguments and exit
    code as they are, their usage line named as typed. A subprocess: fedmed itself never imports nvflare."""
    import subprocess
    import sys

    env = dict(os.environ, FEDMED_PROG=f"fedmed job {a.action}")
    return subprocess.call([sys.executable, "-m", f"fedmed_flare.{a.action}", *a.args], env=env)


def cmd_ssl(a):
    from fedmed.run.ssl import run_ssl

    out = a.out or str(Path("results") / Path(a.config).stem)
    import shlex

    words = ["fedmed", "ssl", a.config, "--out", out, *[w for x in a.set for w in ("--set", x)]]
    run_ssl(a.config, out, overrides=a.set, resume=a.resume, command=" ".join(shlex.quote(w) for w in words))
    print((Path(out) / "summary.md").read_text())


def cmd_report(a):
    from fedmed.report.html import write_report

    print(f"wrote {write_report(a.out_dir)}")


def cmd_predict(a):
    """Apply a trained model: classify images (CSV/JSON out) or segment one NIfTI case (label map out)."""
    import json

    from fedmed.nn.predict import load_model, predict_images, predict_volume

    _, ck = load_model(a.model)
    if ck["task"] == "segmentation":
        if a.mask and not Path(a.mask).is_file():
            raise ValueError(f"--mask {a.mask}: file not found")
        out = Path(a.out or "prediction.nii.gz")
        predict_volume(a.model, a.inputs, out, mask=a.mask, device=a.device)
        print(f"wrote {out} (labels 1 core, 2 edema, 4 enhancing)")
        return
    if a.mask:
        raise ValueError("--mask applies to segmentation models only")
    rows = predict_images(a.model, a.inputs, device=a.device)
    if a.out:
        import csv

        names = list(rows[0]["probabilities"])
        with open(a.out, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["image", "prediction", *names])  # the exported bundle's predictions.csv columns
            for r in rows:
                w.writerow([r["image"], r["prediction"], *[r["probabilities"][n] for n in names]])
        print(f"wrote {a.out} ({len(rows)} images)")
    else:
        print(json.dumps(rows, indent=1))


def _plan_candidates(a, exp) -> dict:
    """--candidate NAME=RUN, or a method of the config (its run beside --global's): name -> run folder."""
    from fedmed.run.jobspec import select_method

    cands = {}
    for c in a.candidate:
        name, eq, path = c.partition("=")
        if not eq:  # a method of the config by its name: its run is the folder beside --global's (the same seed)
            from fedmed.run.experiment import candidate_name, run_folder

            m = select_method(exp, c, a.config).name
            name, path = candidate_name(m), str(Path(a.reference).parent / run_folder(m))
        if not name or not path:
            raise ValueError(f"--candidate {c}: expected NAME=RUN (a name for the candidate, its run folder) or a "
                             f"method of the config")
        if name in cands:
            raise ValueError(f"--candidate {name}: given twice")
        cands[name] = path
    return cands


def _plan_classes(a, exp, method):
    """The config and method with the classes the runs were trained with (the datalists', else the saved models')."""
    from fedmed.run.experiment import with_classes
    from fedmed.run.jobspec import BuildError, select_method

    if a.data and (Path(a.data) / "dataset.json").is_file():
        exp = with_classes(exp, Path(a.data))
    elif exp.dataset.classes is None:  # the classes the runs were trained with (their saved models say)
        import torch

        from fedmed.run.followups import finished_run

        try:
            saved = sorted((finished_run(a.reference, "--global") / "models").glob("*.pt"))
            classes = torch.load(saved[0], map_location="cpu", weights_only=True).get("classes") if saved else None
        except BuildError as e:
            raise ValueError(str(e)) from None
        if classes:
            exp = exp.model_copy(update={"dataset": exp.dataset.model_copy(update={"classes": list(classes)})})
        method = select_method(exp, method.name, a.config)  # the same method, with the classes
    return exp, method


def cmd_plan(a):
    """The serving plan over finished runs (``fedmed.workflows.plan``): in FLARE's simulator, in this process, or
    written as a job spec for provisioned sites."""
    import json

    from fedmed.config import load_config
    from fedmed.run.followups import ServingPlan
    from fedmed.run.jobspec import BuildError, job_spec, run_spec_in_process, select_method

    if a.finetune_epochs < 1 or not 0 < a.finetune_lr_scale <= 1:
        raise ValueError(f"--finetune-epochs should be at least 1 and --finetune-lr-scale above 0 and at most 1, got "
                         f"{a.finetune_epochs} and {a.finetune_lr_scale}")
    if not a.spec and not a.data:
        raise ValueError("--data: the federation's datalists folder (<site>.json) is needed to run the plan here")
    if a.data and not Path(a.data).is_dir():
        raise ValueError(f"--data {a.data}: no such folder")
    exp = load_config(a.config, a.set)
    method = select_method(exp, a.method, a.config) if a.method else exp.methods[0]  # before the runs are read
    cands = _plan_candidates(a, exp)
    exp, method = _plan_classes(a, exp, method)
    finetune = {"epochs": a.finetune_epochs, "lr_scale": a.finetune_lr_scale} if a.finetune else None
    try:
        spec = job_spec(exp, method, a.seed, sites=a.sites or "config", follows=ServingPlan(
            a.reference, cands, finetune, a.local, pool=not a.no_pool, test=a.test))
    except BuildError as e:
        raise ValueError(str(e)) from None
    if a.spec:  # the models it starts from beside it: it runs after this process has ended
        print(f"wrote {spec.to_file(a.spec, self_contained=True)} (run it: fedmed job run --spec {a.spec} --env "
              f"prod|sim ...)")
        return 0
    out = Path(a.out)
    if a.in_process:
        try:
            status, fed = run_spec_in_process(spec, a.data, out)
        finally:
            spec.release()
        doc, server = fed.recorder.doc, out
    else:
        from fedmed.run.jobs import RunError, run_and_release

        try:
            doc = run_and_release(spec, Path(a.data), out, len(spec.sites))
        except RunError as e:
            print(f"the plan did not finish: {e.status}: {e.reason}")
            return 1
        status, server = doc.get("status"), out / "server"
    if status != "finished":
        print(f"the plan did not finish: {status}: {doc.get('reason')}")
        return 1
    print((server / "plan.md").read_text())
    at = {v.get("served_at") for v in json.loads((server / "plan.json").read_text()).values()} - {None}
    print(f"the plan: {server / 'plan.json'}; each site keeps the model it is served in its own workspace"
          + (f" ({out / 'sites'}/<site>/{next(iter(at))} here; a provisioned site: its kit's local/{next(iter(at))}; "
             f"`fedmed predict` runs on it)" if at else "") + f"; the shared ones are also in {server / 'models'}/")
    return 0


def cmd_bundle(a):
    """Write a trained classifier or 3D segmentation model (a run's models/*.pt) as a MONAI bundle (fedmed.nn.bundle)."""
    from fedmed.nn.bundle import export_bundle

    out = export_bundle(a.model, a.out)
    print(f"wrote {out} (python -m monai.bundle run --config_file {out}/configs/inference.json --meta_file "
          f"{out}/configs/metadata.json --bundle_root {out} --dataset_dir IMAGES_OR_CASES --output_dir OUT)")


def cmd_encoders(a):
    from fedmed.nn.encoders import ENCODERS, NORMALIZE_TEXT, EncoderError, check_weights

    if a.action == "check":
        if not a.file or not a.encoder:
            raise ValueError("fedmed encoders check FILE --encoder NAME")
        try:
            print(check_weights(a.file, a.encoder))
        except EncoderError as e:
            raise ValueError(str(e)) from None
        return
    rows = [("name", "architecture", "input", "preprocessing", "feature (dim)", "the authors' file")]
    for name, s in ENCODERS.items():
        inp = "1 x D x H x W" if s.spatial_dims == 3 else (f"{s.channels or 'C'} x {s.size or 'S'} x {s.size or 'S'}")
        rows.append((name, s.architecture, inp, NORMALIZE_TEXT[s.normalize], f"{s.feature} ({s.dim or 'C S^2'})",
                     s.release or "-"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def register(sub):
    """Add the workflow verbs to the `fedmed` parser's subcommands."""
    from fedmed.core.helpformat import HELP

    _register_data(sub, HELP)
    _register_runs(sub, HELP)
    _register_models(sub, HELP)
    register_assess(sub)
    return sys.modules[__name__]


def _register_data(sub, H):
    """encoders, data, check-data, cache: what a site and its data hold."""
    n = sub.add_parser("encoders", help="the registered encoders; 'check FILE --encoder NAME': does a weights file load",
                       formatter_class=H)
    n.add_argument("action", nargs="?", choices=["list", "check"], default="list",
                   help="list the registered encoders, or check a weights file")
    n.add_argument("file", nargs="?", help="check: a weights file as its authors release it")
    n.add_argument("--encoder", help="check: the registered encoder the file is for")
    n.set_defaults(func=cmd_encoders)

    d = sub.add_parser("data", help="write per-site datalists (dataset + partition)", formatter_class=H)
    d.add_argument("--config", help="experiment config (its dataset and federation sections are used; the flags below "
                   "override them when given)")
    d.add_argument("--dataset", help="dataset path or builtin:digits (without --config: required)")
    d.add_argument("--sites", type=int, help="number of sites (config default 4)")
    d.add_argument("--partition", choices=["iid", "dirichlet", "quantity", "predi", "anda"],
                   help="how samples are split (config default iid)")
    d.add_argument("--alpha", type=float, help="Dirichlet concentration (config default 0.5)")
    d.add_argument("--seed", type=int, default=0, help="seed of the partition and the splits")
    d.add_argument("--out", required=True, help="folder for <site>.json and dataset.json")
    d.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    d.set_defaults(func=cmd_data)

    k = sub.add_parser("check-data", help="check a site's datalist before it joins (its first task's checks and "
                       "more: overlaps, near-duplicates, counts per class and split); the report stays at the site",
                       formatter_class=H)
    k.add_argument("datalist", help="the site's datalist (<site>.json), or its settings file (local/fedmed_site.json: "
                   "its datalist, data_root and k_min floor are used)")
    k.add_argument("--config", help="the job's experiment config: classes, image size, channels, k_min and task from it")
    k.add_argument("--task", choices=["classification", "segmentation"], help="default: the config's, else "
                   "classification")
    k.add_argument("--classes", nargs="+", help="the job's class names (labels are their indices or these names)")
    k.add_argument("--image-size", type=positive_int, help="decode size (default: the config's, else 32; at most what "
                   "the site's policy decodes, max_image_pixels and max_task_bytes)")
    k.add_argument("--channels", type=int, choices=(1, 3), help="1 (grayscale) or 3 (RGB); default: the config's, "
                   "else 1")
    k.add_argument("--k-min", type=positive_int, help="the privacy floor (default: the config's, else 1)")
    k.add_argument("--json", help="also write the report as JSON here")
    k.set_defaults(func=cmd_check_data)

    ca = sub.add_parser("cache", help="a site's cache of decoded data (fedmed.site.cache): where it is, how big; clear it",
                        formatter_class=H)
    ca.add_argument("action", choices=["info", "clear"], help="info: entries and size per site; clear: remove them")
    ca.add_argument("--site", help="only this site's folder (default: every site's)")
    ca.add_argument("--dir", help="the cache root: a kit's local/fedmed_cache, fedmed experiment's <out>/cache "
                    "(default: FEDMED_CACHE_DIR)")
    ca.set_defaults(func=cmd_cache)


def _register_runs(sub, H):
    """experiment, demo, job, ssl, report: running studies and reporting them."""
    e = sub.add_parser("experiment", help="run a config's methods over seeds in NVFlare's simulator", formatter_class=H)
    e.add_argument("config", help="experiment config (app_configs/*.yaml)")
    e.add_argument("--out", help="output folder (default results/<config name>)")
    e.add_argument("--methods", nargs="+", help="run only these methods (default: all of the config's)")
    e.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    e.add_argument("--resume", action="store_true", help="reuse runs finished earlier with the same settings; "
                   "continue stopped ones from their checkpoint")
    e.add_argument("--in-process", action="store_true", help="run each job in this process (the same workflow and "
                   "site tasks without FLARE, one site after another: the same models) instead of FLARE's simulator; "
                   "for a GPU machine, where the simulator's process per site costs more than the sites' work; its "
                   "CPU work runs at one torch thread, reference rows included, as each simulated site's does")
    e.set_defaults(func=cmd_experiment)

    m = sub.add_parser("demo", help="the embedded demo: small federations, every table, an HTML report", formatter_class=H)
    m.add_argument("--data", help="a dataset folder instead of the bundled digits, e.g. ../shared/data/busi")
    m.add_argument("--out", default="results/demo", help="output folder")
    m.add_argument("--set", action="append", default=[], help="override of the classification part key.path=value")
    m.add_argument("--part", nargs="+", choices=list(DEMO_PARTS), help="run only these parts (default: all three)")
    m.set_defaults(func=cmd_demo)

    j = sub.add_parser("job", help="build a method's FLARE job from a config (fedmed_flare.build) or run one in the "
                       "simulator or on provisioned sites (fedmed_flare.run); 'fedmed job build --help' for their "
                       "options",
                       formatter_class=H)
    j.add_argument("action", choices=["build", "run"], help="build: fedmed_flare.build; run: fedmed_flare.run")
    j.add_argument("args", nargs=argparse.REMAINDER, help="their arguments")
    j.set_defaults(func=cmd_job)

    q = sub.add_parser("ssl", help="the 001_ study: Fed-MAE pre-training, fine-tuning across PreDi prevalence, "
                       "PreP-WFL, and the Fed-MAE encoder for FMCL", formatter_class=_help())
    q.add_argument("config", help="an SSL config (app_configs/ssl_imagenette.yaml)")
    q.add_argument("--out", help="output folder (default results/<config name>)")
    q.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    q.add_argument("--resume", action="store_true", help="reuse runs finished earlier with the same settings")
    q.set_defaults(func=cmd_ssl)

    r = sub.add_parser("report", help="write the self-contained HTML report of an experiment or sweep output folder",
                       formatter_class=_help())
    r.add_argument("out_dir", help="the --out folder of fedmed experiment / sweep / demo")
    r.set_defaults(func=cmd_report)


def _register_models(sub, H):
    """predict, bundle, plan: what a trained model is used for."""
    p = sub.add_parser("predict", help="apply a trained model (a run's models/*.pt) to images or a NIfTI case",
                       formatter_class=_help())
    p.add_argument("model", help="a model checkpoint written by a finished run (models/global.pt, models/cluster0.pt)")
    p.add_argument("inputs", nargs="+", help="image files (classification), or one NIfTI file per modality of one "
                   "case, in the model's modality order (segmentation)")
    p.add_argument("--out", help="classification: CSV of predictions (default: JSON on stdout); segmentation: the "
                   "label map to write (default prediction.nii.gz)")
    p.add_argument("--mask", help="segmentation: brain mask of the case (default: the first modality's non-zero voxels)")
    p.add_argument("--device", default="auto", help="auto (a CUDA GPU when there is one), cpu, cuda or cuda:N")
    p.set_defaults(func=cmd_predict)
    b = sub.add_parser("bundle", help="write a trained classifier or 3D segmentation model (a run's models/*.pt) as a "
                       "MONAI bundle (a run writes one beside each final model)",
                       formatter_class=_help())
    b.add_argument("model", help="a checkpoint of a finished run (models/global.pt, models/cluster0.pt)")
    b.add_argument("--out", help="the bundle folder (default: <model>_bundle beside the checkpoint)")
    b.set_defaults(func=cmd_bundle)
    pl = sub.add_parser("plan", help="the serving plan: which finished run's model each site is served, chosen on "
                        "its own validation split (the global model unless a candidate beats it beyond the noise)",
                        formatter_class=_help())
    pl.add_argument("config", help="the experiment config the runs were made with")
    pl.add_argument("--global", dest="reference", required=True, metavar="RUN",
                    help="the reference: a finished FedAvg-family run's folder, e.g. results/<name>/runs/seed0/FedAvg "
                         "as fedmed experiment lays it out (or a FLARE job result; the folder holding metrics.json "
                         "and models/global.pt is found inside it)")
    pl.add_argument("--method", help="the config's method the --global run is of (default: its first method)")
    pl.add_argument("--candidate", action="append", default=[], metavar="NAME=RUN|METHOD",
                    help="a finished run whose models a site may be served instead (a clustered run: each site its "
                    "cluster's model): a name and its run folder, or a method of the config as written there (its "
                    "run: the folder beside --global's, as fedmed experiment lays them out); repeatable")
    pl.add_argument("--local", action="store_true", help="also each site's own model, trained on its data alone from "
                    "the run's starting model (train.rounds blocks, train.stop); it never leaves the site")
    pl.add_argument("--finetune", action="store_true", help="also the global model fine-tuned at each site on its "
                    "training split (it never leaves the site)")
    pl.add_argument("--finetune-epochs", type=int, default=2, help="--finetune: local epochs")
    pl.add_argument("--finetune-lr-scale", type=float, default=0.1, help="--finetune: learning rate x train.lr")
    pl.add_argument("--no-pool", action="store_true", help="judge a cluster model on each site's own evidence only "
                    "(default: the sites it serves pool theirs)")
    pl.add_argument("--test", choices=["score", "sign"], default="score",
                    help="the paired test against the global model: 'score', a t-test on the per-image Brier-score "
                         "differences a classifier's sites send (a 2D lesion segmenter's: the sign test); 'sign', the "
                         "exact sign test on the images the two models answer differently (docs/readings.md)")
    pl.add_argument("--data", help="the federation's datalists (<site>.json): fedmed data --out, or an experiment's "
                    "data/seed<N>")
    pl.add_argument("--sites", nargs="+", help="the sites (default: the config's)")
    pl.add_argument("--seed", type=int, default=0, help="the seed the runs were made with")
    pl.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    pl.add_argument("--out", default="results/plan", help="output folder")
    pl.add_argument("--in-process", action="store_true", help="run it in this process instead of FLARE's simulator")
    pl.add_argument("--spec", help="write the job spec here, the models it starts from beside it (<name>_files/), "
                                   "and run nothing (fedmed job run --spec FILE --env prod)")
    pl.set_defaults(func=cmd_plan)
