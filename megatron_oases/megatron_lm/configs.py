"""Model configs (packaged ``configs/models/*.yaml``), the comparison matrix and its summary table.

Used by ``launch_scripts/`` through ``python -m megatron_oases.megatron_lm`` (bash reads no YAML).

A model config holds Megatron-LM ``pretrain_gpt.py`` flags by section (``model``, ``parallel``,
``training``; keys are flag names without the leading ``--``) plus an informational ``paper``
section that is never turned into flags. ``true`` becomes a bare flag, ``false``/``null`` drops it,
a list gives several values.
"""

import math
import os
import shlex

from .. import resources
from ..errors import OasesConfigError
from ..instrument.golden import read_golden

FLAG_SECTIONS = ("model", "parallel", "training")


def read_yaml(path, what="config file"):
    """The YAML document in ``path`` (:func:`megatron_oases.formats.read_yaml`: bounded,
    ``safe_load`` only); a missing, unreadable, binary, oversized or malformed file is one
    :class:`OasesConfigError` line naming it (and, for a syntax error, the line)."""
    from ..formats import read_yaml as read

    return read(path, what)


def _load_yaml(path):
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise OasesConfigError(f"{path}: expected a YAML mapping at top level")
    return data


def model_config_path(name_or_path):
    """An existing path as is (a user's own file wins), else the packaged model config
    ``name_or_path`` (``tiny-cpu``)."""
    if os.path.isfile(name_or_path):
        return name_or_path
    path = resources.model_config(name_or_path)
    if path is None:
        raise OasesConfigError(
            f"unknown model config {name_or_path!r}; choose one of "
            f"{', '.join(resources.available_models())} or give a path"
        )
    return path


def check_flag_values(flags, source):
    """The model-config rule for flag values (``flags``: flag name -> value): a number, string,
    true/false/null or a list of those; every number by the formats' one rule
    (:func:`megatron_oases.formats.is_finite`): no NaN or infinity (YAML's ``.nan``,
    ``.inf``), which Megatron's float flags would take as they are, nor an integer too large for
    a float (``10**400``). One line naming ``source`` and the flag."""
    from ..formats import is_finite, is_number, quote

    for key, value in flags.items():
        for v in value if isinstance(value, list) else [value]:
            if is_number(v) and not is_finite(v):
                raise OasesConfigError(
                    f"{source}: {key} is {quote(v)}; give a finite number (one a float holds)"
                )
            if not (v is None or isinstance(v, (bool, int, float, str))):
                raise OasesConfigError(
                    f"{source}: {key} must be a number, a string, true/false or a list of "
                    f"those, got {type(v).__name__} {quote(v)}"
                )


def load_model_config(name_or_path):
    path = model_config_path(name_or_path)
    data = _load_yaml(path)
    for section in FLAG_SECTIONS:
        if not isinstance(data.get(section) or {}, dict):
            raise OasesConfigError(f"{path}: section {section!r} must be a mapping of flags")
        check_flag_values(data.get(section) or {}, f"{path}: {section}")
    data.setdefault("name", os.path.basename(path)[:-5])
    return data


def to_flags(mapping):
    """``{"num-layers": 2, "swiglu": True}`` → ``["--num-layers", "2", "--swiglu"]``."""
    flags = []
    for key, value in (mapping or {}).items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag] + [str(v) for v in value]
        else:
            flags += [flag, str(value)]
    return flags


def model_flags(config, sections=FLAG_SECTIONS):
    flags = []
    for section in sections:
        flags += to_flags(config.get(section))
    return flags


def get_path(data, dotted, default=None):
    """``get_path(cfg, "parallel.tensor-model-parallel-size")``; ``default`` when absent."""
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def parameter_count(config):
    """Parameters of the GPT a config describes (tied embeddings, learned positions, biases)."""
    m = config["model"]
    h, layers = m["hidden-size"], m["num-layers"]
    ffn = m.get("ffn-hidden-size") or 4 * h
    vocab = m.get("vocab-size", 50257)
    seq = m.get("max-position-embeddings") or m["seq-length"]
    per_layer = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h  # attn + mlp + biases + 2 norms
    return layers * per_layer + vocab * h + seq * h + 2 * h


# ------------------------------------------------------------------------------------------ matrix


def _schedule(value):
    # YAML 1.1 reads a bare `off` as False.
    if value is False or value is None:
        return "off"
    return str(value)


def load_matrix(path=None, name=None):
    """Matrix ``name`` (default: the file's ``default``) of ``path`` (default: the packaged one)."""
    path = path or resources.compare_matrix()
    data = _load_yaml(path)
    matrices = data.get("matrices") or {}
    if not matrices:
        raise OasesConfigError(f"{path}: no 'matrices' defined")
    if name is None:
        name = data.get("default") or next(iter(matrices))
    if name not in matrices:
        raise OasesConfigError(f"{path}: no matrix {name!r}; choose one of {', '.join(matrices)}")
    matrix = dict(matrices[name])
    matrix["name"] = name
    for key in ("model", "layouts", "variants"):
        if not matrix.get(key):
            raise OasesConfigError(f"{path}: matrix {name!r} needs {key!r}")
    return matrix


def expand_matrix(matrix):
    """One dict per run: name, tp, pp, schedule, args (list), variant; variants × layouts."""
    common = [str(a) for a in matrix.get("args") or []]
    runs = []
    for layout in matrix["layouts"]:
        tp, pp = int(layout.get("tp", 1)), int(layout.get("pp", 1))
        for variant in matrix["variants"]:
            runs.append(
                dict(
                    name=f"{variant['name']}-tp{tp}-pp{pp}",
                    variant=variant["name"],
                    tp=tp,
                    pp=pp,
                    schedule=_schedule(variant.get("schedule", "off")),
                    args=common + [str(a) for a in variant.get("args") or []],
                )
            )
    return runs


def matrix_tsv(matrix):
    """Lines ``name<TAB>tp<TAB>pp<TAB>schedule<TAB>shell-quoted args`` for the bash loop."""
    return "\n".join(
        "\t".join([r["name"], str(r["tp"]), str(r["pp"]), r["schedule"], shlex.join(r["args"])])
        for r in expand_matrix(matrix)
    )


# ----------------------------------------------------------------------------------------- summary


def _values(golden, key, skip_first=False):
    """Finite values of one golden-values series; ``skip_first`` drops iteration 1 (warm-up)."""
    raw = list((golden.get(key) or {}).get("values") or [])
    if skip_first and len(raw) > 1:
        raw = raw[1:]
    return [v for v in raw if v is not None and not _isnan(v)]


def _isnan(v):
    try:
        return math.isnan(v)
    except TypeError:
        return True


def summarize_run(name, tp, pp, schedule, status, json_path):
    """One row of :func:`summary_table`: a run as the compare script recorded it, with what its
    golden values file says (iterations, last loss, mean iteration time and throughput, the
    warm-up iteration left out); a run recorded ``ok`` without a readable file is ``no-json``."""
    golden = None
    if json_path and os.path.isfile(json_path):
        try:
            golden = read_golden(json_path)
        except (OSError, ValueError):
            golden = None
    if status == "ok" and golden is None:
        status = "no-json"
    golden = golden or {}
    losses = _values(golden, "lm loss")
    times = _values(golden, "iteration-time", skip_first=True)
    tflops = _values(golden, "throughput", skip_first=True)
    return {
        "name": name,
        "tp": int(tp),
        "pp": int(pp),
        "schedule": schedule,
        "status": status,
        "iters": len((golden.get("lm loss") or {}).get("values") or []),
        "loss": losses[-1] if losses else None,
        "iter_ms": 1000 * sum(times) / len(times) if times else None,
        "tflops": sum(tflops) / len(tflops) if tflops else None,
        "json": json_path,
    }


def summary_table(rows, baseline=None):
    """Markdown table; speedup = baseline variant's iteration time ÷ this run's, same TP/PP."""
    base_ms = {}
    if baseline:
        for r in rows:
            if r["name"].startswith(f"{baseline}-tp") and r["iter_ms"] and r["status"] == "ok":
                base_ms[(r["tp"], r["pp"])] = r["iter_ms"]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [
        "| run | schedule | TP | PP | status | iters | lm loss (last) | iteration time (ms) | "
        "TFLOP/s/GPU | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = base_ms.get((r["tp"], r["pp"]))
        speedup = base / r["iter_ms"] if base and r["iter_ms"] and r["status"] == "ok" else None
        lines.append(
            f"| {r['name']} | {r['schedule']} | {r['tp']} | {r['pp']} | {r['status']} | "
            f"{r['iters']} | {fmt(r['loss'], '.6f')} | {fmt(r['iter_ms'], '.1f')} | "
            f"{fmt(r['tflops'], '.4f')} | {fmt(speedup, '.2f')} |"
        )
    return "\n".join(lines)


def read_runs_file(path):
    """The compare script's record: ``name tp pp schedule status json`` per line, tab-separated."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != 6:
                raise OasesConfigError(f"{path}: malformed line {line!r}")
            rows.append(summarize_run(*parts))
    return rows
