"""Cluster profiles (packaged ``configs/clusters/*.yaml``, or a YAML path) and the ring α–β model.

Placement: global rank r sits on node ``r // gpus_per_node``, local GPU ``r % gpus_per_node``. A
group spanning nodes uses the inter-node link; a group inside one NVLink pair uses NVLink; any other
intra-node group uses the intra-node (PCIe) link — a ring is as slow as its slowest hop.
"""

import os
from dataclasses import dataclass, field

from .. import resources
from ..errors import OasesConfigError


@dataclass(frozen=True)
class Link:
    bandwidth_gbs: float  # effective per-GPU ring bandwidth, GB/s
    latency_us: float  # per ring step

    def ring_time(self, steps, bytes_per_step):
        return steps * (self.latency_us * 1e-6 + bytes_per_step / (self.bandwidth_gbs * 1e9))


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    gpu: str
    peak_tflops: float
    sustained_tflops: float
    dtype_bytes: int
    memory_gb: float
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    nvlink: Link = None
    nvlink_pairs: tuple = field(default_factory=tuple)
    dtype: str = "fp16"
    # SMs NCCL's kernels take during a collective (one per channel): the one-rank emulator on CUDA
    # runs that many one-block spin kernels per collective (a documented default, not measured)
    comm_sms: int = 2
    # host time to issue one aten call on this cluster's GPU hosts (µs, per call as the planner
    # counts them on the CPU, nested calls counted): the host floor of an iteration is calls × this.
    # Default: measured on an H100 machine's host (docs/host-cost.md "Measured on a GPU")
    host_us_per_call: float = 12.0
    # sustained memory bandwidth of the GPU (GB/s): the memory-bound half of the roofline device
    # model (:mod:`megatron_oases.device_model`); None in a user's YAML that predates it
    memory_bandwidth_gbs: float = None

    def link_for(self, ranks):
        ranks = sorted(ranks)
        nodes = {r // self.gpus_per_node for r in ranks}
        if len(nodes) > 1:
            return self.inter_node
        local = {r % self.gpus_per_node for r in ranks}
        if self.nvlink is not None and any(local <= set(p) for p in self.nvlink_pairs):
            return self.nvlink
        return self.intra_node

    def all_reduce_time(self, nbytes, ranks):
        """Ring all-reduce: 2(N−1)/N·K/bw + 2(N−1)·α (seconds)."""
        n = len(ranks)
        if n <= 1:
            return 0.0
        return self.link_for(ranks).ring_time(2 * (n - 1), nbytes / n)

    def all_gather_time(self, nbytes_out, ranks):
        """Ring all-gather (or reduce-scatter) of an ``nbytes_out`` result: (N−1)/N·K/bw + (N−1)·α."""
        n = len(ranks)
        if n <= 1:
            return 0.0
        return self.link_for(ranks).ring_time(n - 1, nbytes_out / n)

    reduce_scatter_time = all_gather_time

    def p2p_time(self, nbytes, src, dst):
        return self.link_for([src, dst]).ring_time(1, nbytes)


def available():
    return resources.available_clusters()


#: The fix a damaged cluster profile's line names.
_FIX = "fix the entry (see megatron_oases/configs/clusters/*.yaml)"
_READ_FIX = "pass a packaged name or a YAML file like megatron_oases/configs/clusters/*.yaml"
#: Top-level keys of a cluster profile (:func:`cluster_from_dict`).
KEYS = (
    "name",
    "gpu",
    "peak_tflops",
    "sustained_tflops",
    "dtype",
    "dtype_bytes",
    "memory_gb",
    "gpus_per_node",
    "intra_node",
    "inter_node",
    "nvlink",
    "nvlink_pairs",
    "comm_sms",
    "host_us_per_call",
    "memory_bandwidth_gbs",
)
REQUIRED = ("name", "gpu", "peak_tflops", "memory_gb", "gpus_per_node", "intra_node", "inter_node")


#: Parsed profiles by the file's text (a profile depends on nothing else): the planner's search
#: asks for its cluster once per candidate plan (hundreds of YAML parses were a third of its time);
#: reading the small file is cheap, parsing it is not, and an edited file is parsed anew whatever
#: its timestamps say.
#: Safe to share: a :class:`ClusterProfile` is frozen all the way down (links, tuples).
_CACHE = {}
#: Packaged profile name -> its path.
_PACKAGED = {}


def load_cluster(name_or_path):
    """Load a profile by path (a user's own YAML wins) or by packaged name (``rtx3090-pcie``);
    read through the bounded reader and checked by :func:`cluster_from_dict`, parsed once per
    file content (:data:`_CACHE`)."""
    from ..formats import read_text, read_yaml

    path = name_or_path
    if not os.path.exists(path):
        path = _PACKAGED.get(name_or_path)  # (listing the package's folder: once per name)
        if path is None:
            path = resources.cluster_profile(name_or_path)
            if path is not None:
                _PACKAGED[name_or_path] = path
    if path is None:
        raise OasesConfigError(
            f"unknown cluster profile {name_or_path!r}; choose one of {', '.join(available())} "
            "or pass a YAML path"
        )
    text = read_text(path, "cluster profile", _READ_FIX, kind="YAML")
    if text in _CACHE:
        return _CACHE[text]
    raw = read_yaml(path, "cluster profile", _READ_FIX)
    profile = cluster_from_dict(raw, f"cluster profile {path}")
    if read_text(path, "cluster profile", _READ_FIX, kind="YAML") == text:  # not edited meanwhile
        if len(_CACHE) >= 64:  # a long process reading many edited files: start over
            _CACHE.clear()
        _CACHE[text] = profile
    return profile


def cluster_from_dict(raw, source="cluster profile"):
    """The cluster-profile format's one validator: a :class:`ClusterProfile` from the mapping
    ``raw``, or one :class:`OasesConfigError` line naming ``source`` and the field. Every number
    follows the formats' one rule (:func:`megatron_oases.formats.number_fault`): finite, held by a
    float, and inside its kind's plausible range — rates, bandwidths and memory positive,
    latencies and host costs not negative (a zero bandwidth divided by zero in every link time, a
    negative one gave negative times, ``sustained_tflops: 1e-300`` 300-digit iteration times,
    ``10**400`` an ``OverflowError``)."""
    import difflib

    from ..formats import count_fault, number_fault, quote

    def fail(key, value, expected):
        raise OasesConfigError(f"{source}: {key} must be {expected}, got {quote(value)}; {_FIX}")

    if not isinstance(raw, dict):
        raise OasesConfigError(f"{source}: a cluster profile must be a YAML mapping; {_FIX}")
    for key in raw:
        if key not in KEYS:
            near = difflib.get_close_matches(str(key), KEYS, n=1, cutoff=0.75)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise OasesConfigError(
                f"{source}: unknown key {quote(key)}{hint}; the keys are {', '.join(KEYS)}"
            )
    missing = [k for k in REQUIRED if raw.get(k) is None]
    if missing:
        raise OasesConfigError(f"{source}: missing {', '.join(missing)}; {_FIX}")

    def number(key, value, kind, positive=True):
        fault = number_fault(value, kind, positive)
        if fault:
            fail(key, value, fault)
        return float(value)

    def count(key, value, kind):
        fault = count_fault(value, kind)
        if fault:
            fail(key, value, fault)
        return value

    def text(key, value):
        if not isinstance(value, str):
            fail(key, value, "a string")
        return value

    def link(key):
        value = raw[key]
        if not isinstance(value, dict) or set(value) != {"bandwidth_gbs", "latency_us"}:
            fail(key, value, "a mapping {bandwidth_gbs: GB/s, latency_us: us}")
        return Link(
            bandwidth_gbs=number(f"{key}.bandwidth_gbs", value["bandwidth_gbs"], "bandwidth_gbs"),
            latency_us=number(f"{key}.latency_us", value["latency_us"], "latency_us", False),
        )

    gpus = count("gpus_per_node", raw["gpus_per_node"], "gpus_per_node")
    pairs = raw.get("nvlink_pairs") or []
    if not isinstance(pairs, list) or not all(
        isinstance(p, list) and p and all(isinstance(r, int) and 0 <= r < gpus for r in p)
        for p in pairs
    ):
        fail("nvlink_pairs", pairs, f"a list of lists of local GPU indices (0..{gpus - 1})")
    peak = number("peak_tflops", raw["peak_tflops"], "tflops")
    bandwidth = raw.get("memory_bandwidth_gbs")
    return ClusterProfile(
        name=text("name", raw["name"]),
        gpu=text("gpu", raw["gpu"]),
        peak_tflops=peak,
        sustained_tflops=number("sustained_tflops", raw.get("sustained_tflops", peak), "tflops"),
        dtype_bytes=count("dtype_bytes", raw.get("dtype_bytes", 2), "dtype_bytes"),
        memory_gb=number("memory_gb", raw["memory_gb"], "memory_gb"),
        gpus_per_node=gpus,
        intra_node=link("intra_node"),
        inter_node=link("inter_node"),
        nvlink=link("nvlink") if raw.get("nvlink") is not None else None,
        nvlink_pairs=tuple(tuple(p) for p in pairs),
        dtype=text("dtype", raw.get("dtype", "fp16")),
        comm_sms=count("comm_sms", raw.get("comm_sms", 2), "sms"),
        host_us_per_call=number(
            "host_us_per_call", raw.get("host_us_per_call", 12.0), "host_us", positive=False
        ),
        memory_bandwidth_gbs=(
            None
            if bandwidth is None
            else number("memory_bandwidth_gbs", bandwidth, "bandwidth_gbs")
        ),
    )
