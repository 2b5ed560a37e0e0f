"""What a results table found, in plain words: the first section of ``summary.md`` and of the HTML report.

For a clinical team that reads one paragraph, not the tables: which method served the sites best and by how much, set
against each reference the table carries (the centralized model as the ceiling, a constant answer or the untrained
network as the floor, each site alone, FedAvg on an IID federation), with the uncertainty said in words — a
difference no larger than its seed-to-seed spread is *within the spread*; one seed has no spread at all — and every
site that sat out. Every number comes from the same rows and the same reported round as the tables
(:func:`fedmed.report.summary.summarize`); nothing is selected on test data here.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cluster_sizes_sentence", "differ_sentence", "findings", "findings_section", "plan_sentence"]

FLOORS = ("Majority class", "Untrained network")
ONE_SEED = ("All of this is from one seed: one run has no spread, so no difference here can be called reliable; run "
            "more seeds (`seeds: [0, 1, 2]`) for mean ± std.")


def cluster_sizes_sentence(clustering: dict) -> str:
    """Whether each cluster would have enough to train on, from a clustering record that holds ``cluster_images``
    (the training images of each cluster's sites, as the sites reported them with their signatures) and
    ``min_cluster_images`` (the method's floor; 0: none set) — before any cluster model is trained (issue #57)."""
    clusters, images = clustering["clusters"], clustering["cluster_images"]
    floor = int(clustering.get("min_cluster_images") or 0)
    each = ", ".join(f"cluster {i}: {n} image{'s' * (n != 1)} at {len(c)} site{'s' * (len(c) != 1)}"
                     for i, (c, n) in enumerate(zip(clusters, images)))
    i = int(np.argmin(images))
    if floor:
        under = [j for j, n in enumerate(images) if n < floor]
        return (f"Training images per cluster: {each}. "
                + (f"Every cluster holds at least min_cluster_images={floor}." if not under else
                   f"Under min_cluster_images={floor}: cluster(s) {', '.join(map(str, under))} (no other cluster to "
                   f"merge into)."))
    return (f"Training images per cluster: {each}. No size floor is set (the method's min_cluster_images): the "
            f"smallest, cluster {i} ({images[i]} images), trains its model on those alone; whether that serves its "
            f"sites better than the global model is what the serving plan (fedmed plan) measures on their validation "
            f"data.")


def _pct(vals) -> str:
    vals = [100 * v for v in vals]
    return f"{np.mean(vals):.1f}%" + (f" (± {np.std(vals):.1f} over {len(vals)} seeds)" if len(vals) > 1 else "")


def _gap(a: list, b: list) -> tuple[float, str]:
    """Paired difference a - b in points over the seeds both have, and how sure it is, in words."""
    n = min(len(a), len(b))
    d = 100 * (np.asarray(a[:n]) - np.asarray(b[:n]))
    if n == 1:
        return float(d[0]), ""
    if abs(d.mean()) <= d.std():
        return float(d.mean()), f"within the spread over {n} seeds (± {d.std():.1f}): not a reliable difference"
    return float(d.mean()), f"larger than its spread over {n} seeds (± {d.std():.1f})"


def _points(x: float) -> str:
    return f"{abs(x):.1f} point{'s' if round(abs(x), 1) != 1 else ''}"


def plan_sentence(plans: dict) -> str:
    """Which model each site should use, from the serving plans of the seeds (``{seed: plan.json}``): the sites
    grouped by what they are served (with how many seeds, when several)."""
    from collections import Counter

    def word(x: str) -> str:
        return ("the global model" if x == "global" else "its own fine-tuned model" if x == "finetuned" else
                "its own model (trained on its data alone)" if x == "local" else
                f"{x}'s model for it")

    by_site: dict = {}
    for _, doc in sorted(plans.items()):
        for site, v in doc.items():
            by_site.setdefault(site, []).append(v["served"])
    groups: dict = {}
    for site, served in sorted(by_site.items()):
        desc = ", ".join(word(k) + (f" ({c} of {len(plans)} seeds)" if len(plans) > 1 else "")
                         for k, c in Counter(served).most_common())
        groups.setdefault(desc, []).append(site)
    return ("Which model each site should use (the serving plan, chosen on each site's own validation data): "
            + "; ".join(f"{', '.join(sites)}: {desc}" for desc, sites in groups.items()) + ".")


def differ_sentence(tests: dict) -> str:
    """"Do the sites differ?" — the split-half test each clustered method ran before training (``{method: [{"seed",
    "p", "answer", "encoder"}, ...]}``), with its evidence (the p-values) and, where the signature came from an encoder
    with random weights, that it is blind to what a trained network sees (#89)."""
    out = []
    for method, runs in tests.items():
        runs = sorted(runs, key=lambda r: r["seed"])
        said = [r for r in runs if r.get("p") is not None]
        if not said:
            continue
        yes = sum(1 for r in said if r["p"] < r.get("alpha", 0.05))
        ps = ", ".join(f"{r['p']:.3g}" for r in said)
        n = len(said)
        verdict = ("the sites differ" if yes == n else "no evidence that the sites differ" if yes == 0 else
                   f"the sites differ at {yes} of {n} seeds")
        txt = (f"{method}'s split-half test on its signatures: {verdict} (p = {ps}"
               + (f" over {n} seeds" if n > 1 else "") + f"; alpha {said[0].get('alpha', 0.05):g})")
        enc = " ".join(str(e) for r in said for e in (r.get("encoder") or []))
        if "random init" in enc or "no pretrained weights" in enc:
            txt += (". Its signatures come from an encoder with random weights (no weights file): it sees the "
                    "images' low-level statistics only, so " + ("a difference it finds is one of intensity or texture"
                                                                if yes else "'no evidence' here does not mean the "
                                                                "sites are alike") + "; give the encoder its released "
                    "weights (encoder_weights) for a trained network's view")
        out.append(txt + ".")
    return ("Do the sites differ? " + " ".join(out)) if out else ""


def _against_references(best: dict, vb, refs: dict, methods: list, key: str) -> list[str]:
    """The best method against the references: the centralized ceiling, FedAvg on IID sites, each site alone, and
    the floors (a method at or below one flagged)."""
    out: list[str] = []
    central = refs.get("Centralized")
    if central:
        d, sure = _gap(vb, central["_values"][key])
        where = "below" if d < 0 else "above"
        out.append(f"The centralized reference — one model trained on all sites' training data pooled, which a "
                   f"federation cannot see — reached {_pct(central['_values'][key])}: the ceiling. {best['method']} is "
                   f"{_points(d)} {where} it" + (f" ({sure})." if sure else "."))
    iid = next((e for n, e in refs.items() if n.startswith("FedAvg (IID")), None)
    if iid:
        out.append(f"FedAvg on the same data dealt evenly (IID) to the sites reached {_pct(iid['_values'][key])}: what "
                   f"the sites' differences cost FedAvg.")
    alone = next((e for n, e in refs.items() if n.startswith("Each ") and n.endswith(" alone")), None)
    if alone:
        d, sure = _gap(vb, alone["_values"][key])
        who = "Each source training only on its own sites' data (a model per source)" \
            if alone["method"] == "Each source alone" else "Each site training only on its own data"
        out.append(f"{who} reached {_pct(alone['_values'][key])} on average, "
                   f"{_points(d)} {'below' if d > 0 else 'above'} {best['method']}" + (f" ({sure})." if sure else "."))
    for name in FLOORS:
        if name in refs:
            kind = "a constant answer (always the most common class)" if name == "Majority class" else \
                "the network before any training"
            out.append(f"The floor: {kind} scores {_pct(refs[name]['_values'][key])}.")
            floor = 100 * np.mean(refs[name]["_values"][key])
            for e in methods:  # a model at the floor decides nothing: said, not left for the reader to spot (#89)
                v = 100 * np.mean(e["_values"][key])
                if round(v - floor, 1) == 0:
                    out.append(f"⚠ {e['method']} scores exactly the floor: "
                               + ("it answers the most common class everywhere (it learned to rank, perhaps — see "
                                  "its AUC — but not to decide)." if name == "Majority class" else
                                  "no better than the untrained network."))
                elif v < floor:
                    out.append(f"⚠ {e['method']} scores below the floor ({_pct(e['_values'][key])}).")
    return out


def _cluster_sentences(best: dict, vb, refs: dict, methods: list, key: str) -> list[str]:
    """The best method's clusters (their number, their ARI against known groups, what ARI 1.00 of single-site groups
    means), sites that sat out, and the clusters' models against a constant answer per cluster."""
    out: list[str] = []
    if best.get("k"):
        ks = best["k"]
        ari = best.get("ari")
        txt = f"{best['method']} grouped the sites into {ks} cluster(s) (per seed)"
        if ari not in (None, "", "n/a"):
            a = float(str(ari).split(" ")[0])
            ks_all = [int(x) for x in str(ks).replace(",", " ").split() if x.isdigit()]
            alone = a >= 0.999 and ks_all and all(k == best.get("n_sites") for k in ks_all)
            txt += (", every site its own cluster; here every site is its own true group, so ARI 1.00 says only "
                    "that no two sites were merged" if alone else
                    ", exactly the true groups of sites (ARI 1.00)" if a >= 0.999 else
                    f", agreeing with the true groups of sites at ARI {ari} (1 = the same grouping, 0 = chance)")
        out.append(txt + ".")
    flagged = [e for e in methods if e.get("sat_out")]
    for e in flagged:
        out.append(f"⚠ In {e['method']}'s runs a site sat out: {e['sat_out']}; its score is over the sites that "
                   f"trained.")
    if best.get("k"):
        cm = next((e for n, e in refs.items() if n == f"{best['method']}: cluster-majority"), None)
        if cm:
            d, sure = _gap(vb, cm["_values"][key])
            out.append(f"A constant answer per cluster (each cluster's most common class) scores "
                       f"{_pct(cm['_values'][key])}; {best['method']} is {_points(d)} above it, so its clusters' "
                       f"models learned more than their clusters' class balance" + (f" ({sure})." if sure else "."))
    return out


def findings(summ: list[dict], phases: list[dict] | None = None, plans: dict | None = None) -> list[str]:
    """Plain sentences for one results table (``summarize``'s entries), its unseen-site rows (``phases``) and the
    serving plans of its seeds (``plans``: ``{seed: plan.json}``; the plan's outcome comes first, and no method is
    then called the one that served the sites best: the plan decides what each site is served)."""
    if not summ:
        return []
    seg = any(e.get("dice_mean", "n/a") != "n/a" for e in summ)
    key = "dice_mean" if seg else "accuracy"
    what = "mean Dice (overlap with the ground-truth tumour outline)" if seg else "accuracy (mean over sites)"
    # the methods that trained (a serving plan's rows choose among them: the plan sentence says what it served)
    methods = [e for e in summ if e["kind"] != "reference" and e["_values"].get(key)
               and e.get("task") not in ("served", "global")]
    refs = {e["method"]: e for e in summ if e["kind"] == "reference" and e["_values"].get(key)}
    out = [plan_sentence(plans)] if plans else []
    if not methods:
        return out + ["No method produced a score (see the runs' status below)."]
    best = max(methods, key=lambda e: np.mean(e["_values"][key]))
    vb = best["_values"][key]
    if len(methods) == 1:
        out.append(f"{best['method']} reached {_pct(vb)} {what}.")
    else:
        out.append(f"Of the {len(methods)} federated methods, **{best['method']}** "
                   f"{'scored highest' if plans else 'served the sites best'}: {_pct(vb)} {what}.")
        others = [e for e in methods if e is not best]
        base = next((e for e in others if e["method"] == "FedAvg"), None) or max(
            others, key=lambda e: np.mean(e["_values"][key]))
        d, sure = _gap(vb, base["_values"][key])
        if round(abs(d), 1) == 0:  # "tied ... by 0.0 points" said nothing (#89)
            out.append(f"It scored the same as {base['method']} ({_pct(base['_values'][key])}).")
        else:
            out.append(f"It {'beat' if d > 0 else 'trailed'} {base['method']} ({_pct(base['_values'][key])}) by "
                       f"{_points(d)}" + (f"; {sure}." if sure else "."))
    out += _against_references(best, vb, refs, methods, key)
    out += _cluster_sentences(best, vb, refs, methods, key)
    for p in phases or []:
        out.append(f"New sites that joined after training were given {p['method']}'s model for them and scored "
                   f"{p['assigned']}% accuracy" + (f" (the best of the cluster models for each, chosen on their test "
                                                   f"labels as a reference only: {p['oracle']}%)"
                                                   if p.get("oracle") not in (None, "n/a") else "") + ".")
    if max(e["seeds"] for e in summ) == 1:
        out.append(ONE_SEED)
    return out


def findings_section(summ: list[dict], phases: list[dict] | None = None, heading: str = "### What this found",
                     plans: dict | None = None, differ: dict | None = None) -> str:
    lines = findings(summ, phases, plans)
    said = differ_sentence(differ or {})
    if said:  # the first question a federation asks, answered at the top (#89)
        lines = [said, *lines]
    return f"{heading}\n\n" + "\n".join(f"- {s}" for s in lines) + "\n\n" if lines else ""
