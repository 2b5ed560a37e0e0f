"""``fedmed demo``: the embedded demo — small federations of each kind, every table, one HTML report — and the summary
page that joins its parts."""

from __future__ import annotations

from pathlib import Path

from fedmed.core.resources import shipped_config


DEMO_PARTS = {"classification": "Classification: FedAvg, FedProx, FMCL",
              "segmentation": "Segmentation: 004_ assessment and a 3D U-Net",
              "flux": "Flux: clustering during training, unseen sites"}


def cmd_demo(a):
    """Three small experiments end to end (each a real NVFlare simulator job per method), their tables, one report;
    ``--part`` runs some of them."""
    from fedmed.report.html import write_report

    parts = [p for p in DEMO_PARTS if p in (a.part or DEMO_PARTS)]
    overrides = list(a.set)
    data_name = "sklearn digits (offline, bundled)"
    if a.data:
        overrides += [f"dataset.path={a.data}", "dataset.image_size=32", "dataset.max_per_class=40",
                      "dataset.classes=null", f"name=demo-{Path(a.data).name}"]  # the data's own classes
        data_name = a.data
    out = Path(a.out)
    import shlex

    words = ["fedmed", "demo", *(["--data", a.data] if a.data else []), "--out", a.out,
             *(["--part", *parts] if a.part else []), *[w for o in a.set for w in ("--set", o)]]
    command = " ".join(shlex.quote(w) for w in words)  # reruns exactly this demo
    print(f"fedmed demo: {data_name} -> {out}", flush=True)
    for k, part in enumerate(parts):
        print(f"\n== {k + 1}. {DEMO_PARTS[part]} ==", flush=True)
        {"classification": lambda: _demo_classification(out, overrides, command),
         "segmentation": lambda: _demo_segmentation(out, command), "flux": lambda: _demo_flux(out, command)}[part]()
    (out / "summary.md").write_text(demo_summary(out, parts, command, data_name))
    print(f"report: {write_report(out, command=command)} (open it in a browser)")


def demo_summary(out: Path, parts: list[str], command: str, data_name: str) -> str:
    """The demo's combined ``summary.md``: first what each part found, in plain words (each part's "What this found"
    and, for segmentation, what the ``004_`` assessment saw before training), then each part's own summary."""
    import json
    import re

    found = []
    for k, p in enumerate(parts):
        text = (out / p / "summary.md").read_text()
        m = re.search(r"### What this found\n\n(.*?)\n\n", text, flags=re.S)
        bullets = m.group(1).splitlines() if m else []
        for f in sorted((out / p / "runs").glob("seed*/*/server/assessment/assessment.json"))[:1]:
            a = json.loads(f.read_text())
            if "emd" in a:
                euc = a.get("euc") or {}
                random_init = any("random init" in str(e) for e in euc.get("encoder") or [])
                bullets.insert(0, f"- Before any training, the 004_ site assessment (aggregates only, no image leaves a "
                                  f"site) found **{a['emd']['most_distant']}** the most different site by its images' "
                                  f"intensity and tumour-size statistics (metadata distance); by the embedding distance "
                                  f"it was {euc.get('most_distant', 'not computed')}"
                                  + (" (from a randomly initialised MedicalNet here, so not evidence on its own)"
                                     if random_init else "") + ".")
        found.append(f"**{k + 1}. {DEMO_PARTS[p]}**\n\n" + "\n".join(bullets))
    from fedmed.report.findings import ONE_SEED

    one_seed = any(f"- {ONE_SEED}" in f for f in found)  # said once for the whole page, not in every part (#89)
    found = [f.replace(f"\n- {ONE_SEED}", "") for f in found]
    head = (f"# fedmed demo\n\nProduced by: `{command}`\n\n## What the demo found\n\n" + "\n\n".join(found)
            + (f"\n\n{ONE_SEED}" if one_seed else "")
            + f"\n\nData: {data_name}; the parts below (each part's own table and runs).\n\n")
    body, seen = [], {}
    for k, p in enumerate(parts):
        text = (out / p / "summary.md").read_text().replace(f"- {ONE_SEED}\n", "")
        text = re.sub(r"^(#{2,4}) ", lambda m: "#" + m.group(1) + " ", text, flags=re.M)  # one level down
        paras = []
        for para in text.split("\n\n"):  # a paragraph an earlier part already gave (how to read its table): once
            if para.startswith(("Values in %", "Dice in %")) and para in seen:
                para = f"(Read as part {seen[para]}'s table.)"
            elif para.startswith(("Values in %", "Dice in %")):
                seen[para] = k + 1
            paras.append(para)
        body.append(f"## {k + 1}. {DEMO_PARTS[p]}\n\n" + "\n\n".join(paras) + f"\n\n<!-- fedmed-part: {p} -->\n")
    return head + "\n\n".join(body)


def _demo_classification(out: Path, overrides: list, command: str) -> None:
    import json

    from fedmed.run.experiment import run_experiment

    print("FedAvg, FedProx and FMCL (one-shot clustering) on a 4-site federation, with reference rows; then the "
          "serving plan: which model each site should use", flush=True)
    run_experiment(str(shipped_config("demo_digits.yaml")), out / "classification", overrides=overrides,
                   command=command)
    for doc in sorted((out / "classification" / "runs" / "seed0").glob("FMCL*/metrics.json")):
        c = json.loads(doc.read_text()).get("clustering", {})
        print(f"FMCL clusters found once, before training ({c.get('rule')}; encoder {', '.join(c.get('encoder', []))}): "
              f"{c.get('clusters')}")
    print()
    print((out / "classification" / "summary.md").read_text())


def _demo_segmentation(out: Path, command: str) -> None:
    from fedmed.data.phantoms import write_phantom_subjects
    from fedmed.run.experiment import run_experiment

    print("004_ site assessment and a trained 3D U-Net (synthetic NIfTI phantoms, 4 sites)", flush=True)
    phantoms = out / "phantoms"
    write_phantom_subjects(phantoms, [0, 2, 3, 3, 4, 4, 5, 6, 6, 9, 10, 11, 3, 5, 8, 2, 3, 4, 5, 6, 7, 8, 9, 10, 4, 6, 7], size=24)  # 27 subjects: two validation subjects a site
    run_experiment(str(shipped_config("demo_seg_phantoms.yaml")), out / "segmentation",
                   overrides=[f"dataset.path={phantoms.resolve()}"], command=command)
    report = next((out / "segmentation" / "runs").rglob("report.md"), None)
    if report:
        print(report.read_text())
    print("(the phantom sites are ordered by lesion volume, so the metadata EMD should name the last site most "
          "distant; the embedding distance uses a randomly initialised MedicalNet here and need not agree)")
    print((out / "segmentation" / "summary.md").read_text())


def _demo_flux(out: Path, command: str) -> None:
    import json

    from fedmed.run.experiment import run_experiment

    print("Flux: clustering during training and unseen-site assignment (digits, ANDA feature shift)", flush=True)
    run_experiment(str(shipped_config("demo_flux_digits.yaml")), out / "flux", command=command)
    run = out / "flux" / "runs" / "seed0" / "Flux"
    train = json.loads((run / "metrics.json").read_text())
    test = json.loads((run / "test_phase" / "metrics.json").read_text())
    groups = json.loads((out / "flux" / "data" / "seed0" / "dataset.json").read_text())["groups"]
    print(f"clusters found in training: {train['clustering']['clusters']} (true groups: "
          f"{ {g: [s for s, x in groups.items() if x == g and not s.startswith('unseen')] for g in sorted(set(groups.values()))} })")
    for u, c in test["assignment"]["test_phase"].items():
        print(f"  {u} (true group {groups[u]}, no labels used) -> cluster {c}: {train['clustering']['clusters'][c]}")
    print((out / "flux" / "summary.md").read_text())
