"""The emulated ``torch.distributed`` functions: what each call costs, and its wrapper.

Patched (as ``torch.distributed.<name>`` attributes, which is how Megatron-Core calls them):
``all_reduce``, ``all_gather``, ``all_gather_into_tensor``, ``_all_gather_base``, ``all_gather_single``,
``reduce_scatter``, ``reduce_scatter_tensor``, ``_reduce_scatter_base``, ``reduce_scatter_single``,
``broadcast``, ``isend``, ``irecv``, ``send``, ``recv``, ``batch_isend_irecv`` and ``P2POp`` (a subclass
that accepts the wrapped ``isend``/``irecv``), plus the module-level aliases Megatron binds at import
time (``dist_all_gather_func``/``dist_reduce_scatter_func`` in ``tensor_parallel.mappings``,
``tensor_parallel.layers`` and ``distributed.param_and_grad_buffer``). Tensor collectives the model does
not cover (``all_to_all``, ``all_to_all_single``, ``scatter``, ``gather``, ``reduce``,
``all_reduce_coalesced``, ``all_gather_coalesced``) raise :class:`EmulationError`. ``barrier`` and the
``*_object*`` helpers are control traffic and pass through un-delayed. Groups of one rank cost nothing.

Each wrapper reads the op's bytes, global ranks and channel from the call's arguments, runs the real
op on gloo and lets the :class:`~.link_model.LinkEmulator` it is given decide when the op completes.
Wrappers carry ``__wrapped__`` and keep ``__name__``, so a tracer installed after the emulator can wrap
them again: it sees the emulated issue, wait and completion times.

Separate from :mod:`.link_model` because this is the part that knows ``torch.distributed``'s
signatures and Megatron's import-time aliases, and changes with them.
"""

import contextlib
import functools
import importlib
import inspect

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..compat import COALESCING_ALIASES, MEGATRON_ALIASES
from ..errors import OasesConfigError

#: The version of what the emulation computes for data-parallel collectives beyond
#: :data:`~.emulator.EMULATOR_VERSION`'s per-op model: when a ``_coalescing_manager``'s batch
#: completes (Megatron DDP's bucket groups, Megatron-FSDP's gathers and reduce-scatters) and a
#: synchronous op issued on a CPU rank's side stream (:func:`.link_model.LinkEmulator._defer`).
#: Runs whose data-parallel groups have one rank (every ``oases compare`` row of
#: ``benchmarks/compare``) never reach it. Bump it (to the day's date) with any change to those.
DATA_PARALLEL_EMULATION_VERSION = "2026-12-07"


class EmulationError(OasesConfigError):
    """A collective the link emulator cannot model was called under ``--emulate-link``."""


# name -> cost kind; ``None`` = not a torch attribute in this torch version (skipped).
COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather_list",
    "all_gather_into_tensor": "all_gather_tensor",
    "_all_gather_base": "all_gather_tensor",
    "all_gather_single": "all_gather_tensor",
    "reduce_scatter": "reduce_scatter_list",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "broadcast": "broadcast",
}
P2P = ("isend", "irecv", "send", "recv")
UNSUPPORTED = (
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "gather",
    "reduce",
    "all_reduce_coalesced",
    "all_gather_coalesced",
)


def _sig(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def group_ranks(group):
    """Global ranks of ``group`` (default group when None); None when this rank is not in it."""
    if group is None:
        group = c10d._get_default_group()
    if c10d._rank_not_in_group(group):
        return None
    return list(dist.get_process_group_ranks(group))


def _collective_cost(emu, kind, ba):
    """(model kind, target bytes, ranks) of a collective call from its bound arguments."""
    a = ba.arguments
    ranks = group_ranks(a.get("group"))
    if ranks is None:
        return None
    n = len(ranks)
    if kind == "all_reduce":
        return "all_reduce", emu.tensor_bytes(a["tensor"]), ranks
    if kind == "all_gather_list":
        return "all_gather", emu.tensor_bytes(a["tensor"]) * n, ranks
    if kind == "all_gather_tensor":
        return "all_gather", emu.tensor_bytes(a["output_tensor"]), ranks
    if kind == "reduce_scatter_list":
        return "reduce_scatter", sum(emu.tensor_bytes(t) for t in a["input_list"]), ranks
    if kind == "reduce_scatter_tensor":
        return "reduce_scatter", emu.tensor_bytes(a["input"]), ranks
    if kind == "broadcast":
        return "broadcast", emu.tensor_bytes(a["tensor"]), ranks
    raise ValueError(kind)


def _device(*candidates):
    """The device of the first tensor among ``candidates`` (tensors or lists of them)."""
    for c in candidates:
        if isinstance(c, (list, tuple)):
            c = c[0] if c else None
        if c is not None and hasattr(c, "device"):
            return c.device
    return None


def wrap_collective(emu, name, orig, kind):
    """The collective ``orig`` (cost ``kind`` of :data:`COLLECTIVES`), completing when ``emu`` says."""
    sig = _sig(orig)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        ba = sig.bind(*args, **kwargs)
        cost = _collective_cost(emu, kind, ba)
        if cost is None:
            return orig(*args, **kwargs)
        model_kind, nbytes, ranks = cost
        a = ba.arguments
        device = _device(a.get("tensor"), a.get("output_tensor"), a.get("input"))
        done, info = emu.issue(name, model_kind, nbytes, ranks, ("coll", tuple(ranks)), device)
        if done is None:
            return orig(*args, **kwargs)
        result = orig(*args, **kwargs)
        batch = None
        if emu.coalescing:  # inside a coalescing manager: completes with its batch
            batch = emu.coalescing.get(a.get("group") or c10d._get_default_group())
        if batch is not None:
            batch.append((done, info))
            return result
        if ba.arguments.get("async_op", False):
            return emu.wrap_async(result, done, info)
        return emu.finish_sync(result, done, info)

    wrapper.__oases_emulated__ = True
    return wrapper


def _p2p_cost(emu, send, tensor, peer, group):
    """(ranks of the link, channel) of a p2p op with global ``peer`` (None: unknown)."""
    me = dist.get_rank()
    if peer is None:
        ranks = group_ranks(group) or [me]
    else:
        ranks = sorted({me, int(peer)})
    channel = ("send" if send else "recv", peer)
    return emu.tensor_bytes(tensor), ranks, channel


def _global_peer(group, peer, group_peer):
    if group_peer is not None:
        g = group if group is not None else c10d._get_default_group()
        return dist.get_global_rank(g, group_peer)
    return peer


def wrap_p2p(emu, name, orig):
    """``isend``/``irecv``/``send``/``recv`` on one channel per peer and direction of ``emu``."""
    sig = _sig(orig)
    send = name in ("isend", "send")
    is_async = name in ("isend", "irecv")

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        a = sig.bind(*args, **kwargs).arguments
        group = a.get("group")
        if group is not None and c10d._rank_not_in_group(group):
            return orig(*args, **kwargs)
        if send:
            peer = _global_peer(group, a.get("dst"), a.get("group_dst"))
        else:
            peer = _global_peer(group, a.get("src"), a.get("group_src"))
        nbytes, ranks, channel = _p2p_cost(emu, send, a["tensor"], peer, group)
        done, info = emu.issue(name, "p2p", nbytes, ranks, channel, a["tensor"].device)
        if done is None:
            return orig(*args, **kwargs)
        result = orig(*args, **kwargs)
        if is_async:
            return emu.wrap_async(result, done, info)
        return emu.finish_sync(result, done, info)

    wrapper.__oases_emulated__ = True
    return wrapper


def wrap_batch_isend_irecv(emu, orig):
    """``batch_isend_irecv`` whose handles complete when ``emu`` says each p2p op does."""

    @functools.wraps(orig)
    def wrapper(p2p_op_list):
        issued = []
        for op in p2p_op_list:
            send = _unwrap(op.op) is c10d.isend
            nbytes, ranks, channel = _p2p_cost(emu, send, op.tensor, op.peer, op.group)
            kind = "isend" if send else "irecv"
            done, info = emu.issue(kind, "p2p", nbytes, ranks, channel, op.tensor.device)
            issued.append((done, info))
        works = orig(p2p_op_list)
        if works is None:
            return works
        works = list(works)
        if len(works) == len(issued):
            pairs = list(zip(works, issued))
        else:  # coalesced: every handle completes with the slowest op of the batch
            booked = [(d, i) for d, i in issued if d is not None]
            if booked and not isinstance(booked[0][0], float):  # CUDA events: the last issued
                last = booked[-1]
            else:
                last = max(booked, default=(None, None), key=lambda x: x[0])
            pairs = [(w, last) for w in works]
        out = []
        for work, (done, info) in pairs:
            out.append(work if done is None else emu.wrap_async(work, done, info))
        return out

    wrapper.__oases_emulated__ = True
    return wrapper


def wrap_coalescing_manager(emu, orig):
    """``torch.distributed._coalescing_manager`` whose batch completes as one collective: the ops
    issued in it on its group are booked on the link one by one (as before) but none completes on
    its own (torch issues them as one coalesced op at the exit, and their own handles are never
    waited); :meth:`~.link_model.LinkEmulator.finish_coalesced` makes the manager's handles (or its
    exit) complete with the batch's last op."""

    @contextlib.contextmanager
    @functools.wraps(orig)
    def wrapper(group=None, device=None, async_ops=False):
        key = group or c10d._get_default_group()
        emu.coalescing[key] = batch = []
        try:
            with orig(group, device, async_ops) as manager:
                yield manager
        finally:
            emu.coalescing.pop(key, None)
        if batch:
            emu.finish_coalesced(manager, batch, async_ops)

    wrapper.__oases_emulated__ = True
    return wrapper


def unsupported(emu, name, orig):
    """A collective the model does not cover: raises :class:`EmulationError` when called."""
    profile = emu.profile.name

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        raise EmulationError(
            f"torch.distributed.{name} is not supported under --emulate-link {profile}: the "
            f"emulator models {', '.join(supported_names())}; run without --emulate-link"
        )

    wrapper.__oases_emulated__ = True
    return wrapper


def replacements(emu):
    """(owner, attr, replacement) for every patched attribute, timed by ``emu``; records the
    replaced functions in ``emu.originals``."""
    out, by_orig = [], {}
    for name, kind in COLLECTIVES.items():
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        new = wrap_collective(emu, name, orig, kind)
        out.append((dist, name, new))
        by_orig[orig] = new
        emu.originals[name] = orig
    for name in P2P:
        orig = getattr(dist, name)
        new = wrap_p2p(emu, name, orig)
        out.append((dist, name, new))
        by_orig[orig] = new
        emu.originals[name] = orig
    out.append((dist, "batch_isend_irecv", wrap_batch_isend_irecv(emu, dist.batch_isend_irecv)))
    coalescing = wrap_coalescing_manager(emu, c10d._coalescing_manager)
    out.append((dist, "_coalescing_manager", coalescing))
    by_orig[c10d._coalescing_manager] = coalescing
    out.append((dist, "P2POp", _make_p2p_op_class(dist.P2POp)))
    for name in UNSUPPORTED:
        orig = getattr(dist, name, None)
        if orig is not None:
            out.append((dist, name, unsupported(emu, name, orig)))
    coalescing_aliases = tuple((m, ("_coalescing_manager",)) for m in COALESCING_ALIASES)
    for module, attrs in MEGATRON_ALIASES + coalescing_aliases:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for attr in attrs:
            cur = getattr(mod, attr, None)
            if cur in by_orig:
                out.append((mod, attr, by_orig[cur]))
    return out


def supported_names():
    return [n for n in COLLECTIVES if hasattr(dist, n)] + list(P2P) + ["batch_isend_irecv"]


def _unwrap(fn):
    """Follow ``__wrapped__`` (ours, or a tracer's wrapper of ours) down to torch's own function."""
    seen = 0
    while fn not in (c10d.isend, c10d.irecv) and hasattr(fn, "__wrapped__") and seen < 16:
        fn = fn.__wrapped__
        seen += 1
    return fn


def _make_p2p_op_class(base):
    class P2POp(base):
        """``torch.distributed.P2POp`` that accepts the emulated (or traced) ``isend``/``irecv``."""

        def __new__(cls, op, tensor, *args, **kwargs):
            return base.__new__(cls, _unwrap(op), tensor, *args, **kwargs)

        def __init__(self, op, tensor, *args, **kwargs):
            super().__init__(_unwrap(op), tensor, *args, **kwargs)

    P2POp.__qualname__ = base.__qualname__
    P2POp.__module__ = base.__module__
    return P2POp
