"""The explanation table ``oases plan`` prints: per layer, the degree chosen, its cost, the runner-up
(the best other degree for that layer with every other layer kept) and why it lost."""

from .settings import recompute_label
from .time_model import decompose, evaluate, objective


def _ms(s):
    return f"{s * 1e3:.2f}"


def runner_ups(problem, ks, decomposition=None):
    """Per layer: dict(degree, delta_s, feasible, reason) for the best alternative degree."""
    U, P = decomposition or decompose(problem)
    base = objective(U, P, ks)
    A, R, fixed, budget = problem.quantized()
    base_eval = None
    out = []
    for l in range(problem.num_layers):
        alts = [k for k in range(len(problem.degrees)) if k != ks[l]]
        if not alts:
            out.append(None)
            continue
        best = None
        for k in alts:
            alt = list(ks)
            alt[l] = k
            delta = objective(U, P, alt) - base
            cand = {"degree_index": k, "delta_s": delta}
            if not problem.allowed[l, k]:
                cand["reason"] = "pinned"
            elif problem.max_switches is not None and problem.switches(alt) > problem.max_switches:
                cand["reason"] = f"exceeds --max-switches {problem.max_switches}"
            elif budget is not None and problem.peak_memory_granules(alt) > budget:
                over = (problem.peak_memory_granules(alt) - budget) * problem.granule
                cand["reason"] = f"needs {over / 1e9:.2f} GB more memory"
            else:
                cand["reason"] = None
            key = (cand["reason"] is not None and delta >= 0, delta)
            if best is None or key < best[0]:
                best = (key, cand)
        cand = best[1]
        if cand["reason"] is None or cand["delta_s"] >= 0:
            if base_eval is None:
                base_eval = evaluate(problem, ks)
            alt = list(ks)
            alt[l] = cand["degree_index"]
            ev = evaluate(problem, alt)
            parts = []
            for key, label in (
                ("forward_s", "fwd"),
                ("backward_s", "bwd"),
                ("edges_s", "re-shard"),
            ):
                d = ev[key] - base_eval[key]
                if abs(d) > 1e-9:
                    parts.append(f"{label} {d * 1e3:+.2f} ms")
            why = "slower: " + (", ".join(parts) or "equal cost")
            if cand["reason"]:
                why += f"; also {cand['reason']}"
        else:
            why = f"faster by {-cand['delta_s'] * 1e3:.2f} ms but {cand['reason']}"
        out.append(
            {
                "degree": problem.degrees[cand["degree_index"]],
                "delta_s": cand["delta_s"],
                "feasible": cand["reason"] is None,
                "why": why,
            }
        )
    return out


def explanation_table(problem, ks, result=None, decomposition=None, max_rows=None):
    """Text table; ``result`` is ``evaluate(problem, ks)`` (computed if omitted)."""
    result = result or evaluate(problem, ks)
    ups = runner_ups(problem, ks, decomposition)
    header = (
        f"{'layer':>5} {'degree':>6} {'fwd ms':>9} {'bwd ms':>9} {'edge ms':>8} {'mem GB':>7}  "
        f"{'runner-up':>9} {'Δ ms':>8}  why"
    )
    lines = [header, "-" * len(header)]
    rows = list(range(problem.num_layers))
    if max_rows and len(rows) > max_rows:
        # show the layers around every degree change, plus the ends
        keep = {0, len(rows) - 1}
        for l in range(len(rows) - 1):
            if ks[l] != ks[l + 1]:
                keep |= {l, l + 1}
        rows = sorted(keep)
    prev = None
    for l in rows:
        if prev is not None and l != prev + 1:
            lines.append(f"{'…':>5}")
        pl = result["per_layer"][l]
        up = ups[l]
        if up is None:
            why = "only one candidate degree"
            run = problem.settings  # (None for a hand-made instance)
            if run is not None and run.sequence_parallel:
                why = "--sequence-parallel: every layer at T (the runtime's SP is uniform TMP)"
            elif run is not None and run.split == "sequence":
                why = "--split sequence: every layer at T (the runtime's chunks are uniform TMP)"
            tail = f"{'—':>9} {'':>8}  {why}"
        else:
            tail = f"{up['degree']:>9} {up['delta_s'] * 1e3:>+8.2f}  {up['why']}"
        lines.append(
            f"{l:>5} {pl['degree']:>6} {_ms(pl['forward_s']):>9} {_ms(pl['backward_s']):>9} "
            f"{_ms(pl['edges_s']):>8} {pl['memory_bytes'] / 1e9:>7.2f}  {tail}"
        )
        prev = l
    return "\n".join(lines)


def compress_degrees(degrees):
    """[2, 2, 4, 4, 4] → '[2]*2 + [4]*3' (the paper's Table 6 notation)."""
    out, i = [], 0
    while i < len(degrees):
        j = i
        while j < len(degrees) and degrees[j] == degrees[i]:
            j += 1
        out.append(f"[{degrees[i]}]*{j - i}")
        i = j
    return " + ".join(out)


def summary(plan):
    p = plan["predicted"]
    recompute = recompute_label(plan.get("recompute"), plan.get("recompute_num_layers"))
    lines = [
        f"plan: {compress_degrees(plan['degrees'])}  (T={plan['tensor_model_parallel_size']}, "
        f"schedule {plan['schedule']}, {recompute} recompute, "
        f"global batch {plan['global_batch_size']}, micro-batch "
        f"{plan['micro_batch_size']} × {plan['num_microbatches']})",
        f"predicted iteration {p.get('device_time_s', p['iteration_time_s']) * 1e3:.2f} ms = "
        f"forward {p['forward_s'] * 1e3:.2f} + backward {p['backward_s'] * 1e3:.2f} + re-shard "
        f"{p['edges_s'] * 1e3:.2f} ms"
        + (
            f" + DP grad sync {p['grad_sync_s'] * 1e3:.2f} ms"
            if p.get("grad_sync_included")
            else ""
        )
        + (
            f" + {plan['data_parallel_sharding']} gathers/reduce-scatters "
            f"{p.get('sharding_s', 0.0) * 1e3:.2f} ms"
            if plan.get("data_parallel_sharding")
            else ""
        )
        + f"; {p['tokens_per_s'] / 1e3:.1f} k tokens/s (whole job)",
        host_line(p),
        f"peak memory per rank {p['peak_memory_bytes_per_rank'] / 1e9:.2f} GB "
        f"(+{plan['memory_margin']:.0%} margin = {p['peak_memory_with_margin_bytes'] / 1e9:.2f} GB"
        f" ≤ {plan['memory_gb']:g} GB)",
    ]
    bd = p.get("memory_breakdown_bytes")
    if bd:
        names = [
            ("fixed_state", "embeddings"),
            ("layer_state", "layer params+grads+optimizer"),
            ("saved_activations", "saved activations"),
            ("runtime_peak_layer", f"backward working set (layer {bd['runtime_peak_at_layer']})"),
            ("fixed_activations", "logits/loss"),
            ("overhead", "framework"),
        ]
        lines.append(
            "  = "
            + " + ".join(f"{label} {bd[k] / 1e9:.2f}" for k, label in names if k in bd)
            + " GB"
        )
    uni = []
    for d, u in plan.get("uniform", {}).items():
        uni.append(
            f"[{d}]*L {u['iteration_time_s'] * 1e3:.2f} ms"
            + ("" if u["fits"] else f" (needs {u['peak_memory_bytes_per_rank'] / 1e9:.1f} GB)")
        )
    if uni:
        lines.append("uniform: " + "; ".join(uni))
    if plan.get("sequence_parallel"):
        T = plan["tensor_model_parallel_size"]
        lines.append(
            f"sequence parallelism: every layer at T={T} (the runtime runs SP with uniform TMP "
            f"only); this is the prediction for --tensor-model-parallel-size {T} "
            f"--sequence-parallel --oases-schedule {plan['schedule']}, without --oases-plan"
        )
    if plan.get("split") == "sequence":
        T = plan["tensor_model_parallel_size"]
        lines.append(
            f"sequence chunks: every layer at T={T} (the runtime runs --oases-split sequence with "
            f"uniform TMP only); this is the prediction for --tensor-model-parallel-size {T} "
            f"--oases-schedule {plan['schedule']} --oases-split sequence, without --oases-plan"
        )
    if plan.get("speedup"):
        lines.append(
            "speedup: "
            + ", ".join(f"{k.replace('_', ' ')} {v:.3f}×" for k, v in plan["speedup"].items())
        )
    line = f"solver {plan['solver']} ({plan['status']}) in {plan['solve_time_s'] * 1e3:.1f} ms"
    v = plan.get("verify")
    if v:
        ilp, dp = v["ilp"], v["dp"]
        if v.get("agree") is True and ilp["objective"] is not None:
            line += (
                f"; verified: ILP {ilp['objective'] * 1e3:.4f} ms ({ilp['solve_time_s']:.2f} s) = "
                f"DP {dp['objective'] * 1e3:.4f} ms ({dp['solve_time_s']:.3f} s)"
            )
        elif v.get("agree") is True:
            line += "; verified: ILP and DP both infeasible"
        else:
            line += f"; verification {v['agree']}: {v.get('note', '')}"
    lines.append(line)
    return "\n".join(lines)


def host_line(p):
    """The host term of a prediction (:mod:`.host_model`), one line; '' without one."""
    h = p.get("host")
    if not h:
        return "host issue time: not modelled (a measured profile: its times include its host's)"
    issue = (
        f"host issue {h['issue_s'] * 1e3:.2f} ms ({h['calls']:,.0f} aten calls x "
        f"{h['host_us_per_call']:g} us)"
    )
    if h["host_bound"]:
        return (
            f"{issue} > device {p['device_time_s'] * 1e3:.2f} ms: HOST-BOUND, the iteration takes "
            f"the host's {p['iteration_time_s'] * 1e3:.2f} ms"
        )
    return f"{issue} < device {p['device_time_s'] * 1e3:.2f} ms: device-bound"
