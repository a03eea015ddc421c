"""The plan file: one TMP degree per transformer layer, editable JSON.

Keys the per-layer TMP runtime reads: ``version`` (1), ``tensor_model_parallel_size`` (the TMP
domain T), ``degrees`` (one per layer, powers of two dividing T), ``schedule``,
``global_batch_size``, ``micro_batch_size``. Everything else (``predicted``, ``objective``,
``solver``, ``solve_time_s``, ``status``, ``input_hash``, ``profile`` …) documents how it was made.
``model_shape`` records the model a plan was made for (layers, hidden size, heads, FFN size,
sequence length, padded vocabulary; :data:`MODEL_SHAPE`): a run of another layer shape is refused,
one of another sequence length or vocabulary warned of (``config.py``); a plan written before
plans recorded it still loads, with a note. A key outside :data:`PLAN_FILE_KEYS` is refused (a
mistyped optional key would otherwise be ignored in silence).
A uniform plan (:func:`uniform_plan`) is a valid plan file too. ``split`` ``"sequence"`` marks a
plan of sequence chunks (``oases plan --split sequence``): every layer at T, run with its
``launch_flags`` and without ``--oases-plan``, which refuses it.

A plan from the cluster search (``oases plan --gpus N --out``) also records ``layout`` (TP, PP,
DP, micro-batch), ``distributed_optimizer`` (the winner runs ``--use-distributed-optimizer``),
``search`` (the ranking) and, side by side, ``best_stock`` (the fastest stock Megatron layout at
any TP: schedule ``off``, uniform degree, any recompute setting, the distributed optimizer where
DP > 1; its ranking row with ``launch_flags``), ``best_oases`` (the fastest with an overlapped
schedule or per-layer degrees; its row) and ``stock_over_oases`` (``best_stock``'s predicted
iteration ÷ ``best_oases``'; > 1: Oases wins; null where either is missing).
``data_parallel_sharding`` (null: none) names the sharded data parallelism the plan runs, one of
:data:`DATA_PARALLEL_SHARDINGS` (torch FSDP2, or one of Megatron-FSDP's strategies; what each
shards and costs: ``megatron_oases/planner/sharding.py``).
"""

import json

from ..errors import OasesConfigError
from ..recompute_settings import RECOMPUTE_MODES, SELECTIVE_MODES
from ..validation import (
    SPLITS,
    check_schedule,
    check_schedule_recompute,
    check_whole_layer_recompute,
)
from . import count_fault, number_fault, quote, read_json, write_atomic
from .profile import sha256_of

PLAN_VERSION = 1
#: ``data_parallel_sharding``'s values: ``--use-torch-fsdp2``, and ``--use-megatron-fsdp`` with
#: each ``--data-parallel-sharding-strategy`` that shards (the planner's rules for each:
#: ``planner/sharding.py``).
DATA_PARALLEL_SHARDINGS = (
    "torch_fsdp2",
    "megatron_fsdp/optim",
    "megatron_fsdp/optim_grads",
    "megatron_fsdp/optim_grads_params",
)


#: The keys every plan has (:func:`validate_plan`).
REQUIRED_KEYS = ("version", "tensor_model_parallel_size", "degrees")
#: The plan's counts (positive integers or null) that the runtime and ``--evaluate`` read.
_COUNTS = (
    "global_batch_size",
    "micro_batch_size",
    "recompute_num_layers",
    "data_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers",
    "num_microbatches",
)
_WRITE_ONE = "write one with `oases plan --out PLAN_JSON`"
#: The part of ``model_shape`` that makes a layer what the plan chose its degree for (the
#: degrees' validity, each layer's memory and times): a run of another is refused. Sequence length
#: and vocabulary change the activations' length and the model's ends; the degrees stay valid: a
#: warning.
LAYER_SHAPE = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size",
}
#: ``model_shape``'s keys (Megatron's names), each with its flag for messages.
MODEL_SHAPE = {
    **LAYER_SHAPE,
    "seq_length": "--seq-length",
    "padded_vocab_size": "padded vocabulary",
}
#: Every key a plan file may have: what the runtime and ``--evaluate`` read, then what documents
#: how the plan was made (``oases plan``, the cluster search, :func:`uniform_plan`).
PLAN_FILE_KEYS = (
    *REQUIRED_KEYS,
    "schedule",
    "recompute",
    "recompute_num_layers",
    "split",
    "sequence_parallel",
    "distributed_optimizer",
    "data_parallel_sharding",
    "global_batch_size",
    "micro_batch_size",
    "num_microbatches",
    "data_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers",
    "model_shape",
    "allow_unsplit",
    "unsplit_degrees",
    "memory_gb",
    "memory_margin",
    "memory_granule_bytes",
    "constraints",
    "predicted",
    "uniform",
    "speedup",
    "objective",
    "objective_units",
    "solver",
    "solve_time_s",
    "build_time_s",
    "status",
    "verify",
    "input_hash",
    "profile",
    "profile_sha256",
    "profile_kind",
    "cluster",
    "model",
    "alternatives",
    "launch_flags",
    "layout",
    "stage_split",
    "search",
    "best_stock",
    "best_oases",
    "stock_over_oases",
)


def _missing(keys, plan):
    """``missing field 'degrees' (found 'degree')``: the keys, each with a near miss of the
    file's own keys where there is one."""
    import difflib

    named = []
    for key in keys:
        near = difflib.get_close_matches(key, [str(k) for k in plan], n=1, cutoff=0.75)
        named.append(repr(key) + (f" (found {near[0]!r})" if near else ""))
    return f"missing field{'s' if len(keys) > 1 else ''} " + ", ".join(named)


def _fail(source, msg):
    raise OasesConfigError(f"{source}: {msg}")


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def degree_fault(d, T=None, domain=None):
    """The one degree rule: a TMP degree is a positive power of two that divides the TMP domain
    ``T`` (unchecked where ``T`` is None). Returns what breaks it, as the words that follow the
    degree (``"3 is not a power of two"``), or None. ``domain`` names ``T`` in the caller's words.
    """
    if not _is_int(d) or d < 1:
        return f"{d!r} is not a positive integer"
    if d & (d - 1):
        return f"{d} is not a power of two"
    if T is not None and T % d:
        where = domain or f"the TMP domain T={T}"
        return f"{d} {'exceeds' if d > T else 'does not divide'} {where}"
    return None


def parse_degrees(text, T=None):
    """``--degrees 1,2,4`` → ``[1, 2, 4]`` (None stays None), each checked by
    :func:`degree_fault`."""
    if text is None:
        return None
    try:
        out = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise OasesConfigError(f"bad --degrees {text!r}; use a comma list such as 1,2,4") from None
    for d in out:
        fault = degree_fault(d, T)
        if fault:
            raise OasesConfigError(f"--degrees: {fault}")
    return out


#: The highest layer number a ``--pin`` may name: far beyond any model, so that a pin's range
#: is always a short list (the planner checks it against the model's layers).
MAX_PIN_LAYER = (1 << 16) - 1


def parse_pins(specs):
    """``["0-3=4", "7=2,9=1"]`` → ``[([0, 1, 2, 3], 4), ([7], 2), ([9], 1)]``."""
    pins = []
    for spec in specs or ():
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                layers, degree = part.split("=")
                first, _, last = layers.partition("-")
                first, last = int(first), int(last or first)
                if not 0 <= first <= last <= MAX_PIN_LAYER:
                    raise ValueError
                pins.append((list(range(first, last + 1)), int(degree)))
            except ValueError:
                raise OasesConfigError(
                    f"bad --pin {part!r}; use LAYER=DEGREE or FIRST-LAST=DEGREE, e.g. 0-3=4 "
                    f"(layers 0 to {MAX_PIN_LAYER})"
                ) from None
    return pins


def validate_plan(plan, num_layers=None, tensor_model_parallel_size=None, source="plan"):
    """Check a plan dict; return it. Every problem is one :class:`OasesConfigError` line."""
    if not isinstance(plan, dict):
        _fail(source, "a plan must be a JSON object")
    if "compute" in plan and "comm" in plan:  # a profile has version, T and degrees too
        _fail(source, f"this is a profile (`oases profile`), not a plan; {_WRITE_ONE}")
    missing = [key for key in REQUIRED_KEYS if key not in plan]
    if missing:
        fix = f'add "version": {PLAN_VERSION}' if missing == ["version"] else _WRITE_ONE
        _fail(source, f"not a plan: {_missing(missing, plan)}; {fix}")
    if plan["version"] != PLAN_VERSION:
        _fail(source, f"unsupported plan version {plan['version']!r} (expected {PLAN_VERSION})")
    _check_keys(plan, PLAN_FILE_KEYS, source, "a plan's keys")
    T = plan.get("tensor_model_parallel_size")
    if not _is_int(T) or T < 1:
        _fail(source, f"tensor_model_parallel_size must be a positive integer, got {T!r}")
    if tensor_model_parallel_size is not None and T != int(tensor_model_parallel_size):
        _fail(
            source,
            f"plan is for a TMP domain of {T} but --tensor-model-parallel-size is "
            f"{tensor_model_parallel_size}; re-plan or change the flag",
        )
    degrees = plan.get("degrees")
    if not isinstance(degrees, list) or not degrees:
        _fail(source, "degrees must be a non-empty list with one TMP degree per layer")
    if num_layers is not None and len(degrees) != int(num_layers):
        _fail(source, f"degrees has {len(degrees)} entries but the model has {num_layers} layers")
    for i, d in enumerate(degrees):
        fault = degree_fault(d, T, domain=f"tensor_model_parallel_size {T}")
        if fault:
            _fail(source, f"layer {i}: degree {fault}")
    schedule = plan.get("schedule")
    if schedule is not None:
        check_schedule(schedule, source=f"{source}: schedule")
    split = plan.get("split")
    if split is not None and split not in SPLITS:
        _fail(source, f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    for key in _COUNTS:  # the formats' one rule for counts and numbers
        v = plan.get(key)
        if v is not None and count_fault(v):
            _fail(source, f"{key} must be {count_fault(v)} or null, got {quote(v)}")
    for key in ("sequence_parallel", "allow_unsplit", "distributed_optimizer"):
        v = plan.get(key)
        if v is not None and not isinstance(v, bool):
            _fail(source, f"{key} must be true, false or null, got {v!r}")
    sharding = plan.get("data_parallel_sharding")
    if sharding is not None and sharding not in DATA_PARALLEL_SHARDINGS:
        _fail(
            source,
            f"data_parallel_sharding must be null or one of {', '.join(DATA_PARALLEL_SHARDINGS)}, "
            f"got {sharding!r}",
        )
    for key, kind, positive in (("memory_gb", "memory_gb", True), ("memory_margin", "fraction", 0)):
        fault = plan.get(key) is not None and number_fault(plan[key], kind, positive)
        if fault:
            _fail(source, f"{key} must be {fault} or null, got {quote(plan[key])}")
    if plan.get("model_shape") is not None:
        _check_shape(plan["model_shape"], source)
    if plan.get("profile") is not None and not isinstance(plan["profile"], str):
        _fail(source, f"profile must be a path or null, got {plan['profile']!r}")
    if plan.get("predicted") is not None and not isinstance(plan["predicted"], dict):
        _fail(source, f"predicted must be a mapping or null, got {plan['predicted']!r}")
    return plan


def _check_keys(mapping, known, source, what):
    """No key outside ``known``: one line naming the unknown ones (the near miss of each, where
    there is one) and the known ones."""
    import difflib

    unknown = [k for k in mapping if k not in known]
    if not unknown:
        return
    named = []
    for key in unknown[:5]:
        near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.75)
        named.append(quote(key) + (f" (did you mean {near[0]!r}?)" if near else ""))
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    s = "s" if len(unknown) > 1 else ""
    _fail(
        source,
        f"unknown key{s} {', '.join(named)}{more}; {what} are {', '.join(known)}: rename or "
        f"remove {'them' if s else 'it'}",
    )


def _check_shape(shape, source):
    """``model_shape``: a mapping of :data:`MODEL_SHAPE`'s keys to counts (the formats' one rule
    for counts)."""
    if not isinstance(shape, dict):
        _fail(source, f"model_shape must be a mapping or null, got {quote(shape)}")
    _check_keys(shape, tuple(MODEL_SHAPE), source, "model_shape's keys")
    for key, value in shape.items():
        if count_fault(value):
            _fail(source, f"model_shape.{key} must be {count_fault(value)}, got {quote(value)}")


def model_shape_of(shape, num_layers=None):
    """The ``model_shape`` a plan records, from a profile's model section (the keys of
    :data:`MODEL_SHAPE` it has); ``num_layers``: the whole model's layers, where given."""
    out = {k: shape[k] for k in MODEL_SHAPE if _is_int(shape.get(k)) and shape[k] >= 1}
    if num_layers is not None:
        out["num_layers"] = int(num_layers)
    return out


def shape_differences(plan, shape):
    """Where the model ``plan`` was made for (its ``model_shape``) differs from ``shape`` (the
    run's, or a profile's, by Megatron's names; a value missing or None is not known and not
    compared): ``[(key, plan's value, shape's value)]`` in :data:`MODEL_SHAPE`'s order. A plan
    that records no shape: ``[]``."""
    recorded = plan.get("model_shape") or {}
    return [
        (key, recorded[key], shape[key])
        for key in MODEL_SHAPE
        if key in recorded and shape.get(key) is not None and shape[key] != recorded[key]
    ]


def load_plan(path, num_layers=None, tensor_model_parallel_size=None):
    plan = read_json(path, "plan file", _WRITE_ONE)
    return validate_plan(plan, num_layers, tensor_model_parallel_size, source=str(path))


#: The run's fields a plan file records, each with its key there (:func:`recorded_run`).
PLAN_KEYS = {
    "global_batch_size": "global_batch_size",
    "micro_batch_size": "micro_batch_size",
    "schedule": "schedule",
    "recompute": "recompute",
    "recompute_layers": "recompute_num_layers",
    "split": "split",
    "sequence_parallel": "sequence_parallel",
    "distributed_optimizer": "distributed_optimizer",
    "data_parallel_sharding": "data_parallel_sharding",
    "memory_gb": "memory_gb",
    "tensor_model_parallel_size": "tensor_model_parallel_size",
    "data_parallel_size": "data_parallel_size",
    "pipeline_model_parallel_size": "pipeline_model_parallel_size",
}


def recompute_mode(value, source="recompute"):
    """``value`` as one of :data:`RECOMPUTE_MODES`. Booleans are the older form (plans written
    before selective recomputation was planned, ``recompute=True`` callers): True is ``full``,
    False ``none``; None is the default, ``full``."""
    if value is None or value is True:
        return "full"
    if value is False:
        return "none"
    if value in RECOMPUTE_MODES:
        return value
    raise OasesConfigError(
        f"{source}: unknown recompute setting {value!r}; choose one of {', '.join(RECOMPUTE_MODES)}"
    )


class RecordedRun:
    """The run a plan file records (:func:`recorded_run`): each field of :data:`PLAN_KEYS` an
    attribute, the plan's value where it records one, else None; :meth:`recorded` says which
    it records (a hand-written or uniform plan records little). The runtime compares it with
    Megatron's flags (``validation.plan_differences``); ``oases plan --evaluate`` merges it with
    its own flags (``PlanSettings.from_plan``)."""

    def __init__(self, values, path):
        self._values, self.path = dict(values), path

    def __getattr__(self, name):
        if name in PLAN_KEYS:
            return self._values.get(name)
        raise AttributeError(name)

    def recorded(self, name):
        """Whether the plan records field ``name``."""
        return name in self._values

    def source(self, name):
        """Field ``name``'s key in the plan, as a message names it."""
        return f"plan {self.path}'s {PLAN_KEYS[name]}"


def recorded_run(plan, path="plan"):
    """The run ``plan`` (a plan file's dict, at ``path``) was made for: a :class:`RecordedRun`.
    A null ``recompute_num_layers`` is a setting (every layer); other nulls are not recorded.
    ``recompute`` is read by :func:`recompute_mode`. A schedule recorded with a recompute setting
    it cannot run is one line naming the file (the plan alone: no flag of the user's is wrong)."""
    values = {}
    for name, key in PLAN_KEYS.items():
        if (key in plan) if name == "recompute_layers" else plan.get(key) is not None:
            values[name] = plan[key]
    if "recompute" in values:
        values["recompute"] = recompute_mode(values["recompute"], str(path))
    schedule, recompute = values.get("schedule"), values.get("recompute")
    if schedule is not None and recompute is not None:
        fix = "record recompute full"
        try:
            check_schedule(schedule, source="schedule")
            if recompute in SELECTIVE_MODES:
                check_whole_layer_recompute(schedule, flag="schedule", fix=fix)
            check_schedule_recompute(schedule, recompute == "full", flag="schedule", fix=fix)
        except OasesConfigError as exc:
            raise OasesConfigError(
                f"plan {path} records a run that cannot be planned ({exc}); edit or re-plan it"
            ) from None
    return RecordedRun(values, path)


def needs_plan_file(plan):
    """Whether a run of ``plan`` needs ``--oases-plan``: some layer runs below T (the launch flags
    alone give every layer T, so a plan of every layer at 1 under T = 2 is not stock TP2)."""
    T = int(plan["tensor_model_parallel_size"])
    return any(int(d) != T for d in plan["degrees"])


def uniform_plan(
    num_layers,
    tensor_model_parallel_size,
    degree=None,
    schedule="oases",
    global_batch_size=None,
    micro_batch_size=None,
):
    """Every layer at ``degree`` (default: T) — what plain Megatron TMP does."""
    T = int(tensor_model_parallel_size)
    degree = T if degree is None else int(degree)
    plan = {
        "version": PLAN_VERSION,
        "tensor_model_parallel_size": T,
        "degrees": [degree] * int(num_layers),
        "schedule": schedule,
        "global_batch_size": global_batch_size,
        "micro_batch_size": micro_batch_size,
        "predicted": None,
        "objective": None,
        "solver": "uniform",
        "solve_time_s": 0.0,
        "status": "uniform",
        "input_hash": None,
        "profile": None,
    }
    return validate_plan(plan, source="uniform plan")


def plan_document(
    settings,
    profile,
    problem,
    solution,
    result,
    *,
    iteration_s,
    host,
    uniform,
    speedup,
    memory_breakdown,
    verify,
    build_time_s,
    profile_path,
):
    """The plan file ``oases plan`` writes, from the planner's pieces: ``settings`` (a
    ``PlanSettings``), the ``profile`` (a :class:`~.profile.Profile`), the stage-0 ``problem`` and
    its ``solution``, ``result`` (the time model's ``evaluate`` of it), ``iteration_s`` (the
    longer of the device's and ``host``'s timelines), the ``uniform`` costs per degree and the
    ``speedup`` over them. ``input_hash`` covers what determines the plan."""
    meta = problem.meta
    pins = [[list(layers), d] for layers, d in settings.pins]
    plan = {
        "version": PLAN_VERSION,
        "tensor_model_parallel_size": meta["tensor_model_parallel_size"],
        "data_parallel_size": meta["data_parallel_size"],
        "num_layers": meta["total_layers"],
        # one stage's plan, repeated on every pipeline stage (stage 0, which holds the most
        # in-flight activations, is the one planned)
        "degrees": [problem.degrees[k] for k in solution.ks] * meta["pipeline_model_parallel_size"],
        "pipeline_model_parallel_size": meta["pipeline_model_parallel_size"],
        "schedule": settings.schedule,
        "recompute": settings.recompute,
        # with full recompute: only each stage's first N layers (Megatron's block method)
        "recompute_num_layers": meta["recompute_num_layers"],
        "sequence_parallel": settings.sequence_parallel,
        # sub-batches of samples, or of sequence chunks (--oases-split sequence; uniform T)
        "split": settings.split,
        "allow_unsplit": settings.allow_unsplit,
        "unsplit_degrees": meta["unsplit_degrees"],
        "distributed_optimizer": settings.distributed_optimizer,
        # FSDP: torch FSDP2 or a Megatron-FSDP strategy (null: none; planner/sharding.py)
        "data_parallel_sharding": settings.data_parallel_sharding,
        "global_batch_size": int(settings.global_batch_size),
        "micro_batch_size": meta["micro_batch_size"],
        "num_microbatches": meta["num_microbatches"],
        "predicted": _predicted(settings, profile, result, iteration_s, host, memory_breakdown),
        "uniform": {str(d): u for d, u in uniform.items()},
        "speedup": speedup,
        "objective": solution.objective,
        "objective_units": "seconds per iteration (eq. 5)",
        "solver": solution.solver,
        "solve_time_s": solution.solve_time_s,
        "build_time_s": build_time_s,
        "status": solution.status,
        "verify": verify,
        "memory_gb": settings.memory_gb,
        "memory_margin": settings.margin,
        "memory_granule_bytes": settings.granule,
        "constraints": {
            "degrees": problem.degrees,
            "pins": pins,
            "max_switches": settings.max_switches,
            "excluded_degrees": meta["excluded_degrees"],
        },
        "input_hash": sha256_of(_hashed_inputs(settings, profile, problem, pins)),
        "profile": profile_path,
        "profile_sha256": profile.sha256,
        "profile_kind": profile.data.get("kind"),
        "cluster": profile.data.get("cluster"),
        "model": profile.shape.get("name"),
        # the model the plan is for: a run of another is refused or warned of (config.py)
        "model_shape": model_shape_of(profile.shape, meta["total_layers"]),
    }
    return plan


def _predicted(settings, profile, result, iteration_s, host, memory_breakdown):
    """The plan's ``predicted`` section."""
    tokens = settings.global_batch_size * profile.shape["seq_length"]
    return {
        # the longer of the device's and the host's timelines (planner/host_model.py)
        "iteration_time_s": iteration_s,
        "device_time_s": result["iteration_time_s"],
        "host": host,
        "forward_s": result["forward_s"],
        "backward_s": result["backward_s"],
        "edges_s": result["edges_s"],
        "grad_sync_s": result["grad_sync_s"],
        "grad_sync_included": result["grad_sync_included"],
        # the exposed all-gathers and reduce-scatters of data_parallel_sharding (0 without)
        "sharding_s": result.get("sharding_s", 0.0),
        "peak_memory_bytes_per_rank": result["peak_memory_bytes"],
        "peak_memory_with_margin_bytes": result["peak_memory_bytes"] * (1 + settings.margin),
        "memory_breakdown_bytes": memory_breakdown,
        "tokens_per_s": tokens / iteration_s,
        "per_layer": result["per_layer"],
    }


def _hashed_inputs(settings, profile, problem, pins):
    """What determines a plan, for ``input_hash`` (keys added later appear only where set, so
    that older plans hash as before)."""
    meta = problem.meta
    inputs = {
        "profile_sha256": profile.sha256,
        "schedule": settings.schedule,
        "recompute": settings.recompute,
        "global_batch_size": settings.global_batch_size,
        "micro_batch_size": meta["micro_batch_size"],
        "memory_gb": settings.memory_gb,
        "margin": settings.margin,
        "granule": settings.granule,
        "degrees": problem.degrees,
        "pins": pins,
        "max_switches": settings.max_switches,
        "grad_sync": settings.grad_sync,
        "allow_unsplit": settings.allow_unsplit,
        "distributed_optimizer": settings.distributed_optimizer,
        "sequence_parallel": settings.sequence_parallel,
    }
    if meta["recompute_num_layers"] is not None:
        inputs["recompute_num_layers"] = meta["recompute_num_layers"]
    if settings.split != "batch":
        inputs["split"] = settings.split
    if settings.data_parallel_sharding is not None:
        inputs["data_parallel_sharding"] = settings.data_parallel_sharding
    return inputs


def _dumps(obj, indent=0):
    """JSON with scalar lists and flat dicts on one line (easy to edit ``degrees`` by hand)."""
    pad = "  " * indent
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        if all(not isinstance(v, (dict, list)) for v in obj.values()) and indent > 0:
            return json.dumps(obj)
        items = [f'{pad}  {json.dumps(k)}: {_dumps(v, indent + 1)}' for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list):
        if all(not isinstance(v, (dict, list)) for v in obj):
            return json.dumps(obj)
        items = [f"{pad}  {_dumps(v, indent + 1)}" for v in obj]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(obj)


def save_plan(plan, path):
    """Validate ``plan`` and write it to ``path`` whole or not at all: serialised first, then
    :func:`write_atomic` (an interrupted save leaves the old plan as it was, never a cut one)."""
    validate_plan(plan, source=str(path))
    write_atomic(path, _dumps(plan) + "\n", "plan file")
    return path
