"""``fedmed ssl CONFIG``: the ``001_`` study at CPU scale — Fed-MAE pre-training, then fine-tuning under label-space
heterogeneity, PreP-WFL, and the federation's own foundation model for FMCL.

For every seed:

1. **Fed-MAE** (the config's ``fedmae`` method) pre-trains on the sites' unlabeled pools — every image of the dataset
   except a common test set, split over the sites with Dirichlet quantity skew (``unlabeled_alpha``) — as an NVFlare
   simulator job; its per-round held-out reconstruction loss is recorded, ``models/encoder.pt`` is the encoder, and a
   PNG shows masked inputs and reconstructions.
2. For every **fine-tuning case** of the config's ``sweep:`` (e.g. PreDi prevalence ``p*`` = 1.5, 2.5, 3.5 at
   ``sigma* = 0``), a PreDi federation with ``predi_samples_per_cell`` labels per (class, site), the same common
   test set in the global label space, and every ``finetune`` method as a simulator job (Fed-MAE encoder, random
   init, Fed-MAE + PreP-WFL). References, in-process with the same recipe and budget: **each site alone** (Fed-MAE
   init; ``001_`` Table 5's client rows) and **centralized** (all labeled data pooled).
3. The **encoder comparison** case (a sweep case whose methods are ``fmcl``): FMCL with the ``fedmae_vit`` encoder
   with random weights vs the Fed-MAE weights on a feature-shift federation: clustering ARI against the true groups,
   chosen K, accuracy.

Tables (macro accuracy and macro-F1 on the common test set, final round, mean ± std over seeds) go to
``OUT/summary.md`` with the command; ``--resume`` reuses finished runs with identical settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedmed.run.experiment import classes_override, prepare_federation

from fedmed.run.jobs import RunError, run_config_job

from fedmed.run.fingerprint import run_fingerprint
from fedmed.report.summary import fmt

__all__ = ["run_key", "run_ssl"]


def _cached(work: Path, fp: str, resume: bool, fn, log, label: str):
    saved = work / "result.json"
    if resume and saved.is_file():
        prev = json.loads(saved.read_text())
        if prev.get("fingerprint") == fp:
            log(f"{label}: finished earlier with the same settings, reused")
            return prev["result"]
    work.mkdir(parents=True, exist_ok=True)
    res = fn()
    saved.write_text(json.dumps({"fingerprint": fp, "result": res}))
    return res


def run_key(exp, method, seed: int, case_set, encoder: Path | None = None) -> str:
    """What ``--resume`` compares for a run after pre-training: :func:`run_fingerprint`, the sweep case's overrides
    and, when the run starts from the Fed-MAE encoder, a digest of that file's bytes — its path alone is the same for
    every pre-training run into one output folder, so a pre-training rerun with other settings must not let a
    fine-tuning made from the old encoder be reused."""
    import hashlib

    key = run_fingerprint(exp, method, seed) + ":" + json.dumps(list(case_set))
    if encoder is not None:
        key += ":encoder:" + hashlib.sha256(Path(encoder).read_bytes()).hexdigest()
    return key


def _final(doc: dict, keys=("macro_acc", "macro_f1", "accuracy")) -> dict:
    last = doc["rounds"][-1]["summary"]["mean"]
    return {k: last.get(k) for k in keys}


def _recon_png(model_pt: Path, data_dir: Path, out_png: Path, n: int = 6) -> Path | None:
    """Masked inputs and reconstructions of a few common-test images by the final Fed-MAE model."""
    import torch

    from fedmed.data.images import load_images
    from fedmed.report.plots import _plt, _save
    from fedmed.nn.mae import mae_model, patchify

    ck = torch.load(model_pt, weights_only=True)
    from fedmed.data.datalists import load_datalist

    meta = json.loads((data_dir / "dataset.json").read_text())
    doc = load_datalist(data_dir / f"{meta['sites'][0]}.json", root=data_dir)
    x, _ = load_images(doc["test"][:n], image_size=ck["data"]["image_size"], channels=ck["data"]["channels"])
    model = mae_model(ck["data"]["channels"])
    model.load_state_dict(ck["state_dict"])
    model.eval()
    p = model.patch_embedding.patch_embeddings.kernel_size[0]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        xin = (x - 0.5) / 0.5
        pred, mask = model(xin)
    target = patchify(xin, p)
    b, c, h, w = x.shape

    def unpatch(t):
        return t.reshape(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)

    masked = unpatch(target * (1 - mask[..., None]))
    recon = unpatch(torch.where(mask[..., None] > 0, pred, target))
    plt = _plt()
    fig, axes = plt.subplots(3, len(x), figsize=(1.6 * len(x), 5), squeeze=False)
    for j in range(len(x)):
        for i, (img, name) in enumerate(((xin, "input"), (masked, "masked (75%)"), (recon, "reconstruction"))):
            im = (img[j].permute(1, 2, 0).numpy() * 0.5 + 0.5).clip(0, 1)
            axes[i, j].imshow(im.squeeze(), cmap="gray" if c == 1 else None)
            axes[i, j].axis("off")
            if j == 0:
                axes[i, j].set_title(name, fontsize=8, loc="left")
    fig.suptitle("Fed-MAE on the common test set (never trained on)")
    return _save(fig, out_png)


def _loop_reference(exp, method, seed, data_dir: Path, sites: list[str], encoder: Path | None, log) -> dict:
    """Each site alone and centralized: ``fedmed.workflows.fedavg_in_process`` over one site (or a pooled datalist)."""
    import torch

    from fedmed.workflows import fedavg_in_process
    from fedmed.run.taskconfig import build_task_config

    cfg = build_task_config(exp, seed, method, sites)
    init = None
    if encoder is not None:
        init = {k: v.numpy() for k, v in torch.load(encoder, weights_only=True).items()}
    out = {"alone": {}}
    for s in sites:
        _, summ = fedavg_in_process(cfg, data_dir, [s], rounds=exp.train.rounds, init=init)
        out["alone"][s] = {k: summ[-1]["mean"].get(k) for k in ("macro_acc", "macro_f1", "accuracy")}
    pooled = {"training": [], "validation": [], "test": None}
    for s in sites:
        doc = json.loads((data_dir / f"{s}.json").read_text())
        pooled["training"] += doc["training"]
        pooled["validation"] += doc["validation"]
        pooled["test"] = doc["test"]
    (data_dir / "central.json").write_text(json.dumps(pooled))
    _, summ = fedavg_in_process(cfg, data_dir, ["central"], rounds=exp.train.rounds, init=init)
    out["centralized"] = {k: summ[-1]["mean"].get(k) for k in ("macro_acc", "macro_f1", "accuracy")}
    log(f"    references: each site alone (Fed-MAE init) macro acc "
        + ", ".join(f"{s} {100 * v['macro_acc']:.1f}%" for s, v in out["alone"].items())
        + f"; centralized {100 * out['centralized']['macro_acc']:.1f}%")
    return out


def _ssl_pretrain(config_path, overrides: list, pre, seed: int, out: Path, resume: bool, log, first: bool) -> dict:
    """Step 1 of ``fedmed ssl``: Fed-MAE pre-training on the unlabeled pools (quantity-skewed) for ``seed``; its
    curve and the encoder it wrote."""
    from fedmed.config import load_config

    pre_over = overrides + ["federation.partition=quantity", f"federation.alpha={pre.unlabeled_alpha or 1000}",
                            "federation.val_fraction=0.1", f"train.rounds={pre.rounds}",
                            f"train.local_epochs={pre.local_epochs}", f"train.batch_size={pre.batch_size}",
                            "train.weight_decay=0.05"]
    pexp = load_config(config_path, pre_over)
    pdata = prepare_federation(pexp, seed, out / "data" / f"seed{seed}" / "pretrain")
    work = out / "runs" / f"seed{seed}" / "pretrain"

    def pretrain():
        log(f"[seed {seed}] Fed-MAE pre-training: {pexp.federation.sites} sites, {pexp.train.rounds} rounds ...")
        doc = run_config_job(str(config_path), pre_over + classes_override(pdata, pexp), pre.name, seed, pdata, work,
                             log=log)
        curve = [(r["round"], r["summary"]["mean"].get("mae_loss"), r["summary"]["mean"].get("val_mae_loss"),
                  r["summary"]["mean"].get("train_loss")) for r in doc["rounds"]]
        return {"curve": curve, "encoder": str(work / "server" / "models" / "encoder.pt")}

    pr = _cached(work, run_fingerprint(pexp, pre, seed), resume, pretrain, log, f"[seed {seed}] Fed-MAE")
    if first and (work / "server" / "models" / "global.pt").is_file():
        _recon_png(work / "server" / "models" / "global.pt", pdata, out / "fedmae_reconstructions.png")
    return pr


def _ssl_finetune(config_path, overrides: list, exp, fts: list, ft_cases: list, seed: int, encoder: Path, out: Path,
                  resume: bool, log, res: dict) -> None:
    """Step 2 of ``fedmed ssl``: every fine-tuning case's methods from the Fed-MAE encoder (or random), and each site
    fine-tuning alone beside them, into ``res``."""
    from fedmed.config import load_config

    for case in ft_cases:
        cover = overrides + list(case.set)
        cexp = load_config(config_path, cover)
        cdata = prepare_federation(cexp, seed, out / "data" / f"seed{seed}" / case.name)
        meta = json.loads((cdata / "dataset.json").read_text())
        for m in [x for x in fts if not case.methods or x.name in case.methods]:
            mover = cover + classes_override(cdata, cexp)
            if m.init == "fedmae":
                mover = mover + [f"methods.{m.name}.encoder_weights={encoder}"]
            mexp = load_config(config_path, mover)
            mm = next(x for x in mexp.methods if x.name == m.name)
            mwork = out / "runs" / f"seed{seed}" / case.name / "".join(c if c.isalnum() else "_" for c in m.name)

            def finetune(mover=mover, mm=mm, mwork=mwork):
                log(f"[seed {seed}] {case.name}: {mm.name} ...")
                doc = run_config_job(str(config_path), mover, mm.name, seed, cdata, mwork, log=log)
                return {**_final(doc), "prep_wfl": doc.get("prep_wfl")}

            fp = run_key(mexp, mm, seed, case.set, encoder if m.init == "fedmae" else None)
            try:
                r = _cached(mwork, fp, resume, finetune, log, f"[seed {seed}] {case.name} {m.name}")
            except RunError as e:
                log(f"    {e.status}: {e.reason}")
                continue
            res["finetune"].setdefault(case.name, {}).setdefault(m.name, {})[seed] = r
        ref_m = next((x for x in fts if x.init == "fedmae" and not x.prep_wfl), fts[0])
        if ref_m.local_only:
            rwork = out / "runs" / f"seed{seed}" / case.name / "_references"
            rexp = load_config(config_path, cover + classes_override(cdata, cexp))
            rm = next(x for x in rexp.methods if x.name == ref_m.name)
            r = _cached(rwork, "ref:" + run_key(rexp, rm, seed, case.set, encoder if rm.init == "fedmae" else None),
                        resume,
                        lambda: _loop_reference(rexp, rm, seed, cdata, meta["sites"],
                                                encoder if ref_m.init == "fedmae" else None, log),
                        log, f"[seed {seed}] {case.name} references")
            res["references"].setdefault(case.name, {})[seed] = r


def _ssl_encoders(config_path, overrides: list, enc_cases: list, seed: int, encoder: Path, out: Path, resume: bool,
                  log, res: dict) -> None:
    """Step 3 of ``fedmed ssl``: FMCL's clusters from random weights and from the Fed-MAE encoder, into ``res``."""
    from fedmed.config import load_config

    for case in enc_cases:
        cover = overrides + list(case.set)
        cexp = load_config(config_path, cover)
        cdata = prepare_federation(cexp, seed, out / "data" / f"seed{seed}" / case.name)
        meta = json.loads((cdata / "dataset.json").read_text())
        for name in case.methods:
            m = next(x for x in cexp.methods if x.name == name)
            mover = cover + classes_override(cdata, cexp)
            trained = m.encoder == "fedmae_vit" and "Fed-MAE" in m.name
            if trained:
                mover = mover + [f"methods.{m.name}.encoder_weights={encoder}"]
            mwork = out / "runs" / f"seed{seed}" / case.name / "".join(c if c.isalnum() else "_" for c in name)
            mexp = load_config(config_path, mover)
            mm = next(x for x in mexp.methods if x.name == name)

            def fmcl_run(mover=mover, mm=mm, mwork=mwork):
                from fedmed.algorithms.clustering import clusters_ari

                log(f"[seed {seed}] {case.name}: {mm.name} ...")
                doc = run_config_job(str(config_path), mover, mm.name, seed, cdata, mwork, log=log)
                clusters = doc["clustering"]["clusters"]
                ari = clusters_ari(clusters, meta["groups"])
                return {"ari": ari, "k": len(clusters), **_final(doc), "encoder": doc["clustering"].get("encoder")}

            r = _cached(mwork, run_key(mexp, mm, seed, case.set, encoder if trained else None), resume, fmcl_run,
                        log, f"[seed {seed}] {case.name} {name}")
            res["encoders"].setdefault(case.name, {}).setdefault(name, {})[seed] = r


def run_ssl(config_path: str, out_dir, *, overrides: list[str] | None = None, resume: bool = False, log=print,
            command: str | None = None) -> dict:
    from fedmed.config import load_config

    overrides = list(overrides or [])
    exp = load_config(config_path, overrides)
    pre = [m for m in exp.methods if m.ssl_role == "pretrain"]
    fts = [m for m in exp.methods if m.ssl_role == "finetune"]
    if len(pre) != 1 or not fts:
        raise ValueError(f"{config_path}: fedmed ssl needs exactly one fedmae method and at least one finetune method")
    pre = pre[0]
    ft_cases = [c for c in exp.sweep if not any(next(m for m in exp.methods if m.name == n).ssl_role == "clusters"
                                                for n in (c.methods or []))]
    enc_cases = [c for c in exp.sweep if c not in ft_cases]
    out = Path(out_dir)
    res: dict = {"pretrain": {}, "finetune": {}, "references": {}, "encoders": {}}
    for seed in exp.seeds:
        pr = _ssl_pretrain(config_path, overrides, pre, seed, out, resume, log, first=seed == exp.seeds[0])
        res["pretrain"][seed] = pr
        encoder = Path(pr["encoder"])
        _ssl_finetune(config_path, overrides, exp, fts, ft_cases, seed, encoder, out, resume, log, res)
        _ssl_encoders(config_path, overrides, enc_cases, seed, encoder, out, resume, log, res)
    text = ssl_tables(res, exp, command or f"fedmed ssl {config_path}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text)
    (out / "ssl_results.json").write_text(json.dumps(res, indent=1, default=str))
    _loss_plot(res, out / "curves.png")
    from fedmed.report.html import write_report

    log(f"report: {write_report(out, command=command)}")
    return res


def _vals(d: dict, key: str) -> list:
    return [v.get(key) for v in d.values() if v and v.get(key) is not None]


def ssl_tables(res: dict, exp, command: str) -> str:
    seeds = len(exp.seeds)
    lines = [f"## {exp.name}", "", f"Produced by: `{command}`", "",
             f"Macro accuracy / macro-F1 in % on the common test set (global label space), final round, mean ± std over "
             f"{seeds} seed(s). Setup: {exp.dataset.path}, {exp.federation.sites} sites, {exp.dataset.image_size} px, "
             f"a small ViT (fedmed.nn.mae.VIT_SMALL); fine-tuning {exp.train.rounds} rounds x {exp.train.local_epochs} local "
             f"epochs, lr {exp.train.lr}, {exp.federation.predi_samples_per_cell} labels per (class, site).", ""]
    curves = [r["curve"] for r in res["pretrain"].values()]
    if curves:
        n = min(len(c) for c in curves)
        picks = sorted({0, n // 2, n - 1})
        lines += ["### Fed-MAE pre-training: held-out reconstruction loss (masked patches, MSE)", "",
                  "| round | " + " | ".join(str(curves[0][i][0]) for i in picks) + " |",
                  "|---" * (len(picks) + 1) + "|",
                  "| test-split loss | " + " | ".join(fmt([c[i][1] for c in curves], 1.0) for i in picks) + " |",
                  "| train loss | " + " | ".join(fmt([c[i][3] for c in curves], 1.0) for i in picks) + " |", ""]
    cases = list(res["finetune"])
    if cases:
        for key, label in (("macro_acc", "macro accuracy"), ("macro_f1", "macro-F1")):
            lines += [f"### Fine-tuning under label-space heterogeneity ({label}), like 001_ Table 5", "",
                      "| | " + " | ".join(cases) + " |", "|---" * (len(cases) + 1) + "|"]
            refs = res.get("references", {})
            sites = sorted({s for c in refs.values() for r in c.values() for s in r["alone"]})
            for s in sites:
                lines.append(f"| {s} alone (Fed-MAE init) | " + " | ".join(
                    fmt([r["alone"][s][key] for r in refs.get(c, {}).values()]) for c in cases) + " |")
            methods = list(dict.fromkeys(m for c in cases for m in res["finetune"][c]))
            for m in methods:
                lines.append(f"| Federated: {m} | " + " | ".join(
                    fmt(_vals(res["finetune"][c].get(m, {}), key)) for c in cases) + " |")
            lines.append("| Centralized (Fed-MAE init) | " + " | ".join(
                fmt([r["centralized"][key] for r in refs.get(c, {}).values()]) for c in cases) + " |")
            lines.append("")
        lines += _paired_table(res, cases)
    for case, methods in res.get("encoders", {}).items():
        lines += [f"### The federation's own foundation model for FMCL ({case})", "",
                  "| encoder | clustering ARI | K | accuracy (site mean) |", "|---|---|---|---|"]
        for m, per_seed in methods.items():
            lines.append(f"| {m} | {fmt(_vals(per_seed, 'ari'), 1.0)} | {fmt(_vals(per_seed, 'k'), 1.0)} | "
                         f"{fmt(_vals(per_seed, 'accuracy'))} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _paired_table(res: dict, cases: list[str]) -> list[str]:
    """Margins over seeds (paired): Fed-MAE over random init, and PreP-WFL's gain over Fed-MAE, per case."""
    ft = res["finetune"]
    names = list(dict.fromkeys(m for c in cases for m in ft[c]))
    base = next((m for m in names if "random" not in m.lower() and "prep" not in m.lower()), None)
    rand = next((m for m in names if "random" in m.lower()), None)
    prep = next((m for m in names if "prep" in m.lower()), None)
    lines = ["### Margins (macro accuracy, percentage points, paired over seeds), like 001_ Table 7", "",
             "| | " + " | ".join(cases) + " |", "|---" * (len(cases) + 1) + "|"]

    def diff(a, b, c):
        sa, sb = ft[c].get(a, {}), ft[c].get(b, {})
        d = [100 * (sa[s]["macro_acc"] - sb[s]["macro_acc"]) for s in sa if s in sb]
        if not d:
            return "n/a"
        txt = f"{np.mean(d):+.2f}" + (f" ± {np.std(d):.2f}" if len(d) > 1 else "")
        return txt + (" (within the spread)" if len(d) > 1 and abs(np.mean(d)) <= np.std(d) else "")

    if base and rand:
        lines.append(f"| {base} minus {rand} | " + " | ".join(diff(base, rand, c) for c in cases) + " |")
    if base and prep:
        lines.append(f"| PreP-WFL gain: {prep} minus {base} | " + " | ".join(diff(prep, base, c) for c in cases) + " |")
    return lines + [""]


def _loss_plot(res: dict, path: Path) -> None:
    from fedmed.report.plots import _plt, _save

    curves = [r["curve"] for r in res["pretrain"].values()]
    if not curves:
        return
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    n = min(len(c) for c in curves)
    for k, label in ((1, "held-out (test split)"), (3, "train")):
        vals = np.array([[c[i][k] if c[i][k] is not None else np.nan for i in range(n)] for c in curves], float)
        x = [curves[0][i][0] for i in range(n)]
        mu, sd = np.nanmean(vals, 0), np.nanstd(vals, 0)
        ax.plot(x, mu, label=label)
        ax.fill_between(x, mu - sd, mu + sd, alpha=0.15)
    ax.set_xlabel("round")
    ax.set_ylabel("reconstruction loss (MSE, masked patches)")
    ax.set_title("Fed-MAE pre-training (band: ± std over seeds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)
