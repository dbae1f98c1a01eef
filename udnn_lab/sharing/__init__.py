"""Co-training study: several training jobs on one device (document 004). See ``facade``.

May import every stage above it; nothing imports it but the CLI, notebooks and benchmarks."""

from udnn_lab.sharing.facade import (  # noqa: F401
    DOCUMENT_004_MODELS,
    QUESTIONS,
    SIZES,
    CapBelowMinimum,
    JobAnalysis,
    JobSpec,
    StudyConfig,
    StudyResult,
    analyze_job,
    compare_runs,
    degradation_heatmap,
    document_004_job,
    document_004_jobs,
    jaccard_heatmap,
    ks_2samp,
    load,
    op_mix_chart,
    q1_chart,
    repeat_chart,
    resolve_caps,
    resolve_factory,
    run_study,
    signals_chart,
    weighted_jaccard,
)

__all__ = [
    "CapBelowMinimum", "DOCUMENT_004_MODELS", "JobAnalysis", "JobSpec", "QUESTIONS", "SIZES", "StudyConfig",
    "StudyResult", "analyze_job", "compare_runs", "degradation_heatmap", "document_004_job",
    "document_004_jobs", "jaccard_heatmap", "ks_2samp", "load", "op_mix_chart", "q1_chart", "repeat_chart",
    "resolve_caps", "resolve_factory", "run_study", "signals_chart", "weighted_jaccard",
]
