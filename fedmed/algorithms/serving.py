"""Which model a site is served (issue #57): the global model, unless a candidate beats it on the site's own
validation images beyond their noise.

A site scores the global model and each candidate (its cluster's model, its personal model, the global model
fine-tuned on its data, ...) on the **same** validation images and sends, per candidate, aggregates over those items —
never a per-item value (:func:`paired_counts`):

* ``n``: the validation items both models were scored on;
* ``wins``: items the candidate gets right and the global model wrong (for segmentation: images where the candidate's
  Dice is higher);
* ``losses``: items the global model gets right and the candidate wrong (its score higher) — ``wins`` and ``losses``
  only when each of them and the ties is at least ``k_min`` (a count below it is never sent, 0 included: #86);
* a classifier's site also sends ``sum_d`` and ``sum_d2``: the sum and the sum of squares, over the same items, of
  ``d`` = the candidate's per-item proper score minus the global model's (the negative Brier score: ``-sum_k (p_k -
  y_k)^2``, bounded, so ``d`` lies in [-2, 2]).

The server's rule (:func:`choose`) is a paired one-sided test of "the candidate is no better", at ``alpha / m`` over
the ``m`` candidates compared at that site (Bonferroni): when no candidate is better, the global model is kept with
probability at least ``1 - alpha`` whatever the number of candidates. ``alpha`` = :data:`ALPHA` = 0.05, fixed before
any number was seen (docs/readings.md "Serving plan"). Two tests (:data:`TESTS`):

* ``"score"`` (the default): a **paired t-test on the proper-score differences** (``mean(d) / (sd(d) / sqrt(n))``
  against Student's t with ``n - 1`` degrees of freedom; :func:`score_test_p`), where the site sent them. Every item
  counts, by how much better or worse the candidate's probabilities are, not only the items where the two models'
  answers differ — on the planted candidates of ``tests/test_serving.py`` it finds a better candidate several times
  as often as the sign test at the same false-alarm rate. A proper score rewards better probabilities, which may be
  better calibration as well as more right answers (docs/readings.md).
* ``"sign"``: the **exact sign test** on the discordant items (McNemar's exact test for correctness): ``p = P(Bin(wins +
  losses, 1/2) >= wins)``. Where a site sent no score sums ``"score"`` falls back to it. A 2D lesion segmenter's site
  sends the sums of its per-image Dice differences (#86: its counts, below ``k_min`` at either end, often cannot be
  sent, and a sign test cannot then show a candidate better on every image).

Among the candidates that pass, the smallest ``p`` wins (then the larger mean gain or ``wins - losses``, then the
name). The sites of one cluster may pool their evidence for their shared candidate (:func:`pooled`: counts and sums
add up; the test is the same).

A site with fewer than ``k_min`` validation items sends nothing (``None``): its global model is kept unless pooled
evidence decides. Candidates already ruled out upstream (a cluster trained on too few images) are passed as
``excluded`` with their reason and never served.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Optional

import numpy as np

__all__ = ["ALPHA", "MIN_PATIENTS", "TESTS", "Choice", "Paired", "choose", "differing_items", "paired_counts", "plan", "plan_table", "pooled",
           "score_test_p", "sign_test_p"]

ALPHA = 0.05
TESTS = ("score", "sign")
FEW = 20  # a site's reason says it had too few validation items to decide when the global model is kept on fewer
MIN_PATIENTS = 5  # a site whose validation items come from fewer patients decides nothing (#86; docs/readings.md)


@dataclass(frozen=True)
class Paired:
    """What a site sends for one candidate against the global model: aggregates over its validation items (see the
    module notes); ``sum_d`` / ``sum_d2`` None where the site scores no per-item proper score."""

    n: int
    wins: Optional[int] = None
    losses: Optional[int] = None
    sum_d: Optional[float] = None
    sum_d2: Optional[float] = None
    unit: Optional[str] = None  # what n counts: None items, "patient" a patient's items scored as one unit (#86)

    def __post_init__(self):
        if (self.wins is None) != (self.losses is None):
            raise ValueError("paired counts come together: wins and losses, or neither")
        w, lo = self.wins or 0, self.losses or 0
        if min(self.n, w, lo) < 0 or w + lo > self.n:
            raise ValueError(f"paired counts need 0 <= wins + losses <= n, got n={self.n}, wins={self.wins}, "
                             f"losses={self.losses}")
        if self.wins is None and self.sum_d is None:
            raise ValueError("paired evidence needs the counts (wins, losses) or the score sums")
        if (self.sum_d is None) != (self.sum_d2 is None):
            raise ValueError("paired score sums come together: sum_d and sum_d2, or neither")
        if self.sum_d2 is not None and not (self.sum_d2 >= 0 and np.isfinite(self.sum_d) and np.isfinite(self.sum_d2)):
            raise ValueError(f"paired score sums need finite values and sum_d2 >= 0, got {self.sum_d}, {self.sum_d2}")

    def tested(self, test: str = "score") -> str:
        """The test these aggregates are judged by under ``test``: ``"score"`` needs the score sums, else ``"sign"``."""
        if test not in TESTS:
            raise ValueError(f"test should be one of {TESTS}, got {test!r}")
        return "score" if test == "score" and self.sum_d is not None else "sign"

    def p_value(self, test: str = "score") -> float:
        """The one-sided p-value of "the candidate is no better" (:func:`score_test_p` or :func:`sign_test_p`)."""
        if self.tested(test) == "score":
            return score_test_p(self.n, self.sum_d, self.sum_d2)
        return 1.0 if self.wins is None else sign_test_p(self.wins, self.losses)

    def message(self) -> dict:
        """What the site sends (and the plan records): the fields it has, without the absent score sums."""
        return {k: v for k, v in vars(self).items() if v is not None}

    @property
    def mean_d(self) -> float:
        """The candidate's mean per-item score gain (NaN without score sums)."""
        return float("nan") if self.sum_d is None or not self.n else self.sum_d / self.n


def score_test_p(n: int, sum_d: float, sum_d2: float) -> float:
    """One-sided paired t-test of ``mean(d) <= 0`` from the aggregates ``n``, ``sum(d)``, ``sum(d^2)``: Student's t
    survival function at ``mean / (sd / sqrt(n))`` with ``n - 1`` degrees of freedom (1.0 under two items; with no
    spread at all, 0.0 for a positive mean, else 1.0)."""
    n = int(n)
    if n < 2:
        return 1.0
    mean = float(sum_d) / n
    var = max(float(sum_d2) - n * mean * mean, 0.0) / (n - 1)
    if var <= 1e-12 * max(1.0, float(sum_d2) / n):
        return 0.0 if mean > 0 else 1.0
    from scipy.stats import t

    return float(t.sf(mean / np.sqrt(var / n), n - 1))


@lru_cache(maxsize=4096)
def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test: ``P(X >= wins)`` for ``X ~ Bin(wins + losses, 1/2)`` (1.0 with no discordant item);
    SciPy's binomial survival function, imported here only (a site never calls this)."""
    n = int(wins) + int(losses)
    if n == 0:
        return 1.0
    from scipy.stats import binom

    return float(binom.sf(int(wins) - 1, n, 0.5))


def paired_counts(reference_scores, candidate_scores, *, k_min: int = 1, reference_proper=None,
                  candidate_proper=None, units=None) -> Optional[Paired]:
    """A site's paired aggregates from per-item scores of the global model and a candidate on the same items
    (correctness 0/1 for classification, a Dice per image for segmentation; higher is better) and, optionally, each
    item's proper score under both models (a classifier's negative Brier score; higher is better): then ``sum_d`` /
    ``sum_d2`` of their differences too (given for one model only, none). ``None`` (nothing sent) under ``k_min``
    items. No count below ``k_min`` is sent (0 included where ``k_min`` is above 1, #86): ``wins`` and ``losses`` only when each is at least
    ``k_min`` (and, beside the sums, whose item count tells the ties, the ties too); without them a classifier's site
    sends its sums alone and a segmenter's site nothing; a segmenter's ``n`` is the discordant items' when its ties are
    fewer than ``k_min``. NaN scores (an item a model could not score) are left out of both. ``units``: each item's
    patient (#86): the items of one patient are one unit of evidence — each score is then the patient's mean over its
    scored items, and ``n``, the counts and the sums are over patients (``unit="patient"``); ``None`` under ``k_min``
    items or :data:`MIN_PATIENTS` patients."""
    a = np.asarray(reference_scores, dtype=np.float64).ravel()
    b = np.asarray(candidate_scores, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"paired scores need the same items: {a.size} against {b.size}")
    proper = reference_proper is not None and candidate_proper is not None
    if proper:
        pa = np.asarray(reference_proper, dtype=np.float64).ravel()
        pb = np.asarray(candidate_proper, dtype=np.float64).ravel()
        if not a.shape == pa.shape == pb.shape:
            raise ValueError(f"paired proper scores need the same items: {a.size}, {pa.size} and {pb.size}")
    ok = np.isfinite(a) & np.isfinite(b)
    if proper:
        ok &= np.isfinite(pa) & np.isfinite(pb)
    a, b = a[ok], b[ok]
    k = max(1, int(k_min))
    if a.size < k:
        return None
    unit = None
    if units is not None:
        u = np.asarray(units, dtype=object).ravel()
        if u.size != ok.size:
            raise ValueError(f"paired scores need one unit per item: {u.size} units for {ok.size} items")
        _, inv = np.unique(u[ok].astype(str), return_inverse=True)
        if inv.max(initial=-1) + 1 < MIN_PATIENTS:
            return None
        a, b = _unit_means(a, inv), _unit_means(b, inv)
        if proper:
            pa, pb, ok = _unit_means(pa[ok], inv), _unit_means(pb[ok], inv), np.ones(a.size, dtype=bool)
        unit = "patient"
    wins, losses = int(np.sum(b > a)), int(np.sum(a > b))
    ties = int(a.size) - wins - losses
    if min(wins, losses) < k and k > 1:  # a count below k_min is never sent (0 included, unless k_min is 1)
        return None if not proper else Paired(int(a.size), None, None, *_sums(pa[ok], pb[ok]), unit)
    if not proper:  # the sign test needs wins and losses alone: the ties are not told when fewer than k_min
        return Paired(int(a.size) if ties >= k or k == 1 else wins + losses, wins, losses, unit=unit)
    if ties < k and k > 1:  # with the sums the count of items is sent, and with it the ties
        wins = losses = None
    return Paired(int(a.size), wins, losses, *_sums(pa[ok], pb[ok]), unit)


def _unit_means(v, inv) -> np.ndarray:
    """Each unit's mean of ``v`` (``inv``: each item's unit index)."""
    return np.bincount(inv, weights=v) / np.bincount(inv)


def _sums(pa, pb) -> tuple[float, float]:
    d = pb - pa
    return float(d.sum()), float(np.sum(d * d))


def differing_items(a, b, tol: float = 1e-6) -> int:
    """On how many items two models' per-item scores differ (beyond ``tol``; NaN equals NaN only): the replies of
    two models that differ on fewer than ``k_min`` items could be differenced to single those items out."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    same = (np.abs(a - b) <= tol) | (np.isnan(a) & np.isnan(b))
    same = same.reshape(same.shape[0], -1).all(axis=1) if same.ndim > 1 else same
    return int(np.sum(~same))


def pooled(*counts: Optional[Paired]) -> Optional[Paired]:
    """The evidence of several sites for one shared candidate (the sites of a cluster): the counts add up, and the
    score sums where every site sent them. Sites that sent nothing (``None``) add nothing; ``None`` when none sent
    anything."""
    got = [c for c in counts if c is not None]
    if not got:
        return None
    sums = all(c.sum_d is not None for c in got)
    tally = all(c.wins is not None for c in got)
    if not sums and not tally:  # the sites sent different kinds of evidence: the larger kind's sites alone
        got = max(([c for c in got if c.sum_d is not None], [c for c in got if c.wins is not None]),
                  key=lambda cs: sum(c.n for c in cs))
        return pooled(*got)
    units = {c.unit for c in got}
    return Paired(sum(c.n for c in got), sum(c.wins for c in got) if tally else None,
                  sum(c.losses for c in got) if tally else None,
                  sum(c.sum_d for c in got) if sums else None, sum(c.sum_d2 for c in got) if sums else None,
                  units.pop() if len(units) == 1 else "unit")


@dataclass(frozen=True)
class Choice:
    """The model served at one site, and why."""

    served: str
    reason: str
    p: Mapping[str, float]  # each compared candidate's one-sided p-value
    threshold: float  # alpha / (candidates compared)


def choose(candidates: Mapping[str, Optional[Paired]], *, alpha: float = ALPHA, reference: str = "global",
           excluded: Mapping[str, str] | None = None, notes=(), test: str = "score",
           withheld: Mapping[str, str] | None = None) -> Choice:
    """Serve ``reference`` unless a candidate beats it beyond the noise (see the module notes).

    Args:
        candidates: per candidate name, the site's (or its cluster's pooled) :class:`Paired` counts against the
            reference, or ``None`` where the site sent nothing (fewer than ``k_min`` validation items).
        alpha: the family-wise rate of serving a candidate that is no better (Bonferroni over the candidates).
        excluded: candidates ruled out before scoring, with the reason (never served; named in the reason).
        notes: said after the verdict in the reason (e.g. whose evidence was pooled).
        test: ``"score"`` (the paired t-test on proper-score differences, where sent; else the sign test) or
            ``"sign"`` (the sign test on correctness); see the module notes.
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha should be in (0, 1), got {alpha}")
    if test not in TESTS:
        raise ValueError(f"test should be one of {TESTS}, got {test!r}")
    excluded = dict(excluded or {})
    judged = {k: v for k, v in candidates.items() if k not in excluded and k != reference and v is not None}
    silent = sorted(k for k, v in candidates.items() if k not in excluded and k != reference and v is None)
    notes = list(notes) + [f"{k} not served: {why}" for k, why in sorted(excluded.items())]
    withheld = dict(withheld or {})
    notes += [f"no validation evidence for {k}: {withheld[k]}" for k in silent if k in withheld]
    plain = [k for k in silent if k not in withheld]
    if plain:
        notes.append(f"no validation evidence for {', '.join(plain)} (fewer than k_min validation items, or a "
                     f"count below k_min withheld)")
    if not judged:
        return Choice(reference, "; ".join([f"{reference} kept: no candidate to compare"] + notes), {}, float("nan"))
    threshold = alpha / len(judged)
    p = {k: v.p_value(test) for k, v in judged.items()}

    def gain(k):
        v = judged[k]
        return v.mean_d if v.tested(test) == "score" else float((v.wins or 0) - (v.losses or 0))

    best = min(judged, key=lambda k: (p[k], -gain(k), k))
    c = judged[best]
    what = {None: "items", "patient": "patients"}.get(c.unit, "units")
    if c.tested(test) == "score":
        evidence = (f"mean Brier score gain {c.mean_d:+.4f} over {c.n} validation {what} (paired t-test), "
                    f"p = {_num(p[best])}")
    elif c.wins is None:
        evidence = (f"no sign test: the counts of {c.n} validation {what} were withheld (one below k_min), "
                    f"p = {_num(p[best])}")
    else:
        evidence = (f"{_items(c.wins, what)} better, {c.losses} worse, of {c.n} validation {what} (sign test), "
                    f"p = {_num(p[best])}")
    over = f"alpha {alpha:g} over {len(judged)} candidate(s)"
    if p[best] < threshold:
        return Choice(best, "; ".join([f"{best} beats {reference}: {evidence} < {_num(threshold)} ({over})"] + notes),
                      p, threshold)
    few = f"too few validation {what} to decide (n = {c.n}; under {FEW} only a large gain can pass): " \
        if c.n < FEW else ""
    return Choice(reference, "; ".join([f"{reference} kept: {few}no candidate beats it beyond the validation noise "
                                        f"(best {best}: {evidence} >= {_num(threshold)}, {over})"] + notes), p, threshold)


def _num(x: float) -> str:
    """A p-value or threshold as a reader reads it: three significant digits, never in e-notation."""
    return "0" if x == 0 else f"{x:.3g}" if x >= 1e-3 else f"{x:.{2 - int(np.floor(np.log10(x)))}f}"


def _items(n: int, what: str = "items") -> str:
    return f"{n} {what[:-1] if n == 1 and what.endswith('s') else what}"


def plan(site_counts: Mapping[str, Mapping[str, Optional[Paired]]], *, groups: Mapping[str, Mapping[str, object]]
         | None = None, alpha: float = ALPHA, reference: str = "global",
         excluded: Mapping[str, Mapping[str, str]] | None = None, test: str = "score",
         withheld: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, Choice]:
    """The serving plan: per site, :func:`choose` over its candidates.

    Args:
        site_counts: ``{site: {candidate: Paired or None}}``, what each site sent.
        groups: ``{candidate: {site: group}}`` for candidates shared by several sites (a clustered method's cluster
            model: the group is the cluster): each member is judged on the group's pooled counts. A candidate not
            named here is judged on the site's own counts (a fine-tuned or personal model).
        excluded: ``{site: {candidate: reason}}`` ruled out before scoring (see :func:`choose`).
        test: the test (see :func:`choose`).
        withheld: ``{site: {candidate: reason}}``: why a site sent no evidence for a candidate (said in its reason).
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
        out[site] = choose(ev, alpha=alpha, reference=reference, excluded=(excluded or {}).get(site), notes=notes,
                           test=test, withheld=(withheld or {}).get(site))
    return out


def plan_table(choices: Mapping[str, Choice]) -> str:
    """The plan as a markdown table: site, served model, why (with the evidence)."""
    rows = ["| site | served model | why |", "|---|---|---|"]
    rows += [f"| {site} | {c.served} | {c.reason} |" for site, c in sorted(choices.items())]
    return "\n".join(rows) + "\n"
