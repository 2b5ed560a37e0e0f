"""Do these sites differ? A calibrated answer from split-half signatures (issue #57).

A threshold on a distance between sites (Auto-K's K = 1 test, a silhouette level) is chosen on some dataset and says
nothing about how often it cries wolf on another. Here the answer is a **permutation test** whose false-alarm rate is
``alpha`` by construction, on any data:

* each site splits its own (training) images at random into two halves of at least ``k_min`` images and sends one
  signature per half (an aggregate, as any signature: e.g. the mean embedding, FECFL's label-free signature);
* the statistic ``T`` is the mean distance between halves of *different* sites minus the mean distance between the two
  halves of the *same* site (each squared distance between half means scaled by ``1 / (1/n_a + 1/n_b)``, so that a
  small site's noisier halves weigh as a large site's): sites whose data differ have ``T`` well above 0; IID sites have ``T`` near 0 (a site's
  two halves are as far apart as two halves of different sites);
* under "the sites do not differ" (their images are exchangeable: IID splits of one source), which site a half came
  from carries no information, so re-pairing the halves at random gives ``T``'s null distribution;
  ``p = (1 + #{T_perm >= T}) / (1 + n_perm)`` (the permutation p-value, never 0), and the sites differ when
  ``p < alpha``.

The scaled distances have the same expectation under the null whatever the halves' sizes, not the same distribution;
the test's rate on IID federations of real images with the natural federation's site sizes is measured
(``benchmarks/sites_differ.py``, docs/readings.md "Do the sites differ?") rather than assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ALPHA", "DifferTest", "differ_test", "halves_test", "split_halves"]

ALPHA = 0.05


def split_halves(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A site's random split of its ``n`` items into two halves (indices; the first gets the odd one)."""
    idx = rng.permutation(int(n))
    h = (int(n) + 1) // 2
    return np.sort(idx[:h]), np.sort(idx[h:])


@dataclass(frozen=True)
class DifferTest:
    """The answer: the statistic, its permutation p-value, and whether the sites differ at ``alpha``."""

    statistic: float
    p: float
    alpha: float
    n_sites: int
    n_perm: int

    @property
    def differ(self) -> bool:
        return self.p < self.alpha

    def sentence(self) -> str:
        if self.differ:
            return (f"the {self.n_sites} sites differ (split-half permutation test, p = {self.p:.3g} < alpha "
                    f"{self.alpha:g})")
        return (f"no evidence that the {self.n_sites} sites differ (split-half permutation test, p = {self.p:.3g} >= "
                f"alpha {self.alpha:g})")


def _statistic(D: np.ndarray, owner: np.ndarray) -> float:
    same = owner[:, None] == owner[None, :]
    off = ~np.eye(len(owner), dtype=bool)
    return float(D[off & ~same].mean() - D[off & same].mean())


def differ_test(D, owner, *, sizes=None, n_perm: int = 999, alpha: float = ALPHA,
                rng: np.random.Generator | None = None) -> DifferTest:
    """The split-half permutation test (see the module notes).

    Args:
        D: ``(M, M)`` symmetric distances between the half-signatures; with ``sizes``, **squared Euclidean distances
            between mean vectors** (a mean embedding per half).
        owner: ``(M,)`` the site of each half; every site has exactly two halves.
        sizes: ``(M,)`` the items behind each half's mean. Each squared distance is divided by ``1/n_a + 1/n_b``, its
            expectation's factor under "no difference" (``E ||m_a - m_b||^2 = tr(Sigma) (1/n_a + 1/n_b)`` for means of
            IID vectors), so that halves of small and large sites weigh alike; without it a federation of unequal
            sites is called different far above ``alpha`` (``tests/test_differ.py``).
        n_perm: random re-pairings of the halves (the p-value's resolution is ``1 / (n_perm + 1)``).
        rng: the permutations' generator (``np.random.default_rng(seed)``).
    """
    D = np.asarray(D, dtype=np.float64)
    owner = np.asarray(owner)
    if D.ndim != 2 or D.shape[0] != D.shape[1] or D.shape[0] != owner.shape[0]:
        raise ValueError(f"differ_test: D should be (M, M) with one owner per half, got D {D.shape}, owner "
                         f"{owner.shape}")
    sites, counts = np.unique(owner, return_counts=True)
    if (counts != 2).any() or len(sites) < 2:
        raise ValueError(f"differ_test: every site needs exactly two halves and at least two sites, got "
                         f"{dict(zip(sites.tolist(), counts.tolist()))}")
    if not 0 < alpha < 1 or n_perm < 1:
        raise ValueError(f"differ_test: alpha in (0, 1) and n_perm >= 1, got {alpha}, {n_perm}")
    rng = rng if rng is not None else np.random.default_rng(0)
    if sizes is not None:
        n = np.asarray(sizes, dtype=np.float64)
        if n.shape != owner.shape or (n <= 0).any():
            raise ValueError(f"differ_test: sizes should be one positive count per half, got {n.tolist()}")
        D = D / (1.0 / n[:, None] + 1.0 / n[None, :])
    t = _statistic(D, owner)
    pairs = np.repeat(np.arange(len(sites)), 2)
    hits = sum(_statistic(D, pairs[rng.permutation(len(owner))]) >= t for _ in range(int(n_perm)))
    return DifferTest(statistic=t, p=(1 + hits) / (1 + int(n_perm)), alpha=float(alpha), n_sites=len(sites),
                      n_perm=int(n_perm))


def halves_test(halves, sizes, *, n_perm: int = 999, alpha: float = ALPHA,
                rng: np.random.Generator | None = None) -> DifferTest:
    """:func:`differ_test` on what the sites send: per site its two half means (``halves``, a list of pairs of
    vectors) and the halves' sizes (``sizes``, a list of pairs of counts): squared Euclidean distances between all the
    half means, scaled by the sizes."""
    means = np.asarray([v for pair in halves for v in pair], dtype=np.float64)
    D = ((means[:, None] - means[None, :]) ** 2).sum(axis=-1)
    return differ_test(D, np.repeat(np.arange(len(halves)), 2), sizes=[n for pair in sizes for n in pair],
                       n_perm=n_perm, alpha=alpha, rng=rng)
