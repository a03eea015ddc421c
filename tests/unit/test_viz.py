"""Trace analysis (exposed communication, comm union, efficiency, CPU time) and the timeline PNG."""

import json
import threading
import time

import pytest

from megatron_oases.instrument.trace import Tracer, trace_path
from megatron_oases.viz import analysis
from megatron_oases.viz.__main__ import main as viz_main
from megatron_oases.viz.timeline import plot_timeline

PNG = b"\x89PNG\r\n\x1a\n"


def _ev(cat, ts, dur, **args):
    tid = 0 if cat == "compute" else 1
    return {
        "name": cat,
        "cat": cat,
        "ph": "X",
        "pid": 0,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def _comm(issue, wait, done, sb=-1, p="forward", **extra):
    return _ev(
        "comm",
        issue,
        done - issue,
        op="all_reduce",
        bytes=8,
        group_size=2,
        sub_batch=sb,
        issue_us=issue,
        wait_us=wait,
        done_us=done,
        **{"pass": p},
        **extra,
    )


def _trace(events, T, rank=0, schedule="off"):
    return {
        "traceEvents": events,
        "metadata": {
            "rank": rank,
            "world_size": 2,
            "schedule": schedule,
            "iteration": 3,
            "iteration_time_us": T,
        },
    }


def test_interval_helpers():
    assert analysis.union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert analysis.length([(0, 2), (1, 3), (10, 11)]) == 4
    assert analysis.subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert analysis.subtract([(0, 4), (6, 8)], [(3, 7)]) == [(0, 3), (7, 8)]


def test_stock_metrics_sync_communication_is_all_exposed():
    # compute 100, sync comm 60, compute 100, sync comm 60 (+ 10 of other host time): T = 330.
    ev = [
        _ev("compute", 0, 100, sub_batch=-1),
        _comm(100, 100, 160),
        _ev("compute", 160, 100, sub_batch=-1),
        _comm(260, 260, 320),
    ]
    m = analysis.rank_metrics(_trace(ev, 330))
    assert m["exposed_us"] == 120 and m["comm_us"] == 120
    assert m["exposed_share"] == pytest.approx(120 / 330)
    assert m["compute_us"] == 210 and m["traced_compute_us"] == 200
    assert m["efficiency"] == pytest.approx(210 / 330)


def test_overlapped_metrics_hidden_communication():
    # Two sub-batches: each comm runs under the other's compute; only the last one is waited on.
    ev = [
        _ev("compute", 0, 100, sub_batch=0),
        _comm(100, 200, 200, sb=0),
        _ev("compute", 100, 100, sub_batch=1),
        _comm(200, 200, 260, sb=1),
    ]
    m = analysis.rank_metrics(_trace(ev, 260, schedule="oases"))
    assert m["exposed_us"] == 60 and m["comm_us"] == 160 and m["compute_us"] == 200
    assert m["efficiency"] == pytest.approx(200 / 260)


def test_modelled_completion_bounds_the_comm_interval():
    # Waited late (done at 500) but the emulator says the transfer ended at 150.
    ev = [_comm(100, 500, 500, model_done_us=150)]
    m = analysis.rank_metrics(_trace(ev, 600))
    assert m["comm_us"] == 50 and m["exposed_us"] == 0


def test_run_metrics_average_ranks():
    a = _trace([_comm(0, 0, 50)], 100, rank=0)
    b = _trace([_comm(0, 0, 30)], 100, rank=1)
    m = analysis.run_metrics([a, b])
    assert m["exposed_share"] == pytest.approx(0.4) and m["num_ranks"] == 2
    assert [r["rank"] for r in m["ranks"]] == [0, 1]
    assert analysis.run_metrics([]) is None


def test_schedule_exposure_leaves_out_waiting_for_a_late_peer():
    """Rank 0 reaches both collectives early and blocks until its peer (rank 1) arrives: that
    is skew between the ranks, not the schedule. Per collective the least blocked time over
    the ranks is the schedule's own exposure (the first collective: rank 1 blocked 5 us too,
    the link's own; the second: hidden on rank 1)."""
    r0 = _trace([_comm(0, 10, 40), _comm(50, 60, 100, p="backward")], T=200, rank=0)
    r1 = _trace([_comm(30, 35, 40), _comm(80, 100, 100, p="backward")], T=200, rank=1)
    m = analysis.run_metrics([r0, r1])
    assert m["exposed_us"] == pytest.approx(((30 + 40) + (5 + 0)) / 2)
    assert m["schedule_exposed_us"] == pytest.approx(5 + 0)
    assert m["schedule_exposed_share"] == pytest.approx(5 / 200)
    # matched by labels and order, not by timestamps: a third collective only rank 0 has
    # keeps its own blocked time; one rank alone (a one-rank run: its peers are virtual and
    # never late) keeps all of its own
    r0["traceEvents"].append(_comm(150, 150, 170, p="optimizer"))
    assert analysis.schedule_exposed_us([r0, r1]) == pytest.approx((2 * 5 + 20) / 2)
    assert analysis.schedule_exposed_us([r0]) == pytest.approx(30 + 40 + 20)
    assert analysis.run_metrics([r0])["schedule_exposed_share"] == pytest.approx(90 / 200)
    assert analysis.schedule_exposed_us([]) is None


def _tracer_trace(rank, path_pattern):
    """A trace written by the project's own Tracer (format compatibility)."""
    tr = Tracer(rank=rank, world_size=2, schedule="oases")
    tr.start_iteration(3)
    for p in ("forward", "recompute", "backward"):
        for sb in (0, 1):
            with tr.compute(**{"pass": p, "layer": 0, "block": "attention", "sub_batch": sb}):
                pass
            with tr.context(**{"pass": p, "sub_batch": sb}):
                rec = tr.comm_issue("all_reduce", 1024, 2, True)
            tr.comm_wait(rec)
            tr.comm_done(rec)
    tr.end_iteration()
    path = trace_path(path_pattern, rank)
    tr.dump(path)
    return path


def test_timeline_png_and_cli(tmp_path, capsys):
    pattern = str(tmp_path / "t.rank{rank}.json")
    files = [_tracer_trace(r, pattern) for r in (0, 1)]
    traces = analysis.load_traces(pattern)
    assert len(traces) == 2 and analysis.trace_files(pattern) == sorted(files)
    m = analysis.run_metrics(traces)
    assert 0.0 <= m["exposed_share"] <= 1.0 and m["iteration_us"] > 0
    out = plot_timeline(traces, str(tmp_path / "timeline.png"), title="test")
    with open(out, "rb") as f:
        data = f.read()
    assert data.startswith(PNG) and len(data) > 10_000
    # Stock-style trace without compute events still plots.
    stock = [_trace([_comm(0, 0, 50), _comm(60, 60, 90)], 100, rank=r) for r in (0, 1)]
    assert plot_timeline(stock, str(tmp_path / "stock.png"))
    assert viz_main([pattern, "-o", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").read_bytes().startswith(PNG)
    printed = capsys.readouterr().out
    assert json.loads(printed[: printed.rindex("}") + 1])["num_ranks"] == 2
    assert viz_main([str(tmp_path / "missing.json")]) == 2


def test_channel_replay_uses_the_emulators_model():
    # Two async all-reduces issued back to back, waited late: each transfer lasts 40 µs on the
    # model, the second queues behind the first on the group's channel.
    ev = [_comm(0, 500, 500), _comm(10, 500, 500)]
    for e in ev:
        e["args"]["group_size"] = 2
    ends = analysis.modelled_ends(ev, lambda e: 40.0)
    assert ends == [40.0, 80.0]
    m = analysis.rank_metrics(_trace(ev, 600), comm_model=lambda e: 40.0)
    assert m["comm_us"] == 80 and m["exposed_us"] == 0
    assert analysis.rank_metrics(_trace(ev, 600))["comm_us"] == 500  # without: until the wait
    model = analysis.emulated_comm_model({"profile": "rtx3090-pcie", "dilation": 100.0})
    e = _comm(0, 0, 1)
    e["args"].update(bytes=4 * 1000, group_size=2)  # 1000 fp32 elements = 2000 fp16 bytes
    from megatron_oases.testbed.clusters import load_cluster

    want = 100.0 * load_cluster("rtx3090-pcie").all_reduce_time(2000, [0, 1]) * 1e6
    assert model(e) == pytest.approx(want)


def _cpu_comm(issue, wait, done, cpu_issue, cpu_wait, cpu_done, **kw):
    e = _comm(issue, wait, done, **kw)
    e["args"].update(issue_cpu_us=cpu_issue, wait_cpu_us=cpu_wait, done_cpu_us=cpu_done)
    return e


def _op(ts, dur, cpu, p="forward", layer=0, block="layer", sb=-1, runq=None):
    return _ev(
        "compute", ts, dur, layer=layer, block=block, sub_batch=sb, cpu_us=cpu, runq_us=runq,
        **{"pass": p},
    )  # fmt: skip


def test_cpu_metrics_tell_extra_work_from_contention():
    """Stock: one layer segment [0, 700] containing a synchronous all-reduce blocked [400, 600];
    the split schedule: the same layer's work (500 µs CPU) in two sub-batch ops that took 800 µs of
    wall, because the thread waited 300 µs for a CPU. Compute CPU is equal, compute wall is not."""
    stock = _trace(
        [_op(0, 700, 502, runq=0), _cpu_comm(400, 400, 600, 300, 300, 302)], 1000, schedule="off"
    )
    stock["metadata"].update(iteration_cpu_us=702, iteration_runq_us=0)
    split = _trace(
        [
            _op(0, 400, 250, block="attention", sb=0, runq=150),
            _cpu_comm(400, 900, 950, 250, 500, 500, sb=0),
            _op(400, 400, 250, block="attention", sb=1, runq=150),
            _cpu_comm(800, 950, 1000, 500, 500, 500, sb=1),
        ],
        1000,
        schedule="oases",
    )
    split["metadata"].update(iteration_cpu_us=600, iteration_runq_us=300)
    ops = analysis.compute_ops(stock)
    assert ops[0]["wall_us"] == pytest.approx(500) and ops[0]["cpu_us"] == pytest.approx(500)
    s, o = analysis.rank_metrics(stock), analysis.rank_metrics(split)
    assert s["blocked_cpu_us"] == pytest.approx(2) and s["compute_cpu_us"] == pytest.approx(700)
    assert s["compute_us"] == pytest.approx(800) and o["compute_us"] == pytest.approx(900)
    assert o["compute_cpu_us"] == pytest.approx(600) and o["runq_us"] == 300
    assert o["compute_cpu_share"] == pytest.approx(600 / 900)
    assert s["layer_compute_cpu_us"] == pytest.approx(500) == o["layer_compute_cpu_us"]
    assert o["layer_compute_us"] == pytest.approx(800)
    by = analysis.op_breakdown([split])
    assert by[("forward", 0)] == {"ops": 2, "wall_us": 800, "cpu_us": 500, "runq_us": 300}
    table = analysis.format_ops({"stock": [stock], "oases": [split]})
    assert "CPU oases/stock" in table.splitlines()[0]
    last = table.splitlines()[-1].split()
    assert last[:2] == ["all", "layers"] and last[-1] == "1.000"  # the same work
    assert last[2:5] == ["0.5", "0.5", "0.0"] and last[5:8] == ["0.8", "0.5", "0.3"]


def test_cpu_metrics_absent_from_old_traces():
    op = _ev("compute", 0, 50, layer=0, sub_batch=0, **{"pass": "forward"})
    old = _trace([op, _comm(50, 50, 90)], 100)
    m = analysis.rank_metrics(old)
    assert m["compute_us"] == 60 and m["compute_cpu_us"] is None and m["runq_us"] is None
    assert m["layer_compute_us"] == 50 and m["layer_compute_cpu_us"] is None
    assert analysis.op_breakdown(old)[("forward", 0)]["cpu_us"] is None
    run = analysis.run_metrics([old, old])
    assert run["compute_cpu_us"] is None and run["external_cpu_us"] is None
    assert "-" in analysis.format_ops({"a": [old]})


def test_host_load_of_other_processes():
    traces = []
    for rank in (0, 1):
        t = _trace([], 1000, rank=rank)
        t["metadata"].update(
            iteration_cpu_us=700,
            process_cpu_us=800,
            host_cpu={"busy_us": 2000 - 2 * rank, "steal_us": 0, "cpus": 2},
        )
        traces.append(t)
    m = analysis.run_metrics(traces)
    assert m["other_threads_cpu_us"] == pytest.approx(100)
    assert m["host_busy_cpu_us"] == pytest.approx(1999)
    assert m["external_cpu_us"] == pytest.approx(399)  # 1999 - 2 x 800
    assert m["external_cpu_share"] == pytest.approx(399 / 2000)


def test_tracer_records_thread_cpu_time(tmp_path):
    tr = Tracer(rank=0, world_size=1, schedule="off")
    tr.start_iteration(1)
    with tr.compute(**{"pass": "forward", "layer": 0, "block": "attention", "sub_batch": 0}):
        time.sleep(0.05)  # waiting: wall, no CPU
    with tr.compute(**{"pass": "forward", "layer": 0, "block": "mlp", "sub_batch": 0}):
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:  # working: CPU ~ wall (unless descheduled)
            pass
    tr.open_compute("bwd", **{"pass": "backward", "layer": 0, "block": "layer"})
    rec = tr.comm_issue("all_reduce", 1024, 2, True)
    tr.comm_wait(rec)
    time.sleep(0.02)
    tr.comm_done(rec)
    tr.close_compute("bwd")
    tr.close_compute("never-opened")
    tr.end_iteration()
    trace = tr.to_json()
    sleep_op, spin_op, bwd = [e for e in trace["traceEvents"] if e["cat"] == "compute"]
    assert sleep_op["dur"] >= 50e3 and sleep_op["args"]["cpu_us"] < 10e3
    a = spin_op["args"]
    assert spin_op["dur"] >= 50e3 and a["cpu_us"] > 0 and a["cpu_us"] <= spin_op["dur"] + 1e3
    if a["runq_us"] is not None:  # Linux: CPU + waiting for a CPU accounts for the wall time
        assert a["cpu_us"] + a["runq_us"] == pytest.approx(spin_op["dur"], rel=0.2)
    assert bwd["args"]["pass"] == "backward" and bwd["dur"] >= 20e3
    (comm,) = [e for e in trace["traceEvents"] if e["cat"] == "comm"]
    c = comm["args"]
    assert c["issue_cpu_us"] <= c["wait_cpu_us"] <= c["done_cpu_us"] < c["wait_cpu_us"] + 10e3
    md = trace["metadata"]
    assert md["iteration_cpu_us"] >= a["cpu_us"] and md["process_cpu_us"] >= a["cpu_us"] * 0.9
    m = analysis.rank_metrics(trace)
    assert m["blocked_cpu_us"] < 10e3 and m["compute_cpu_us"] >= a["cpu_us"] * 0.9
    if "threads_cpu_us" in md:
        assert set(md["threads_cpu_us"]) >= {"compute"} and md["host_cpu"]["cpus"] >= 1

    # Another thread's calls record no CPU time (thread_time is per thread).
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("cpu", tr.cpu_now()))
    worker.start()
    worker.join()
    assert got == {"cpu": None}


def test_intervals_are_cut_to_the_iteration():
    # The gradient all-reduce completes after the iteration's end stamp (the tracer records it
    # until it writes): only its part inside the iteration counts, so nothing exceeds T.
    ev = [_ev("compute", 0, 100, sub_batch=-1), _comm(0, 90, 130)]
    m = analysis.rank_metrics(_trace(ev, 110))
    assert m["comm_us"] == 110 and m["exposed_us"] == 20
    assert m["efficiency"] == pytest.approx(1.0) and m["exposed_share"] == pytest.approx(20 / 110)
    run = analysis.run_metrics([_trace(ev, 110, rank=r) for r in (0, 1)])
    assert run["schedule_exposed_us"] == pytest.approx(20)
