"""Trace analysis (exposed communication, efficiency) and Figure-3-style timelines."""

from .analysis import load_traces, rank_metrics, run_metrics, trace_files

__all__ = ["load_traces", "rank_metrics", "run_metrics", "trace_files", "plot_timeline"]


def plot_timeline(*args, **kwargs):
    from .timeline import plot_timeline as _plot

    return _plot(*args, **kwargs)
