"""Every abbreviation, paper reference and method name a report uses, in plain words: the report's glossary lists
those its page contains (:func:`glossary_html`), and a test checks that the demo report uses none that is not here."""

from __future__ import annotations

import html
import re

__all__ = ["GLOSSARY", "glossary_html", "terms_in"]

GLOSSARY = {
    "000_": "seed paper 000 (FMCL): clustering hospitals by class prototypes from a frozen foundation model",
    "001_": "seed paper 001: PreDi partitioning, prevalence-weighted loss (PreP-WFL) and Fed-MAE self-supervised "
            "pre-training",
    "002_": "seed paper 002 (FMCL, extended version)",
    "003_": "seed paper 003 (Flux): describing each site by its model's latent statistics, clustering and assigning "
            "new sites without labels",
    "004_": "seed paper 004 (Alekseenko et al.): measuring how different the sites' data are before training "
            "(metadata and embedding distances), down-weighting the most distant site, 3D U-Net segmentation",
    "App. C": "Appendix C of the 004_ paper (how the metadata distance is computed)",
    "Eq.": "an equation of the paper the text names (e.g. Eq. 1 of 004_: the embedding distance; Eq. 9 of 003_: "
           "assigning a new site to the nearest cluster)",
    "ANDA": "the shifts of the Flux paper's benchmark (feature, label and quantity shifts between groups of sites)",
    "ARI": "adjusted Rand index: how well the clusters found match the true groups of sites (1 = exactly, 0 = "
           "no better than chance)",
    "AUC": "area under the ROC curve: how well the scores rank positive above negative cases (50% = chance, 100% = "
           "perfect), averaged over classes",
    "Brier": "the Brier score: the squared distance between a model's predicted class probabilities and the true "
             "class (0 = certain and right, 2 = certain and wrong); the serving plan compares a candidate with the "
             "global model by its mean Brier score gain on the same validation images (higher gain: better "
             "probabilities)",
    "BraTS": "the Brain Tumor Segmentation challenge, whose MRI scans and tumour outlines the 3D part follows",
    "CFL": "Clustered Federated Learning (Sattler et al.): splits sites into clusters while training, by how their "
           "updates disagree",
    "D_EMD": "004_'s metadata distance between two sites: the earth mover's distance between their intensity and "
             "label-volume histograms",
    "D_EUC": "004_'s embedding distance between two sites: the Euclidean distance between the mean embeddings of "
             "their images (MedicalNet)",
    "DBSCAN": "a density-based clustering method (the Flux paper's choice)",
    "Dice": "overlap between a predicted and a true outline: 2 x shared area / total area (100% = identical)",
    "DiceMetric": "MONAI's implementation of the Dice score",
    "DP": "differential privacy: calibrated noise added to what a site sends, so that no single patient can be "
          "inferred from it (epsilon: the privacy budget; smaller is more private)",
    "EMD": "earth mover's distance: how much one histogram must be moved to become another",
    "EMD_maxI": "the largest intensity EMD between any two sites, which scales the intensity part of D_EMD",
    "EMD_maxL": "the largest label-volume EMD between any two sites, which scales the label part of D_EMD",
    "ET": "enhancing tumour (a BraTS region)",
    "F1": "the harmonic mean of precision and recall; macro-F1 averages it over classes, so rare classes count as "
          "much as common ones",
    "FECFL": "a clustered FL baseline that groups sites by embeddings from a small randomly initialised encoder",
    "FedAvg": "Federated Averaging: every site trains the shared model on its own data and the server averages the "
              "updates, weighted by the sites' sizes",
    "FedBN": "FedAvg in which each site keeps its own batch-normalisation layers",
    "FedProx": "FedAvg with a penalty that keeps each site's update close to the shared model",
    "FMCL": "Foundation-Model Clustered Learning (000_/002_): sites grouped once before training by class prototypes "
            "from a frozen foundation model; one model per group",
    "Flux": "the 003_ method: sites described by statistics of their models' latent features, clustered during "
            "training; a new site is assigned to a cluster without labels",
    "FP": "false positive: tumour predicted where the ground truth has none (counted in voxels or pixels)",
    "HD95": "the 95th-percentile Hausdorff distance between the predicted and true outlines, in mm (lower is better)",
    "IFCA": "Iterative Federated Clustering Algorithm: K models; each site trains the one with its lowest loss",
    "IID": "independent and identically distributed: data dealt evenly and at random to the sites, so the sites do "
           "not differ",
    "K": "the number of clusters",
    "k_min": "the smallest number of samples an aggregate a site sends may describe (smaller groups are withheld)",
    "MedicalNet": "a 3D ResNet pre-trained on medical volumes, used by 004_ to embed images",
    "PACFL": "a clustered FL baseline that groups sites by principal angles between their data subspaces",
    "pp": "percentage points: the difference between two percentages",
    "T1c": "the contrast-enhanced T1-weighted MRI sequence",
    "TC": "tumour core (a BraTS region: enhancing tumour plus necrosis)",
    "WT": "whole tumour (a BraTS region: every tumour label)",
}

_PATTERNS = {k: re.compile(r"(?<![\w/.-])" + re.escape(k) + (r"(?![\w/-])" if k[-1].isalnum() or k[-1] == "_"
                                                              else "")) for k in GLOSSARY}


def terms_in(text: str) -> list[str]:
    """The glossary's terms that ``text`` (a page's visible text) uses, in the glossary's order."""
    return [k for k, p in _PATTERNS.items() if p.search(text)]


def glossary_html(text: str) -> str:
    """A definition list of every glossary term ``text`` uses (empty when it uses none)."""
    terms = terms_in(text)
    if not terms:
        return ""
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(GLOSSARY[k])}</dd>" for k in terms)
    return f"<h2 id='glossary'>Glossary</h2><dl class='glossary'>{items}</dl>"
