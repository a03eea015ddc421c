"""``parity``: every schedule against stock Megatron on this device (loss and every gradient),
two ranks sharing it through gloo with device tensors; fp32, ``--bf16``, sequence parallelism
and ``--attention-backend flash``."""

import contextlib
import time

from .common import FULL_RECOMPUTE, KERNEL_FLAGS, on_cuda, shapes

LIMIT_S = 240
OPTIONS = ("save", "only")


def parity_configs(dry):
    s = shapes(dry)
    base = (
        f"--num-layers 2 {s['parity']} --vocab-size {s['vocab']} --mock-data --lr 1e-2 "
        "--tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 2 --hidden-dropout 0 --attention-dropout 0 " + " ".join(KERNEL_FLAGS)
    )
    llama = (
        " --swiglu --normalization RMSNorm --group-query-attention --num-query-groups 4 "
        "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights"
    )
    hybrid = base.replace("--num-layers 2", "--hybrid-layer-pattern '*--*'")
    all4 = ["off", "overlap", "cross-pass", "oases"]
    # tolerances: fp32 on a GPU, a split's GEMMs may take other kernels (reassociated sums, ~1e-6
    # relative; 1e-4 leaves room); bf16 rounds at 2^-8 = 3.9e-3, and a reassociated gradient sum
    # differs by a few such units: 3e-2.
    cfgs = [
        ("gpt-fp32", base, all4, 1e-4),
        ("gpt-bf16", base + " --bf16", ["off", "oases", "overlap"], 3e-2),
        ("gpt-sp-fp32", base + " --sequence-parallel", ["off", "oases"], 1e-4),
        ("llama-fp32", base + llama, ["off", "oases"], 1e-4),
        # HybridModel: '*' attention and '-' MLP layers, not alternating, the stage ending on '*'
        ("hybrid-fp32", hybrid + llama, ["off", "oases", "overlap"], 1e-4),
        ("hybrid-bf16", hybrid + llama + " --bf16", ["off", "oases"], 3e-2),
    ]
    if dry:  # CI's time: the hybrid stack's bf16 adds nothing the CPU would show
        cfgs = [c for c in cfgs if c[0] != "hybrid-bf16"]
    if on_cuda():  # PyTorch's flash kernel: CUDA and bf16 only
        cfgs.append(
            (
                "llama-bf16-flash",
                base + llama + " --bf16 --attention-backend flash",
                ["off", "oases"],
                3e-2,
            )
        )
    return cfgs


class _OneByOne:
    """What ``_coalescing_manager`` yields, for synchronous ops already completed."""

    def wait(self):
        return None


@contextlib.contextmanager
def _one_collective_at_a_time(group=None, device=None, async_ops=False):
    """Gloo has no coalesced all-reduce of CUDA tensors (two ranks share the GPU through gloo here;
    NCCL refuses two ranks on one device): Megatron's grad-buffer ops run one by one instead."""
    if async_ops:
        raise RuntimeError("the GPU check's gloo grad reduce is synchronous only")
    yield _OneByOne()


def _parity_worker(base, variants):
    """``variants_worker`` with Megatron's gradient-buffer collectives uncoalesced on CUDA."""
    import torch
    from megatron.core.distributed import param_and_grad_buffer as buffers

    from megatron_oases.training.inprocess import variants_worker

    if not torch.cuda.is_available():
        return variants_worker(base, variants)
    original = buffers._coalescing_manager
    buffers._coalescing_manager = _one_collective_at_a_time
    try:
        return variants_worker(base, variants)
    finally:
        buffers._coalescing_manager = original


def parity_run(base, variants, pairs, tol, timeout):
    """Run ``variants`` on 2 ranks and compare each ``(got, ref)`` of ``pairs`` (loss and every
    gradient, worst over ranks): the config's result dict; a failed run is a result too."""
    from megatron_oases.errors import last_line
    from megatron_oases.launch import run_distributed
    from megatron_oases.training.inprocess import max_rel_diff

    t0 = time.time()
    try:
        ranks = run_distributed(_parity_worker, 2, base, variants, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - one config's failure is a result
        return {"status": "failed", "error": last_line(exc)[:400]}
    worst = {}
    for res in ranks:
        for got, ref in pairs:
            if got not in res:
                continue
            diffs = [max_rel_diff(res[got]["losses"], res[ref]["losses"])]
            diffs += [max_rel_diff(res[got]["grads"][k], g) for k, g in res[ref]["grads"].items()]
            worst[got] = max(worst.get(got, 0.0), *diffs)
    return {
        "status": "ok" if all(v < tol for v in worst.values()) else "mismatch",
        "tolerance": tol,
        "worst_rel_diff": worst,
        "seconds": round(time.time() - t0, 1),
    }


def run(dry, save=None, only=None):
    """Each config's result, passed to ``save`` as it completes (a time-out keeps the done ones);
    ``only``: the configs whose name starts with one of these prefixes."""
    results = {}
    for name, base, schedules, tol in parity_configs(dry):
        if only and not any(name.startswith(prefix) for prefix in only):
            continue
        if save:
            save(results)
        variants = [(sch, f"--oases-schedule {sch} {FULL_RECOMPUTE}") for sch in schedules]
        pairs = [(sch, "off") for sch in schedules[1:]]
        results[name] = parity_run(base, variants, pairs, tol, timeout=300)
    return results


def not_ok(result):
    """The configs that did not match stock (each fails the step)."""
    return [k for k, v in result.items() if v["status"] != "ok"]


def table(results):
    """The report's parity table (this step's and the graphs step's)."""
    lines = ["| config | status | tolerance | worst relative difference |", "|---|---|---|---|"]
    for n, r in results.items():
        worst = ", ".join(f"{k} {v:.1e}" for k, v in (r.get("worst_rel_diff") or {}).items())
        lines.append(
            f"| {n} | {r['status']} | {r.get('tolerance', '')} | {worst or r.get('error')} |"
        )
    return lines


def report(result, env=None):
    lines = ["", "## Parity against stock (loss and every gradient, 2 ranks on gloo)", ""]
    return lines + table(result)
