"""Cluster profiles (packaged ``configs/clusters/*.yaml``, or a YAML path) and the ring α–β model.

Placement: global rank r sits on node ``r // gpus_per_node``, local GPU ``r % gpus_per_node``. A
group spanning nodes uses the inter-node link; a group inside one NVLink pair uses NVLink; any other
intra-node group uses the intra-node (PCIe) link — a ring is as slow as its slowest hop.
"""

import os
from dataclasses import dataclass, field

import yaml

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


def load_cluster(name_or_path):
    """Load a profile by path (a user's own YAML wins) or by packaged name (``rtx3090-pcie``)."""
    path = name_or_path
    if not os.path.exists(path):
        path = resources.cluster_profile(name_or_path)
    if path is None:
        raise OasesConfigError(
            f"unknown cluster profile {name_or_path!r}; choose one of {', '.join(available())} "
            "or pass a YAML path"
        )
    with open(path) as f:
        raw = yaml.safe_load(f)
    return ClusterProfile(
        name=raw["name"],
        gpu=raw["gpu"],
        peak_tflops=float(raw["peak_tflops"]),
        sustained_tflops=float(raw.get("sustained_tflops", raw["peak_tflops"])),
        dtype_bytes=int(raw.get("dtype_bytes", 2)),
        memory_gb=float(raw["memory_gb"]),
        gpus_per_node=int(raw["gpus_per_node"]),
        intra_node=Link(**raw["intra_node"]),
        inter_node=Link(**raw["inter_node"]),
        nvlink=Link(**raw["nvlink"]) if raw.get("nvlink") else None,
        nvlink_pairs=tuple(tuple(p) for p in raw.get("nvlink_pairs") or ()),
        dtype=raw.get("dtype", "fp16"),
        comm_sms=int(raw.get("comm_sms", 2)),
        host_us_per_call=float(raw.get("host_us_per_call", 12.0)),
        memory_bandwidth_gbs=(
            float(raw["memory_bandwidth_gbs"]) if raw.get("memory_bandwidth_gbs") else None
        ),
    )
