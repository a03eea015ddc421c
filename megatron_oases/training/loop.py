"""``oases train``: pretrain_gpt.py on Megatron-Core — model, DDP, optimizer, Megatron's schedules.

Order matters and mirrors Megatron-LM: parse args → init distributed → install patches (from args,
before the model is built) → build GPTModel → DDP → optimizer → train loop that calls
``get_forward_backward_func()`` (1F1B when PP > 1).
"""

import json
import os
import time
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from ..schedule.trace import active_tracer
from .checkpointing import load_checkpoint, save_checkpoint
from .data import mock_data_iterator
from .flops import flops_from_args
from .initialize import initialize_distributed
from .model import build_model, transformer_config_from_args


class Trainer:
    """Owns the model, optimizer and Megatron config of one run; ``train_step`` is one iteration."""

    def __init__(self, args):
        self.args = args
        self.config = transformer_config_from_args(args)
        self.module = build_model(args, self.config)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.model = DDP(self.config, ddp_config, self.module)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            clip_grad=args.clip_grad,
            fp16=False,
            bf16=False,
            params_dtype=torch.float32,
            use_distributed_optimizer=False,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        hetero = getattr(self.module.decoder, "_oases_hetero", None)
        if hetero is not None:  # replicated (degree < T) layers: also sum over their replicas
            self.config.finalize_model_grads_func = _with_replica_sync(hetero, self.module)
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.iteration = 0

    @staticmethod
    def _loss_func(loss_mask, output_tensor):
        losses = output_tensor.float()
        loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        output = model(
            batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"]
        )
        return output, partial(self._loss_func, batch["loss_mask"])

    def train_step(self, data_iterator=None, forward_only=False):
        """One iteration (all micro-batches + optimizer step); returns the mean lm loss or None."""
        args = self.args
        if data_iterator is None:
            data_iterator = mock_data_iterator(args, self.iteration)
        tracer = active_tracer()
        if tracer is not None:
            tracer.start_iteration(self.iteration + 1)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=data_iterator,
            model=[self.model],
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=forward_only,
        )
        if not forward_only:
            self.optimizer.step()
            self.iteration += 1
        if tracer is not None:
            tracer.end_iteration()
        return self._reduce_loss(losses)

    def _reduce_loss(self, losses):
        """Mean over micro-batches and DP ranks, on the last pipeline stage (None elsewhere)."""
        if not parallel_state.is_pipeline_last_stage():
            return None
        loss = torch.stack([x["lm loss"] for x in losses]).mean()
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        return (loss / parallel_state.get_data_parallel_world_size()).item()

    def save(self, path):
        save_checkpoint(path, self.iteration, self.model, self.optimizer, self.args)

    def load(self, path):
        self.iteration = load_checkpoint(path, self.model, self.optimizer, self.args)
        return self.iteration


def _with_replica_sync(hetero, module):
    from ..hetero.model import sync_replica_grads

    def finalize(model, *args, **kwargs):
        finalize_model_grads(model, *args, **kwargs)
        sync_replica_grads(module, hetero.groups)

    return finalize


def _is_logging_rank():
    return dist.get_rank() == dist.get_world_size() - 1


def _golden(values, start):
    return {
        "start_step": start,
        "end_step": start + len(values) - 1,
        "step_interval": 1,
        "values": values,
    }


def train(args, install_patches=None):
    """Run ``args.train_iters`` iterations; returns the metrics dict (also written to --log-json)."""
    initialize_distributed(args)
    if install_patches is not None:
        install_patches(args)
    trainer = Trainer(args)
    if args.load:
        trainer.load(args.load)
    start = trainer.iteration + 1
    metrics = {"lm loss": [], "iteration-time": [], "throughput": [], "tokens-per-sec": []}
    flops = flops_from_args(args)
    tokens = args.global_batch_size * args.seq_length
    world = dist.get_world_size()
    while trainer.iteration < args.train_iters:
        dist.barrier()
        t0 = time.perf_counter()
        loss = trainer.train_step()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        # The loss lives on the last stage; make it known to the logging (last) rank.
        loss_t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
        dist.broadcast(loss_t, src=world - 1)
        loss = loss_t.item()
        tflops = flops / (elapsed * 1e12 * world)
        metrics["lm loss"].append(loss)
        metrics["iteration-time"].append(elapsed)
        metrics["throughput"].append(tflops)
        metrics["tokens-per-sec"].append(tokens / elapsed)
        it = trainer.iteration
        if _is_logging_rank() and (it % args.log_interval == 0 or it == args.train_iters):
            print(
                f" iteration {it:8d}/{args.train_iters:8d} | consumed samples: "
                f"{it * args.global_batch_size:12d} | elapsed time per iteration (ms): "
                f"{elapsed * 1000:.1f} | tokens/s: {tokens / elapsed:.1f} | "
                f"throughput per GPU (TFLOP/s/GPU): {tflops:.4f} | lm loss: {loss:.6E} |",
                flush=True,
            )
        if args.save and args.save_interval and it % args.save_interval == 0:
            trainer.save(args.save)
    if args.save and (not args.save_interval or trainer.iteration % args.save_interval != 0):
        trainer.save(args.save)
    result = {k: _golden(v, start) for k, v in metrics.items()}
    if args.log_json and _is_logging_rank():
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
        with open(args.log_json, "w") as f:
            json.dump(result, f, indent=1)
    return result
