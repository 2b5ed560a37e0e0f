"""Segmentation assessment (004_) against one FedAvg round — two different computations, timed interleaved
(``benchmarks/_common.py``, no result check).

Both run locally on the same federation (BraTS-2013 from ../shared/data, 12 hemisphere samples
in 4 label-volume sites; synthetic phantoms when absent):
* assessment = every site's metadata histograms + MedicalNet embeddings, then D_EMD, D_EUC, the
  most distant site and the two-cluster split;
* one FedAvg round = every site trains the 3D U-Net for one local epoch, then the average.

    .venv/bin/python benchmarks/bench_assessment.py [--pairs 5]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from fedmed.algorithms.aggregation import weighted_average
from fedmed.algorithms.assessment import assess
from fedmed.site.seg_aggregates import site_assessment
from fedmed.nn.encoders import build_encoder
from fedmed.data.nifti import load_case
from fedmed.nn.seg import seg_model, train_seg_local
from fedmed.data.seg_federation import discover_subjects, write_seg_federation
from fedmed.nn.train import get_params, make_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare  # noqa: E402

BRATS = Path(__file__).resolve().parents[2] / "shared" / "data" / "brats2013"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp())
    if BRATS.exists():
        entries = discover_subjects(BRATS, {"FLAIR": "Flair*", "T1c": "T1c*"}, "OTMultiClass*", "brainmask*", True)
        source = "BraTS-2013 (12 hemisphere samples)"
    else:
        from fedmed.data.phantoms import write_phantom_subjects

        root = write_phantom_subjects(tmp / "ph", [0, 2, 2, 3, 3, 3, 4, 4, 4, 9, 10, 11], size=32)
        entries = discover_subjects(root, {"FLAIR": "Flair*", "T1c": "T1c*"}, "OTMultiClass*", "brainmask*")
        source = "synthetic phantoms"
    fed = write_seg_federation(entries, 4, tmp / "fed", test_fraction=0.34)
    meta = json.loads((fed / "dataset.json").read_text())
    shape = (32, 48, 40)
    cases = {}
    for s in meta["sites"]:
        doc = json.loads((fed / f"{s}.json").read_text())
        cases[s] = [load_case(e, shape=shape, site=s) for e in doc["training"] + doc["validation"]]
    print(f"data: {source}; cases resampled to {shape} (loading excluded from both timings)")

    enc = build_encoder("medicalnet_resnet18")

    def assessment():
        return assess({s: site_assessment(c, enc) for s, c in cases.items()})

    theta = get_params(seg_model(2))

    def fedavg_round():
        states, weights = [], []
        for k, (s, c) in enumerate(cases.items()):
            m = seg_model(2)
            m.load_state_dict({n: torch.as_tensor(v) for n, v in theta.items()})
            train_seg_local(m, c, epochs=1, seed=k, optimizer=make_optimizer(m, {"optimizer": "adam", "lr": 1e-3}))
            states.append(get_params(m))
            weights.append(len(c))
        return weighted_average(states, weights)

    rep = assessment()
    out = compare("004_ assessment vs one 3D U-Net FedAvg round (different computations)", fedavg_round, assessment,
                  label_a="FedAvg round", label_b="assessment", pairs=a.pairs, check=False)
    print(f"assessment ({len(cases)} sites; most distant: EMD {rep['emd']['most_distant']}, EUC "
          f"{rep['euc']['most_distant']}) costs {out['wall_ratio']:.2f} FedAvg rounds (1 local epoch per site)")


if __name__ == "__main__":
    main()
