"""A site's cache of decoded, resampled data, so a study's later runs skip decoding.

An entry is keyed by the **content** of the files it was made from (SHA-1 of each file's bytes) and by the
preprocessing settings (image size and channels; a 3D case's shape, region and allowed labels) and
:data:`CACHE_VERSION` (bumped when decoding changes): a changed file, another setting or another fedmed decoding
never hits an old entry. Each site has its own folder (``<cache root>/<site>/``); nothing in it is ever sent, and
it is never shared between sites. The cache holds decoded patient images, so it lives in the site's own workspace,
never in the home folder of whoever started the site. The cache root: the site settings' ``cache_dir`` (``false``
turns it off), else ``FEDMED_CACHE_DIR``, else the site's workspace (``fedmed_cache/`` beside its settings file: a
startup kit's ``local/fedmed_cache/``; ``fedmed experiment``: ``<out>/cache/``; ``fedmed_flare.run --env sim``:
``<workspace>/fedmed_cache/``); a site with none of these runs without a cache. ``FEDMED_CACHE=0`` turns it off.
``fedmed cache clear`` empties it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

__all__ = ["CACHE_VERSION", "SiteCache", "cache_root"]

CACHE_VERSION = 1


WORKSPACE_CACHE = "fedmed_cache"  # the folder in a site's workspace (beside its settings file)


def cache_root(configured=None, workspace=None) -> Path | None:
    """The cache root folder (see the module notes): ``configured`` (the settings' ``cache_dir``), else
    ``FEDMED_CACHE_DIR``, else ``<workspace>/fedmed_cache``; ``None`` when caching is off or no place is known."""
    if configured is False or os.environ.get("FEDMED_CACHE", "1").lower() in ("0", "false", "no", "off"):
        return None
    if configured:
        return Path(configured)
    if os.environ.get("FEDMED_CACHE_DIR"):
        return Path(os.environ["FEDMED_CACHE_DIR"])
    return Path(workspace) / WORKSPACE_CACHE if workspace is not None else None


class SiteCache:
    """One site's cache folder. ``key(files, settings)`` names an entry; ``get``/``put`` read and write its arrays
    (and a JSON ``meta``) atomically; ``clear`` empties the folder."""

    def __init__(self, root: Path, site: str):
        self.dir = Path(root) / site
        self._hashes: dict = {}  # (path, size, mtime) -> content hash, within this process
        self.hits = self.misses = 0

    def file_hash(self, path) -> str:
        import stat

        p = Path(path)
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block, a device never ends: decoding refuses it, naming it
            raise OSError(f"{p.name}: not a regular file")
        k = (str(p), st.st_size, st.st_mtime_ns)
        if k not in self._hashes:
            h = hashlib.sha1()
            with p.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            self._hashes[k] = h.hexdigest()
        return self._hashes[k]

    def _content(self, f) -> str:
        p = Path(f)
        if p.is_dir():  # a DICOM series folder: its files' contents, in name order
            return hashlib.sha1("".join(self.file_hash(x) for x in sorted(p.iterdir()) if x.is_file()).encode()
                                ).hexdigest()
        return self.file_hash(p)

    def key(self, files, settings: dict) -> str | None:
        """The entry's name, or ``None`` when a file cannot be read (decoding then reports it, naming the file)."""
        try:
            contents = [self._content(f) for f in files]
        except OSError:
            return None
        doc = json.dumps({"v": CACHE_VERSION, "files": contents, "settings": settings}, sort_keys=True, default=str)
        return hashlib.sha256(doc.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.npz"

    def get(self, key: str | None):
        """``(arrays, meta)`` of the entry, or ``None``."""
        if key is None or not self._path(key).is_file():
            self.misses += key is not None
            return None
        try:
            with np.load(self._path(key), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files if k != "__meta__"}
                meta = json.loads(str(z["__meta__"])) if "__meta__" in z.files else {}
        except Exception:  # a damaged entry (truncated, zero bytes, not a zip: BadZipFile, EOFError, ...) is a miss
            self.misses += 1  # and is rewritten by the put that follows
            return None
        self.hits += 1
        return arrays, meta

    unwritable = ""  # why this cache could not be written (then the site runs uncached; said once)

    def put(self, key: str | None, arrays: dict, meta: dict | None = None) -> None:
        """Write an entry; a cache folder that cannot be written (read-only, full) leaves the site running uncached
        (:attr:`unwritable` says why) instead of failing its task."""
        if key is None or self.unwritable:
            return
        p = self._path(key)
        tmp = p.with_name(f".{p.stem}.{os.getpid()}.tmp.npz")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            np.savez(tmp, __meta__=np.asarray(json.dumps(meta or {})), **arrays)
            tmp.replace(p)
        except OSError as e:
            self.unwritable = f"{type(e).__name__} ({e.strerror or 'cannot write'})"
            try:
                tmp.unlink()
            except OSError:
                pass

    def clear(self) -> int:
        """Remove every entry; the number removed."""
        n = sum(1 for _ in self.dir.rglob("*.npz")) if self.dir.is_dir() else 0
        shutil.rmtree(self.dir, ignore_errors=True)
        return n
