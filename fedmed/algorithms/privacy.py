"""What may leave a site: minimum group size and differential privacy for every signature kind.

Two rules (``PrivacyConfig``; docs/privacy.md gives the reasoning and the measured cost):

* **Minimum group size** ``k_min``: a per-class or per-group statistic leaves a site only if it
  aggregates at least ``k_min`` samples. Smaller classes are withheld from the signature (the site's
  log and the reply's ``notes`` say which and why; the server sees the class as absent). This is
  an aggregation rule, not a differential-privacy guarantee.
* **Differential privacy** (``dp_epsilon`` set): every signature is released through a mechanism
  with a stated sensitivity, on embeddings first clipped to L2 norm ``clip`` (the bound that
  makes the sensitivity finite). Neighbouring datasets differ in one sample's image (replace-one);
  class counts, which a changed label would move, are released with their own Laplace noise.

  ===================  ==========================================================  =====================
  signature            mechanism                                                   sensitivity
  ===================  ==========================================================  =====================
  FMCL prototype       analytic Gaussian (Balle & Wang 2018) on each class mean    L2: 2 clip / n_c
  FMCL class counts    Laplace                                                     L1: 2
  FECFL mean           analytic Gaussian on the site mean                          L2: 2 clip / n
  PACFL basis          Analyze Gauss (Dwork et al. 2014): Gaussian noise on each   Frobenius: 2 clip^2
                       class's d x d second-moment matrix, then its eigenvectors
  004 histograms       Laplace on every bin of every feature (eps split evenly)   L1: 2 per feature
  004 embedding        analytic Gaussian on the centroid of clipped vectors        L2: 2 clip / n
  Flux S1 box          replaced by the public box [0, latent_bound]^z (no data)    none
  Flux S2-S4           the paper's Laplace (fedmed.algorithms.flux, Range(g_i) / n)           per entry
  ===================  ==========================================================  =====================

  A signature made of several releases splits ``dp_epsilon`` evenly over them (basic
  composition), so the whole signature is ``(dp_epsilon, dp_delta)``-DP. The ε spent is recorded
  in every reply (``dp``) and in the run's ``metrics.json``.
"""

from __future__ import annotations

import math

import numpy as np

from fedmed.core.schema import PrivacyConfig

__all__ = ["analytic_gaussian_sigma", "clip_rows", "k_min_consent_note", "private_bounds", "private_histogram", "private_mean",
           "privacy_settings", "signature_payload", "withhold_small", "fmcl_release", "pacfl_release",
           "fecfl_release"]


def privacy_settings(privacy) -> PrivacyConfig:
    """The ``privacy`` section (a dict as a task carries it, or the typed model) with the schema's defaults for what
    it leaves out (:class:`fedmed.core.schema.PrivacyConfig`)."""
    if isinstance(privacy, PrivacyConfig):
        return privacy
    return PrivacyConfig.model_validate(dict(privacy or {}), context={"at_site": True})


def k_min_consent_note(privacy) -> str | None:
    """The line a run states wherever it is read (its record, the console, the report) when the config accepted
    ``k_min < 2`` (``privacy.accept_k_min_below_2``); None otherwise. ``privacy``: the config's section (a dict or
    the typed model)."""
    k = privacy_settings(privacy).k_min
    if k >= 2:
        return None
    return (f"WARNING privacy.k_min={k} < 2, accepted by privacy.accept_k_min_below_2: statistics of single samples "
            f"(one image's update, loss or embedding) may leave a site")


def clip_rows(X, clip: float) -> np.ndarray:
    """Scale every row of ``X`` to L2 norm at most ``clip``."""
    X = np.asarray(X, dtype=np.float64)
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    return X * np.minimum(1.0, clip / np.maximum(norms, 1e-12))


def analytic_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """Smallest sigma for which adding N(0, sigma^2) to a query of L2 ``sensitivity`` is (epsilon, delta)-DP.

    The exact condition of the analytic Gaussian mechanism (Balle & Wang 2018, Theorem 8):
    ``Phi(D/(2s) - e s/D) - exp(e) Phi(-D/(2s) - e s/D) <= delta``, solved by bisection. Valid for every
    epsilon > 0 (the classical ``sqrt(2 ln(1.25/delta)) D / e`` holds only for epsilon < 1).
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon should be a finite number > 0, got {epsilon}.")
    if not 0 < delta < 1:
        raise ValueError(f"delta should lie in (0, 1), got {delta}.")
    if sensitivity <= 0:
        return 0.0
    from scipy.special import ndtr  # not at import: fedmed.config loads this module

    def leak(s):
        a = sensitivity / (2 * s)
        b = epsilon * s / sensitivity
        return ndtr(a - b) - math.exp(epsilon) * ndtr(-a - b)

    lo, hi = 1e-12, sensitivity
    while leak(hi) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if leak(mid) <= delta else (mid, hi)
    return hi


def private_mean(X, *, clip: float, epsilon: float | None, delta: float, rng) -> tuple[np.ndarray, dict]:
    """Mean of the rows of ``X`` clipped to L2 ``clip``; with ``epsilon``, plus analytic Gaussian noise of L2
    sensitivity ``2 clip / n`` (replace-one). Returns (mean, mechanism record)."""
    Xc = clip_rows(X, clip)
    mean = Xc.mean(axis=0)
    if epsilon is None:
        return mean, {}
    sens = 2.0 * clip / Xc.shape[0]
    sigma = analytic_gaussian_sigma(sens, epsilon, delta)
    return mean + rng.normal(0.0, sigma, size=mean.shape), {"mechanism": "gaussian", "epsilon": epsilon,
                                                            "delta": delta, "l2_sensitivity": sens, "sigma": sigma}


def private_histogram(counts, *, epsilon: float | None, rng) -> tuple[np.ndarray, dict]:
    """Histogram counts plus Laplace noise of scale 2 / epsilon (replace-one moves one count down, one up:
    L1 sensitivity 2); clipped at 0."""
    h = np.asarray(counts, dtype=np.float64)
    if epsilon is None:
        return h, {}
    b = 2.0 / epsilon
    return np.maximum(h + rng.laplace(0.0, b, size=h.shape), 0.0), {"mechanism": "laplace", "epsilon": epsilon,
                                                                    "l1_sensitivity": 2.0, "scale": b}


def withhold_small(y, k_min: int) -> tuple[np.ndarray, list[int], list[int]]:
    """(mask of samples whose class has >= k_min samples, kept classes, withheld classes)."""
    classes, counts = np.unique(np.asarray(y), return_counts=True)
    kept = [int(c) for c, n in zip(classes, counts) if n >= k_min]
    dropped = [int(c) for c, n in zip(classes, counts) if n < k_min]
    return np.isin(y, kept), kept, dropped


def _withheld_note(site, dropped, y, k_min, what):
    """The note a site logs and sends when classes are withheld: which classes and the rule, never their counts (a
    count below k_min is itself a statistic of fewer than k_min samples)."""
    if not dropped:
        return []
    return [f"{site}: class(es) {dropped} withheld from the {what} (each has fewer than k_min={k_min} samples); "
            f"the server treats them as absent"]


def _pacfl_basis(X, n_basis, *, clip, epsilon, delta, rng):
    """Leading eigenvectors of a class's second-moment matrix X^T X (the left singular vectors of PACFL's
    features x samples matrix); with DP, Analyze Gauss: symmetric Gaussian noise of Frobenius sensitivity
    2 clip^2 is added to X^T X first."""
    if epsilon is None:
        U, S, _ = np.linalg.svd(X.T, full_matrices=False)
        k = min(int(n_basis), int((S > S.max() * 1e-12).sum()) if S.size else 0)
        return U[:, :k], {}
    Xc = clip_rows(X, clip)
    M = Xc.T @ Xc
    sens = 2.0 * clip ** 2
    sigma = analytic_gaussian_sigma(sens, epsilon, delta)
    E = rng.normal(0.0, sigma, size=M.shape)
    M = M + np.triu(E) + np.triu(E, 1).T  # symmetric noise, each entry drawn once
    w, V = np.linalg.eigh(M)
    order = np.argsort(w)[::-1][: int(n_basis)]
    return V[:, order], {"mechanism": "analyze_gauss", "epsilon": epsilon, "delta": delta,
                         "frobenius_sensitivity": sens, "sigma": sigma}


def signature_payload(kind: str, feats, y, *, k_min: int, privacy: dict, rng=None, site: str = "site",
                      **options) -> dict:
    """What a site sends as its one-shot clustering signature of ``kind`` (a registered
    :class:`~fedmed.algorithms.signatures.SignatureKind`: FMCL, PACFL, FECFL, a plugin's), with the kind's own
    ``options`` (PACFL: ``n_basis``).

    A per-class kind's classes with fewer than ``k_min`` samples are withheld; a label-free kind's one statistic needs
    ``k_min`` samples in all. With ``privacy["dp_epsilon"]`` each release gets the kind's mechanism.

    Returns:
        the reply's meta: the signature arrays, ``withheld_classes``, ``notes`` (for both logs) and ``dp``.

    Raises:
        ValueError: nothing is left to send (every class below ``k_min``), naming the site.
    """
    from fedmed.algorithms.signatures import signature_kind, signature_to_wire

    sk = signature_kind(kind)
    feats = np.asarray(feats, dtype=np.float64)
    y = np.asarray(y)
    p = privacy_settings(privacy)
    eps, delta, clip = p.dp_epsilon, p.dp_delta, p.clip
    rng = rng if rng is not None else np.random.default_rng(0)
    out: dict = {"dp": {"epsilon": eps, "delta": delta if eps else None, "clip": clip if eps else None}}
    mech = dict(epsilon=eps, delta=delta, clip=clip, rng=rng, **options)
    if not sk.per_class:
        if y.size < k_min:
            raise ValueError(f"{site}: {y.size} training samples < k_min={k_min}; the site's {kind} signature "
                             f"cannot be sent")
        sig, releases = sk.release(feats, None, [], **mech)
        dropped, notes = [], []
    else:
        keep, kept, dropped = withhold_small(y, k_min)
        notes = _withheld_note(site, dropped, y, k_min, f"{kind} signature")
        if not kept:
            raise ValueError(f"{site}: every class has fewer than k_min={k_min} samples; no signature can be sent")
        sig, releases = sk.release(feats[keep], y[keep], kept, **mech)
    out.update(signature_to_wire(sig), withheld_classes=dropped, notes=notes)
    out["dp"].update(releases=releases)
    return out


def fmcl_release(fk, yk, kept, *, epsilon, delta, clip, rng):
    """FMCL's class prototypes (``000_``): per-class means and counts; under DP one Gaussian release per class mean
    and Laplace counts, the budget split evenly."""
    from fedmed.algorithms.fmcl import ClassSignature, class_signature

    if epsilon is None:
        return class_signature(fk, yk), []
    share = epsilon / (len(kept) + 1)  # one Gaussian release per class mean + the Laplace counts
    means, releases = [], []
    for c in kept:
        m, rec = private_mean(fk[yk == c], clip=clip, epsilon=share, delta=delta / len(kept), rng=rng)
        means.append(m)
        releases.append({"class": c, **rec})
    counts, rec = private_histogram([int((yk == c).sum()) for c in kept], epsilon=share, rng=rng)
    releases.append({"counts": True, **rec})
    return ClassSignature(np.asarray(kept), np.stack(means), np.maximum(counts, 1e-3)), releases


def pacfl_release(fk, yk, kept, *, epsilon, delta, clip, rng, n_basis: int = 3):
    """PACFL's class subspaces: ``n_basis`` leading singular vectors per class; under DP Analyze Gauss per class."""
    from fedmed.algorithms.signatures import PACFLSignature

    share = epsilon / len(kept) if epsilon else None
    bases, releases = [], []
    for c in kept:
        b, rec = _pacfl_basis(fk[yk == c], n_basis, clip=clip, epsilon=share, delta=delta / len(kept), rng=rng)
        bases.append(b)
        if rec:
            releases.append({"class": c, **rec})
    return PACFLSignature(np.concatenate(bases, axis=1), np.asarray(kept)), releases


def fecfl_release(feats, _y, _kept, *, epsilon, delta, clip, rng):
    """FECFL's site mean embedding; under DP one Gaussian release."""
    from fedmed.algorithms.signatures import FECFLSignature

    mean, rec = private_mean(feats, clip=clip, epsilon=epsilon, delta=delta, rng=rng) if epsilon else (feats.mean(0), {})
    return FECFLSignature(mean), [rec] if rec else []


def private_bounds(z, *, k_min: int, privacy: dict, rng=None, site: str = "site",
                   box: str = "elementwise") -> tuple[np.ndarray, np.ndarray, str]:
    """Flux S1 at a site, with nothing that is one sample's value.

    Without DP: per latent coordinate, the mean of the ``k_min`` smallest values (lo) and of the ``k_min``
    largest (hi) — each an aggregate of ``k_min`` samples (``k_min = 1`` gives the paper's exact min/max).
    ``box="scalar"`` (the official code): one box ``[0, 1.02 max]`` for every coordinate, with the max
    taken the same way. With DP on, no data leaves: the public box ``[0, latent_bound]^z``
    (``privacy.latent_bound`` of the config, :class:`fedmed.core.schema.PrivacyConfig`) is returned and latents are
    clipped to it.

    Raises:
        ValueError: fewer than ``k_min`` samples.
    """
    from fedmed.algorithms.flux import _check_latents

    z = _check_latents(z, site)
    if privacy_settings(privacy).dp_epsilon is not None:
        bound = privacy_settings(privacy).latent_bound
        return np.zeros(z.shape[1]), np.full(z.shape[1], bound), (
            f"{site}: DP on, S1 sends no data-dependent bounds (public box [0, {bound}])")
    k = int(k_min)
    if z.shape[0] < k:
        raise ValueError(f"{site}: {z.shape[0]} samples < k_min={k}; latent bounds cannot be sent")
    srt = np.sort(z, axis=0)
    lo, hi = srt[:k].mean(axis=0), srt[-k:].mean(axis=0)
    if box == "scalar":
        top = float(hi.max()) * 1.02
        return np.zeros(z.shape[1]), np.full(z.shape[1], top), ""
    return lo, hi, ""
