"""Results: summary tables and honest round selection (summary), plots (plots), the HTML report (html).

Every name below is importable from ``fedmed.report`` (loaded on first use)."""

from fedmed.core.faces import lazy_face

_PUBLIC = {
    "CLS_METRICS": "summary",
    "FIELDS": "summary",
    "METRICS": "record",
    "Recorder": "record",
    "SEG_METRICS": "summary",
    "markdown_to_html": "html",
    "missing_sentence": "record",
    "plot_dendrogram": "plots",
    "plot_heatmap": "plots",
    "plot_silhouette": "plots",
    "plot_sweep": "plots",
    "read_results": "summary",
    "reported_rows": "summary",
    "rows_from_metrics": "summary",
    "strict_json": "record",
    "summarize": "summary",
    "summarize_sites": "record",
    "sweep_stats": "summary",
    "sweep_table": "summary",
    "write_assessment_report": "assessment_report",
    "write_outputs": "summary",
    "write_report": "html",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_face(__name__, _PUBLIC)
