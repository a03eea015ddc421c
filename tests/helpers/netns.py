"""Two hosts on one machine: two network namespaces joined by a veth pair, for multi-node tests.

Each namespace is a host with its own loopback and one interface, named :data:`IFNAME` in both
(as every node of a cluster has its ``eth0``), addressed :data:`ADDRS`; the hosts reach each other
only over the veth. They share the file system (a cluster's shared ``--save`` directory) and the
process table. Names are unique per use; :meth:`TwoHosts.close` kills what still runs inside and
deletes both namespaces (which deletes the veth), also after a failure. Needs root (``ip netns``).
"""

import os
import shutil
import signal
import subprocess
import time
import uuid

#: The interface of each host (the same name in both namespaces).
IFNAME = "veth0"
#: Host k's address on the veth; host 0 is the rendezvous (``--master-addr``).
ADDRS = ("10.77.0.1", "10.77.0.2")
PREFIX = 24


def _ip(*args, check=True):
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def why_not_available():
    """``None`` when this process can create network namespaces, else the reason (a skip)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to create network namespaces"
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    name = f"oases-probe-{uuid.uuid4().hex[:8]}"
    proc = _ip("netns", "add", name, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` fails here: {proc.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class TwoHosts:
    """Two namespaces ``<tag>-h0``, ``<tag>-h1`` joined by a veth; a context manager.

    ``hosts`` (node names, e.g. for SLURM) go into each namespace's ``/etc/hosts`` (``ip netns
    exec`` bind-mounts ``/etc/netns/<name>/hosts`` over ``/etc/hosts``)."""

    def __init__(self, hosts=("node0", "node1")):
        self.tag = f"oases-{uuid.uuid4().hex[:8]}"
        self.names = [f"{self.tag}-h0", f"{self.tag}-h1"]
        self.hostnames = list(hosts)
        self._created = []
        self._ends = []

    def __enter__(self):
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _create(self):
        for name in self.names:
            _ip("netns", "add", name)
            self._created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        # temporary names in the root namespace (unique, <= 15 characters), renamed inside
        short = self.tag.split("-")[1][:8]
        ends = self._ends = [f"o{short}a", f"o{short}b"]
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for k, (name, end) in enumerate(zip(self.names, ends)):
            _ip("link", "set", end, "netns", name)
            _ip("-n", name, "link", "set", end, "name", IFNAME)
            _ip("-n", name, "addr", "add", f"{ADDRS[k]}/{PREFIX}", "dev", IFNAME)
            _ip("-n", name, "link", "set", IFNAME, "up")
        try:
            with open("/etc/hosts") as f:
                base = f.read()
        except OSError:
            base = "127.0.0.1 localhost\n"
        extra = "".join(f"{a} {h}\n" for a, h in zip(ADDRS, self.hostnames))
        for name in self.names:
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write(base.rstrip("\n") + "\n" + extra)

    def exec_prefix(self, k):
        """The command prefix that runs a program on host ``k``."""
        return ["ip", "netns", "exec", self.names[k]]

    def daemon_prefix(self, k):
        """The prefix for a daemon on host ``k`` that needs this machine's ``/sys`` (slurmd's
        cgroups): ``ip netns exec`` mounts a sysfs of the namespace over ``/sys``, hiding
        ``/sys/fs/cgroup``; this enters the network namespace only, with the host's
        ``/etc/hosts`` bind-mounted in a private mount namespace."""
        return [
            "nsenter",
            f"--net=/var/run/netns/{self.names[k]}",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"',
            f"/etc/netns/{self.names[k]}/hosts",
        ]

    def link(self, k, state):
        """Bring host ``k``'s veth ``up`` or ``down`` (a host dropping off the network)."""
        _ip("-n", self.names[k], "link", "set", IFNAME, state)

    def pids(self, k):
        proc = _ip("netns", "pids", self.names[k], check=False)
        return [int(p) for p in proc.stdout.split()]

    def close(self):
        """Kill what still runs inside, delete the namespaces and their ``/etc/netns`` files."""
        for k, name in enumerate(self.names):
            if name not in self._created:
                continue
            for _ in range(3):
                pids = self.pids(k)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)
        for end in self._ends:  # still in this namespace if the move failed
            _ip("link", "del", end, check=False)
        for name in self._created:
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        self._created = []
