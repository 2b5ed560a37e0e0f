"""Seeded partitioners: how a pooled dataset becomes a federation of sites.

Every function takes a ``numpy.random.Generator`` (``np.random.default_rng(seed)``) or an int
seed, never global state, and retries a bounded number of times before raising a clear error.

* :func:`iid_partition`, :func:`dirichlet_label_partition` (label skew, Hsu et al. 2019 as used by
  FMCL §4.2), :func:`quantity_partition` (Dirichlet quantity skew, ``001_`` §3.3.1).
* :func:`predi` — PreDi, ``001_`` Algorithm 1: a class-site assignment with target average
  prevalence ``p*`` and class-set-size disparity ``sigma*``; :func:`predi_partition` distributes
  images.
* ANDA-style shifts (``003_`` Appendix B.1/F.1) with the ground-truth group of every site: :mod:`fedmed.data.anda`.
* :func:`natural_partition` — a site per source (hospital, scanner), a large source dealt by patient into several
  sites, sources held out as unseen sites; :func:`group_units` / :func:`expand_units` make any partition split by
  patient.
* :func:`label_volume_federation` — ``004_`` Appendix D: subjects ordered by label volume and cut
  into contiguous sites.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedmed.core.validation import check_finite_number

__all__ = ["PreDiResult", "as_rng", "check_sites", "dirichlet_label_partition", "expand_units", "group_units", "iid_partition", "label_volume_federation", "natural_partition", "predi", "predi_partition", "quantity_partition"]


def as_rng(seed) -> np.random.Generator:
    """An injected Generator, or a new one from an int seed."""
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is None or isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed should be an int or numpy Generator, got {seed!r}.")
    return np.random.default_rng(int(seed))


def check_sites(n_sites, n_items=None, what="samples"):
    check_finite_number(n_sites, "n_sites", low=1, integer=True)
    if n_items is not None and n_sites > n_items:
        raise ValueError(f"n_sites ({n_sites}) should not exceed the number of {what} ({n_items}).")
    return int(n_sites)


def iid_partition(n_samples: int, n_sites: int, seed) -> list[np.ndarray]:
    """Shuffle and cut into ``n_sites`` near-equal parts (sizes differ by at most one)."""
    check_finite_number(n_samples, "n_samples", low=1, integer=True)
    n_sites = check_sites(n_sites, n_samples)
    perm = as_rng(seed).permutation(int(n_samples))
    return [np.sort(p) for p in np.array_split(perm, n_sites)]


def dirichlet_label_partition(labels, n_sites: int, alpha: float, seed, *, mode: str = "per-site",
                              min_size: int = 2, max_retries: int = 10) -> list[np.ndarray]:
    """Dirichlet label skew.

    ``mode="per-site"`` (default; Hsu, Qi & Brown 2019, as FMCL §4.2 uses it): every site gets
    ``N / n_sites`` samples (sizes differ by at most one) whose class mix is ``q_k ~ Dir(alpha * p)``,
    ``p`` the pooled class frequencies. ``mode="per-client"`` is the same with ``q_k ~ Dir(alpha * 1)``
    (FedLab's client-level Dirichlet): on C balanced classes, Hsu's ``alpha`` equals ``C x`` this one's
    (at alpha = 1 on 10 classes a site holds ~3.9 vs ~9.5 classes). Samples are drawn without
    replacement **one at a time, the sites taking turns in a fresh random order each turn**, so a class
    running out hurts every site alike; filling the sites one after the other (the usual code) leaves
    the last sites with whatever is left and makes them markedly more skewed (docs/readings.md). A
    class whose pool is empty is dropped from later draws (its probability mass renormalised over the
    rest). Every sample is assigned and no site is empty, which the per-class form cannot guarantee
    for small label sets: BUSI (3 classes) over 20 sites at ``alpha = 0.1`` leaves about 6 sites empty.

    ``mode="per-class"`` (NIID-Bench): each class's samples are split over sites with proportions
    ``~ Dir(alpha)`` (sites already holding ``N / n_sites`` samples get no share of later classes);
    redrawn at most ``max_retries`` times until every site has ``min_size``.

    Raises:
        ValueError: bad arguments, or (per-class) a site still under ``min_size`` after
            ``max_retries`` draws.
    """
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ValueError(f"labels should be a non-empty 1-D array, got shape {y.shape}.")
    if mode not in ("per-site", "per-client", "per-class"):
        raise ValueError(f"mode should be 'per-site', 'per-client' or 'per-class', got {mode!r}.")
    n_sites = check_sites(n_sites, y.size)
    check_finite_number(alpha, "alpha", low=0.0, low_inclusive=False)
    check_finite_number(min_size, "min_size", low=0, integer=True)
    check_finite_number(max_retries, "max_retries", low=1, integer=True)
    rng = as_rng(seed)
    classes = np.unique(y)
    if mode in ("per-site", "per-client"):
        pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in classes]
        prior = np.array([len(p) for p in pools], dtype=np.float64) / y.size
        if mode == "per-client":
            prior = np.ones(len(classes))
        sizes = np.array([len(a) for a in np.array_split(np.arange(y.size), n_sites)])
        q = np.stack([rng.dirichlet(np.maximum(alpha * prior, 1e-12)) for _ in range(n_sites)])
        got: list[list[int]] = [[] for _ in range(n_sites)]
        avail = np.array([len(p) for p in pools], dtype=np.float64)
        for turn in range(int(sizes.max())):
            for k in rng.permutation(n_sites):
                if turn >= sizes[k]:
                    continue
                w = q[k] * (avail > 0)
                w = w / w.sum() if w.sum() > 0 else (avail > 0) / (avail > 0).sum()
                c = int(rng.choice(len(pools), p=w))
                got[k].append(pools[c].pop())
                avail[c] -= 1
        parts = [np.sort(np.asarray(g, dtype=np.int64)) for g in got]
        if min(len(p) for p in parts) < min_size:
            raise ValueError(f"{y.size} samples over {n_sites} sites leave fewer than min_size={min_size} per site.")
        return parts
    smallest = 0
    for _ in range(int(max_retries)):
        parts_l: list[list[int]] = [[] for _ in range(n_sites)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            prop = rng.dirichlet(np.full(n_sites, float(alpha)))
            prop = prop * np.array([len(p) < y.size / n_sites for p in parts_l])
            prop = prop / prop.sum() if prop.sum() > 0 else np.full(n_sites, 1.0 / n_sites)
            cuts = (np.cumsum(prop) * idx.size).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts_l[k].extend(chunk.tolist())
        smallest = min(len(p) for p in parts_l)
        if smallest >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts_l]
    raise ValueError(
        f"Dirichlet(alpha={alpha}) per-class label partition of {y.size} samples into {n_sites} sites left a site "
        f"with {smallest} < min_size={min_size} samples after {max_retries} draws; use mode='per-site', fewer "
        f"sites, a larger alpha or a smaller min_size."
    )


def quantity_partition(n_samples: int, n_sites: int, alpha: float, seed, *, min_size: int = 1,
                       max_retries: int = 10) -> list[np.ndarray]:
    """Quantity skew (``001_`` §3.3.1): ``r ~ Dir_K(alpha)``, ``n_i = N r_i`` (largest remainders)."""
    check_finite_number(n_samples, "n_samples", low=1, integer=True)
    n_sites = check_sites(n_sites, n_samples)
    check_finite_number(alpha, "alpha", low=0.0, low_inclusive=False)
    rng = as_rng(seed)
    sizes = np.zeros(n_sites, dtype=int)
    for _ in range(int(max_retries)):
        r = rng.dirichlet(np.full(n_sites, float(alpha)))
        raw = r * n_samples
        sizes = np.floor(raw).astype(int)
        rem = int(n_samples - sizes.sum())
        sizes[np.argsort(-(raw - sizes), kind="mergesort")[:rem]] += 1
        if sizes.min() >= min_size:
            perm = rng.permutation(int(n_samples))
            return [np.sort(p) for p in np.split(perm, np.cumsum(sizes)[:-1])]
    raise ValueError(
        f"Dirichlet(alpha={alpha}) quantity partition left a site with {sizes.min()} < min_size={min_size} "
        f"samples after {max_retries} draws."
    )


# ----------------------------------------------------------------------------- PreDi (001_)

@dataclass
class PreDiResult:
    """A PreDi class-site assignment and its realised statistics."""

    assignment: np.ndarray  # (C, K) 0/1
    class_prevalence: np.ndarray  # (C,) p_c
    prevalence: float  # p-bar
    disparity: float  # sigma (population std of n_k)
    targets: tuple[float, float]
    target_counts: np.ndarray  # (K,) q_k
    attempts: int

    @property
    def classes_per_site(self) -> np.ndarray:
        return self.assignment.sum(axis=0)


def _predi_once(C, K, A, sigma, rng, q_tries):
    # Step 1: prevalence assignment
    p = np.ones(C, dtype=int)
    while p.sum() < A:
        open_ = np.flatnonzero(p < K)
        p[rng.choice(open_)] += 1
    # Step 2: disparity assignment (best of q_tries samples)
    mu = A / K
    must = int((p == K).sum())
    best_q, best_err = None, np.inf
    for _ in range(q_tries):
        z = rng.standard_normal(K)
        if K > 1 and sigma > 0:
            z = (z - z.mean()) / (z.std() if z.std() > 0 else 1.0)
            q = np.rint(mu + sigma * z).astype(int)
        else:
            q = np.full(K, int(np.floor(mu)))
        lo = max(1, must)
        q = np.clip(q, lo, C)
        guard = 0
        while q.sum() != A and guard < 10 * C * K:
            guard += 1
            if q.sum() < A:
                cand = np.flatnonzero(q < C)
                q[rng.choice(cand)] += 1
            else:
                cand = np.flatnonzero(q > lo)
                q[rng.choice(cand)] -= 1
        if q.sum() != A:
            continue
        err = abs(q.std() - sigma)
        if err < best_err:
            best_q, best_err = q.copy(), err
        if err < 1e-9:
            break
    if best_q is None:
        return None
    q = best_q
    # Step 3: class allocation (largest remaining need first)
    n = np.zeros(K, dtype=int)
    M = np.zeros((C, K), dtype=np.int8)
    for c in rng.permutation(C):
        g = np.maximum(q - n, 0)
        order = np.lexsort((rng.random(K), -g))
        chosen = order[: p[c]]
        M[c, chosen] = 1
        n[chosen] += 1
    return M, p, q


def predi(n_classes: int, n_sites: int, prevalence: float, disparity: float, seed, *,
          max_attempts: int = 50, q_tries: int = 200, disparity_tol: float = 0.25) -> PreDiResult:
    """PreDi (``001_`` Algorithm 1): class-site assignment with target prevalence and disparity.

    1. ``p_c = 1`` for every class, then random classes (with ``p_c < K``) are incremented until
       ``sum_c p_c = A = round(C p*)`` — so the realised mean prevalence is exact whenever
       ``C p*`` is an integer (all 20 configurations of the paper with ``C = 36``).
    2. ``q_k`` ~ ``mu + sigma* z`` with ``z`` standardised to mean 0 and population std 1,
       rounded, clipped to ``[max(1, #classes on every site), C]`` and adjusted by ±1 steps to
       sum to ``A``; the best of ``q_tries`` draws (std closest to ``sigma*``) is kept.
    3. Classes in random order go to the ``p_c`` sites with the largest remaining need
       ``max(q_k - n_k, 0)`` (ties broken at random).

    The realised disparity is the population std of the sites' class counts ``n_k``. Class
    counts are integers, so when ``K`` does not divide ``A`` the smallest reachable disparity is
    that of the most even split (``sqrt(r (K - r)) / K`` with ``r = A mod K``: 0.5 for the paper's
    ``sigma* = 0`` rows, where ``A / K = 31.5, 22.5, 13.5``); the target is raised to that floor.
    The whole draw is repeated (at most ``max_attempts`` times) until ``|sigma - sigma*| <= disparity_tol``.

    Raises:
        ValueError: infeasible targets (``p*`` outside ``[1, K]``, ``sigma*`` < 0) or no draw
            within tolerance after ``max_attempts``.
    """
    check_finite_number(n_classes, "n_classes", low=1, integer=True)
    check_finite_number(n_sites, "n_sites", low=1, integer=True)
    C, K = int(n_classes), int(n_sites)
    check_finite_number(prevalence, "prevalence", low=1.0, high=float(K))
    check_finite_number(disparity, "disparity", low=0.0)
    rng = as_rng(seed)
    A = int(round(C * prevalence))
    r = A % K
    sigma_floor = float(np.sqrt(r * (K - r)) / K)  # most even integer split of A over K sites
    target = max(float(disparity), sigma_floor)
    best = None
    for attempt in range(1, int(max_attempts) + 1):
        out = _predi_once(C, K, A, float(disparity), rng, int(q_tries))
        if out is None:
            continue
        M, p, q = out
        nk = M.sum(axis=0)
        err = abs(nk.std() - target)
        if best is None or err < best[0]:
            best = (err, M, p, q, attempt)
        if err <= disparity_tol:
            break
    if best is None or best[0] > disparity_tol:
        got = "no feasible draw" if best is None else f"best disparity {best[1].sum(axis=0).std():.3f}"
        raise ValueError(
            f"PreDi could not reach disparity {target} (tolerance {disparity_tol}) with C={C} classes, K={K} sites, "
            f"prevalence {prevalence} after {max_attempts} attempts ({got})."
        )
    err, M, p, q, attempt = best
    return PreDiResult(assignment=M, class_prevalence=M.sum(axis=1), prevalence=float(M.sum(axis=1).mean()),
                       disparity=float(M.sum(axis=0).std()), targets=(float(prevalence), float(disparity)),
                       target_counts=q, attempts=attempt)


def predi_partition(labels, assignment, seed, *, samples_per_cell: int | None = 50) -> list[np.ndarray]:
    """``001_`` Algorithm 1 line 11: give each (class, site) cell ``s`` distinct images.

    With ``samples_per_cell=None`` each class's images are split evenly among its sites.

    Raises:
        ValueError: a class has fewer than ``s * p_c`` images.
    """
    y = np.asarray(labels)
    M = np.asarray(assignment)
    C, K = M.shape
    rng = as_rng(seed)
    parts: list[list[int]] = [[] for _ in range(K)]
    for c in range(C):
        holders = np.flatnonzero(M[c])
        if holders.size == 0:
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        if samples_per_cell is None:
            chunks = np.array_split(idx, holders.size)
        else:
            need = int(samples_per_cell) * holders.size
            if idx.size < need:
                raise ValueError(f"class {c} has {idx.size} images but PreDi needs {samples_per_cell} x {holders.size} = {need}.")
            chunks = np.split(idx[:need], holders.size)
        for k, ch in zip(holders, chunks):
            parts[k].extend(ch.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


# ----------------------------------------------------------------------------- 004_ Appendix D

def label_volume_federation(volumes, n_sites: int) -> list[np.ndarray]:
    """Order subjects by label volume (smallest first) and cut into ``n_sites`` contiguous sites.

    Site ``k`` holds the ``k``-th block of the ordering, so site sizes differ by at most one and
    the last site holds the largest lesions (ties keep input order: mergesort).
    """
    v = np.asarray(volumes, dtype=np.float64)
    if v.ndim != 1 or v.size == 0 or not np.isfinite(v).all():
        raise ValueError(f"volumes should be a non-empty finite 1-D array, got shape {v.shape}.")
    n_sites = check_sites(n_sites, v.size, "subjects")
    order = np.argsort(v, kind="mergesort")
    return [np.asarray(part, dtype=np.int64) for part in np.array_split(order, n_sites)]


# --------------------------------------------------------------------------------------------- patients and sources

def group_units(groups) -> tuple[np.ndarray, list[np.ndarray]]:
    """The patients of a pool as partition units: ``(first, members)`` — per patient (in order of first appearance)
    the index of its first image and the indices of all its images. A partition of the units (by the first image's
    label) expanded with :func:`expand_units` splits a pool by patient, never by image."""
    first: dict = {}
    members: list[list[int]] = []
    for i, g in enumerate(groups):
        if g not in first:
            first[g] = len(members)
            members.append([])
        members[first[g]].append(i)
    return np.asarray([m[0] for m in members], dtype=np.int64), [np.asarray(m, dtype=np.int64) for m in members]


def expand_units(parts, members) -> list[np.ndarray]:
    """Unit indices per site -> image indices per site (:func:`group_units`)."""
    return [np.concatenate([members[u] for u in p]).astype(np.int64) if len(p) else np.zeros(0, dtype=np.int64)
            for p in parts]


def natural_partition(sites, groups, seed, *, split: dict | None = None, holdout=(),
                      holdout_sites: dict | None = None) -> tuple[list, list, dict, list]:
    """A site per source (``003_``/``004_``'s real federations: a hospital or scanner is a site).

    Args:
        sites: each image's source name.
        groups: each image's patient (:func:`group_units`).
        split: ``{source: n}``: deal that source's patients over ``n`` sites ``<source>-1..n`` of about equal image
            counts (seeded; a patient's images stay together).
        holdout: sources held out of training as unseen sites ``unseen-<source>``.
        holdout_sites: ``{source: k}``: of a source split into ``n > k`` sites, the last ``k`` are held out as
            ``unseen-<source>-1..k``; its other sites train, so a newcomer's own source has a cluster to compare with.

    Returns:
        ``(names, parts, source_of, unseen)``: site names, image indices per site, site -> source, the held-out
        sites' names.

    Raises:
        ValueError: a split or held-out source that is not in the data (the sources are listed), or a split into
            more sites than the source has patients.
    """
    rng = as_rng(seed)
    split = dict(split or {})
    held_sites = dict(holdout_sites or {})
    order = list(dict.fromkeys(sites))  # sources in order of first appearance
    unknown = sorted((set(split) | set(holdout) | set(held_sites)) - set(order))
    if unknown:
        raise ValueError(f"federation: source(s) {unknown} are not in the data; its sources are {order}")
    for src, k in held_sites.items():
        if src in holdout or not 1 <= int(k) < int(split.get(src, 1)):
            raise ValueError(f"federation.holdout_sites: {src!r} can hold out 1 to n - 1 of the n sites it is split into "
                             f"(federation.split_sources: {split.get(src, 1)}), not {k}"
                             + (" — it is held out whole (holdout_sources)" if src in holdout else ""))
    names, parts, source_of, unseen = [], [], {}, []
    sites = np.asarray(sites)
    for src in order:
        idx = np.flatnonzero(sites == src)
        n = int(split.get(src, 1))
        if src in holdout or n <= 1:
            name = f"unseen-{src}" if src in holdout else src
            names.append(name)
            parts.append(idx)
            source_of[name] = src
            if src in holdout:
                unseen.append(name)
            continue
        _, members = group_units([groups[i] for i in idx])
        if n > len(members):
            raise ValueError(f"federation.split_sources: {src!r} has {len(members)} patients, too few for {n} sites")
        load = np.zeros(n, dtype=np.int64)
        own: list[list[int]] = [[] for _ in range(n)]
        for u in rng.permutation(len(members)):  # each patient to the site with the fewest images so far
            k = int(np.argmin(load))
            own[k].append(u)
            load[k] += members[u].size
        kept = n - int(held_sites.get(src, 0))
        for k in range(n):
            name = f"{src}-{k + 1}" if k < kept else f"unseen-{src}-{k - kept + 1}"
            names.append(name)
            parts.append(np.sort(idx[np.concatenate([members[u] for u in own[k]])]))
            source_of[name] = src
            if k >= kept:
                unseen.append(name)
    return names, parts, source_of, unseen
