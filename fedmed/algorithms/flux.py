"""Flux descriptors, test-time assignment and the clustering start rule (``003_``).

Fenoglio et al., *Flux: Efficient Descriptor-Driven Clustered Federated Learning under
Arbitrary Distribution Shifts*. Appendix C.1 gives four steps:

* **S1** :func:`latent_bounds` (site) / :func:`merge_bounds` (server): element-wise min/max of
  the latents of the current global model; only two z-vectors leave a site.
* **S2** :func:`shared_pca`: every party draws the same 200 points uniformly from the global box
  with a shared seed and fits the same rank-``l`` PCA (``l = 10``).
* **S3** :func:`flux_descriptor`: moments of the projected latents — marginal mean and spread and
  the same per class, ``d = [mu_x, s_x, mu_1, s_1, ..., mu_U, s_U]`` (Eq. 7), length ``2(U+1)l``.
  The label-free sub-vector ``d' = [mu_x, s_x]`` (Eq. 5) is what an unlabeled site sends.
* **S4** optional Laplace DP: ``b_i = Delta_i / epsilon`` with ``Delta_i <= Range(g_i) / n``.

Readings where the paper is ambiguous (documented and tested):

* *Second moment.* Eq. 7 writes ``Sigma``, but §C.1.4 counts ``2(U+1)l`` floats ("mean and
  (diagonal) covariance"), §C.1.1/C.2 bound the sensitivity of "means and standard deviations",
  and F.6.4 calls them "standard deviation descriptors". fedmed sends the per-component
  **standard deviation** (``second_moment="std"``, default); then, for diagonal Gaussians,
  ``||d1 - d2||^2 = ||mu1 - mu2||^2 + ||s1 - s2||^2`` *is* the squared 2-Wasserstein distance
  of Proposition C.1. ``second_moment="var"`` sends variances instead.
* *Absent classes.* A class with no sample at a site (or fewer than ``k_min``) contributes zeros to
  its slot (``absent="minus_one"``: the official code's -1 fill, also for a one-sample class).
* *Range(g_i)* for DP: the range of projected coordinate ``j`` over the global box,
  ``sum_i |V_ji| (m+_i - m-_i)`` — data independent, so the noise scale leaks nothing. Latents
  are clipped to the box before projection so the bound holds for late-joining sites too.
* *Eq. 14.* ``dA/dr`` at round ``r`` is ``A(r) - A(r-1)``; rounds are 1-based.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedmed.core.validation import check_finite_number

__all__ = [
    "FluxDescriptor",
    "SharedPCA",
    "assign_nearest",
    "cluster_centroids",
    "descriptor_length",
    "flux_descriptor",
    "latent_bounds",
    "merge_bounds",
    "shared_pca",
    "should_start_clustering",
]


def _check_latents(latents, site: str) -> np.ndarray:
    z = np.asarray(latents, dtype=np.float64)
    if z.ndim != 2:
        raise ValueError(f"{site}: latents should be (n, z), got shape {z.shape}.")
    if z.shape[0] == 0:
        raise ValueError(f"{site}: no samples, so no latent statistics can be computed.")
    if not np.isfinite(z).all():
        rows = np.flatnonzero(~np.isfinite(z).all(axis=1))
        raise ValueError(f"{site}: latents contain NaN or inf in {rows.size} of {z.shape[0]} samples "
                         f"(first at sample {int(rows[0])}).")
    return z


def latent_bounds(latents, site: str = "site") -> tuple[np.ndarray, np.ndarray]:
    """S1 at a site: element-wise (min, max) of its (n, z) latents."""
    z = _check_latents(latents, site)
    return z.min(axis=0), z.max(axis=0)


def merge_bounds(bounds) -> tuple[np.ndarray, np.ndarray]:
    """S1 at the server: coordinate-wise min of the minima and max of the maxima."""
    bounds = list(bounds)
    if not bounds:
        raise ValueError("merge_bounds needs the bounds of at least one site.")
    lo = np.min(np.stack([np.asarray(b[0], dtype=np.float64) for b in bounds]), axis=0)
    hi = np.max(np.stack([np.asarray(b[1], dtype=np.float64) for b in bounds]), axis=0)
    return lo, hi


def one_blas_thread():
    """A context in which numpy's BLAS / LAPACK run one thread: the same result bits whatever the process's thread
    pool (#88: the demo's Flux descriptors differed in the last digits between two processes)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


@dataclass(frozen=True)
class SharedPCA:
    """The shared projector ``g: R^z -> R^l`` of step S2 and the box it was fitted on."""

    mean: np.ndarray  # (z,)
    components: np.ndarray  # (l, z), orthonormal rows
    lo: np.ndarray  # (z,)
    hi: np.ndarray  # (z,)

    @property
    def n_components(self) -> int:
        return int(self.components.shape[0])

    def project(self, latents) -> np.ndarray:
        z = np.clip(np.asarray(latents, dtype=np.float64), self.lo, self.hi)
        with one_blas_thread():  # the same bits in every process (#88)
            return (z - self.mean) @ self.components.T

    def coordinate_range(self) -> np.ndarray:
        """(l,) range of each projected coordinate over the box (the DP sensitivity numerator)."""
        return np.abs(self.components) @ (self.hi - self.lo)


def shared_pca(lo, hi, *, n_components: int = 10, n_points: int = 200, seed: int = 0) -> SharedPCA:
    """S2: PCA fitted on ``n_points`` uniform samples of the box ``[lo, hi]`` drawn with ``seed``.

    Every party calling this with the same bounds and seed gets the same projector. Component
    signs are fixed (largest-magnitude loading positive) so the result does not depend on the
    LAPACK build.

    Raises:
        ValueError: ``n_components`` larger than the latent dimension or the number of points.
    """
    lo = np.asarray(lo, dtype=np.float64).ravel()
    hi = np.asarray(hi, dtype=np.float64).ravel()
    if lo.shape != hi.shape or (hi < lo).any():
        raise ValueError(f"bounds should be two (z,) vectors with lo <= hi, got shapes {lo.shape}, {hi.shape}.")
    check_finite_number(n_components, "n_components", low=1, integer=True)
    check_finite_number(n_points, "n_points", low=2, integer=True)
    if n_components > min(lo.size, n_points):
        raise ValueError(f"n_components should be <= min(latent dim {lo.size}, n_points {n_points}), "
                         f"got {n_components}.")
    rng = np.random.default_rng(seed)
    pts = rng.uniform(lo, hi, size=(int(n_points), lo.size))
    mean = pts.mean(axis=0)
    with one_blas_thread():  # a multi-threaded LAPACK's rounding depends on its threads: every party the same bits
        _, _, vt = np.linalg.svd(pts - mean, full_matrices=False)
    comps = vt[: int(n_components)]
    signs = np.sign(comps[np.arange(comps.shape[0]), np.argmax(np.abs(comps), axis=1)])
    signs[signs == 0] = 1.0
    return SharedPCA(mean=mean, components=comps * signs[:, None], lo=lo, hi=hi)


def descriptor_length(n_classes: int, n_components: int = 10) -> int:
    """``L = 2 (U + 1) l`` (§C.1.4)."""
    return 2 * (int(n_classes) + 1) * int(n_components)


@dataclass
class FluxDescriptor:
    """A site's descriptor ``d`` (Eq. 7), its label-free part ``d'`` (Eq. 5) and diagnostics."""

    full: np.ndarray | None  # (2(U+1)l,), None for a label-free (test-time) descriptor
    label_free: np.ndarray  # (2l,)
    n_samples: int
    warnings: list[str]


def _moments(x: np.ndarray, second: str) -> tuple[np.ndarray, np.ndarray]:
    mu = x.mean(axis=0)
    var = x.var(axis=0) if x.shape[0] > 1 else np.zeros(x.shape[1])
    return mu, (np.sqrt(var) if second == "std" else var)


def _class_moments(proj: np.ndarray, labels, n_classes, k_min: int, absent: str, second_moment: str, site: str,
                   parts: list, counts: list) -> list:
    """S3's class-conditional moments appended to ``parts`` (their sample counts to ``counts``): a class of fewer than
    ``k_min`` samples (or fewer than 2 under ``absent="minus_one"``) is sent as absent; returns the classes withheld
    for ``k_min``."""
    if n_classes is None:
        raise ValueError("n_classes is required when labels are given.")
    check_finite_number(n_classes, "n_classes", low=1, integer=True)
    y = np.asarray(labels)
    if y.shape != (proj.shape[0],):
        raise ValueError(f"{site}: labels should be ({proj.shape[0]},), got shape {y.shape}.")
    if y.size and (y.min() < 0 or y.max() >= n_classes):
        raise ValueError(f"{site}: labels should lie in [0, {n_classes}), got range [{y.min()}, {y.max()}].")
    l = proj.shape[1]
    fill = 0.0 if absent == "zeros" else -1.0
    withheld = []
    for u in range(int(n_classes)):
        sel = proj[y == u]
        if 0 < sel.shape[0] < k_min:
            withheld.append(u)
        if sel.shape[0] < max(k_min, 1) or (absent == "minus_one" and sel.shape[0] < 2):
            parts += [np.full(l, fill), np.full(l, fill)]
            counts += [0, 0]
        else:
            mu_u, s_u = _moments(sel, second_moment)
            parts += [mu_u, s_u]
            counts += [sel.shape[0], sel.shape[0]]
    return withheld


def flux_descriptor(latents, pca: SharedPCA, labels=None, *, n_classes: int | None = None,
                    second_moment: str = "std", dp_epsilon: float | None = None,
                    rng: np.random.Generator | None = None, site: str = "site", k_min: int = 1,
                    absent: str = "zeros") -> FluxDescriptor:
    """S3 (+ optional S4): the descriptor of one site's latents.

    Args:
        latents: (n, z) final-hidden-layer activations of the current global model.
        pca: the shared projector from :func:`shared_pca`.
        labels: (n,) integer labels in ``[0, n_classes)``; ``None`` for a label-free descriptor.
        n_classes: ``U``; required with labels.
        second_moment: ``"std"`` (default) or ``"var"`` — see the module notes.
        dp_epsilon: Laplace-mechanism budget; ``None`` disables S4.
        rng: generator for the DP noise (required when ``dp_epsilon`` is set).
        k_min: minimum group size: a class with fewer samples is sent as absent (its moments would
            describe fewer than ``k_min`` patients); the site needs ``k_min`` samples in all.
        absent: what an absent class's slot holds: ``"zeros"`` (fedmed) or ``"minus_one"`` (the
            official code's -1 fill).

    Returns:
        :class:`FluxDescriptor`. ``warnings`` notes e.g. fewer samples than the ``l`` PCA
        dimensions (moments still computed, but poorly estimated).

    Raises:
        ValueError: NaN/inf latents, no samples, labels out of range, bad options.
    """
    if second_moment not in ("std", "var"):
        raise ValueError(f"second_moment should be 'std' or 'var', got {second_moment!r}.")
    if absent not in ("zeros", "minus_one"):
        raise ValueError(f"absent should be 'zeros' or 'minus_one', got {absent!r}.")
    z = _check_latents(latents, site)
    if z.shape[0] < k_min:
        raise ValueError(f"{site}: {z.shape[0]} samples < k_min={k_min}; no descriptor can be sent.")
    if z.shape[1] != pca.mean.size:
        raise ValueError(f"{site}: latents have dimension {z.shape[1]} but the shared PCA expects {pca.mean.size}.")
    proj = pca.project(z)
    l = pca.n_components
    warnings = []
    if z.shape[0] < l:
        warnings.append(f"{site}: {z.shape[0]} samples < {l} descriptor dimensions; moments are poorly estimated.")
    mu, s = _moments(proj, second_moment)
    parts = [mu, s]
    counts = [z.shape[0], z.shape[0]]
    full = None
    if labels is not None:
        withheld = _class_moments(proj, labels, n_classes, k_min, absent, second_moment, site, parts, counts)
        if withheld:
            warnings.append(f"{site}: class(es) {withheld} sent as absent (fewer than k_min={k_min} samples)")
    vec = np.concatenate(parts)
    if dp_epsilon is not None:
        check_finite_number(dp_epsilon, "dp_epsilon", low=0.0, low_inclusive=False)
        if rng is None:
            raise ValueError("rng (a numpy Generator) is required for DP noise.")
        rng_range = pca.coordinate_range()
        scale = np.concatenate([
            (rng_range / max(c, 1)) / dp_epsilon if c > 0 else np.zeros(l) for c in counts
        ])
        vec = vec + rng.laplace(0.0, 1.0, size=vec.size) * scale
    label_free = vec[: 2 * l].copy()
    if labels is not None:
        full = vec
    return FluxDescriptor(full=full, label_free=label_free, n_samples=int(z.shape[0]), warnings=warnings)


def cluster_centroids(descriptors, labels) -> np.ndarray:
    """Algorithm 1 line 11: ``gamma_m`` = mean descriptor (usually ``d'``) of cluster m."""
    X = np.asarray(descriptors, dtype=np.float64)
    lab = np.asarray(labels)
    if X.ndim != 2 or lab.shape != (X.shape[0],):
        raise ValueError(f"descriptors (K, L) and labels (K,) expected, got {X.shape} and {lab.shape}.")
    return np.stack([X[lab == m].mean(axis=0) for m in range(int(lab.max()) + 1)])


def assign_nearest(descriptor, centroids) -> int:
    """Eq. 9: the cluster whose centroid is closest (Euclidean) to a label-free descriptor."""
    d = np.asarray(descriptor, dtype=np.float64).ravel()
    C = np.asarray(centroids, dtype=np.float64)
    if C.ndim != 2 or C.shape[1] != d.size:
        raise ValueError(f"centroids should be (M, {d.size}), got shape {C.shape}.")
    if not np.isfinite(d).all():
        raise ValueError("descriptor contains NaN or inf; it cannot be assigned.")
    return int(np.argmin(np.linalg.norm(C - d, axis=1)))


def should_start_clustering(accuracies, total_rounds: int, *, threshold: float = 0.06, rule: str = "paper") -> bool:
    """Eq. 14: start clustering at round ``r = len(accuracies)`` (1-based) when ``r >= 3`` and
    either the smallest accuracy gain ``A(r') - A(r'-1)`` over the gains considered is below ``T``,
    or ``r >= 0.8 R``.

    ``rule="paper"`` considers the gains of rounds ``3 <= r' <= r`` (Eq. 14's ``min_{r' in [3, r]}``);
    ``rule="official"`` also counts the round-2 gain ``A(2) - A(1)``, as the authors' code does
    (docs/readings.md: the two differ whenever round 2 gained less than ``T`` and later rounds did not).

    Args:
        accuracies: global-model accuracy after rounds 1..r (fractions, as in ``T = 0.06``).
        total_rounds: ``R``.
        threshold: ``T`` (0.06 in the paper).
    """
    if rule not in ("paper", "official"):
        raise ValueError(f"rule should be 'paper' or 'official', got {rule!r}.")
    acc = [float(a) for a in accuracies]
    r = len(acc)
    check_finite_number(total_rounds, "total_rounds", low=1, integer=True)
    if r < 3:
        return False
    first = 3 if rule == "paper" else 2
    gains = [acc[k - 1] - acc[k - 2] for k in range(first, r + 1)]
    return bool(min(gains) < threshold or r >= 0.8 * total_rounds)
