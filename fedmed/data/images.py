"""Datasets as MONAI-style per-site datalists.

A site's datalist is one JSON file::

    {"site": "site-1", "training": [{"image": "a.png", "label": 0}, ...],
     "validation": [...],   # held out of training: model/round selection, never reported as a result
     "test": [...]}         # the site's local test split: what the tables report

Image paths are absolute or relative to the site's data root (by default the datalist's folder;
see :mod:`fedmed.site.settings`).

plus one ``dataset.json`` beside the site files with ``n_classes``, ``class_names`` and the
source. :func:`discover` reads the formats in ``../shared/data`` — PNG/JPEG class folders (BUSI,
Imagenette; ``*_mask*`` files skipped), MedMNIST ``.npz`` (all splits pooled) and the builtin
scikit-learn digits — and :func:`write_site_datalists` writes a federation from a partition.
Array sources (npz, digits) and shifted images (ANDA) are written as PNGs next to the datalists,
so every site reads plain image files.

Only file paths and labels are in a datalist; images never leave the site that holds them.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["DataError", "ImagePool", "check_readable", "conversion_note", "decode_image", "discover", "is_dicom", "load_images", "near_duplicates", "unreadable_images"]

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm"}


CT_HU_RANGE = (-1024.0, 3071.0)  # the 12-bit Hounsfield range: air to dense bone and metal


def is_regular_file(path) -> bool:
    """A regular file (not a FIFO, a device, a socket or a folder: reading those blocks or never ends)."""
    import os
    import stat

    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def is_dicom(path) -> bool:
    """A DICOM file: ``.dcm`` / ``.dicom``, or the ``DICM`` magic at byte 128 (files often have no extension)."""
    p = Path(path)
    if p.suffix.lower() in (".dcm", ".dicom"):
        return True
    if not is_regular_file(p):
        return False
    try:
        with p.open("rb") as fh:
            fh.seek(128)
            return fh.read(4) == b"DICM"
    except OSError:
        return False


def _dicom_pixels(path, limits=None) -> tuple[np.ndarray, list[str]]:
    """The pixels of a single-frame 2D DICOM file as float64 (modality values: rescale slope/intercept applied;
    MONOCHROME1 inverted so that bright means dense, as MONOCHROME2; colour as RGB) and what was converted. Only
    pixel data and the attributes that say how to read it are touched: no patient identifier is read into a
    message, a log or a report."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(path)
    except InvalidDicomError:
        raise DataError("is not a readable DICOM file") from None
    if "PixelData" not in ds:
        raise DataError("is a DICOM file without pixel data (a report or a structured document?)")
    try:
        frames = int(ds.get("NumberOfFrames", 1) or 1)
    except (TypeError, ValueError):
        raise DataError("has a malformed DICOM header (NumberOfFrames)") from None
    if frames > 1:
        raise DataError(f"is a multi-frame DICOM ({frames} frames); a 2D dataset needs one image per file (a 3D "
                        f"series belongs to a segmentation datalist)")
    try:
        rows, cols = int(ds.get("Rows", 0) or 0), int(ds.get("Columns", 0) or 0)
    except (TypeError, ValueError):
        raise DataError("has a malformed DICOM header (Rows/Columns)") from None
    if limits is not None and rows * cols > limits.max_image_pixels:
        raise DataError(f"has {cols}x{rows} pixels, more than this site decodes (its policy's max_image_pixels="
                        f"{limits.max_image_pixels})")
    check_geometry(cols, rows)
    try:
        a = ds.pixel_array
    except Exception as e:  # a compressed transfer syntax without a decoder here, or broken pixel data
        ts = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
        raise DataError(f"has pixel data pydicom cannot decode here ({getattr(ts, 'name', ts)}: "
                        f"{type(e).__name__})") from None
    done = ["DICOM"]
    photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2"))
    if a.ndim == 2:
        from pydicom.pixels import apply_modality_lut

        if "RescaleSlope" in ds or "RescaleIntercept" in ds or "ModalityLUTSequence" in ds:
            try:
                a = apply_modality_lut(a, ds)
            except Exception as e:  # a non-numeric RescaleSlope, a broken LUT: pydicom raises many kinds
                raise DataError(f"has a malformed DICOM header (rescale slope/intercept or modality LUT: "
                                f"{type(e).__name__})") from None
            done.append("DICOM rescale slope/intercept applied")
            if str(ds.get("Modality", "")) == "CT":
                done.append("DICOM CT")
        a = np.asarray(a, dtype=np.float64)
        if photometric == "MONOCHROME1":
            a = a.max() - a
            done.append("DICOM MONOCHROME1 inverted")
    elif a.ndim == 3 and a.shape[-1] == 3:
        a = np.asarray(a, dtype=np.float64)  # pydicom returns YBR as RGB
    else:
        raise DataError(f"has pixel data of shape {a.shape}; a 2D grayscale or RGB image is expected")
    return a, done


class DataError(FedmedError, ValueError):
    """Bad data at a site. ``str(e)`` is for the site's own log and names the file; ``e.public`` (when given) is what
    the site may tell the server: the split and position (``training[17]``) and the kind of problem, no name."""

    def __init__(self, message: str, public: str | None = None):
        super().__init__(message)
        self.public = public


@dataclass
class ImagePool:
    """A pooled labelled image set before it is split into sites."""

    items: list  # file paths (str) or 2-D/3-D uint8 arrays
    labels: np.ndarray
    class_names: list[str]
    source: str
    sites: Optional[list] = None  # each image's source (fedmed.data.sources), None for a single-source pool
    groups: Optional[list] = None  # each image's patient: images of one patient are never split apart
    masks: Optional[list] = None  # each image's mask file (or None), where the source has masks

    @property
    def n_classes(self) -> int:
        return len(self.class_names)

    def subset(self, idx) -> "ImagePool":
        idx = np.asarray(idx, dtype=np.int64)

        def pick(xs):
            return None if xs is None else [xs[i] for i in idx]

        return ImagePool([self.items[i] for i in idx], self.labels[idx], self.class_names, self.source,
                         sites=pick(self.sites), groups=pick(self.groups), masks=pick(self.masks))


def _class_dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir() and any(
        f.suffix.lower() in IMAGE_SUFFIXES for f in d.iterdir() if f.is_file()))


def discover(path: str, *, max_per_class: int | None = None, seed: int = 0) -> ImagePool:
    """Read a labelled image collection.

    Args:
        path: ``builtin:digits``; a MedMNIST-style ``.npz`` (``{train,val,test}_images/labels``);
            or a folder of class folders (possibly one level down, or split folders
            ``train/``, ``val/``, ``test/`` each holding the same class folders).
        max_per_class: keep at most this many images per class (seeded choice).

    Raises:
        DataError: the path does not exist or holds no recognisable images.
    """
    rng = np.random.default_rng(seed)
    if path == "builtin:digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        imgs = (d.images * (255.0 / 16.0)).round().astype(np.uint8)
        pool = ImagePool(list(imgs), d.target.astype(np.int64), [str(c) for c in d.target_names], "sklearn digits")
    else:
        p = Path(path)
        if not p.exists():
            raise DataError(f"{p}: dataset path does not exist")
        if p.is_file() and p.suffix == ".npz":
            try:
                z = np.load(p)
                splits = [s for s in ("train", "val", "test") if f"{s}_images" in z.files]
                if not splits:
                    raise KeyError("no <split>_images arrays")
                imgs = np.concatenate([z[f"{s}_images"] for s in splits])
                labels = np.concatenate([z[f"{s}_labels"].reshape(-1) for s in splits]).astype(np.int64)
            except Exception as e:
                raise DataError(f"{p}: not a MedMNIST-style npz ({type(e).__name__}: {e})") from None
            names = [str(c) for c in range(int(labels.max()) + 1)]
            pool = ImagePool(list(imgs), labels, names, str(p))
        elif p.is_dir():
            roots = [p]
            while len(roots) == 1 and not _class_dirs(roots[0]):
                subs = [d for d in roots[0].iterdir() if d.is_dir()]
                if len(subs) == 1:
                    roots = subs
                elif subs and all(_class_dirs(s) for s in subs):
                    roots = sorted(subs)  # split folders (train/val/...) holding class folders
                else:
                    break
            class_names = sorted({d.name for r in roots for d in _class_dirs(r)})
            if not class_names:
                raise DataError(f"{p}: no class folders with images found")
            items, labels = [], []
            for r in roots:
                for d in _class_dirs(r):
                    for f in sorted(d.iterdir()):
                        if f.suffix.lower() in IMAGE_SUFFIXES and "_mask" not in f.stem:
                            items.append(str(f.resolve()))
                            labels.append(class_names.index(d.name))
            pool = ImagePool(items, np.asarray(labels, dtype=np.int64), class_names, str(p))
        else:
            raise DataError(f"{p}: expected 'builtin:digits', a .npz file or a folder of class folders")
    if max_per_class:
        keep = []
        for c in range(pool.n_classes):
            idx = np.flatnonzero(pool.labels == c)
            keep.extend(rng.choice(idx, size=min(max_per_class, idx.size), replace=False).tolist())
        pool = pool.subset(np.sort(keep))
    return drop_exact_duplicates(pool)


def drop_exact_duplicates(pool: ImagePool) -> ImagePool:
    """``pool`` without the second and later copies of an identical image (same pixels of an array, same bytes of a
    file): written into a federation, copies would land in different splits — a test image that is also trained on
    (a site's first task refuses such a datalist, :func:`check_split_overlap`). Says how many it dropped. PneumoniaMNIST
    holds 8 such copies, BUSI and BreastMNIST one each."""
    import hashlib

    seen: set = set()
    keep = []
    for i, item in enumerate(pool.items):
        if isinstance(item, np.ndarray):
            h = hashlib.sha1(np.ascontiguousarray(item).tobytes() + str(item.shape).encode()).hexdigest()
        else:
            try:
                if not is_regular_file(item):
                    raise OSError("not a regular file")
                h = hashlib.sha1(Path(item).read_bytes()).hexdigest()
            except OSError:  # an unreadable file is named by check_readable
                keep.append(i)
                continue
        if h not in seen:
            seen.add(h)
            keep.append(i)
    if len(keep) == len(pool.items):
        return pool
    print(f"[fedmed] {pool.source}: {len(pool.items) - len(keep)} exact duplicate image(s) dropped from the pool "
          f"(copies would land in different splits: a test image that is also trained on)", flush=True)
    return pool.subset(np.asarray(keep))


def unreadable_images(items) -> list[tuple[str, str]]:
    """``(path, reason)`` of every image file in ``items`` that cannot be read (missing, truncated, not an image,
    several frames); arrays are skipped. PIL's ``verify`` checks a file's structure without decoding it."""
    from PIL import Image

    bad = []
    for item in items:
        if isinstance(item, np.ndarray):
            continue
        try:
            check_input_file(item)
        except FileNotFoundError:
            bad.append((str(item), "not found"))
            continue
        except DataError as e:
            bad.append((str(item), e.public))
            continue
        if is_dicom(item):
            try:
                _dicom_pixels(item)
            except FileNotFoundError:
                bad.append((str(item), "not found"))
            except DataError as e:
                bad.append((str(item), str(e)))
            continue
        try:
            with Image.open(item) as im:
                frames = getattr(im, "n_frames", 1)
                im.verify()
            if frames > 1:
                bad.append((str(item), f"{frames} frames"))
        except FileNotFoundError:
            bad.append((str(item), "not found"))
        except Exception as e:  # PIL raises many kinds for a broken file
            bad.append((str(item), f"corrupt or not an image: {type(e).__name__}"))
    return bad


def check_readable(pool: ImagePool) -> None:
    """Raise before any datalist is written when a file of ``pool`` cannot be read (named, up to five).

    Raises:
        DataError: ``"<n> image file(s) of <source> cannot be read: a.png (corrupt ...), ...; fix or remove them"``.
    """
    bad = unreadable_images(pool.items)
    if bad:
        shown = ", ".join(f"{p} ({why})" for p, why in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise DataError(f"{len(bad)} image file(s) of {pool.source} cannot be read: {shown}; fix or remove them "
                        f"(a datalist lists only files its site can read)")


def save_png(arr: np.ndarray, path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(arr)).save(path)


def read_array(item) -> np.ndarray:
    from PIL import Image

    if isinstance(item, np.ndarray):
        return item
    if is_dicom(item):  # 8-bit by the image's own range, native size (ANDA's transforms work on 8-bit pictures)
        a, _ = _dicom_pixels(item)
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
        return (a * 255).round().astype(np.uint8)
    with Image.open(item) as im:
        return np.asarray(im.convert("RGB") if im.mode not in ("L", "RGB") else im)


SPLITS = ("training", "validation", "test")


def file_problem(path) -> str | None:
    """Why ``path`` is not a file a site can read, in words that name no path (``not found``, ``is a folder``, ``is a
    FIFO``, ``is a symbolic link that leads nowhere or loops``), or None for a regular file."""
    import os
    import stat

    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return "is a symbolic link that leads nowhere" if p.is_symlink() else "not found"
    except OSError as e:  # ELOOP: a link that loops; EACCES: unreadable
        import errno

        return ("is a symbolic link that loops" if e.errno == errno.ELOOP else
                "cannot be opened (no permission)" if e.errno == errno.EACCES else f"cannot be opened ({e.strerror})")
    if stat.S_ISREG(st.st_mode):
        return None
    what = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
        "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket or other special file"
    return f"is {what}, not a regular file"


def check_input_file(path, limits=None, *, public: str = "") -> None:
    """Refuse, before anything reads it, a file a site should not read: not a regular file (a FIFO would block, a
    device such as ``/dev/zero`` reads without end) or larger than ``limits.max_file_bytes``
    (:class:`fedmed.core.policy.ReadLimits`). A missing file raises ``FileNotFoundError``."""
    import os

    from fedmed.core.policy import ReadLimits

    limits = limits or ReadLimits()
    st = os.stat(path)  # a missing file: FileNotFoundError
    what = file_problem(path)
    if what:
        raise DataError(f"{path}: {what}", f"{public} {what}".strip())
    if st.st_size > limits.max_file_bytes:
        raise DataError(f"{path}: {st.st_size} bytes, more than this site reads (max_file_bytes={limits.max_file_bytes})",
                        f"{public} is larger than this site reads (its policy's max_file_bytes)".strip())


WIDE_MODES = {"I;16": "16-bit", "I;16L": "16-bit", "I;16B": "16-bit", "I;16N": "16-bit", "I": "32-bit integer",
              "F": "32-bit float"}


MAX_ASPECT = 20  # an image longer than this many times its width is a strip, not a picture to resize to a square


def check_geometry(w: int, h: int) -> None:
    """An image a classifier can be given: each side at least 2 pixels, at most :data:`MAX_ASPECT`:1 (a 1x1 image
    or a 16000x1 strip resized to a square is interpolation, not the picture)."""
    if min(w, h) < 2:
        raise DataError(f"is {w}x{h} pixels: too small to be an image (each side should be at least 2 pixels)")
    if max(w, h) > MAX_ASPECT * min(w, h):
        raise DataError(f"is {w}x{h} pixels, a {max(w, h) / min(w, h):.0f}:1 strip: resized to a square it would be "
                        f"interpolation, not the picture (at most {MAX_ASPECT}:1)")


def decode_image(path, *, image_size: int, channels: int, limits=None) -> tuple[np.ndarray, list[str]]:
    """One image file as float32 in [0, 1], ``(C, H, W)`` at ``image_size``, and what was converted to get there.

    * 8-bit grayscale / colour: ``/ 255`` (colour to grayscale by PIL's ITU-R 601-2 luma, grayscale to RGB by
      repeating it; a palette image through its palette; an alpha channel dropped).
    * 16-bit, 32-bit integer and float images keep their dynamic range: each image is scaled by its own range,
      ``(v - min) / (max - min)`` (a constant image gives zeros), then resized in floating point. PIL's
      ``convert("L")`` would clip them at 255 (a full-range 16-bit image turns almost white).
    * Any other size: bilinear resize to ``image_size`` x ``image_size``.

    Only a regular file within ``limits`` (:class:`fedmed.core.policy.ReadLimits`: bytes, pixels) is decoded; the pixel
    count is read from the header before any pixel is.

    Raises:
        FileNotFoundError, OSError, ValueError: what PIL raises for a missing or unreadable file.
        DataError: a multi-frame image (a stack or a video is not one image), a special file, a file or an image
            larger than the limits (a decompression bomb).
    """
    from PIL import Image

    from fedmed.core.policy import ReadLimits

    limits = limits or ReadLimits()
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size < 1:
        raise ValueError(f"image_size should be a positive number of pixels, got {image_size!r}")
    if channels not in (1, 3):
        raise ValueError(f"channels should be 1 (grayscale) or 3 (RGB), got {channels!r}")
    try:
        check_input_file(path, limits)
    except DataError as e:
        raise DataError(e.public) from None  # the caller names the file
    done: list[str] = []
    if is_dicom(path):
        return _decode_dicom(path, image_size, channels, limits)
    try:
        im = Image.open(path)
    except Image.DecompressionBombError:
        raise DataError(f"has more pixels than this site decodes (a decompression bomb?; its policy's "
                        f"max_image_pixels={limits.max_image_pixels})") from None
    with im:
        w, h = im.size
        if w * h > limits.max_image_pixels:
            raise DataError(f"has {w}x{h} pixels, more than this site decodes (its policy's max_image_pixels="
                            f"{limits.max_image_pixels})")
        check_geometry(w, h)
        if getattr(im, "n_frames", 1) > 1:
            raise DataError(f"has {im.n_frames} frames; one image per file is expected")
        size = (image_size, image_size)
        if im.size != size:
            done.append(f"resized to {image_size}x{image_size} (bilinear)")
        if im.mode in WIDE_MODES:
            a = np.asarray(im, dtype=np.float64)
            if a.ndim == 3:  # e.g. a multi-channel float TIFF read as one band per channel
                a = a.mean(axis=2)
            if not np.all(np.isfinite(a)):  # one NaN pixel would turn the whole image, then the model, into NaN
                raise DataError("has NaN or infinite pixel values")
            lo, hi = float(a.min()), float(a.max())
            a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
            done.append(f"{WIDE_MODES[im.mode]} ({im.mode}) scaled by each image's own range to [0, 1]")
            f = Image.fromarray(a.astype(np.float32), mode="F").resize(size, Image.BILINEAR)
            arr = np.clip(np.asarray(f, dtype=np.float32), 0.0, 1.0)
            if channels != 1:
                arr = np.repeat(arr[..., None], 3, axis=2)
                done.append("grayscale repeated to 3 channels")
        else:
            mode = "L" if channels == 1 else "RGB"
            if im.mode != mode:
                done.append({("L", "RGB"): "grayscale repeated to 3 channels", ("RGB", "L"): "colour to grayscale (ITU-R "
                             "601-2 luma)", ("RGBA", "L"): "colour to grayscale (ITU-R 601-2 luma), alpha dropped",
                             ("RGBA", "RGB"): "alpha channel dropped", ("LA", "L"): "alpha channel dropped",
                             ("1", "L"): "1-bit to 8-bit"}.get((im.mode, mode), f"{im.mode} converted to {mode}"))
            im = im.convert(mode).resize(size, Image.BILINEAR)
            arr = np.asarray(im, dtype=np.float32) / 255.0
    return (arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)), done


def _decode_dicom(path, image_size: int, channels: int, limits) -> tuple[np.ndarray, list[str]]:
    """A 2D DICOM image as :func:`decode_image` returns it: modality values scaled by the image's own range to
    [0, 1] (as other images wider than 8 bits), resized bilinearly in floating point."""
    from PIL import Image

    a, done = _dicom_pixels(path, limits)
    if not np.all(np.isfinite(a)):
        raise DataError("has NaN or infinite pixel values")
    ct = "DICOM CT" in done
    if ct:
        done.remove("DICOM CT")
    if ct:  # Hounsfield units mean the same at every site: one fixed range, not each image's own
        lo, hi = CT_HU_RANGE
        a = np.clip(a, lo, hi)
        done.append(f"CT Hounsfield units mapped from [{lo}, {hi}] to [0, 1]")
    else:
        lo, hi = float(a.min()), float(a.max())
        done.append("DICOM values scaled by each image's own range to [0, 1]")
    a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
    size = (image_size, image_size)
    if a.ndim == 3 and channels == 1:
        a = a @ np.array([0.299, 0.587, 0.114])
        done.append("colour to grayscale (ITU-R 601-2 luma)")
    planes = [a] if a.ndim == 2 else [a[..., k] for k in range(3)]
    if planes[0].shape != size[::-1]:
        done.append(f"resized to {image_size}x{image_size} (bilinear)")
    planes = [np.asarray(Image.fromarray(p.astype(np.float32), mode="F").resize(size, Image.BILINEAR)) for p in planes]
    arr = np.clip(np.stack(planes), 0.0, 1.0).astype(np.float32)
    if channels != 1 and arr.shape[0] == 1:
        arr = np.repeat(arr, 3, axis=0)
        done.append("grayscale repeated to 3 channels")
    return arr, done


def load_images(entries: Sequence[dict], *, image_size: int, channels: int, site: str = "site",
                display: Callable[[str], str] = str, conversions: set | None = None, split: str = "entries",
                limits=None):
    """Decode, resize and stack a datalist's images (:func:`decode_image`): ``(N, C, H, W)`` float32 in [0, 1],
    labels (N,). ``conversions``, when given, collects what was converted (each kind once).

    Raises:
        DataError: ``"<site>: cannot read image <path> (<reason>)"`` for a missing or corrupt file (``display``
            turns the path into what the site's log shows); its ``public`` is ``"<site>: <split>[<i>]: cannot read
            the image (<reason>)"`` — the position, no name.
    """
    import torch
    from PIL import UnidentifiedImageError

    xs = np.empty((len(entries), channels, image_size, image_size), np.float32)  # filled in place: no second copy
    ys = []
    for i, e in enumerate(entries):
        f = e["image"]
        where = f"{site}: {split}[{i}]:"
        try:
            arr, done = decode_image(f, image_size=image_size, channels=channels, limits=limits)
        except FileNotFoundError:
            raise DataError(f"{where} cannot read image {display(f)} (file not found)",
                            f"{where} cannot read the image (file not found)") from None
        except DataError as err:
            raise DataError(f"{where} image {display(f)} {err}", f"{where} the image {err}") from None
        except (UnidentifiedImageError, OSError, ValueError) as err:
            raise DataError(f"{where} cannot read image {display(f)} (corrupt or not an image: "
                            f"{type(err).__name__})", f"{where} cannot read the image (corrupt or not an image: "
                            f"{type(err).__name__})") from None
        if conversions is not None:
            conversions.update(done)
        xs[i] = arr
        ys.append(int(e["label"]))
    # C-contiguous, as the site cache hands them back: an RGB stack of HWC->CHW views kept a channels-last layout,
    # and a convolution over channels-last memory sums in another order (a cold and a warm cache trained apart)
    return torch.from_numpy(xs), torch.tensor(ys, dtype=torch.long)


def conversion_note(site: str, conversions) -> str:
    """One line saying what a site's image loading converted (empty when nothing was)."""
    if not conversions:
        return ""
    return f"{site}: images converted on loading: " + "; ".join(sorted(conversions))


def near_duplicates(xa, xb, *, threshold: float = 0.98, size: int = 16) -> list[tuple[int, int, float]]:
    """Pairs ``(i, j, r)`` of images ``xa[i]`` and ``xb[j]`` (``(N, C, H, W)`` arrays in [0, 1]) whose ``size`` x
    ``size`` grayscale thumbnails correlate with Pearson r >= ``threshold``: the same picture re-exported, resized,
    re-compressed or slightly shifted in brightness (an exact copy is caught by :func:`check_split_overlap`).
    Blank images (no variation) are never paired. Sorted by r, highest first."""
    import torch

    def thumbs(x):
        x = torch.as_tensor(np.asarray(x), dtype=torch.float32)
        if x.shape[0] == 0:
            return x.new_zeros((0, size * size)), x.new_zeros(0, dtype=torch.bool)
        t = torch.nn.functional.interpolate(x.mean(1, keepdim=True), size=(size, size), mode="area").flatten(1)
        t = t - t.mean(1, keepdim=True)
        norm = t.norm(dim=1, keepdim=True)
        return t / norm.clamp_min(1e-8), norm.squeeze(1) > 1e-6

    ta, oka = thumbs(xa)
    tb, okb = thumbs(xb)
    if not len(ta) or not len(tb):
        return []
    r = ta @ tb.T
    r[~oka] = -1.0
    r[:, ~okb] = -1.0
    hits = (r >= threshold).nonzero().tolist()
    return sorted(((i, j, float(r[i, j])) for i, j in hits), key=lambda t: -t[2])
