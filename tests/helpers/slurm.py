"""A real SLURM cluster for the launch-script tests: munged, slurmctld and slurmd(s) as root.

:func:`single_node` is one node on this machine's loopback (``tests/e2e/test_slurm.py``);
:func:`two_nodes` is one node per host of :class:`helpers.netns.TwoHosts`
(``tests/e2e/test_two_hosts_e2e.py``). Both generate a munge key and a ``slurm.conf``
(:data:`SLURM_CONF`) under ``root``, wait until every node is idle, and stop everything they
started at the end, also after a failure. SLURM missing is a failure, not a skip:
:func:`ensure_slurm_installed` runs ``.ci/install_slurm.sh`` (CI runs it too).
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from .netns import ADDRS
from .paths import REPO

#: Where the daemons are when ``PATH`` lacks the sbin directories (a non-login root shell).
SBIN_PATH = os.pathsep.join(["/usr/local/sbin", "/usr/sbin", "/sbin"])
BINARIES = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
)


def which(name):
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + SBIN_PATH)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid):
    """Whether ``pid`` runs (a zombie does not: it only waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def read_pid(path):
    try:
        with open(path) as f:
            return int(f.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


def ensure_slurm_installed():
    missing = [b for b in BINARIES if not which(b)]
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.fail(
            f"SLURM is not installed (missing {missing}) and we are not root to install it; "
            "run .ci/install_slurm.sh as root"
        )
    proc = subprocess.run(
        ["bash", os.path.join(REPO, ".ci", "install_slurm.sh")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    missing = [b for b in BINARIES if not which(b)]
    if proc.returncode != 0 or missing:
        pytest.fail(
            f".ci/install_slurm.sh failed (rc {proc.returncode}, missing {missing}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )


def node_name():
    """This host's short name when it resolves (torchrun's MASTER_ADDR), else localhost."""
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
        return host
    except OSError:
        return "localhost"


def detected_cpus():
    """CPUs as slurmd counts them (a larger CPUs= in slurm.conf would drain the node)."""
    proc = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, timeout=30)
    match = re.search(r"\bCPUs=(\d+)", proc.stdout)
    return int(match.group(1)) if match else 1


#: ``{per_node}`` is ``-%n`` (the node's name) where several slurmds share one machine: each its
#: own spool, pid and log file. slurmctld checks that it runs on ``SlurmctldHost``.
SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost={ctld_host}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool{per_node}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd{per_node}.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd{per_node}.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
ReturnToService=2
InactiveLimit=0
KillWait=5
# sbatch --wait polls every 2 s only while MinJobAge/2 <= 2 (else it backs off to 8-32 s).
MinJobAge=4
{node_lines}\
PartitionName=ci Nodes={node_names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def slurm_conf(*, cluster, ctld_host, nodes, ctld_port, slurmd_port, munge_socket, root, cpus):
    """:data:`SLURM_CONF` for ``nodes`` ({name: address}); slurmctld on the first node's address."""
    addrs = list(nodes.values())
    return SLURM_CONF.format(
        cluster=cluster,
        ctld_host=ctld_host,
        ctld_addr=addrs[0],
        ctld_port=ctld_port,
        slurmd_port=slurmd_port,
        munge_socket=munge_socket,
        root=root,
        per_node="-%n" if len(nodes) > 1 else "",
        node_lines="".join(
            f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN\n"
            for name, addr in nodes.items()
        ),
        node_names=",".join(nodes),
    )


def stepds_of(root):
    """This cluster's leftover ``slurmstepd`` processes (their working directory is under root)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if f.read().strip() != "slurmstepd":
                    continue
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if cwd.startswith(root) and alive(int(entry)):
            found.append(int(entry))
    return found


class SlurmCluster:
    """The daemons started so far and how to talk to them: ``prefix`` runs a command where
    slurmctld is reachable (``TwoHosts.exec_prefix(0)``; nothing on one node)."""

    def __init__(self, root, prefix=()):
        self.root = root
        self.prefix = list(prefix)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["PATH"] = os.pathsep.join(
            [os.path.dirname(sys.executable), self.env.get("PATH", ""), SBIN_PATH]
        )
        #: daemon -> its pid file, in start order; pids as read once they ran
        self.pid_files = {}
        self.pids = {}

    def run(self, *cmd, timeout=60, **kwargs):
        return subprocess.run(
            self.prefix + list(cmd),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )

    def job_env(self, **extra):
        """The environment sbatch exports to the job (sbatch --export=ALL, the default)."""
        env = dict(
            self.env,
            PYTHON=sys.executable,
            OASES_ROOT=REPO,
            OMP_NUM_THREADS="1",
            DEVICE="cpu",
            GPUS_PER_NODE="2",
            MODEL="tiny-cpu",
            DIST_TIMEOUT_MINUTES="1",
            PYTHONPATH=REPO,
        )
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def sbatch_cmd(self, script, out, name, time_min, wait=True, nodes=None, chdir=None):
        """``sbatch`` of ``script``, by default in :attr:`root` (run it with :meth:`job_env`)."""
        return [
            *self.prefix,
            "sbatch",
            *(["--wait"] if wait else []),
            *([f"--nodes={nodes}"] if nodes else []),
            f"--job-name={name}",
            f"--output={out}",
            f"--chdir={chdir or self.root}",
            f"--time={time_min}",
            script,
        ]

    def logs(self):
        """The last 2000 characters of each SLURM log (for a failure's message)."""
        text = ""
        for name in sorted(os.listdir(os.path.join(self.root, "log"))):
            with open(os.path.join(self.root, "log", name)) as f:
                text += f"--- {name}\n" + f.read()[-2000:]
        return text

    def start(self, name, cmd, pid_file, what=None):
        """Start daemon ``name`` (it forks into the background); remembered for :meth:`stop`."""
        self.pid_files[name] = pid_file
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            what = what or name
            raise RuntimeError(f"{what} failed to start (rc {proc.returncode}): {proc.stderr}")

    def start_munged(self, munge_dir):
        """A fresh munge key and ``munged`` in ``munge_dir``; its socket's path."""
        key = os.path.join(munge_dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = os.path.join(munge_dir, "munge.sock")
        pid_file = os.path.join(munge_dir, "munged.pid")
        self.start(
            "munged",
            [
                which("munged"),
                "--force",
                f"--key-file={key}",
                f"--socket={socket_path}",
                f"--pid-file={pid_file}",
                f"--log-file={munge_dir}/munged.log",
                f"--seed-file={munge_dir}/munged.seed",
            ],
            pid_file,
        )
        return socket_path

    def read_pids(self):
        """The daemons' pids, once they have written their pid files (up to 10 s each): a slurmd
        that is shutting down removes its pid file but may still wait on its job steps."""
        for name, path in self.pid_files.items():
            deadline = time.time() + 10
            while (pid := read_pid(path)) is None and time.time() < deadline:
                time.sleep(0.1)
            self.pids[name] = pid

    def wait_idle(self, fmt, idle, failure):
        """Poll ``sinfo --format=fmt`` until ``idle(its output)`` (60 s), else raise ``failure``
        (formatted with ``state``, sinfo's output) with the logs."""
        deadline = time.time() + 60
        state = ""
        while time.time() < deadline:
            proc = self.run("sinfo", "--noheader", f"--format={fmt}", timeout=20)
            state = proc.stdout.strip()
            if proc.returncode == 0 and idle(state):
                return
            time.sleep(0.5)
        raise RuntimeError(failure.format(state=state) + f"\n{self.logs()}")

    def stop(self):
        """Cancel the jobs, shut SLURM down, then make sure: the daemons (by the pids read at
        start, else their pid files), last started first, and leftover job steps are killed."""
        if self.env.get("SLURM_CONF"):
            for cmd in (["scancel", "--user=root"], ["scontrol", "shutdown"]):
                try:
                    self.run(*cmd, timeout=30)
                except (OSError, subprocess.SubprocessError):
                    pass
        for name in reversed(list(self.pid_files)):
            pid = self.pids.get(name) or read_pid(self.pid_files[name])
            if pid is None:
                continue
            deadline = time.time() + 15
            if alive(pid) and name == "munged":
                os.kill(pid, signal.SIGTERM)
            while alive(pid) and time.time() < deadline:
                time.sleep(0.2)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in stepds_of(self.root):
            os.kill(pid, signal.SIGKILL)


#: One SLURM cluster at a time on this machine: the suite runs two test files at once
#: (pytest-xdist), and both files that start a cluster could be among them.
LOCK = os.path.join(tempfile.gettempdir(), "oases-test-slurm.lock")


@contextlib.contextmanager
def one_cluster_at_a_time():
    """Hold :data:`LOCK` (another file's cluster first stops)."""
    import fcntl

    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def single_node(root):
    """:func:`_single_node`, once no other cluster of the suite runs."""
    with one_cluster_at_a_time(), _single_node(root) as cluster:
        yield cluster


@contextlib.contextmanager
def two_nodes(root, hosts):
    """:func:`_two_nodes`, once no other cluster of the suite runs."""
    with one_cluster_at_a_time(), _two_nodes(root, hosts) as cluster:
        yield cluster


@contextlib.contextmanager
def _single_node(root):
    """One SLURM node, this host (:func:`node_name`) on 127.0.0.1, free ports; files in ``root``."""
    cluster = SlurmCluster(root)
    try:
        host = node_name()
        for sub in ("state", "spool", "log", "munge"):
            os.makedirs(os.path.join(root, sub), mode=0o700, exist_ok=True)
        munge_dir = os.path.join(root, "munge")
        if len(os.path.join(munge_dir, "munge.sock")) > 100:  # AF_UNIX path limit
            munge_dir = tempfile.mkdtemp(prefix="oases-munge-")
        socket_path = cluster.start_munged(munge_dir)
        conf = os.path.join(root, "slurm.conf")
        with open(conf, "w") as f:
            f.write(
                slurm_conf(
                    cluster="oasesci",
                    ctld_host=host,
                    nodes={host: "127.0.0.1"},
                    ctld_port=free_port(),
                    slurmd_port=free_port(),
                    munge_socket=socket_path,
                    root=root,
                    cpus=detected_cpus(),
                )
            )
        cluster.env["SLURM_CONF"] = conf
        cluster.start("slurmctld", [which("slurmctld"), "-f", conf], f"{root}/slurmctld.pid")
        cluster.start("slurmd", [which("slurmd"), "-f", conf, "-N", host], f"{root}/slurmd.pid")
        cluster.read_pids()
        cluster.wait_idle(
            "%T",
            lambda state: state.startswith("idle"),
            "the SLURM node did not become idle (sinfo: {state!r})",
        )
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def _two_nodes(root, hosts):
    """Two SLURM nodes, one per host of ``hosts`` (:class:`helpers.netns.TwoHosts`): slurmctld and
    node0's slurmd on host 0, node1's on host 1; munged, whose socket is a file, serves both.
    slurmctld's host name is the machine's own (both namespaces share it), at host 0's address;
    each host has its own ports. Files in ``root``."""
    cluster = SlurmCluster(root, prefix=hosts.exec_prefix(0))
    try:
        for sub in ("state", "log", "spool-node0", "spool-node1"):
            os.makedirs(os.path.join(root, sub), mode=0o700)
        socket_path = cluster.start_munged(tempfile.mkdtemp(prefix="oases-munge-"))  # AF_UNIX
        conf = os.path.join(root, "slurm.conf")
        with open(conf, "w") as f:
            f.write(
                slurm_conf(
                    cluster="oases2n",
                    ctld_host=socket.gethostname().split(".")[0],
                    nodes={"node0": ADDRS[0], "node1": ADDRS[1]},
                    ctld_port=6817,
                    slurmd_port=6818,
                    munge_socket=socket_path,
                    root=root,
                    cpus=detected_cpus(),
                )
            )
        cluster.env["SLURM_CONF"] = conf
        cluster.start(
            "slurmctld",
            hosts.daemon_prefix(0) + [which("slurmctld"), "-f", conf],
            f"{root}/slurmctld.pid",
        )
        for k in range(2):
            cluster.start(
                f"slurmd-node{k}",
                hosts.daemon_prefix(k) + [which("slurmd"), "-f", conf, "-N", f"node{k}"],
                f"{root}/slurmd-node{k}.pid",
                what=f"slurmd on host {k}",
            )
        cluster.read_pids()
        cluster.wait_idle(
            "%n %T",
            lambda state: sorted(state.splitlines()) == ["node0 idle", "node1 idle"],
            "the two SLURM nodes did not become idle ({state!r})",
        )
        yield cluster
    finally:
        cluster.stop()
