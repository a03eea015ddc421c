"""``megatron-fsdp-checkpoint``: ``--save``/``--load`` under ``--use-megatron-fsdp``
(``fsdp_dtensor``), on every device.

Megatron-FSDP shards each parameter bucket evenly over the data-parallel ranks, so some ranks hold
an empty local shard of some parameters (a small bias or norm weight lies wholly in another rank's
slice). Megatron gives such a parameter no gradient on that rank (``update_main_grads``:
``grad = None`` where the shard is empty); torch's Adam (Megatron's optimizer without TE or Apex,
on any device) and Apex's FusedAdam make no state for a parameter without a gradient, and the
dummy step a load runs first skips it on purpose (``_init_optimizer_states_with_dummy_values``:
"Avoid FusedAdam errors on empty tensor input"). ``DistributedOptimizer.
sharded_param_state_fsdp_dtensor`` packs only the states that exist, so the ranks' optimizer state
dicts hold different DTensor keys (tiny GPT at DP=2: 14 on rank 0, 48 on rank 1; 56 each with the
mocks below), and ``preprocess_state_dict_for_uneven_dtensor``, which every save and load runs
before torch DCP (one ``all_gather_object`` per DTensor, in sorted key order), pairs different
tensors across ranks and hangs. Nothing in this depends on the device: it is the sharding and the
optimizer (TE's FusedAdam makes state for every parameter, gradient or not: with it the keys agree
and the patch adds nothing). Upstream fixed the same hazard in its ``fully_shard`` API's optimizer
hook (NVIDIA/Megatron-LM PR #3510); the Megatron-LM path, ``DistributedOptimizer``, still has it in
megatron-core 0.19.2.

Here, after Megatron's method, each parameter whose local shard is empty gets, in the returned
state dict only, an entry of the DTensor keys the optimizer keeps (``exp_avg``, ``exp_avg_sq``),
each an empty DTensor laid out like the parameter (its local shape, global shape, placements,
mesh): the mock upstream's fix makes. Every rank then holds the same DTensor keys, in the same
order. The mocks add no bytes to a checkpoint (an empty chunk) and take none from it. The keys
come from every rank (one ``all_gather_object`` of a few names per save or load), so a rank with
no state at all (every shard of it empty) mocks them too.

Non-DTensor entries (Adam's ``step``): a load's mock holds a copy of another state's (torch's
Adam reads ``step`` from every state it is given; the load overwrites it with the saved one), and
the load installs the mocks as those parameters' state, which never steps on that rank (its
gradient stays None there). A save therefore writes, for every parameter whose local shard is
empty, its DTensor entries only: DCP keeps one rank's copy of a replicated entry, and a loaded
mock's stale step beside the real one made a second resume restart that parameter's Adam step
(measured: step 2 where the uninterrupted run had 4). The optimizer's state is untouched by a
save.

**Pipeline stages.** ``fsdp_dtensor`` keys the model's tensors by the stage's own module names, so
every stage writes its first layer as ``decoder.layers.0`` and DCP keeps one of them: a resume at
PP=2 loaded one stage's layers into both, with no error (measured: losses 3-6 off by 6e-3).
The optimizer's state is keyed the same way (``DistributedOptimizer._param_name``: the stage's
``named_parameters()``), so after the parameters, its moments were one stage's too (losses 4-6
off). After Megatron's ``preprocess_fsdp_dtensor_state_dict`` (every save and load runs it on a
copy of the state dict, before DCP, which loads the tensors in place; Megatron then puts the
original model and optimizer dicts back), the layer keys of the model and of the optimizer's
``state`` and ``param_to_group_meta`` are renamed model-wide: ``layers.{i}`` of the stage becomes
``layers.{layer_number - 1}``, the index Megatron's ``get_global_unique_param_name`` gives. The
renamed dicts hold the same values (tensors loaded in place, the optimizer's per-parameter dicts,
into which a load writes its other entries). A model entry that is no tensor (TE's
``_extra_state``) is loaded into the renamed dict only, and Megatron reloads the unloaded one: not
restored across a resume with pipeline stages. Without pipeline stages nothing is renamed.
"""

import functools
import re

from ..compat import require_call, require_symbol
from ..patching import Patch

PATCH_NAME = "megatron-fsdp-checkpoint"

#: What ``sharded_param_state_fsdp_dtensor`` packs: the states that exist (the gap).
PACKED = "self.state.items()"
#: The condition under which ``_init_optimizer_states_with_dummy_values`` makes no state.
SKIPS_EMPTY = "_local_tensor.numel() == 0"
#: The per-DTensor collective every fsdp_dtensor save and load runs on the whole state dict.
PAIRED = "for key_chain in sorted(visit_dtensor)"


def _empty_local(param):
    """Whether this rank's shard of ``param`` (a DTensor) is empty."""
    local = getattr(param, "_local_tensor", None)
    return local is not None and local.numel() == 0


def state_keys(states):
    """``{key: ("dtensor", dtype name) or ("value", value)}`` of the entries in ``states`` (an
    optimizer's per-parameter state dicts), the first seen per key."""
    from torch.distributed.tensor import DTensor

    keys = {}
    for state in states:
        for key, value in state.items():
            if key not in keys:
                if isinstance(value, DTensor):
                    keys[key] = ("dtensor", str(value.dtype).removeprefix("torch."))
                else:
                    keys[key] = ("value", value)
    return keys


def all_ranks_keys(local):
    """:func:`state_keys` of every rank, merged (this rank's first): one ``all_gather_object``,
    which every rank reaches as each saves or loads its optimizer (other ranks' tensor values
    come as CPU copies; torch's ``load_state_dict`` puts a loaded step where Adam keeps it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return dict(local)
    import torch

    def portable(kind):  # a CUDA step would unpickle onto the sender's GPU on every rank
        tag, what = kind
        return (tag, what.detach().cpu()) if torch.is_tensor(what) else kind

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {key: portable(kind) for key, kind in local.items()})
    merged = dict(local)
    for one in gathered:
        for key, kind in (one or {}).items():
            merged.setdefault(key, kind)
    return merged


def mock_state(param, keys, is_loading):
    """The state entry of a parameter whose local shard is empty: an empty DTensor per DTensor
    key, laid out like ``param`` (its empty local shape, global shape, stride, mesh,
    placements); with ``is_loading`` the other keys too, each a copy of another state's value
    for the load to overwrite (torch's Adam reads ``step`` from every state it is given)."""
    import copy

    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for key, (kind, what) in keys.items():
        if kind == "dtensor":
            out[key] = DTensor.from_local(
                torch.empty_like(param._local_tensor, dtype=getattr(torch, what)),
                device_mesh=param.device_mesh,
                placements=param.placements,
                shape=param.shape,
                stride=param.stride(),
                run_check=False,
            )
        elif is_loading:
            out[key] = what.detach().clone() if torch.is_tensor(what) else copy.deepcopy(what)
    return out


def fill_missing(optimizer, packed, is_loading=False):
    """Make ``packed`` (``{param name: state}``, what Megatron's method returns under ``state``)
    hold, for each parameter of ``optimizer`` (Megatron's ``DistributedOptimizer``) whose local
    shard is empty, every DTensor key (mocked where missing); in a save, only those (module
    docstring: no step from a rank where the parameter never steps). Returns the names of the
    parameters that got mocks."""
    from torch.distributed.tensor import DTensor

    keys = all_ranks_keys(state_keys(optimizer.state.values()))
    added = []
    if not any(kind == "dtensor" for kind, _ in keys.values()):
        return added
    for group in optimizer.optimizer.param_groups:
        for param in group["params"]:
            if not _empty_local(param):
                continue
            name = optimizer._param_name(param)
            held = packed.get(name)
            if held is None:
                packed[name] = mock_state(param, keys, is_loading)
                added.append(name)
            elif not is_loading:  # a loaded mock: its step never advanced on this rank
                entry = {k: v for k, v in held.items() if isinstance(v, DTensor)}
                missing = {k: v for k, v in keys.items() if v[0] == "dtensor" and k not in entry}
                entry.update(mock_state(param, missing, False))
                packed[name] = entry
                if missing:
                    added.append(name)
    return added


def make_sharded_param_state(original):
    def sharded_param_state_fsdp_dtensor(self, is_loading=False):
        state_dict = original(self, is_loading)
        fill_missing(self, state_dict["state"], is_loading)
        return state_dict

    sharded_param_state_fsdp_dtensor.__wrapped__ = original
    return sharded_param_state_fsdp_dtensor


#: A key's (or a module name's) transformer-layer index within its stage.
_LAYER = re.compile(r"(^|\.)layers\.(\d+)(\.|$)")


def global_layer_numbers(model):
    """``{index in the stage: index in the model}`` of ``model``'s (a stage's) transformer
    layers, from each layer's ``layer_number`` (1-based, model-wide); multi-token-prediction
    layers are left out, as Megatron's optimizer names leave them."""
    numbers = {}
    for name, module in model.named_modules():
        found = _LAYER.search(name)
        number = getattr(module, "layer_number", None)
        if found and not found.group(3) and "mtp" not in name and isinstance(number, int):
            numbers[int(found.group(2))] = number - 1
    return numbers


def with_global_layer_keys(model_state, numbers):
    """``model_state`` (a dict of the stage's model tensors) keyed with model-wide layer
    indices; itself where they are the stage's (no pipeline stages)."""
    if all(local == whole for local, whole in numbers.items()):
        return model_state

    def rename(key):
        if "mtp" in key:
            return key
        return _LAYER.sub(
            lambda m: f"{m.group(1)}layers.{numbers.get(int(m.group(2)), int(m.group(2)))}"
            + m.group(3),
            key,
            count=1,
        )

    return {rename(key): value for key, value in model_state.items()}


def make_preprocess(original):
    """``preprocess_fsdp_dtensor_state_dict`` whose model keys name each layer model-wide."""

    @functools.wraps(original)
    def preprocess_fsdp_dtensor_state_dict(args, raw_state_dict, model):
        state_dict = original(args, raw_state_dict, model)
        numbers = global_layer_numbers(model)
        if all(local == whole for local, whole in numbers.items()):  # no pipeline stages
            return state_dict
        if "model" in state_dict:
            state_dict["model"] = with_global_layer_keys(state_dict["model"], numbers)
        optimizer = state_dict.get("optimizer")
        if isinstance(optimizer, dict):
            optimizer = dict(optimizer)
            for field in ("state", "param_to_group_meta"):
                if isinstance(optimizer.get(field), dict):
                    optimizer[field] = with_global_layer_keys(optimizer[field], numbers)
            state_dict["optimizer"] = optimizer
        return state_dict

    return preprocess_fsdp_dtensor_state_dict


def replacements():
    """``[(DistributedOptimizer, "sharded_param_state_fsdp_dtensor", replacement)]``, after
    checking that the method, the dummy-state skip and the per-key collective are the code
    Megatron calls (one :class:`~megatron_oases.errors.OasesConfigError` line otherwise)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor
    from megatron.core.optimizer import distrib_optimizer
    from megatron.training import checkpointing

    cls = require_symbol(distrib_optimizer, "DistributedOptimizer")
    original = require_symbol(
        cls,
        "sharded_param_state_fsdp_dtensor",
        called_by=[cls.sharded_state_dict],
        parameters=("is_loading",),
    )
    require_call(original, PACKED)
    dummy = require_symbol(cls, "_init_optimizer_states_with_dummy_values", called_by=[original])
    require_call(dummy, SKIPS_EMPTY)
    require_symbol(cls, "_param_name", called_by=[original])
    require_symbol(
        checkpointing,
        "preprocess_state_dict_for_uneven_dtensor",
        called_by=[checkpointing.preprocess_fsdp_dtensor_state_dict],
    )
    require_call(uneven_dtensor.preprocess_state_dict_for_uneven_dtensor, PAIRED)
    preprocess = require_symbol(
        checkpointing,
        "preprocess_fsdp_dtensor_state_dict",
        parameters=("args", "raw_state_dict", "model"),
    )
    require_call(checkpointing._load_base_checkpoint, "state_dict['model'] = raw_model_state_dict")
    return [
        (cls, "sharded_param_state_fsdp_dtensor", make_sharded_param_state(original)),
        (checkpointing, "preprocess_fsdp_dtensor_state_dict", make_preprocess(preprocess)),
    ]


def needed(args):
    """Whether a run of Megatron's ``args`` needs the patch: ``--use-megatron-fsdp`` with
    ``--save`` or ``--load`` (on any device)."""
    return bool(getattr(args, "use_megatron_fsdp", False)) and bool(
        getattr(args, "save", None) or getattr(args, "load", None)
    )


def make_patch(args):
    """The ``megatron-fsdp-checkpoint`` patch for ``args``, else None."""
    if not needed(args):
        return None
    return Patch(PATCH_NAME, replacements=replacements())
