"""What the planner's report scripts share: their start (the libraries quieted, ``--out``
parsed) and the label of a ranked candidate's setting."""

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


def setting(row):
    """A ranked candidate's setting as the reports print it: schedule and recompute, then its
    degrees (below TP), uneven stage split, distributed optimizer and sharding strategy."""
    from megatron_oases.planner.choose import setting_name
    from megatron_oases.planner.sharding import STRATEGIES

    out = setting_name(row["schedule"], row["recompute"], row["recompute_num_layers"], row["split"])
    if row["degrees"] != [row["layout"]["tp"]]:
        out += f" degrees {row['degrees']}"
    if row.get("stage_split"):
        out += " stages {}/../{}".format(row["stage_split"][0], row["stage_split"][2])
    if row.get("distributed_optimizer"):
        out += " dist-opt"
    if row.get("data_parallel_sharding"):
        out += " " + STRATEGIES[row["data_parallel_sharding"]].short
    return out
