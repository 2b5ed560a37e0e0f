"""One self-contained HTML page per experiment: ``fedmed report OUT`` (also written at the end of ``experiment``,
``sweep`` and ``demo``).

The page holds the setup (data, sites and their sizes, model, rounds, seeds, each encoder and whether its weights
are pretrained), the results tables with their reference rows, learning curves with a band over seeds, and per
method the clustering or assessment figures of the first seed (distance heatmap with values and cluster outlines,
dendrogram with its cut, silhouette curve, ``004_`` assessment matrices), per-site metrics at the final round,
slices of test cases with ground truth and prediction (segmentation), and the exact command. Images are embedded
(base64), so the file can be mailed or archived as it is.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

from fedmed.core.io import readable, shown_path
from fedmed.report.findings import cluster_sizes_sentence

__all__ = ["case_verdict", "markdown_to_html", "visible_text", "write_report"]


def _inline(text: str) -> str:
    t = html.escape(text)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    t = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", t)
    return t


def markdown_to_html(md: str) -> str:
    """The small markdown subset fedmed writes: headers, pipe tables, bullet lists, paragraphs, code and bold."""
    out, para, table, items = [], [], [], []

    def flush():
        if para:
            out.append(f"<p>{_inline(' '.join(para))}</p>")
            para.clear()
        if table:
            rows = [r for r in table if not re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*", r)]
            cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
            head = "".join(f"<th>{_inline(c)}</th>" for c in cells[0])
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in cells[1:])
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            table.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in items) + "</ul>")
            items.clear()

    for line in md.splitlines():
        s = line.strip()
        if s.startswith("|"):
            if para or items:
                flush()
            table.append(s)
            continue
        if table:
            flush()
        if not s:
            flush()
        elif s.startswith("#"):
            flush()
            level = min(len(s) - len(s.lstrip("#")) + 1, 5)
            out.append(f"<h{level}>{_inline(s.lstrip('#').strip())}</h{level}>")
        elif s.startswith("- "):
            if para:
                flush()
            items.append(s[2:])
        else:
            para.append(s)
    flush()
    return "\n".join(out)


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"><figcaption>{html.escape(alt)}</figcaption></figure>'


def _sites_table(doc: dict) -> str:
    rounds = doc.get("rounds") or []
    if not rounds:
        return ""
    last = rounds[-1]
    sites = last.get("sites", {})
    keys = [k for k in ("accuracy", "macro_f1", "val_accuracy", "dice_wt", "dice_tc", "dice_et", "dice_mean",
                        "hd95_wt", "fp_voxels") if any(k in v for v in sites.values())]
    head = "".join(f"<th>{k}</th>" for k in ["site", "cluster", "test samples", *keys])
    body = ""
    for s, v in sorted(sites.items()):
        cells = [s, v.get("cluster", "") if v.get("cluster") is not None else "—", v.get("n_test", "")]
        for k in keys:
            x = v.get(k)
            cells.append("n/a" if x is None else (f"{100 * x:.1f}%" if k not in ("hd95_wt", "fp_voxels") else readable(x)))
        body += "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"
    errs = doc.get("errors", [])
    note = f"<p>{len(errs)} site error(s) recorded (see metrics.json).</p>" if errs else ""
    return (f"<p>Round {last['round']} ({last['task']}), each site scoring the model it is served:</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}")


def _seg_slices(run: Path, data_dir: Path, out_png: Path) -> Path | None:
    """Middle axial slices of each test case: image (first modality), ground truth, prediction of the final model."""
    model = next(iter(sorted((run / "server" / "models").glob("*.pt"))), None)
    meta_p = data_dir / "dataset.json"
    if model is None or not meta_p.is_file():
        return None
    from fedmed.report.plots import _plt, _save
    from fedmed.nn.predict import load_model
    from fedmed.data.nifti import load_case
    from fedmed.nn.seg import predict_masks

    net, ck = load_model(model)
    meta = json.loads(meta_p.read_text())
    doc = json.loads((data_dir / f"{meta['sites'][0]}.json").read_text())
    cases = [load_case(e, shape=tuple(ck["data"]["shape"])) for e in doc.get("test", [])[:4]]
    if not cases:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(cases), 3, figsize=(9, 3.0 * len(cases)), squeeze=False)
    from fedmed.nn.preprocessing import case_transform

    pre = case_transform(ck["model"].get("preprocessing"))  # what the network took at the sites
    notes = []
    for row, c in zip(axes, cases):
        pred = predict_masks(net, pre(c["image"]), roi=tuple(ck["data"]["roi"]))
        z = int(c["label"][0].sum(axis=(0, 1)).argmax()) if c["label"][0].any() else c["image"].shape[-1] // 2
        verdict = case_verdict(c["label"][0] > 0, pred[0] > 0)
        if verdict["failure"]:
            notes.append(f"{c['meta']['id']}: {verdict['text']}")
        for j, (ax, (im, name)) in enumerate(zip(row, ((c["image"][0, :, :, z], "image"),
                                                       (c["label"][0, :, :, z], "ground truth (WT)"),
                                                       (pred[0, :, :, z], "prediction (WT)")))):
            ax.imshow(im.T, cmap="gray" if name == "image" else "magma", origin="lower")
            ax.set_title(name if j else f"{c['meta']['id']}\n{name}", fontsize=8)  # short titles: none clipped
            ax.axis("off")
            if j == 2:  # the verdict under the prediction, wrapped inside its panel (#89: titles overlapped)
                ax.text(0.5, -0.04, verdict["short"], transform=ax.transAxes, ha="center", va="top", fontsize=7,
                        wrap=True, color="red" if verdict["failure"] else "black")
    return _save(fig, out_png), notes


def case_verdict(truth, pred) -> dict:
    """What one test case's whole-tumour prediction shows, said plainly: a failure when the case has no tumour and
    the model predicts one (a false positive), when it misses a tumour, or when the overlap (Dice) is under 50%."""
    import numpy as np

    t, p = int(np.count_nonzero(truth)), int(np.count_nonzero(pred))
    if t == 0:
        if p == 0:
            return {"failure": False, "short": "no tumour, none predicted", "text": "no tumour, none predicted"}
        return {"failure": True, "short": f"false positive: {p:,} voxels",
                "text": f"a failure — the case has no tumour, yet the model marks {p:,} voxels as tumour (a false "
                        f"positive)"}
    dice = 2 * int(np.count_nonzero(truth & pred)) / (t + p)
    if p == 0:
        return {"failure": True, "short": "tumour missed", "text": "a failure — the model misses the tumour entirely"}
    if p > 2 * t:  # marks far more than the tumour (most of the brain): said as such, not only as a Dice
        return {"failure": True, "short": f"{p / t:.1f}× the tumour marked, Dice {100 * dice:.0f}%",
                "text": f"a failure — the model marks {p / t:.1f}× the tumour's volume as tumour (Dice {100 * dice:.0f}%)"}
    return {"failure": dice < 0.5, "short": f"Dice {100 * dice:.0f}%",
            "text": (f"a poor prediction — Dice {100 * dice:.0f}%" if dice < 0.5 else f"Dice {100 * dice:.0f}%")}


def privacy_table(doc: dict) -> str:
    """Each site's own rules as its replies stated them (its policy's k_min floor, DP ceiling) and the epsilon it
    released in the run (every DP release composed: ``Recorder.account``); empty when no site stated any."""
    pols, spent = doc.get("site_policies") or {}, doc.get("epsilon_spent") or {}
    if not pols and not spent:
        return ""
    rows = ""
    for s in sorted(set(pols) | set(spent)):
        p, e = pols.get(s, {}), spent.get(s)
        ceiling = p.get("max_epsilon")
        cells = [s, p.get("source", "?"), p.get("k_min", "?"), "yes" if p.get("dp_required") else "no",
                 "none" if ceiling is None else f"{ceiling:g}",
                 "0 (no DP release)" if not e else f"{e['epsilon']:g} over {e['releases']} release(s)"]
        rows += "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"
    head = "".join(f"<th>{h}</th>" for h in ("site", "policy", "k_min floor", "DP required", "epsilon ceiling",
                                              "epsilon spent (composed)"))
    return (f"<p>What each site allowed and spent (its own policy, fedmed.core.policy):</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")


def visible_text(page: str) -> str:
    """What a reader sees of an HTML fragment: no tags, no embedded images, entities decoded."""
    page = re.sub(r"<img[^>]*>", " ", page)
    page = re.sub(r"<style>.*?</style>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def plan_html(server: Path) -> str:
    """The serving plan of one seed (``fedmed.workflows.plan``): per site each model's validation accuracy — lesion
    Dice for a 2D segmenter — (the chosen one marked), the served and the global model's test score, and why."""
    plan = json.loads((server / "plan.json").read_text())
    doc = json.loads((server / "metrics.json").read_text()) if (server / "metrics.json").is_file() else {}
    by_task = {r["task"]: r.get("sites", {}) for r in doc.get("rounds", [])}
    scored = by_task.get("serve_score", {})
    # a classifier's plan scores accuracy, a 2D lesion segmenter's the lesion Dice (fedmed.site.seg2d.serve_score)
    metric = "dice_mean" if any(k.startswith("val_dice_mean/") for v in scored.values() for k in v) else "accuracy"
    names = list(dict.fromkeys(k.split("/", 1)[1] for v in scored.values() for k in v
                               if k.startswith(f"val_{metric}/")))

    def pct(x) -> str:
        return "n/a" if x is None or not isinstance(x, (int, float)) or x != x else f"{100 * x:.1f}%"

    head = "".join(f"<th>{html.escape(c)}</th>" for c in
                   ["site", *[f"{n} (val)" for n in names], "served", "served: test", "global: test", "why"])
    body = ""
    for site, v in sorted(plan.items()):
        cells = [html.escape(site)]
        for n in names:
            cell = html.escape(pct(scored.get(site, {}).get(f"val_{metric}/{n}")))
            cells.append(f"<b>{cell} ✓</b>" if n == v["served"] else cell)
        cells += [f"<b>{html.escape(v['served'])}</b>", html.escape(pct(by_task.get("served", {}).get(site, {})
                                                                       .get(metric))),
                  html.escape(pct(by_task.get("global", {}).get(site, {}).get(metric))), html.escape(v["reason"])]
        body += "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"
    return ("<p>Which model each site is served, chosen on its validation split only (the global model unless a "
            "candidate beats it beyond the noise: docs/readings.md \"Serving plan\"); the test columns were scored "
            "after the choice:</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def _run_section(run: Path, doc: dict, label: str, seed_dir: Path, policies: dict, failures: list) -> list[str]:
    """One run's part of the report: its status, the sites' answer to "do the sites differ?", its clustering and
    figures, the sites' table, their policies (once per table), and a 3D segmentation's test cases (its shown
    failures counted in ``failures``)."""
    parts: list[str] = []
    parts.append(f"<h2>{html.escape(label)}</h2>")
    parts.append(f"<p>Status: <b>{html.escape(doc.get('status', '?'))}</b> {html.escape(doc.get('reason', ''))}"
                 f"; sites {', '.join(doc.get('sites', []))}.</p>")
    if (doc.get("differ") or {}).get("answer"):
        parts.append(f"<p>Before training, do the sites differ? {html.escape(doc['differ']['answer'])}.</p>")
    c = doc.get("clustering")
    if c:
        enc = ", ".join(c.get("encoder", [])) if isinstance(c.get("encoder"), list) else c.get("encoder", "")
        parts.append(f"<p>Clustering: {html.escape(str(c.get('rule', '')))}; clusters "
                     f"{html.escape(json.dumps(c.get('clusters')))}"
                     + (f"; encoder {html.escape(enc)}" if enc else "") + "</p>")
        if c.get("cluster_images") and len(c["cluster_images"]) == len(c.get("clusters") or []):
            parts.append(f"<p>{html.escape(cluster_sizes_sentence(c))}</p>")
    server = run / "server"
    for png, alt in (("distance_heatmap.png", "distance heatmap (values; red boxes: clusters)"),
                     ("dendrogram.png", "dendrogram with the cut"), ("silhouette.png", "silhouette over K"),
                     ("assessment/heatmap_emd.png", "004_ metadata EMD (D_EMD)"),
                     ("assessment/heatmap_euc.png", "004_ embedding distance (D_EUC)")):
        if (server / png).is_file():
            parts.append(_img(server / png, alt))
    if (server / "assessment" / "report.md").is_file():
        parts.append(markdown_to_html((server / "assessment" / "report.md").read_text()))
    parts.append(_sites_table(doc))
    pt = privacy_table(doc)
    if pt and pt in policies:
        parts.append(f"<p>Each site's policy and spending: the same as for {html.escape(policies[pt])}.</p>")
    elif pt:
        policies[pt] = label
        parts.append(pt)
    config = doc.get("meta", {}).get("config", {})
    if (config.get("task") == "segmentation" and seed_dir.is_dir()
            and (config.get("data") or {}).get("spatial_dims", 3) != 2):  # 3D cases: the middle slice
        got = _seg_slices(run, seed_dir, run / "test_slices.png")
        if got:
            png, notes = got
            alt = "test cases: image, ground truth, prediction (whole tumour, middle slice)"
            alt += (f". Shown failures ({len(notes)} of the cases): " + "; ".join(notes) if notes else
                    ". No shown case is a failure.")
            parts.append(_img(png, alt))
            failures.append((label, len(notes)))
    return parts


def write_report(out_dir, *, command: str | None = None) -> Path:
    """Write ``OUT/report.html`` for an experiment or sweep output folder, or for a ``fedmed plan --out`` folder (its
    ``plan.json``, in the folder or its ``server/``); returns its path."""
    out = Path(out_dir)
    summary = out / "summary.md"
    if not summary.is_file():
        server = next((d for d in (out, out / "server") if (d / "plan.json").is_file()), None)
        if server is None:
            raise FileNotFoundError(f"{out}: no summary.md (a fedmed experiment folder) and no plan.json (a fedmed "
                                    f"plan folder)")
        title = f"Serving plan: {out.name}"
        parts = [f"<h1>{html.escape(title)}</h1>",
                 f"<p class='cmd'>Command: <code>{html.escape(command or 'fedmed plan')}</code></p>", plan_html(server)]
        return _write_page(out, title, parts)
    md = summary.read_text()
    title = md.splitlines()[0].lstrip("# ").strip() if md else out.name
    parts = [f"<h1>{html.escape(title)}</h1>"]
    m = re.search(r"Produced by: `([^`]+)`", md)
    cmd = command or (m.group(1) if m else "")
    parts.append(f"<p class='cmd'>Command: <code>{html.escape(cmd)}</code></p>")
    top = len(parts)  # the shown test cases' failures go here, above the tables whose Dice they qualify
    failures: list = []
    body = md.split("\n", 1)[1] if md.startswith("# ") or md.startswith("## ") else md  # the title is the page's h1
    if m:  # and the command is shown above
        body = body.replace(m.group(0), "", 1)
    curves = "learning curves: validation and test score, train loss"
    shown = set()
    chunks = re.split(r"<!-- fedmed-part: (\S+) -->", body)  # the demo's parts: each its curves under its own table
    for i, chunk in enumerate(chunks):
        if i % 2 == 0:
            parts.append(markdown_to_html(chunk))
        elif (out / chunk / "curves.png").is_file():
            parts.append(_img(out / chunk / "curves.png", f"{chunk}: {curves}"))
            shown.add(chunk)
    for png, alt in (("curves.png", curves), ("summary.png", "sweep: unseen sites and clustering per case")):
        if (out / png).is_file():
            parts.append(_img(out / png, alt))
    cases = [out] + sorted(p for p in out.iterdir() if p.is_dir() and (p / "summary.md").is_file())
    for case in cases[1:]:  # a sweep's cases: each its own learning curves
        if (case / "curves.png").is_file() and case.name not in shown:
            parts.append(_img(case / "curves.png", f"{case.name}: {curves}"))
    policies: dict = {}  # a policy table already shown -> the run it was shown for
    for case in cases:
        for server in sorted((case / "runs").glob("seed*/_serving_plan/server")) if (case / "runs").is_dir() else []:
            if (server / "plan.json").is_file():
                seed = server.parent.parent.name.replace("seed", "seed ")
                parts.append(f"<h2>{html.escape((case.name + ' / ' if case != out else '') + 'Serving plan (' + seed + ')')}"
                             f"</h2>")
                parts.append(plan_html(server))
        runs = sorted((case / "runs").glob("seed*/*/metrics.json")) if (case / "runs").is_dir() else []
        seen = set()
        for mpath in runs:
            run = mpath.parent
            if run.name.startswith("_") or run.name in seen:
                continue
            seen.add(run.name)
            doc = json.loads(mpath.read_text())
            try:
                name = json.loads((run / "run.json").read_text())["method"]
            except (OSError, ValueError, KeyError):
                name = run.name
            label = f"{case.name + ' / ' if case != out else ''}{name} ({run.parent.name.replace('seed', 'seed ')})"
            parts += _run_section(run, doc, label, case / "data" / run.parent.name, policies, failures)
    shown_fail = [(lab, n) for lab, n in failures if n]
    if shown_fail:
        parts.insert(top, "<p><b>⚠ Read the Dice with the test cases shown below</b>: "
                     + "; ".join(f"{html.escape(lab)}: {n} shown case(s) a failure" for lab, n in shown_fail)
                     + " (a mean Dice can hide a model that marks most of the brain on some cases).</p>")
    return _write_page(out, title, parts)


def _write_page(out: Path, title: str, parts: list) -> Path:
    """``out/report.html``: the parts, the glossary of the words they use, the command that regenerates it."""
    from fedmed.report.glossary import glossary_html

    parts = [*parts, glossary_html(visible_text("".join(parts)))]
    style = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
             "dt{font-weight:bold;margin-top:0.4em}dd{margin-left:1.5em}"
             "table{border-collapse:collapse;margin:1em 0;font-size:0.85em}td,th{border:1px solid #ccc;padding:3px 6px}"
             "th{background:#f2f2f2}figure{display:inline-block;margin:0.5em}img{max-width:100%}"
             "figcaption{font-size:0.8em;color:#555}code{background:#f4f4f4;padding:1px 3px}.cmd{font-size:1.05em}")
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}<hr><p>Regenerate: <code>fedmed report "
            f"{html.escape(shown_path(out))}</code></p></body></html>")
    path = out / "report.html"
    path.write_text(page)
    return path
