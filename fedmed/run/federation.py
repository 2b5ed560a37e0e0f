"""A federation on disk for one seed: the config's data partitioned into per-site datalists (training, validation and
test splits), and the classes it found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from fedmed.config import ExperimentConfig


def check_classes(exp, found: list[str]) -> None:
    """The classes a config names (``dataset.classes``: a job is built from the config alone) are the dataset's."""
    if exp.dataset.classes and list(exp.dataset.classes) != list(found):
        raise ValueError(f"dataset.classes {list(exp.dataset.classes)} differ from the classes found in "
                         f"{exp.dataset.describe()} {list(found)}")


def prepare_federation(exp: ExperimentConfig, seed: int, out_dir, *, partition: str | None = None) -> Path:
    """Partition the dataset for ``seed`` and write the site datalists into ``out_dir`` (``partition``
    overrides the config's, e.g. ``"iid"`` for the IID reference)."""
    from fedmed.data import partition as P
    from fedmed.data.datalists import write_site_datalists

    exp.check_data_paths()
    fed = exp.federation
    part = partition or fed.partition
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    seg2d = exp.dataset.task == "segmentation" and bool(exp.dataset.sources)  # 2D lesion masks from an index
    if exp.dataset.task == "segmentation" and not seg2d:
        from fedmed.data.seg_federation import discover_subjects, write_seg_federation

        d = exp.dataset
        entries = discover_subjects(d.path, d.modalities, d.label_pattern, d.mask_pattern, d.hemispheres)
        return write_seg_federation(entries, fed.sites, out, partition=part if part in ("iid", "label_volume")
                                    else "label_volume", region=fed.volume_region, test_fraction=fed.test_fraction,
                                    val_fraction=fed.val_fraction, seed=seed, site_names=exp.site_names())
    pool = _image_pool(exp, seed, seg2d)
    rng = np.random.default_rng(seed)
    extra: dict = {"partition": part, "seed": seed}
    if part == "natural":
        names, parts, source_of, unseen = P.natural_partition(pool.sites, pool.groups, rng,
                                                              split=fed.split_sources, holdout=fed.holdout_sources,
                                                              holdout_sites=fed.holdout_sites)
        extra.update(groups=source_of, unseen_sites=unseen, patient_wise=True,
                     sources={s: int(np.sum(np.asarray(pool.sites) == s)) for s in dict.fromkeys(pool.sites)})
        write_site_datalists(pool, parts, out, test_fraction=fed.test_fraction, val_fraction=fed.val_fraction,
                             seed=seed, extra=extra, site_names=names, segmentation=seg2d)
        return _training_sites(out, [n for n in names if n not in unseen])
    if fed.holdout_sources and pool.sites is not None:  # e.g. the IID reference of a natural federation: held-out
        held = set(fed.holdout_sources)                   # sources stay out, it trains what the methods train on
        pool = pool.subset(np.asarray([i for i, x in enumerate(pool.sites) if x not in held], dtype=np.int64))
    units = None
    if pool.groups is not None:  # any partition of a multi-source pool deals patients, not images
        first, members = P.group_units(pool.groups)
        units = (pool, members)
        pool = pool.subset(first)
        extra["patient_wise"] = True
    common = None
    if fed.common_test_fraction > 0:  # one stratified test set every site scores; the rest is partitioned
        common = np.sort(np.concatenate([rng.permutation(np.flatnonzero(pool.labels == c))[
            :int(round(fed.common_test_fraction * int((pool.labels == c).sum())))] for c in range(pool.n_classes)]))
        rest = np.setdiff1d(np.arange(len(pool.labels)), common)
        full, pool = pool, pool.subset(rest)
        common_items = full.subset(common)
        extra["common_test"] = int(common.size)
    parts, transforms, groups = _deal(exp, part, pool, rng, extra)
    names = _site_names(exp, groups, extra)
    if units is not None:  # patients back to their images
        pool, members = units
        parts = P.expand_units(parts, members)
    if common is not None:  # the common test images join the pool's end so the datalists can refer to them
        from fedmed.data.images import ImagePool

        pool = ImagePool(pool.items + common_items.items, np.concatenate([pool.labels, common_items.labels]),
                         pool.class_names, pool.source)
        common = np.arange(len(pool.labels) - len(common_items.labels), len(pool.labels))
    write_site_datalists(pool, parts, out, test_fraction=fed.test_fraction, val_fraction=fed.val_fraction, seed=seed,
                         transforms=transforms, extra=extra, site_names=names, common_test=common, segmentation=seg2d)
    return _training_sites(out, [n for n in names if not n.startswith("unseen-")])


def _image_pool(exp, seed: int, seg2d: bool):
    """The config's images (a folder, or an index of sources), every one readable, with their classes checked."""
    from fedmed.data.images import ImagePool, check_readable, discover

    if exp.dataset.sources:
        from fedmed.data.sources import read_sources

        pool = read_sources(exp.dataset.sources, exp.dataset.classes)
        if exp.dataset.max_per_class:
            raise ValueError("dataset.max_per_class would cut patients apart in a multi-source dataset; leave it out")
    else:
        pool = discover(exp.dataset.path, max_per_class=exp.dataset.max_per_class, seed=seed)
    check_readable(pool)  # nothing unreadable goes into a datalist
    if seg2d:
        missing = [pool.items[i] for i, m in enumerate(pool.masks or [None] * len(pool.items)) if not m]
        if missing:
            raise ValueError(f"dataset.sources: {len(missing)} image(s) have no mask in a segmentation dataset, e.g. "
                             f"{missing[0]}")
        check_readable(ImagePool(list(pool.masks), pool.labels, pool.class_names, pool.source + " (masks)"))
    check_classes(exp, pool.class_names)
    return pool


def _deal(exp, part: str, pool, rng, extra: dict) -> tuple[list, list | None, list | None]:
    """The pool dealt to the sites and the held-out sites by ``part``: (index arrays, ANDA's image transforms or None,
    ANDA's group of every site or None); what the partition chose goes into ``extra``."""
    from fedmed.data import anda, partition as P

    fed = exp.federation
    n_all = fed.sites + fed.unseen_sites  # held-out sites are dealt like the others, then kept out of training
    if part == "iid":
        return P.iid_partition(len(pool.labels), n_all, rng), None, None
    if part == "dirichlet":
        return P.dirichlet_label_partition(pool.labels, n_all, fed.alpha, rng, mode={
            "hsu": "per-site", "per_client": "per-client"}[fed.dirichlet_scheme]), None, None
    if part == "quantity":
        return P.quantity_partition(len(pool.labels), n_all, fed.alpha, rng), None, None
    if part == "predi":
        try:
            res = P.predi(pool.n_classes, n_all, fed.predi_prevalence, fed.predi_disparity, rng)
            parts = P.predi_partition(pool.labels, res.assignment, rng, samples_per_cell=fed.predi_samples_per_cell)
        except ValueError as e:
            raise ValueError(f"federation.predi_prevalence={fed.predi_prevalence}, predi_disparity={fed.predi_disparity}, "
                             f"predi_samples_per_cell={fed.predi_samples_per_cell} with {n_all} sites and "
                             f"{pool.n_classes} classes cannot be met: {e}") from None
        extra.update(prevalence=res.prevalence, disparity=res.disparity)
        return parts, None, None
    if part == "anda":
        sites = anda.anda_federation(pool.labels, n_all, fed.anda_shift, rng,
                                     level=fed.anda_level, n_groups=fed.anda_groups)
        transforms = [(lambda img, lab, s=s: anda.apply_anda_transform(img, lab, s, colour=fed.anda_colour))
                      for s in sites]
        extra.update(shift=fed.anda_shift, level=fed.anda_level)
        return [s.indices for s in sites], transforms, [s.group for s in sites]
    raise ValueError(f"federation.partition {part!r} is for segmentation datasets")


def _site_names(exp, groups: list | None, extra: dict) -> list[str]:
    """The names of the dealt parts: the config's sites and ``unseen-<j>`` for the held-out ones — with known groups
    (ANDA), one held out per group in turn from the end of the list; otherwise the last ones dealt."""
    fed = exp.federation
    names = exp.site_names()
    if groups is not None:
        names = names + [f"unseen-{j + 1}" for j in range(fed.unseen_sites)]
        unseen: list[int] = []
        order = list(range(len(names)))[::-1]
        g = 0
        while len(unseen) < fed.unseen_sites:
            pick = next((k for k in order if groups[k] == g % fed.anda_groups and k not in unseen), None)
            if pick is not None:
                unseen.append(pick)
            g += 1
        trained = [k for k in range(len(names)) if k not in unseen]
        final = [None] * len(names)
        for j, k in enumerate(trained):
            final[k] = exp.site_names()[j]
        for j, k in enumerate(unseen):
            final[k] = f"unseen-{j + 1}"
        extra.update(groups=dict(zip(final, groups)), unseen_sites=[f"unseen-{j + 1}" for j in range(len(unseen))])
        return final
    if fed.unseen_sites:  # no known groups: the last sites dealt are held out
        names = names + [f"unseen-{j + 1}" for j in range(fed.unseen_sites)]
        extra.update(unseen_sites=names[fed.sites:])
    return names


def _training_sites(out: Path, sites: list[str]) -> Path:
    """``dataset.json`` names the sites that train (the held-out ones stay out of its ``sites``)."""
    meta_path = out / "dataset.json"
    meta = json.loads(meta_path.read_text())
    meta["sites"] = sites
    meta_path.write_text(json.dumps(meta, indent=1))
    return out


def with_classes(exp, data_dir: Path):
    """The config with ``dataset.classes`` from a written federation (a job is built from the config alone), and for a
    natural federation its sites (their names and count come from the data)."""
    seg2d = exp.dataset.task == "segmentation" and bool(exp.dataset.sources)
    if exp.dataset.task != "classification" and not seg2d:
        return exp
    meta = json.loads((Path(data_dir) / "dataset.json").read_text())
    update = {} if seg2d else {"dataset": exp.dataset.model_copy(update={"classes": list(meta["class_names"])})}
    if exp.federation.partition == "natural" and exp.federation.site_names is None:
        update["federation"] = exp.federation.model_copy(update={"site_names": list(meta["sites"]),
                                                                 "sites": len(meta["sites"])})
    out = exp.model_copy(update=update)
    out._base_dir, out._path_origins = exp.base_dir, exp._path_origins
    return out


def classes_override(data_dir: Path, exp) -> list[str]:
    """``dataset.classes=[...]`` from a written federation, as a ``--set`` override."""
    if exp.dataset.task != "classification":
        return []
    names = json.loads((data_dir / "dataset.json").read_text())["class_names"]
    return [f"dataset.classes={json.dumps(names)}"]
