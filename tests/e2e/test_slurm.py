"""The launch scripts on a real single-node SLURM (Debian slurmctld, slurmd, munge), CPU/gloo ranks.

The module fixture (``helpers.slurm.single_node``) generates a munge key and a minimal
``slurm.conf`` in a pytest temp dir, starts ``munged``, ``slurmctld`` and ``slurmd`` as root on free
ports, and tears them down at the end. SLURM missing is a failure, not a skip: the fixture runs
``.ci/install_slurm.sh`` first (CI runs it too).
"""

import json
import os
import re
import signal
import subprocess
import time
import uuid

import pytest
from helpers.paths import LAUNCHER, REPO
from helpers.slurm import alive, ensure_slurm_installed, node_name, single_node

COMPARE = os.path.join(REPO, "launch_scripts", "compare_vs_megatron.sh")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the SLURM tests start slurmctld/slurmd/munged and must run as root")
    ensure_slurm_installed()
    with single_node(str(tmp_path_factory.mktemp("slurm"))) as cluster:
        yield cluster


def _job_processes(job_id, slurm_conf):
    """(pid, environ) of this cluster's job ``job_id`` (another test cluster may reuse job ids)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = dict(
                    kv.split("=", 1)
                    for kv in f.read().decode(errors="replace").split("\0")
                    if "=" in kv
                )
        except OSError:
            continue
        if (
            environ.get("SLURM_JOB_ID") == str(job_id)
            and environ.get("SLURM_CONF") == slurm_conf
            and alive(int(entry))
        ):
            found.append((int(entry), environ))
    return found


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(")")[-1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _read(path, tail=None):
    try:
        with open(path) as f:
            text = f.read()
            return text[-tail:] if tail else text
    except OSError:
        return "(no output file)"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sbatch_pretrain_job_succeeds_and_writes_json(slurm, tmp_path):
    """ENTRY=pretrain-gpt-oases (``oases-pretrain-gpt``); the other jobs use the default entry."""
    golden = tmp_path / "golden.json"
    out = tmp_path / "job.out"
    proc = subprocess.run(
        slurm.sbatch_cmd(LAUNCHER, out, "oases-ci-train", 4),
        capture_output=True,
        text=True,
        timeout=230,
        env=slurm.job_env(TRAIN_ITERS=3, LOG_JSON=golden, ENTRY="pretrain-gpt-oases"),
    )
    log = _read(out)
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\n{log}"
    host = node_name()
    # The srun path: MASTER_ADDR came from `scontrol show hostnames`, 2 CPU ranks on gloo.
    assert "entry=pretrain-gpt-oases model=tiny-cpu device=cpu nodes=1" in log, log
    assert f"world=2 TP=2 PP=1 schedule=off master={host}:" in log, log
    assert re.search(r"^oases launch: \S*/oases-pretrain-gpt --num-layers 2 ", log, re.M), log
    assert "--distributed-backend gloo" in log and "iteration        3/       3" in log, log
    with open(golden) as f:
        data = json.load(f)
    assert data["lm loss"]["start_step"] == 1 and data["lm loss"]["end_step"] == 3
    assert len(data["lm loss"]["values"]) == 3 and len(data["iteration-time"]["values"]) == 3


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_compare_vs_megatron_writes_summary_table(slurm, tmp_path):
    out_dir = tmp_path / "compare"
    out = tmp_path / "compare.out"
    proc = subprocess.run(
        slurm.sbatch_cmd(COMPARE, out, "oases-ci-compare", 6),
        capture_output=True,
        text=True,
        timeout=350,
        env=slurm.job_env(MATRIX="ci", OUT_DIR=out_dir, TRAIN_ITERS=3),
    )
    log = _read(out)
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\n{log}"
    with open(out_dir / "summary.md") as f:
        table = f.read()
    lines = table.strip().splitlines()
    assert lines[0].startswith("| run | schedule | TP | PP | status | iters | lm loss (last) |")
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]] for ln in lines[2:]}
    assert set(rows) == {"megatron-tp2-pp1", "oases-tp2-pp1"}, table
    for name, cells in rows.items():
        assert cells[4] == "ok" and cells[5] == "3", table
        assert float(cells[6]) > 0 and float(cells[7]) > 0, table
        assert (out_dir / f"{name}.json").exists()
    assert rows["megatron-tp2-pp1"][9] == "1.00" and rows["oases-tp2-pp1"][1] == "oases"
    assert table.strip() in log  # the job prints its summary table too


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_rank_fails_the_job_instead_of_hanging(slurm, tmp_path):
    out = tmp_path / "kill.out"
    name = f"oases-ci-kill-{uuid.uuid4().hex[:8]}"
    job = subprocess.Popen(
        slurm.sbatch_cmd(LAUNCHER, out, name, 4),  # --time 4 min: SLURM's backstop
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=slurm.job_env(TRAIN_ITERS=1000000, LOG_JSON=tmp_path / "kill.json"),
    )
    try:
        deadline = time.time() + 180
        job_id = None
        while time.time() < deadline and job_id is None:
            q = slurm.run("squeue", "--noheader", f"--name={name}", "--format=%i")
            job_id = q.stdout.strip() or None
            time.sleep(0.3)
        assert job_id, f"job {name} never showed up in squeue"
        # Wait until both ranks train (two iterations logged), then SIGKILL rank 1.
        while time.time() < deadline and len(re.findall(r" iteration +\d+/", _read(out))) < 2:
            assert job.poll() is None, f"job ended early:\n{_read(out)}"
            time.sleep(0.3)
        # Rank 1 is the process torchrun started with RANK=1; its own children (Megatron's data
        # loader workers) inherit that environment.
        with_rank_1 = {
            pid
            for pid, e in _job_processes(job_id, slurm.env["SLURM_CONF"])
            if e.get("RANK") == "1" and e.get("LOCAL_RANK") == "1"
        }
        ranks = [pid for pid in with_rank_1 if _parent(pid) not in with_rank_1]
        assert len(ranks) == 1, f"rank 1 of job {job_id} not found: {ranks}\n{_read(out)}"
        killed_at = time.time()
        os.kill(ranks[0], signal.SIGKILL)
        rc = job.wait(timeout=90)
        took = time.time() - killed_at
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    log = _read(out)
    assert rc != 0, f"the job survived a killed rank:\n{log}"
    # Well inside the 4-minute --time: torchrun noticed the dead rank and stopped the other one.
    assert took < 60, f"job took {took:.0f} s to fail after the kill:\n{log}"
    assert re.search(r"exitcode\s*:\s*-9|Signal 9|SIGKILL", log), log
    deadline = time.time() + 20
    while _job_processes(job_id, slurm.env["SLURM_CONF"]) and time.time() < deadline:
        time.sleep(0.5)
    assert (
        _job_processes(job_id, slurm.env["SLURM_CONF"]) == []
    ), "processes of the failed job are still running"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_corrupt_plan_file_fails_the_job_with_one_line(slurm, tmp_path):
    """A fault found before training (a binary --oases-plan): one error line for the whole job
    (2 ranks under srun + torchrun), a failed job, no training."""
    plan = tmp_path / "plan.json"
    plan.write_bytes(bytes(range(256)))
    out = tmp_path / "badplan.out"
    proc = subprocess.run(
        slurm.sbatch_cmd(LAUNCHER, out, "oases-ci-badplan", 3),
        capture_output=True,
        text=True,
        timeout=180,
        env=slurm.job_env(TRAIN_ITERS=3, EXTRA_ARGS=f"--oases-plan {plan}"),
    )
    log = _read(out)
    assert proc.returncode != 0, log
    # srun adds its own "srun: error: ... task 0: Exited with exit code 1"
    errors = [ln for ln in log.splitlines() if ": error: " in ln and not ln.startswith("srun:")]
    assert errors == [
        f"oases train: error: plan file {plan} is not a text file (binary content); write one "
        "with `oases plan --out PLAN_JSON`"
    ], log
    assert not re.search(r" iteration +\d+/", log), log
