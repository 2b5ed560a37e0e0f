"""A site's images on its device (issue #54): decoded once, kept there, reused by every round and task.

On a GPU, copying and flipping every batch on the CPU (and reading the loss back every step) leaves the card idle
much of the time. :class:`DeviceImages` keeps one split on the site's device — 8-bit images as ``uint8`` (a quarter
of float32's memory; turned back into exactly the CPU path's float32 values on the device) — or, when it does not fit
the site's budget, in pinned host memory, each batch copied on a side stream while the previous one computes.
:func:`epoch_draws` takes every random draw of one epoch from the task's CPU generator in the very order
:func:`fedmed.nn.train.augment_batch` takes them and sends them to the device in one copy: the device path trains on
the same batches as the CPU path for a seed, on any device (tested on the CPU against today's path).

For 3D segmentation, :class:`DeviceVolumes` keeps a site's training volumes on its GPU and cuts each step's patches
there (:meth:`DeviceVolumes.patches`: tumour- or background-centred crops, flips, intensity scale and shift — the
augmentation of ``004_`` App. A that MONAI's transforms do on the CPU, in loader processes), with every random draw
taken on the host from a seeded generator, so nothing is read back from the device.

A site sets its budget in its settings (``local/fedmed_site.json``: ``"device_data_gb": 12``; ``0`` keeps every split
in pinned host memory); by default half the device memory free when the site first places its data.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_FREE_FRACTION", "DeviceImages", "DeviceVolumes", "EpochDraws", "augment_on_device",
           "default_budget", "epoch_draws", "exact_uint8"]

import numpy as np

DEFAULT_FREE_FRACTION = 0.5  # of the device memory free at first use: the default budget of a site's resident data


def exact_uint8(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` (float32 in [0, 1]) as uint8 codes ``k`` when every value is exactly ``float32(k) / 255`` (what decoding
    an 8-bit image gives), else ``None`` (the split stays float32)."""
    if x.dtype != torch.float32 or x.numel() == 0:
        return None
    q = torch.round(x * 255)
    if bool(((q < 0) | (q > 255)).any()):
        return None
    u8 = q.to(torch.uint8)
    return u8 if torch.equal(u8.float() / 255, x) else None


def default_budget(device: torch.device) -> int:
    """Bytes a site may keep resident on ``device`` by default: :data:`DEFAULT_FREE_FRACTION` of its free memory
    (unbounded on the CPU, where the data already is)."""
    if device.type != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * DEFAULT_FREE_FRACTION)


class DeviceImages:
    """One split's images, ``(N, C, H, W)``, for training or scoring on ``device``.

    Args:
        x: the split as the site decoded it (float32 in [0, 1], on the CPU): it stays the source of truth.
        device: where batches are wanted.
        budget: bytes this split may occupy on ``device``; above it the split stays in pinned host memory (on a GPU)
            and ``resident`` is False.
    """

    def __init__(self, x: torch.Tensor, device, budget: int | None = None):
        self.device = torch.device(device)
        self.shape = tuple(x.shape)
        u8 = exact_uint8(x)
        src = u8 if u8 is not None else x.float().contiguous()
        self.uint8 = u8 is not None
        self.nbytes = src.numel() * src.element_size()
        budget = default_budget(self.device) if budget is None else int(budget)
        self.resident = self.nbytes <= budget
        self._stream = None
        if self.resident:
            self.data = src.to(self.device)
        elif self.device.type == "cuda":  # pinned host memory: each batch copied asynchronously on a side stream
            self.data = src.pin_memory()
            self._stream = torch.cuda.Stream(self.device)
            self._bufs: list = [None, None]  # two pinned batch buffers, used in turn
            self._done: list = [None, None]  # the event after the last copy out of each
            self._turn = 1
        else:
            self.data = src

    def __len__(self) -> int:
        return self.shape[0]

    def _float(self, t: torch.Tensor) -> torch.Tensor:
        return t.float().div_(255) if self.uint8 else t

    def take(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The images ``idx`` (a long tensor; on the device for resident data, on the CPU otherwise; ``None``: all)
        as float32 in [0, 1] on the device — the values the CPU path has."""
        if self.resident:
            return self._float(self.data if idx is None else self.data.index_select(0, idx.to(self.device)))
        if self._stream is None:
            rows = self.data if idx is None else self.data.index_select(0, idx.cpu())
            return self._float(rows.to(self.device))
        idx = torch.arange(len(self)) if idx is None else idx.cpu()
        k = self._turn = 1 - self._turn
        if self._done[k] is not None:
            self._done[k].synchronize()  # the copy that last read this buffer has finished
        if self._bufs[k] is None or self._bufs[k].shape[0] < idx.numel():
            self._bufs[k] = torch.empty((idx.numel(), *self.data.shape[1:]), dtype=self.data.dtype).pin_memory()
        rows = self._bufs[k][:idx.numel()]
        torch.index_select(self.data, 0, idx, out=rows)  # gathered straight into pinned memory
        with torch.cuda.stream(self._stream):
            out = rows.to(self.device, non_blocking=True)
            self._done[k] = torch.cuda.Event()
            self._done[k].record(self._stream)
        cur = torch.cuda.current_stream(self.device)
        cur.wait_stream(self._stream)
        out.record_stream(cur)
        return self._float(out)

    def batches(self, batch_size: int):
        """Every image in order, ``batch_size`` at a time (scoring)."""
        for s in range(0, len(self), batch_size):
            idx = torch.arange(s, min(s + batch_size, len(self)))
            yield self.take(idx.to(self.device) if self.resident else idx)

    def describe(self) -> str:
        where = self.device if self.resident else "pinned host memory"
        return f"{self.shape[0]} images ({'uint8' if self.uint8 else 'float32'}, {self.nbytes / 2**20:.1f} MiB) on {where}"


class EpochDraws:
    """One epoch's random draws, taken on the CPU in :func:`fedmed.nn.train.augment_batch`'s order: the shuffled
    ``order``, and per batch (``starts``) its flips and crop offsets; ``on(device)`` copies them in one transfer."""

    def __init__(self, order, starts, flips, dy, dx):
        self.order, self.starts, self.flips, self.dy, self.dx = order, starts, flips, dy, dx

    def on(self, device) -> "EpochDraws":
        device = torch.device(device)
        if device.type == "cpu":
            return self
        n = self.order.numel()
        packed = torch.cat([self.order, self.flips.long(), self.dy, self.dx])
        if device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(device, non_blocking=True)
        o, f, dy, dx = packed.split([n, self.flips.numel(), self.dy.numel(), self.dx.numel()])
        return EpochDraws(o, self.starts, f.bool(), dy, dx)

    def batch(self, s: int, batch_size: int):
        """The order's slice at ``s``, and that batch's flips and crop offsets (offsets count from the epoch's start
        of drawn batches, kept in ``starts``)."""
        j = self.starts[s]
        b = min(batch_size, self.order.numel() - s)
        sl = slice(j, j + b)
        crop = (self.dy[sl], self.dx[sl]) if self.dy.numel() else None
        return self.order[s:s + b], (self.flips[sl] if self.flips.numel() else None), crop


def epoch_draws(n: int, batch_size: int, mode: str, generator: torch.Generator | None) -> EpochDraws:
    """The random draws of one epoch of :func:`fedmed.nn.train.train_local` over ``n`` images, in its order: the
    permutation, then per batch that trains (a trailing batch of one is skipped when n >= 2) ``n_b`` flip draws and,
    for ``flip_crop``, ``n_b`` row and ``n_b`` column offsets."""
    if mode not in ("none", "flip", "flip_crop"):
        raise ValueError(f"augment should be 'none', 'flip' or 'flip_crop', got {mode!r}.")
    order = torch.randperm(n, generator=generator)
    starts, flips, dys, dxs, j = {}, [], [], [], 0
    for s in range(0, n, batch_size):
        b = min(batch_size, n - s)
        if b < 2 and n >= 2:
            continue
        starts[s] = j
        j += b
        if mode == "none":
            continue
        flips.append(torch.rand(b, generator=generator) < 0.5)
        if mode == "flip_crop":
            dys.append(torch.randint(0, 9, (b,), generator=generator))
            dxs.append(torch.randint(0, 9, (b,), generator=generator))
    cat = (lambda ts, dt: torch.cat(ts) if ts else torch.zeros(0, dtype=dt))
    return EpochDraws(order, starts, cat(flips, torch.bool), cat(dys, torch.long), cat(dxs, torch.long))


def augment_on_device(x: torch.Tensor, flips: torch.Tensor | None, crop=None, pad: int = 4) -> torch.Tensor:
    """:func:`fedmed.nn.train.augment_batch` with its draws given (on ``x``'s device): flip where ``flips``, then
    crop each image of the ``pad``-padded batch at its offsets (one gather, no per-image loop)."""
    if flips is not None:
        x = torch.where(flips[:, None, None, None], x.flip(-1), x)
    if crop is not None:
        dy, dx = crop
        n, c, h, w = x.shape
        xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
        ar_h = torch.arange(h, device=x.device)
        ar_w = torch.arange(w, device=x.device)
        rows = (dy[:, None] + ar_h)[:, None, :, None]
        cols = (dx[:, None] + ar_w)[:, None, None, :]
        x = xp[torch.arange(n, device=x.device)[:, None, None, None], torch.arange(c, device=x.device)[None, :, None, None],
               rows, cols]
    return x


class DeviceVolumes:
    """A segmentation site's training cases (``image`` (C, D, H, W) float, ``label`` (K, D, H, W) 0/1) kept on
    ``device``, each padded (zeros) to at least ``roi``, with the flat indices of its foreground voxels (any label
    channel set) and background voxels kept on the host: a patch's centre is drawn there, its crop is a slice on the
    device."""

    def __init__(self, cases, device, roi):
        self.device = torch.device(device)
        self.roi = tuple(int(r) for r in roi)
        self.images, self.labels, self.fg, self.bg, self.shapes = [], [], [], [], []
        self.nbytes = 0
        for i, c in enumerate(cases):
            img, lab = np.asarray(c["image"], dtype=np.float32), np.asarray(c["label"])
            if img.ndim != 4 or lab.ndim != 4 or img.shape[1:] != lab.shape[1:]:
                raise ValueError(f"DeviceVolumes: case {i} ({c.get('name', 'unnamed')}): image {img.shape} and label "
                                 f"{lab.shape} should be (C, D, H, W) and (K, D, H, W) of one grid")
            pad = [(0, 0)] + [((r - d) // 2, r - d - (r - d) // 2) if d < r else (0, 0)
                              for d, r in zip(img.shape[1:], self.roi)]
            if any(p != (0, 0) for p in pad):
                img, lab = np.pad(img, pad), np.pad(lab, pad)
            fg = lab.any(axis=0).ravel()
            self.fg.append(np.flatnonzero(fg).astype(np.int64))
            self.bg.append(np.flatnonzero(~fg).astype(np.int64))
            self.shapes.append(img.shape[1:])
            self.images.append(torch.from_numpy(np.ascontiguousarray(img)).to(self.device))
            self.labels.append(torch.from_numpy(np.ascontiguousarray(lab.astype(np.uint8))).to(self.device))
            self.nbytes += img.nbytes + lab.size

    def __len__(self) -> int:
        return len(self.images)

    @staticmethod
    def nbytes_of(cases) -> int:
        """The device bytes :class:`DeviceVolumes` would take for ``cases`` (images float32, labels uint8)."""
        return sum(int(np.prod(np.shape(c["image"]))) * 4 + int(np.prod(np.shape(c["label"]))) for c in cases)

    def centre(self, i: int, rng: np.random.Generator, pos_fraction: float) -> tuple[tuple, bool]:
        """A patch centre in case ``i`` (a voxel index triple) and whether it was drawn from the foreground
        (probability ``pos_fraction``; from the other set when one of them is empty)."""
        fg, bg = self.fg[i], self.bg[i]
        pos = rng.random() < pos_fraction
        if not len(fg):
            pos = False
        elif not len(bg):
            pos = True
        pool = fg if pos else bg
        flat = int(pool[rng.integers(len(pool))])
        return tuple(int(v) for v in np.unravel_index(flat, self.shapes[i])), pos

    def patches(self, i: int, n: int, pos_fraction: float, rng: np.random.Generator):
        """``n`` augmented ``roi`` patches of case ``i`` as a batch (image (n, C, *roi) float32, label (n, K, *roi)
        float32) on the device: each centred on a foreground voxel with probability ``pos_fraction`` (else on a
        background voxel), the crop moved inside the volume, flipped along each axis with p = 0.5, its intensity
        scaled by 1 + U(-0.1, 0.1) and shifted by U(-0.1, 0.1) (MONAI's RandCropByPosNegLabeld, RandFlipd,
        RandScaleIntensityd(factors=0.1), RandShiftIntensityd(offsets=0.1))."""
        xs, ys = [], []
        img, lab, shape = self.images[i], self.labels[i], self.shapes[i]
        for _ in range(n):
            c, _ = self.centre(i, rng, pos_fraction)
            start = [min(max(ci - r // 2, 0), d - r) for ci, r, d in zip(c, self.roi, shape)]
            sl = tuple(slice(s0, s0 + r) for s0, r in zip(start, self.roi))
            x, y = img[(slice(None), *sl)], lab[(slice(None), *sl)]
            flips = [ax + 1 for ax in range(3) if rng.random() < 0.5]
            if flips:
                x, y = torch.flip(x, flips), torch.flip(y, flips)
            scale, shift = 1.0 + rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1)
            xs.append(x * scale + shift)
            ys.append(y)
        return torch.stack(xs), torch.stack(ys).float()
