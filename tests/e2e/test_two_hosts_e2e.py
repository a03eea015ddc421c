"""Two hosts for real: ``oases-pretrain-gpt`` across two hosts, each host a network namespace with
its own address on a veth pair (``tests/helpers/netns.py``); gloo runs over the veth
(``GLOO_SOCKET_IFNAME``), the rendezvous on host 0's address.

Layout: TP=2 inside each host, DP=2 across the hosts (4 ranks; the last rank, which prints
Megatron's iteration lines, on host 1). One chain of four runs, iterations 1-4 saving at 2 and 4,
covers the launchers, the schedules, the checkpoint and the faults:

1. ``stock`` (``--oases-schedule off``), uninterrupted, through the SLURM launch script on two
   SLURM nodes (one ``slurmd`` per namespace, ``sbatch --nodes 2``): the reference losses, and
   the command line every later run repeats; its checkpoint of iteration 2 is written by the
   ranks of both hosts.
2. ``overlap`` under ``torchrun --nnodes 2 --node-rank k`` on each host, rank 2 (host 1)
   SIGKILLed at the start of iteration 3: the job ends on both hosts within a bounded time with
   one error line; iterations 1-2 equal stock's; the checkpoint of iteration 2 is intact.
3. ``cross-pass`` resumed from it, rank 2 taking host 1's veth down at the start of iteration 4:
   both hosts end after the distributed timeout (``--distributed-timeout-seconds-after-init``)
   with one error line; iteration 3 equals stock's; the checkpoint of iteration 2 is intact.
4. ``oases`` resumed from it (veth up again): iterations 3-4 equal stock's, iteration 4 saved.

Five 4-rank jobs would be the cleaner split; one less keeps the module's time down (see
``docs/multi-node.md``).
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import types

import helpers
import pytest
from helpers.netns import ADDRS, IFNAME, TwoHosts, why_not_available
from helpers.paths import FAULT_INJECTION, LAUNCHER
from helpers.slurm import ensure_slurm_installed, two_nodes

from megatron_oases.training.checkpoint_check import check_tracker

_WHY_NOT = why_not_available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),  # the first test sets up the chain of four 4-rank jobs
    pytest.mark.skipif(
        _WHY_NOT is not None, reason=f"two hosts need network namespaces: {_WHY_NOT}"
    ),
]

#: Added to the SLURM script's tiny-cpu command line (TP=2; DP=2 across the hosts): dropout 0 and
#: full recomputation, so that every schedule can be compared with stock (cross-pass and oases
#: need the recomputation); saves at 2 and 4; a peer that stops answering is given up after 10 s
#: once training runs.
FLAGS = "--save-interval 2 --distributed-timeout-seconds-after-init 10 --num-workers 0"
EXTRA_ARGS = helpers.NO_DROP + helpers.RECOMPUTE + FLAGS
#: Megatron's iteration line: iteration number, loss.
ITERATION = re.compile(r" iteration +(\d+)/ *\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
#: The most a job may take from the fault to its end on both hosts: the 10 s timeout, the 5 s
#: grace before the error line, torchrun stopping the other ranks, with room for a loaded host.
FAULT_TO_END_S = 60


@pytest.fixture(scope="module")
def hosts():
    with TwoHosts() as h:
        yield h


def launch(hosts, command, fault=None, timeout=300):
    """``torchrun --nnodes 2 --node-rank k`` on each host k of ``hosts``, ``command``
    (``oases-pretrain-gpt ARGV``; with ``fault``: ``oases run ARGV`` in
    ``tests/helpers/fault_injection.py``, the same program). Each torchrun in its own session, killed with what is left of it at the end (a hang
    past ``timeout`` fails the test). Returns ``rcs``, ``out`` (per host), ``losses`` ({iteration:
    loss}), ``faulted`` (when the fault's rank said it strikes), ``ended`` (when both had exited).
    """
    program = [FAULT_INJECTION, "run"] if fault else command[:1]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME)
    env.pop("OASES_FAULT", None)
    if fault:
        env["OASES_FAULT"] = fault
    port = str(20000 + os.getpid() % 10000 + int(time.time()) % 5000)
    files = [tempfile.TemporaryFile("w+") for _ in range(2)]
    procs = []
    try:
        for k in range(2):
            cmd = hosts.exec_prefix(k) + [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(k),
                "--nproc-per-node",
                "2",
                "--master-addr",
                ADDRS[0],
                "--master-port",
                port,
                *program,
                *command[1:],
            ]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=files[k],
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=env,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                )
            )
        deadline = time.time() + timeout
        faulted = None
        while time.time() < deadline and any(p.poll() is None for p in procs):
            if fault and faulted is None:
                files[1].seek(0)
                if "fault_injection: " in files[1].read():
                    faulted = time.time()
            time.sleep(0.2)
        ended = time.time()
        hung = [k for k, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    out = []
    for f in files:
        f.seek(0)
        out.append(f.read())
        f.close()
    if hung:
        pytest.fail(f"host(s) {hung} hung: no exit within {timeout} s\n{out[0][-3000:]}")
    losses = {int(i): float(v) for i, v in ITERATION.findall(out[1])}
    return types.SimpleNamespace(
        rcs=[p.returncode for p in procs], out=out, losses=losses, faulted=faulted, ended=ended
    )


def errors(run):
    """Our one-line errors (``PROG: error: ...``) in both hosts' output."""
    return [ln for o in run.out for ln in o.splitlines() if re.match(r"^[\w -]+: error: ", ln)]


def tracker(ckpt):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        return f.read().strip()


def assert_same_losses(got, ref, iterations, what):
    assert sorted(got) == iterations, (what, got)
    for it in iterations:
        assert got[it] == pytest.approx(ref[it], rel=1e-5), (what, it, got, ref)


SERVE = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 29400)); s.settimeout(20); "
    "c, _ = s.accept(); c.sendall(b'host 0')"
)
CONNECT = (
    "import socket, sys; c = socket.create_connection((sys.argv[1], 29400), timeout=3); "
    "print(c.recv(16).decode())"
)


def test_the_hosts_meet_only_over_the_veth_and_are_torn_down_after_a_failure():
    with pytest.raises(RuntimeError, match="failed on purpose"):
        with TwoHosts() as h:
            names = list(h.names)
            server = subprocess.Popen(h.exec_prefix(0) + [sys.executable, "-c", SERVE, ADDRS[0]])
            try:
                for _ in range(50):  # until it listens
                    client = subprocess.run(
                        h.exec_prefix(1) + [sys.executable, "-c", CONNECT, ADDRS[0]],
                        capture_output=True,
                        text=True,
                        timeout=30,
                    )
                    if client.returncode == 0:
                        break
                    time.sleep(0.2)
                assert client.stdout.strip() == "host 0", client.stderr
            finally:
                server.kill()
                server.wait()
            # not from this machine's own namespace, nor once host 1's veth is down
            outside = subprocess.run(
                [sys.executable, "-c", CONNECT, ADDRS[0]], capture_output=True, timeout=30
            )
            assert outside.returncode != 0
            h.link(1, "down")
            cut = subprocess.run(
                h.exec_prefix(1) + [sys.executable, "-c", CONNECT, ADDRS[0]],
                capture_output=True,
                timeout=30,
            )
            assert cut.returncode != 0
            raise RuntimeError("failed on purpose")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)


def sbatch_stock(slurm, root, ckpt):
    """``sbatch --nodes 2`` of the SLURM script on host 0: stock, iterations 1-4, saving into
    ``ckpt``; (sbatch's result, the job's output)."""
    out = root / "stock.job.out"
    env = slurm.job_env(
        ENTRY="pretrain-gpt-oases",
        TRAIN_ITERS=4,
        LR="1e-3",
        LOG_JSON=root / "stock.json",
        EXTRA_ARGS=f"{EXTRA_ARGS} --save {ckpt}",
        GLOO_SOCKET_IFNAME=IFNAME,
    )
    cmd = slurm.sbatch_cmd(LAUNCHER, out, "oases-two-nodes", 5, nodes=2, chdir=root)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=320)
    return proc, out.read_text() if out.exists() else "(no output file)"


@pytest.fixture(scope="module")
def chain(hosts, slurm_two_nodes, tmp_path_factory):
    """The four runs of the module docstring."""
    root = tmp_path_factory.mktemp("two_hosts")
    stock_ckpt, ckpt = str(root / "stock"), str(root / "ckpt")
    proc, log = sbatch_stock(slurm_two_nodes, root, stock_ckpt)
    if proc.returncode != 0:
        pytest.fail(
            f"the SLURM job failed: {proc.stdout}{proc.stderr}\n{log[-4000:]}\n"
            f"{slurm_two_nodes.logs()}"
        )
    # the script prints its command line: the program, then every flag
    command = shlex.split(re.search(r"^oases launch: (/\S+ .*)$", log, re.M).group(1))
    stock = types.SimpleNamespace(
        log=log, losses={int(i): float(v) for i, v in ITERATION.findall(log)}
    )
    runs, after = {}, {}

    def json_of(name):  # each run its own (the script's names the stock run's)
        return ["--log-json", str(root / f"{name}.json")]

    runs["kill"] = launch(
        hosts,
        command + ["--oases-schedule", "overlap", "--save", ckpt, *json_of("kill")],
        fault="kill:rank=2:iter=3",
    )
    after["kill"] = check_tracker(ckpt)  # the iteration of a complete checkpoint
    resume = ["--load", ckpt, "--save", ckpt]
    try:
        runs["linkdown"] = launch(
            hosts,
            command + ["--oases-schedule", "cross-pass", *resume, *json_of("linkdown")],
            fault="linkdown:rank=2:iter=4",
        )
    finally:
        hosts.link(1, "up")
        hosts.link(0, "up")
    after["linkdown"] = check_tracker(ckpt)
    runs["resumed"] = launch(
        hosts, command + ["--oases-schedule", "oases", *resume, *json_of("resumed")]
    )
    for name, run in runs.items():  # for a look after a failure
        for k, text in enumerate(run.out):
            (root / f"{name}.host{k}.log").write_text(text)
    return types.SimpleNamespace(
        stock=stock,
        command=command,
        runs=runs,
        after=after,
        stock_ckpt=stock_ckpt,
        ckpt=ckpt,
        root=root,
    )


def test_slurm_script_runs_stock_on_two_nodes_saving_from_both(chain, slurm_two_nodes):
    """srun started one torchrun per node, ``MASTER_ADDR`` node0 (``scontrol show hostnames``,
    resolved in each host's ``/etc/hosts``), 2 ranks per node on gloo over the veth; the
    checkpoint holds shards of ranks of both hosts."""
    log = chain.stock.log
    assert "device=cpu nodes=2 ranks/node=2 world=4 TP=2 PP=1 schedule=off master=node0:" in log
    assert re.search(r"^  world_size \.+ 4$", log, re.M), log[-3000:]
    assert sorted(chain.stock.losses) == [1, 2, 3, 4], log[-3000:]
    with open(chain.root / "stock.json") as f:
        assert len(json.load(f)["lm loss"]["values"]) == 4
    with open(os.path.join(slurm_two_nodes.root, "log", "slurmd-node1.log")) as f:
        assert "launch task StepId=" in f.read()  # srun's torchrun task on the second node
    shards = sorted(os.listdir(os.path.join(chain.stock_ckpt, "iter_0000002")))
    writers = {int(m.group(1)) for s in shards if (m := re.match(r"__(\d+)_\d+\.distcp$", s))}
    assert writers & {0, 1} and writers & {2, 3}, shards  # ranks of host 0 and of host 1


def test_sigkilled_rank_on_one_host_ends_the_job_on_both(chain):
    run = chain.runs["kill"]
    assert run.rcs[0] != 0 and run.rcs[1] != 0, run.rcs
    assert "exitcode  : -9" in run.out[1], run.out[1][-3000:]  # host 1's launcher names it
    lines = errors(run)
    assert len(lines) == 1, lines
    assert "lost contact with another rank of this job" in lines[0], lines
    assert run.faulted and run.ended - run.faulted < FAULT_TO_END_S, run.ended - run.faulted
    assert chain.after["kill"] == 2
    print(f"SIGKILL on host 1: both hosts ended {run.ended - run.faulted:.0f} s after it")


def test_host_dropping_off_the_network_ends_the_job_on_both(chain):
    run = chain.runs["linkdown"]
    assert run.rcs[0] != 0 and run.rcs[1] != 0, run.rcs
    lines = errors(run)
    assert len(lines) == 1, lines
    assert "lost contact with another rank of this job" in lines[0], lines
    assert "Timed out waiting 10000ms" in lines[0], lines
    assert run.faulted and run.ended - run.faulted < FAULT_TO_END_S, run.ended - run.faulted
    assert chain.after["linkdown"] == 2
    print(f"link down on host 1: both hosts ended {run.ended - run.faulted:.0f} s after it")


def test_schedules_equal_stock_and_the_checkpoint_survives_both_faults(chain):
    stock = chain.stock.losses
    assert_same_losses(chain.runs["kill"].losses, stock, [1, 2], "overlap, before the kill")
    assert_same_losses(chain.runs["linkdown"].losses, stock, [3], "cross-pass, resumed")
    resumed = chain.runs["resumed"]
    assert resumed.rcs == [0, 0], resumed.out[0][-3000:] + resumed.out[1][-3000:]
    assert_same_losses(resumed.losses, stock, [3, 4], "oases, resumed after both faults")
    assert tracker(chain.ckpt) == "4"


# ------------------------------------------------------------------ SLURM on the same two hosts


@pytest.fixture(scope="module")
def slurm_two_nodes(hosts, tmp_path_factory):
    """munged, slurmctld and two slurmds on ``hosts`` (``helpers.slurm.two_nodes``); everything
    started is stopped at the end (and :class:`TwoHosts` kills what is left inside the
    namespaces)."""
    ensure_slurm_installed()
    with two_nodes(str(tmp_path_factory.mktemp("slurm2")), hosts) as cluster:
        yield cluster
