"""Multi-process training on torch.distributed: DDP by default, FSDP2 for larger drafters.

Launch with ``torchrun`` (``python -m torch.distributed.run``); its environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...) selects the process group:
gloo on CPU, nccl on CUDA. Without it everything here is a no-op and the trainer runs as
one process.

Data parallelism keeps the *global* batch of a single-process run: every rank draws the
same global batch (seeded order, seeded COD layouts) and trains on its contiguous share.
The loss of each rank is ``sum(KL over its elements) / (global count / world)``; DDP and
FSDP average gradients over ranks, so the update equals the single-process one up to
float summation order.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from vllm_peagle.modeling import PEagleDrafter

Strategy = Literal["ddp", "fsdp"]


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int = 0
    """Global rank (0 logs, shows progress, writes checkpoints and the export)."""
    world_size: int = 1
    """Number of processes; 1 = no process group."""
    local_rank: int = 0
    """Rank on this node (selects the GPU)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Device of the drafter and the target."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place on a copy; returns it on the tensor's own device)."""
        if not self.enabled:
            return tensor
        out = tensor.detach().clone().to(self.device)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(tensor.device)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def share(self, global_batch: int) -> slice:
        """This rank's contiguous share of a global batch of ``global_batch`` samples."""
        if global_batch % self.world_size:
            raise ValueError(
                f"batch size {global_batch} does not split over {self.world_size} processes; "
                "pass a --batch-size divisible by the number of processes"
            )
        per = global_batch // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)


def init_distributed(device: str | None = None, timeout_s: float = 1800.0) -> DistContext:
    """Join the torchrun job described by the environment, or return a single-process context.

    ``device`` overrides the default (``cuda:LOCAL_RANK`` when CUDA is available, else CPU);
    the backend follows it (nccl for CUDA, gloo otherwise).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world <= 1:
        return DistContext(device=dev)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistContext(dist.get_rank(), dist.get_world_size(), local, dev)


def close_distributed(ctx: DistContext) -> None:
    """Free what still holds the process group, then destroy it.

    Gloo's worker threads live as long as anything references the group (FSDP's device
    mesh does, through sharded parameters and optimizer state, often inside reference
    cycles). Left to interpreter shutdown, their teardown can abort the process after a
    finished run ("terminate called without an active exception", seen once on CI on a
    rank of a completed FSDP job), so they are collected here while the interpreter is whole.
    """
    if ctx.enabled and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


class DrafterCaller(nn.Module):
    """``forward(fn, *args) = fn(drafter, *args)``: routes any drafter computation (a full
    loss, a partition segment, a no-grad K/V pass) through DDP's or FSDP's forward so
    that parameters are gathered and the gradient reducer is armed."""

    def __init__(self, drafter: PEagleDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.drafter, *args)


_PREFIX = "drafter."


class Runner:
    """How the trainer reaches its drafter: directly, through DDP, or through FSDP2."""

    def __init__(self, drafter: PEagleDrafter, ctx: DistContext, strategy: Strategy) -> None:
        self.drafter, self.ctx = drafter.to(ctx.device), ctx
        self.strategy: Strategy | None = strategy if ctx.enabled else None
        caller = DrafterCaller(self.drafter)
        self.module: nn.Module = caller
        if self.strategy == "ddp":
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.module = nn.parallel.DistributedDataParallel(caller, device_ids=ids)
        elif self.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # One unit per decoder layer, the root holds embeddings, fc, norm and head.
            for layer in self.drafter.decoder_layers():
                fully_shard(layer)
            self.module = fully_shard(caller)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.module(fn, *args)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (every backward of a step but the last)."""
        if self.strategy == "ddp":
            with self.module.no_sync():  # type: ignore[operator]
                yield
        elif self.strategy == "fsdp":
            self.module.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)  # type: ignore[operator]
        else:
            yield

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.trainable(), max_norm)
        full = getattr(norm, "full_tensor", None)  # FSDP2 returns a DTensor
        return float(full() if full is not None else norm)

    # -- full (unsharded) state, identical format for every strategy -----------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """Plain ``drafter.state_dict()`` names and tensors; a collective under FSDP
        (complete on rank 0 only)."""
        if self.strategy != "fsdp":
            return self.drafter.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        full = get_model_state_dict(
            self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {k.removeprefix(_PREFIX): v for k, v in full.items()}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.strategy != "fsdp":
            self.drafter.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(
            self.module,
            {_PREFIX + k: v for k, v in state.items()},
            options=StateDictOptions(full_state_dict=True),
        )

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        if self.strategy != "fsdp":
            return opt.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            self.module, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if self.strategy != "fsdp":
            opt.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            self.module, opt, state, options=StateDictOptions(full_state_dict=True)
        )

    def plain_drafter(self) -> PEagleDrafter:
        """An unwrapped drafter with the trained weights (a collective under FSDP)."""
        if self.strategy != "fsdp":
            return self.drafter
        state = self.model_state()
        plain = PEagleDrafter(self.drafter.config)
        if self.ctx.is_main:
            plain.load_state_dict(state)
        return plain
