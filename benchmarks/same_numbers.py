"""Does a change move a number? A small digits federation (FedAvg, FMCL, the serving plan with fine-tuning; seed 0)
and a 3D segmentation FedAvg on the demo's NIfTI phantoms (2 rounds) run in-process; prints, as one JSON line, the hash of every saved model, every site's per-round scores and the plan's
choices, p-values and served scores (its serve_score accuracies left out: #86 sends fewer of them). Run it in two
trees and compare the outputs byte for byte:

    git worktree add /tmp/before <commit>
    (cd /tmp/before && PYTHONPATH=/tmp/before /work/main/.venv/bin/python /work/main/benchmarks/same_numbers.py) > before.json
    .venv/bin/python benchmarks/same_numbers.py > after.json && cmp before.json after.json && echo the same
"""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

RAW = {"name": "same", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 40},
       "federation": {"sites": 6, "partition": "anda", "anda_shift": "label", "anda_level": 6, "anda_groups": 2,
                      "unseen_sites": 2, "val_fraction": 0.25},
       "model": {"arch": "resnet9", "width": 4}, "train": {"rounds": 4, "local_epochs": 2, "batch_size": 16},
       "privacy": {"k_min": 2}, "references": [],
       "methods": [{"name": "FedAvg", "workflow": "fedavg"},
                   {"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn", "n_clusters": 2}]}


def _scores(doc: dict, skip=lambda task, key: False) -> list:
    return [{s: {k: v for k, v in d.items() if isinstance(v, float) and not skip(r["task"], k)}
             for s, d in r["sites"].items()} for r in doc["rounds"]]


def main() -> None:
    import torch

    import fedmed
    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.run.jobspec import job_spec, run_spec_in_process
    from fedmed.run.followups import ServingPlan

    print(f"fedmed from {Path(fedmed.__file__).parent}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp())
    exp = load_config(RAW)
    data = prepare_federation(exp, 0, tmp / "data")
    exp = load_config(RAW, classes_override(data, exp))
    out = {}
    for m in exp.methods:
        status, fed = run_spec_in_process(job_spec(exp, m, 0), data, tmp / m.name)
        assert status == "finished", fed.recorder.doc.get("reason")
        for f in sorted((tmp / m.name / "models").glob("*.pt")):
            sd = torch.load(f, weights_only=True)["state_dict"]
            out[f"{m.name}/{f.name}"] = hashlib.sha256(b"".join(v.numpy().tobytes()
                                                                for _, v in sorted(sd.items()))).hexdigest()[:16]
        out[f"{m.name}/rounds"] = _scores(fed.recorder.doc)
    spec = job_spec(exp, exp.methods[0], 0, follows=ServingPlan(
        tmp / "FedAvg", candidates={"FMCL": tmp / "FMCL"}, finetune={"epochs": 2, "lr_scale": 0.5}))
    status, fed = run_spec_in_process(spec, data, tmp / "plan")
    assert status == "finished", fed.recorder.doc.get("reason")
    plan = json.loads((tmp / "plan" / "plan.json").read_text())
    out["plan"] = {s: (v["served"], v["p"]) for s, v in plan.items()}
    out["plan/rounds"] = _scores(fed.recorder.doc, lambda task, key: task == "serve_score")
    out.update(_segmentation(tmp))
    print(json.dumps(out, sort_keys=True, default=str))


def _segmentation(tmp: Path) -> dict:
    """The demo's segmentation part in small: its phantoms, its config, FedAvg for 2 rounds of 1 local epoch."""
    import torch

    from fedmed.config import load_config
    from fedmed.core.resources import shipped_config
    from fedmed.data.phantoms import write_phantom_subjects
    from fedmed.run.experiment import prepare_federation
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    phantoms = write_phantom_subjects(tmp / "phantoms", [0, 2, 3, 3, 4, 4, 5, 6, 6, 9, 10, 11, 3, 5, 8, 2, 3, 4, 5, 6,
                                                         7, 8, 9, 10, 4, 6, 7], size=24)
    exp = load_config(shipped_config("demo_seg_phantoms.yaml"), ["train.rounds=2", "train.local_epochs=1",
                                                                  f"dataset.path={phantoms}"])
    data = prepare_federation(exp, 0, tmp / "seg_data")
    m = next(x for x in exp.methods if x.workflow == "fedavg")
    status, fed = run_spec_in_process(job_spec(exp, m, 0), data, tmp / "seg")
    assert status == "finished", fed.recorder.doc.get("reason")
    sd = torch.load(tmp / "seg" / "models" / "global.pt", weights_only=True)["state_dict"]
    return {"seg/global.pt": hashlib.sha256(b"".join(v.numpy().tobytes() for _, v in sorted(sd.items()))).hexdigest()[:16],
            "seg/rounds": _scores(fed.recorder.doc)}


if __name__ == "__main__":
    main()
