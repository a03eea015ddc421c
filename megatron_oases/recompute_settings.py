"""Megatron's recompute settings as this package names them, and the flags that select each.

One table: ``oases plan --recompute`` and the plan file's ``recompute`` key, the planner's
``launch_flags`` and ``oases compare``'s variants all read it.
"""

#: Most activation memory first: keep everything; recompute core attention; also the two norms'
#: outputs (freed after the linear that reads them); every layer from its input.
RECOMPUTE_MODES = ("none", "selective", "selective+ln", "full")

#: Megatron's flags for each setting.
RECOMPUTE_ARGV = {
    "none": (),
    "selective": ("--recompute-granularity", "selective", "--recompute-modules", "core_attn"),
    "selective+ln": (
        "--recompute-granularity",
        "selective",
        "--recompute-modules",
        "core_attn",
        "layernorm",
    ),
    "full": (
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ),
}

#: The selective settings (core attention recomputed inside its backward).
SELECTIVE_MODES = ("selective", "selective+ln")


def block_argv(num_layers):
    """Megatron's full recomputation of only each pipeline stage's first ``num_layers`` layers
    (``--recompute-method block``); the layers after them keep their activations."""
    return (
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        str(num_layers),
    )


def recompute_mode_of(args):
    """A parsed Megatron command line's setting, in :data:`RECOMPUTE_MODES` words."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "full":
        return "full"
    if granularity == "selective":
        modules = getattr(args, "recompute_modules", None) or ()
        return "selective+ln" if "layernorm" in modules else "selective"
    return "none"
