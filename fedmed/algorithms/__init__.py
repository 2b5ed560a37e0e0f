"""The papers' math as pure numpy/torch functions — no FLARE, no files, no sites: FMCL signatures and distances (fmcl), clustering rules (clustering), one-shot clustered FL and CFL (clustered), the baselines' signatures (baselines), Flux (flux), the 004_ heterogeneity measures and assessment (heterogeneity, assessment), aggregation (aggregation), metrics from aggregates (metrics), what may leave a site (privacy).

Every name below is importable from ``fedmed.algorithms`` (loaded on first use)."""

from importlib import import_module

_PUBLIC = {
    "AutoKResult": "clustering",
    "ClassSignature": "fmcl",
    "DEFAULT_EDGES": "assessment",
    "FECFLSignature": "signatures",
    "FIELDS": "signatures",
    "FluxDescriptor": "flux",
    "LINKAGES": "clustering",
    "N_BINS": "metrics",
    "PACFLSignature": "signatures",
    "SIGNATURES": "signatures",
    "SIGNATURE_KINDS": "clustered",
    "SharedPCA": "flux",
    "adaptive_dbscan": "clustering",
    "agglomerative": "clustering",
    "analytic_gaussian_sigma": "privacy",
    "assess": "assessment",
    "assign_nearest": "flux",
    "auc_from_histograms": "metrics",
    "auto_k": "clustering",
    "binary_auc": "metrics",
    "canonical_labels": "clustering",
    "cfl_split": "clustered",
    "choose_clusters": "clustered",
    "class_signature": "fmcl",
    "clip_rows": "privacy",
    "cluster_average": "aggregation",
    "cluster_centroids": "flux",
    "cv_window": "clustering",
    "d_emd": "heterogeneity",
    "descriptor_length": "flux",
    "down_weight": "aggregation",
    "embedding_distance_matrix": "heterogeneity",
    "emd_1d": "heterogeneity",
    "emd_matrix": "heterogeneity",
    "emd_summary": "heterogeneity",
    "farthest_split": "clustering",
    "fecfl_distance_matrix": "baselines",
    "fecfl_signature": "baselines",
    "flux_cluster": "clustered",
    "flux_descriptor": "flux",
    "fmcl_distance_matrix": "fmcl",
    "fmcl_distance_matrix_loop": "fmcl",
    "histogram_edges": "assessment",
    "ifca_models": "aggregation",
    "k_min_consent_note": "privacy",
    "kmeans_prior": "clustering",
    "labels_to_clusters": "clustering",
    "latent_bounds": "flux",
    "linkage_matrix": "clustering",
    "macro_f1": "metrics",
    "merge_bounds": "flux",
    "metadata_histogram": "heterogeneity",
    "most_distant_site": "clustering",
    "pacfl_distance_matrix": "baselines",
    "pacfl_signature": "baselines",
    "pca2_embedding": "heterogeneity",
    "pooled_metrics": "metrics",
    "prep_weights": "aggregation",
    "privacy_settings": "privacy",
    "private_bounds": "privacy",
    "private_histogram": "privacy",
    "private_mean": "privacy",
    "select_max_feature": "heterogeneity",
    "shared_pca": "flux",
    "should_start_clustering": "flux",
    "signature_distances": "clustered",
    "signature_from_wire": "signatures",
    "signature_payload": "privacy",
    "signature_to_wire": "signatures",
    "silhouette": "clustering",
    "site_metrics": "metrics",
    "weighted_average": "aggregation",
    "withhold_small": "privacy",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
