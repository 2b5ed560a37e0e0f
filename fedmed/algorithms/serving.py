"""Which model a site is served (issue #57): the global model, unless a candidate beats it on the site's own
validation images beyond their noise.

A site scores the global model and each candidate (its cluster's model, its personal model, the global model
fine-tuned on its data, ...) on the **same** validation images and sends, per candidate, three counts — never a
per-image value (:func:`paired_counts`):

* ``n``: the validation items both models were scored on;
* ``wins``: items the candidate gets right and the global model wrong (for segmentation: volumes where the candidate's
  score is higher);
* ``losses``: items the global model gets right and the candidate wrong (its score higher).

The server's rule (:func:`choose`) is a paired, one-sided **exact sign test** on the discordant items (McNemar's exact
test for correctness): under "the candidate is no better", each discordant item is a win with probability at most
1/2, so ``p = P(Bin(wins + losses, 1/2) >= wins)``. A candidate is served only when ``p < alpha / m`` over the ``m``
candidates compared at that site (Bonferroni): when no candidate is better, the global model is kept with probability
at least ``1 - alpha`` whatever the number of candidates, and the rule needs no threshold tuned on any dataset.
``alpha`` = :data:`ALPHA` = 0.05, fixed before any number was seen (docs/readings.md "Serving plan"). Among the
candidates that pass, the smallest ``p`` wins (then the larger ``wins - losses``, then the name). The sites of one
cluster may pool their evidence for their shared candidate (:func:`pooled`: the counts add up; the test is the same).

A site with fewer than ``k_min`` validation items sends nothing (``None``): its global model is kept unless pooled
evidence decides. Candidates already ruled out upstream (a cluster trained on too few images) are passed as
``excluded`` with their reason and never served.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Optional

import numpy as np

__all__ = ["ALPHA", "Choice", "Paired", "choose", "paired_counts", "plan", "plan_table", "pooled", "sign_test_p"]

ALPHA = 0.05


@dataclass(frozen=True)
class Paired:
    """What a site sends for one candidate against the global model: counts over its validation items."""

    n: int
    wins: int
    losses: int

    def __post_init__(self):
        if min(self.n, self.wins, self.losses) < 0 or self.wins + self.losses > self.n:
            raise ValueError(f"paired counts need 0 <= wins + losses <= n, got n={self.n}, wins={self.wins}, "
                             f"losses={self.losses}")

    @property
    def p(self) -> float:
        return sign_test_p(self.wins, self.losses)


@lru_cache(maxsize=4096)
def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test: ``P(X >= wins)`` for ``X ~ Bin(wins + losses, 1/2)`` (1.0 with no discordant item);
    SciPy's binomial survival function, imported here only (a site never calls this)."""
    n = int(wins) + int(losses)
    if n == 0:
        return 1.0
    from scipy.stats import binom

    return float(binom.sf(int(wins) - 1, n, 0.5))


def paired_counts(reference_scores, candidate_scores, *, k_min: int = 1) -> Optional[Paired]:
    """A site's paired counts from per-item scores of the global model and a candidate on the same items (correctness
    0/1 for classification, a Dice per volume for segmentation; higher is better). ``None`` (nothing sent) under
    ``k_min`` items. NaN scores (an item a model could not score) are left out of both."""
    a = np.asarray(reference_scores, dtype=np.float64).ravel()
    b = np.asarray(candidate_scores, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"paired scores need the same items: {a.size} against {b.size}")
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    if a.size < max(1, int(k_min)):
        return None
    return Paired(int(a.size), int(np.sum(b > a)), int(np.sum(a > b)))


def pooled(*counts: Optional[Paired]) -> Optional[Paired]:
    """The evidence of several sites for one shared candidate (the sites of a cluster): the counts add up. Sites that
    sent nothing (``None``) add nothing; ``None`` when none sent anything."""
    got = [c for c in counts if c is not None]
    if not got:
        return None
    return Paired(sum(c.n for c in got), sum(c.wins for c in got), sum(c.losses for c in got))


@dataclass(frozen=True)
class Choice:
    """The model served at one site, and why."""

    served: str
    reason: str
    p: Mapping[str, float]  # each compared candidate's one-sided p-value
    threshold: float  # alpha / (candidates compared)


def choose(candidates: Mapping[str, Optional[Paired]], *, alpha: float = ALPHA, reference: str = "global",
           excluded: Mapping[str, str] | None = None, notes=()) -> Choice:
    """Serve ``reference`` unless a candidate beats it beyond the noise (see the module notes).

    Args:
        candidates: per candidate name, the site's (or its cluster's pooled) :class:`Paired` counts against the
            reference, or ``None`` where the site sent nothing (fewer than ``k_min`` validation items).
        alpha: the family-wise rate of serving a candidate that is no better (Bonferroni over the candidates).
        excluded: candidates ruled out before scoring, with the reason (never served; named in the reason).
        notes: said after the verdict in the reason (e.g. whose evidence was pooled).
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha should be in (0, 1), got {alpha}")
    excluded = dict(excluded or {})
    judged = {k: v for k, v in candidates.items() if k not in excluded and k != reference and v is not None}
    silent = sorted(k for k, v in candidates.items() if k not in excluded and k != reference and v is None)
    notes = list(notes) + [f"{k} not served: {why}" for k, why in sorted(excluded.items())]
    if silent:
        notes.append(f"no validation evidence for {', '.join(silent)} (fewer than k_min validation items)")
    if not judged:
        return Choice(reference, "; ".join([f"{reference} kept: no candidate to compare"] + notes), {}, float("nan"))
    threshold = alpha / len(judged)
    p = {k: v.p for k, v in judged.items()}
    best = min(judged, key=lambda k: (p[k], -(judged[k].wins - judged[k].losses), k))
    c = judged[best]
    evidence = f"{c.wins} wins / {c.losses} losses over {c.n} validation items, p = {p[best]:.3g}"
    over = f"alpha {alpha:g} over {len(judged)} candidate(s)"
    if p[best] < threshold:
        return Choice(best, "; ".join([f"{best} beats {reference}: {evidence} < {threshold:.3g} ({over})"] + notes),
                      p, threshold)
    return Choice(reference, "; ".join([f"{reference} kept: no candidate beats it beyond the validation noise "
                                        f"(best {best}: {evidence} >= {threshold:.3g}, {over})"] + notes), p, threshold)


def plan(site_counts: Mapping[str, Mapping[str, Optional[Paired]]], *, groups: Mapping[str, Mapping[str, object]]
         | None = None, alpha: float = ALPHA, reference: str = "global",
         excluded: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, Choice]:
    """The serving plan: per site, :func:`choose` over its candidates.

    Args:
        site_counts: ``{site: {candidate: Paired or None}}``, what each site sent.
        groups: ``{candidate: {site: group}}`` for candidates shared by several sites (a clustered method's cluster
            model: the group is the cluster): each member is judged on the group's pooled counts. A candidate not
            named here is judged on the site's own counts (a fine-tuned or personal model).
        excluded: ``{site: {candidate: reason}}`` ruled out before scoring (see :func:`choose`).
    """
    groups = {k: dict(v) for k, v in (groups or {}).items()}
    out = {}
    for site, counts in site_counts.items():
        ev, notes = {}, []
        for cand, c in counts.items():
            g = groups.get(cand, {}).get(site)
            if g is None:
                ev[cand] = c
                continue
            members = sorted(s for s, gs in groups[cand].items() if gs == g and s in site_counts)
            ev[cand] = pooled(*(site_counts[s].get(cand) for s in members))
            if len(members) > 1:
                notes.append(f"{cand} judged on the pooled evidence of the {len(members)} sites it serves")
        out[site] = choose(ev, alpha=alpha, reference=reference, excluded=(excluded or {}).get(site), notes=notes)
    return out


def plan_table(choices: Mapping[str, Choice]) -> str:
    """The plan as a markdown table: site, served model, why (with the evidence)."""
    rows = ["| site | served model | why |", "|---|---|---|"]
    rows += [f"| {site} | {c.served} | {c.reason} |" for site, c in sorted(choices.items())]
    return "\n".join(rows) + "\n"
