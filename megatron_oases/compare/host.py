"""The host floor of each ``oases compare`` variant: what the iteration costs the host to issue.

The emulator dilates compute by D but not the host's cost of issuing ops, which a GPU pays at full
price: an iteration cannot finish sooner than its host can issue it. After the timed runs, an
untimed pass (rank 0 alone on the fake process group, no link emulator: one process) runs each
variant twice in-process, at the run's layer count L and at 2L, and counts the aten calls of its
second iteration (:mod:`megatron_oases.instrument.host_calls`). Counted, not timed: the same on
every CPU host for the run's shape (a GPU's CUDA path issues its own count). Then, per variant,
``host``:

* ``aten_calls_per_iteration`` (at L), ``aten_calls_per_layer`` (per micro-batch:
  (calls at 2L − calls at L) ÷ L ÷ micro-batches per iteration);
* ``issue_ms_per_iteration``: calls × the target profile's ``host_us_per_call``;
* ``device_ms_per_iteration``: the emulated iteration ÷ D (the target GPU's time);
* ``host_bound``: issue time > device time (the host, not the GPU, sets the pace);
* ``host_floor_s``: the issue time in this host's dilated units (× D), to set beside the
  emulated time in the table and chart.
"""

import os

from ..errors import last_line


def _worker(configs, log_path):
    """A one-rank :func:`~megatron_oases.launch.run_distributed` process: aten calls of each
    (name, layers, argv) job's second iteration; Megatron's output goes to ``log_path``."""
    from ..instrument.host_calls import profiled_step_patch
    from ..launch import output_to
    from ..training.pretrain import run_in_process

    console = output_to(log_path)
    out = {}
    for name, layers, argv in configs:
        record = {}
        try:
            run_in_process(argv, demo=True, extra_patches=[profiled_step_patch(record, 2)])
            out[(name, layers)] = record["aten_calls"]
        except Exception as exc:  # noqa: BLE001 - one variant's failure is its result
            out[(name, layers)] = {"error": last_line(exc)}
        console.write(f"  [host] {name}, {layers} layers: counted\n")
    return out


def _with_layers(argv, layers):
    """``argv`` with ``--num-layers`` set to ``layers`` (and 2 iterations, one micro-batch)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--num-layers", "--train-iters"):
            skip = True
            continue
        if a.startswith("--num-layers=") or a.startswith("--train-iters="):
            continue
        out.append(a)
    return out + ["--num-layers", str(layers), "--train-iters", "2", "--fake-process-group"]


def count_calls(variants, train_argv, parsed, nproc, out_dir, timeout, progress=print):
    """``{name: {aten_calls_per_iteration, aten_calls_per_layer}}`` (or ``{'error': line}``) for
    the resolved ``variants``; ``parsed``: each variant's Megatron args."""
    from ..launch import run_distributed

    configs = []
    for v in variants:
        layers = parsed[v.name].num_layers
        argv = list(train_argv) + list(v.flags)
        # a per-layer plan fixes the layer count: such a variant is counted at L only
        counts_at = (layers,) if v.needs_plan else (layers, 2 * layers)
        configs += [(v.name, n, _with_layers(argv, n)) for n in counts_at]
    log_path = os.path.join(out_dir, "host-pass.log")
    progress(
        f"host pass (untimed, rank 0 alone, no link emulation): aten calls of {len(variants)} "
        f"variant(s) at L and 2L layers; Megatron's output in {os.path.basename(log_path)}"
    )
    try:
        counts = run_distributed(
            _worker,
            nproc,
            configs,
            log_path,
            timeout=timeout * max(len(configs), 1),
            one_rank=True,
        )[0]
    except RuntimeError as exc:
        why = f"host pass failed: {last_line(exc)}"
        progress(why)
        return {v.name: {"error": why} for v in variants}
    out = {}
    for v in variants:
        a = parsed[v.name]
        L = a.num_layers
        c1, c2 = counts.get((v.name, L)), counts.get((v.name, 2 * L))
        bad = next((c for c in (c1, c2) if isinstance(c, dict)), None)
        if bad is not None or c1 is None or (c2 is None and not v.needs_plan):
            bad = dict(bad or {"error": "not counted"})
            bad["error"] = bad["error"].replace(out_dir.rstrip("/") + "/", "")  # DIR-relative
            out[v.name] = bad
            continue
        dp = max(1, nproc // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size))
        micro = max(1, a.global_batch_size // (a.micro_batch_size * dp))
        out[v.name] = {
            "aten_calls_per_iteration": c1,
            "aten_calls_per_layer": None if c2 is None else (c2 - c1) / L / micro,
            "micro_batches_per_iteration": micro,
        }
    return out


def project(host, result, emulation, profile):
    """Add the projected issue and device times and ``host_bound`` to ``host`` (in place)."""
    if "aten_calls_per_iteration" not in host or profile is None:
        return host
    host["host_us_per_call"] = profile.host_us_per_call
    issue_ms = host["aten_calls_per_iteration"] * profile.host_us_per_call / 1e3
    host["issue_ms_per_iteration"] = issue_ms
    d = float(emulation["dilation"])
    if result.get("mean_iteration_s"):
        device_ms = 1e3 * result["mean_iteration_s"] / d
        host["device_ms_per_iteration"] = device_ms
        host["host_bound"] = issue_ms > device_ms
        host["host_floor_s"] = issue_ms * d / 1e3
    return host
