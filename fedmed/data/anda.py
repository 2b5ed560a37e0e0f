"""ANDA (``003_`` §5, Flux's benchmark): a federation whose sites differ by a planted shift — of features (a per-group
image transform), of labels (a per-group class subset) or of both — at a chosen level, the groups known."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedmed.core.validation import check_finite_number
from fedmed.data.partition import as_rng, check_sites

__all__ = ["ANDA_SHIFTS", "SiteShift", "anda_federation", "apply_anda_transform"]

ANDA_SHIFTS = ("feature", "label", "p_y_given_x", "p_x_given_y", "quantity")
_ROTATIONS = {1: [0, 180], 2: [0, 120, 240], 3: [0, 90, 180, 270], 4: [0, 72, 144, 216, 288]}
_COLORS = ["red", "blue", "green"]


@dataclass
class SiteShift:
    """One site of an ANDA-style federation: its samples, its group and its transform."""

    indices: np.ndarray
    group: int
    rotation: int = 0  # degrees, whole-site (feature shift)
    color: str | None = None  # whole-site colour (feature shift)
    keep_classes: list[int] | None = None  # label shift
    label_map: dict[int, int] = field(default_factory=dict)  # P(Y|X): original -> new label
    class_rotation: dict[int, int] = field(default_factory=dict)  # P(X|Y): class -> degrees

    def to_json(self) -> dict:
        return {"indices": self.indices.tolist(), "group": self.group, "rotation": self.rotation, "color": self.color,
                "keep_classes": self.keep_classes, "label_map": {str(k): v for k, v in self.label_map.items()},
                "class_rotation": {str(k): v for k, v in self.class_rotation.items()}}


def _groups_for_sites(n_sites, n_groups, rng):
    g = np.arange(n_sites) % n_groups
    return rng.permutation(g)


def _iid(sites: list, n: int, rng) -> None:
    """The ``n`` samples dealt IID over the sites."""
    for s, part in zip(sites, np.array_split(rng.permutation(n), len(sites))):
        s.indices = np.sort(part)


def _feature_shift(sites: list, y: np.ndarray, classes: list, rng, level: int, n_groups: int, group_of: np.ndarray,
                   quantity_alpha: float) -> None:
    """One (rotation, colour) pattern per group; samples IID."""
    rots = _ROTATIONS[(int(level) - 1) % 4 + 1]
    cols = [None] if level <= 4 else _COLORS
    patterns = [(r, c) for r in rots for c in cols]
    if n_groups > len(patterns):
        raise ValueError(f"feature shift level {level} has {len(patterns)} patterns, fewer than n_groups={n_groups}.")
    chosen = [patterns[i] for i in rng.choice(len(patterns), size=int(n_groups), replace=False)]
    for s in sites:
        s.rotation, s.color = chosen[s.group]
    _iid(sites, y.size, rng)


def _label_shift(sites: list, y: np.ndarray, classes: list, rng, level: int, n_groups: int, group_of: np.ndarray,
                 quantity_alpha: float) -> None:
    """Each group keeps ``U - level + 1`` classes; each class split over the sites that keep it."""
    U = len(classes)
    keep = max(1, U - int(level) + 1)
    subsets: list[list[int]] = []
    tries = 0
    while len(subsets) < n_groups:
        tries += 1
        cand = sorted(rng.choice(classes, size=keep, replace=False).tolist())
        if cand not in subsets or tries > 100:
            subsets.append(cand)
    if len({tuple(s) for s in subsets}) < n_groups:
        raise ValueError(f"label shift level {level} keeps {keep} of {U} classes: too few distinct subsets for {n_groups} groups.")
    for s in sites:
        s.keep_classes = subsets[s.group]
    for c in classes:
        holders = [k for k, s in enumerate(sites) if c in s.keep_classes]
        if not holders:
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        for k, ch in zip(holders, np.array_split(idx, len(holders))):
            sites[k].indices = np.concatenate([sites[k].indices, ch])
    for s in sites:
        s.indices = np.sort(s.indices.astype(np.int64))


def _swap_shift(sites: list, y: np.ndarray, classes: list, rng, level: int, n_groups: int, group_of: np.ndarray,
                quantity_alpha: float) -> None:
    """P(Y|X): a swap pool of classes permuted differently per group; samples IID."""
    U = len(classes)
    pool_size = min(U, max(2, int(level)))
    pool = sorted(rng.choice(classes, size=pool_size, replace=False).tolist())
    perms = [list(pool)]  # group 0 keeps the original labels
    tries = 0
    while len(perms) < n_groups and tries < 1000:
        tries += 1
        cand = rng.permutation(pool).tolist()
        if cand not in perms:
            perms.append(cand)
    if len(perms) < n_groups:
        raise ValueError(f"a swap pool of {pool_size} classes has too few permutations for {n_groups} groups.")
    for s in sites:
        s.label_map = {int(a): int(b) for a, b in zip(pool, perms[s.group]) if a != b}
    _iid(sites, y.size, rng)


def _rotation_shift(sites: list, y: np.ndarray, classes: list, rng, level: int, n_groups: int, group_of: np.ndarray,
                    quantity_alpha: float) -> None:
    """P(X|Y): some classes rotated by a per-group angle; samples IID."""
    U = len(classes)
    n_aug = min(U, int(level))
    aug = sorted(rng.choice(classes, size=n_aug, replace=False).tolist())
    maps: list[dict] = []
    tries = 0
    while len(maps) < n_groups and tries < 1000:
        tries += 1
        cand = {int(c): int(rng.choice([0, 90, 180, 270])) for c in aug}
        if cand not in maps:
            maps.append(cand)
    if len(maps) < n_groups:
        raise ValueError(f"{n_aug} augmented classes give too few distinct rotations for {n_groups} groups.")
    for s in sites:
        s.class_rotation = {c: r for c, r in maps[s.group].items() if r}
    _iid(sites, y.size, rng)


def _quantity_shift(sites: list, y: np.ndarray, classes: list, rng, level: int, n_groups: int, group_of: np.ndarray,
                    quantity_alpha: float) -> None:
    """Groups differ only in size (group sizes ~ Dir(quantity_alpha))."""
    share = rng.dirichlet(np.full(int(n_groups), float(quantity_alpha)))
    site_w = np.array([share[s.group] / max(1, int((group_of == s.group).sum())) for s in sites])
    raw = site_w / site_w.sum() * y.size
    sizes = np.maximum(np.floor(raw).astype(int), 1)
    while sizes.sum() > y.size:
        sizes[np.argmax(sizes)] -= 1
    sizes[np.argmax(raw - sizes)] += y.size - sizes.sum()
    for s, part in zip(sites, np.split(rng.permutation(y.size), np.cumsum(sizes)[:-1])):
        s.indices = np.sort(part)


def anda_federation(labels, n_sites: int, shift: str, seed, *, level: int = 3, n_groups: int = 2,
                    quantity_alpha: float = 0.5) -> list[SiteShift]:
    """An ANDA-style federation with a known group per site (``003_`` Appendix B.1, Table 9).

    ``n_groups`` distinct distributions are drawn; sites are dealt round-robin to groups and the
    order shuffled, so every group has ``n_sites // n_groups`` or one more sites. The ``level``
    follows Table 9:

    * ``feature``: one (rotation, colour) pattern per group from the level's rotation set
      (levels 1-4: {0,180}, {0,120,240}, {0,90,180,270}, {0,72,...,288} with original colours;
      levels 5-8 the same rotations with colours {red, blue, green}); samples IID over sites.
    * ``label``: each group keeps ``U - level + 1`` classes (at least 1), chosen per group;
      each class's samples are split over the sites that keep it.
    * ``p_y_given_x``: a swap pool of ``max(2, level)`` classes (at most U), permuted differently
      per group; samples IID.
    * ``p_x_given_y``: ``min(level, U)`` classes are rotated by a per-group angle from
      {0, 90, 180, 270} (groups differ in at least one class); samples IID.
    * ``quantity``: groups differ only in size (group sizes ~ Dir(quantity_alpha)).

    Returns:
        one :class:`SiteShift` per site.
    """
    if shift not in ANDA_SHIFTS:
        raise ValueError(f"shift should be one of {ANDA_SHIFTS}, got {shift!r}.")
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ValueError(f"labels should be a non-empty 1-D array, got shape {y.shape}.")
    n_sites = check_sites(n_sites, y.size)
    check_finite_number(level, "level", low=1, high=8, integer=True)
    check_finite_number(n_groups, "n_groups", low=1, integer=True)
    if n_groups > n_sites:
        raise ValueError(f"n_groups ({n_groups}) should not exceed n_sites ({n_sites}).")
    rng = as_rng(seed)
    classes = np.unique(y).tolist()
    group_of = _groups_for_sites(n_sites, int(n_groups), rng)
    sites = [SiteShift(indices=np.empty(0, dtype=np.int64), group=int(g)) for g in group_of]

    _SHIFTS[shift](sites, y, classes, rng, int(level), int(n_groups), group_of, quantity_alpha)
    return sites


def apply_anda_transform(image: np.ndarray, label: int, spec: SiteShift, *, colour: str = "channel") -> tuple[np.ndarray, int]:
    """Apply a site's shift to one image (H, W) or (H, W, C) uint8/float, and map its label.

    Rotation is about the centre with the same canvas size (scipy ``ndimage.rotate``,
    ``reshape=False``). Colour (docs/readings.md): ``colour="channel"`` (fedmed's default) keeps the
    grayscale intensity in the site's RGB channel and zeros the others; ``colour="anda"`` is ANDA's
    code: the site's channel is set to full intensity and the gray image is kept in the other two.
    """
    from scipy import ndimage

    if colour not in ("channel", "anda"):
        raise ValueError(f"colour should be 'channel' or 'anda', got {colour!r}.")
    img = np.asarray(image)
    lab = int(label)
    angle = spec.rotation + spec.class_rotation.get(lab, 0)
    if angle % 360:
        k = angle // 90 if angle % 90 == 0 else None
        if k is not None:
            img = np.rot90(img, k=int(k) % 4, axes=(0, 1)).copy()
        else:
            img = ndimage.rotate(img, angle, axes=(1, 0), reshape=False, order=1, mode="constant")
    if spec.color is not None:
        gray = img.mean(axis=2).astype(img.dtype) if img.ndim == 3 else img
        ch = {"red": 0, "green": 1, "blue": 2}[spec.color]
        if colour == "channel":
            rgb = np.zeros(gray.shape + (3,), dtype=img.dtype)
            rgb[..., ch] = gray
        else:
            full = 255 if np.issubdtype(img.dtype, np.integer) else 1.0
            rgb = np.repeat(gray[..., None], 3, axis=2)
            rgb[..., ch] = full
        img = rgb
    return img, spec.label_map.get(lab, lab)


_SHIFTS = {"feature": _feature_shift, "label": _label_shift, "p_y_given_x": _swap_shift,
           "p_x_given_y": _rotation_shift, "quantity": _quantity_shift}
