"""The start of a planner benchmark that writes a report: the libraries quieted, ``--out`` parsed."""

import argparse
import logging
import os
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(doc, argv=None):
    """Quiet warnings, Megatron's logging and its CUDA-less banners, then parse ``--out`` (the
    results folder, default ``benchmarks/results/planner``) with ``doc``'s first paragraph as the
    description; returns the parsed arguments."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from megatron_oases.training import quiet

    quiet.install(cuda=False)
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "planner"))
    return p.parse_args(argv)
