"""``vllm-peagle train``: distil a P-EAGLE (or plain EAGLE-3) drafter from its target.

Loss: count-normalised KL(target || draft) over the vocabulary at every sampled element,
with the target's full next-token distribution as soft label. This equals soft-label
cross-entropy minus the target's entropy (a constant), so it has the same gradients, but
its value reaches 0 for a perfect drafter and is comparable across depths; it also
rewards matching the whole distribution, which is what sampled (T > 0) acceptance needs.
All depths weigh the same (no per-depth decay), as in speculators and NeMo.

Two kinds share one loop (the step itself is :mod:`vllm_peagle.training.step`):

* ``peagle``: depth 0 = (token, fused target hidden); depth >= 1 = (mask token,
  ``mask_hidden``); all COD-sampled depths run in ONE drafter pass under the flattened
  parallel-group mask (:mod:`vllm_peagle.training.cod`).
* ``eagle3``: no mask token, no ``mask_hidden``. Training-time test (TTT) unrolling:
  depth d feeds the data token ``x_{j+d+1}`` with the drafter's own output hidden state of
  depth d-1, exactly what vLLM's sequential EAGLE-3 drafting feeds, one depth per pass on
  top of the KV of the earlier depths. ``num_depths=1`` gives plain depth-0 training.

Determinism: every random draw is derived from ``(seed, step)`` (data order per epoch, COD
per step), so resuming from a checkpoint reproduces an uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from vllm_peagle.checkpoint import atomic_directory
from vllm_peagle.modeling import PEagleDrafter, PEagleDrafterConfig
from vllm_peagle.training.cod import CodConfig
from vllm_peagle.training.data import Sample, read_dataset
from vllm_peagle.training.distributed import (
    DistContext,
    Runner,
    close_distributed,
    init_distributed,
)
from vllm_peagle.training.export import export_run
from vllm_peagle.training.hidden_states import FeatureCache, TargetModel
from vllm_peagle.training.partition import partitioned_backward
from vllm_peagle.training.step import (
    drafter_loss_sum,
    make_batch,
    make_layouts,
    stats_from_sums,
)

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "state.pt"
LOG_FILE = "train_log.jsonl"


@dataclass
class TrainConfig:
    """Everything that determines a training run (saved in its checkpoints)."""

    target: str
    data: str | list[str]
    """One or more generate-data outputs."""
    out: str
    kind: Literal["peagle", "eagle3"] = "peagle"
    num_depths: int = 7
    """Depths trained = K recorded in the export (TTT steps for eagle3)."""
    cod_ratio: float = 0.7
    cod_min_ratio: float = 0.2
    num_layers: int = 2
    aux_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    """Default: the tokenizer's mask token."""
    norm_before_fc: bool = False
    """One RMSNorm over the concatenated aux states before ``fc``."""
    fc_norm: bool = False
    """EAGLE-3.1 "FC normalization": an RMSNorm per aux state before ``fc``."""
    norm_output: bool = False
    """EAGLE-3.1 "post-norm hidden states" as the drafter's aux output."""
    norm_before_residual: bool = False
    """Take layer 0's residual after ``hidden_norm`` instead of before it."""
    steps: int = 600
    batch_size: int = 4
    max_seq_len: int = 320
    lr: float = 2e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    loss_on_prompt: bool = False
    train_lm_head: bool = False
    feature_cache: str | None = None
    num_threads: int | None = None
    export: bool = True
    segment_len: int | None = None
    """Sequence-partitioned training: anchors per segment (None = whole sequences)."""
    distributed: Literal["ddp", "fsdp"] = "ddp"
    """Under torchrun: DistributedDataParallel, or FSDP2 sharding for larger drafters."""
    device: str | None = None
    """None = ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""

    def cod(self) -> CodConfig:
        return CodConfig(self.num_depths, self.cod_ratio, self.cod_min_ratio)


# Fields that may change between an interrupted run and its resume.
# segment_len changes only the summation order of the same gradient; device where it runs.
_RESUMABLE_CHANGES = {
    "steps",
    "checkpoint_every",
    "log_every",
    "export",
    "num_threads",
    "segment_len",
    "device",
}
# Fields added after checkpoints were first written; a checkpoint without one used the default.
_LATER_DEFAULTS = {"segment_len": None, "distributed": "ddp", "device": None}


@dataclass
class TrainResult:
    drafter: PEagleDrafter
    history: list[dict[str, Any]]
    steps: int
    seconds: float
    exported: dict[str, str] = field(default_factory=dict)


def lr_lambda(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_drafter(cfg: TrainConfig, target: TargetModel, tokenizer: Any) -> PEagleDrafter:
    """A fresh drafter shaped like the target, embeddings and head copied from it."""
    tc = target.config.get_text_config()
    mask_id = None
    if cfg.kind == "peagle":
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else tokenizer.mask_token_id
        if mask_id is None:
            raise ValueError("P-EAGLE needs a mask token: pass mask_token_id")
    dcfg = PEagleDrafterConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        intermediate_size=tc.intermediate_size,
        vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size,
        head_dim=getattr(tc, "head_dim", None),
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 1e4)),
        max_position_embeddings=tc.max_position_embeddings,
        eagle_aux_hidden_state_layer_ids=list(target.aux_layer_ids),
        mask_token_id=mask_id,
        norm_before_fc=cfg.norm_before_fc,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        norm_before_residual=cfg.norm_before_residual,
    )
    torch.manual_seed(cfg.seed)
    drafter = PEagleDrafter(dcfg)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.embed_weight())
        drafter.lm_head.weight.copy_(target.lm_head_weight())
    # The embedding stays trainable so the mask token's row can learn (P-EAGLE).
    drafter.lm_head.weight.requires_grad_(cfg.train_lm_head)
    return drafter


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


class Trainer:
    """Owns the model, optimiser, schedule, data order and checkpoints of one run.

    ``dist`` (from :func:`~vllm_peagle.training.distributed.init_distributed`) makes it one
    rank of a torchrun job; every rank must construct and run its own Trainer.
    """

    def __init__(self, cfg: TrainConfig, dist: DistContext | None = None) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.dist = dist or DistContext(device=torch.device(cfg.device or "cpu"))
        self.out = Path(cfg.out)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.target)
        self.target = TargetModel(cfg.target, cfg.aux_layer_ids).to(self.dist.device)
        files = [cfg.data] if isinstance(cfg.data, str) else list(cfg.data)
        self.samples = [s for f in files for s in read_dataset(f, max_len=cfg.max_seq_len)]
        if not self.samples:
            raise ValueError(f"{cfg.data}: no usable samples")
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.cache = FeatureCache(cfg.feature_cache, self.target) if cfg.feature_cache else None
        self.drafter = build_drafter(cfg, self.target, self.tokenizer).train()
        self.runner = Runner(self.drafter, self.dist, cfg.distributed)
        params = self.runner.trainable()
        self.opt = torch.optim.AdamW(
            params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=True
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_lambda(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
        )
        self.step, self.epoch, self.cursor = 0, 0, 0
        self.history: list[dict[str, Any]] = []
        self.seconds = 0.0

    # -- data order -------------------------------------------------------------------
    def _permutation(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch)
        return torch.randperm(len(self.samples), generator=gen).tolist()

    def _next_samples(self) -> list[Sample]:
        chosen: list[Sample] = []
        while len(chosen) < self.cfg.batch_size:
            perm = self._permutation(self.epoch)
            take = perm[self.cursor : self.cursor + self.cfg.batch_size - len(chosen)]
            chosen += [self.samples[i] for i in take]
            self.cursor += len(take)
            if self.cursor >= len(perm):
                self.epoch, self.cursor = self.epoch + 1, 0
        return chosen

    # -- checkpoints ------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write ``out/checkpoint`` atomically (rank 0; every rank must call it)."""
        # Gathering sharded (FSDP) state is a collective, so every rank takes part.
        model, optim = self.runner.model_state(), self.runner.optimizer_state(self.opt)
        if not self.dist.is_main:
            self.dist.barrier()
            return self.out / CHECKPOINT_DIR
        state = {
            "model": model,
            "optimizer": optim,
            "scheduler": self.sched.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "rng": _rng_state(),
            "config": asdict(self.cfg),
            "history": self.history,
            "seconds": self.seconds,
        }
        with atomic_directory(self.out / CHECKPOINT_DIR) as stage:
            torch.save(state, stage / STATE_FILE)
        self.dist.barrier()
        return self.out / CHECKPOINT_DIR

    def load_checkpoint(self, path: Path | None = None) -> bool:
        """Restore the latest checkpoint under ``out`` if there is one; returns whether it did."""
        file = (path or self.out / CHECKPOINT_DIR) / STATE_FILE
        if not file.is_file():
            return False
        state = torch.load(file, weights_only=False, map_location="cpu")
        saved, now = state["config"], asdict(self.cfg)
        changed = {
            k for k in now if saved.get(k, _LATER_DEFAULTS.get(k)) != now[k]
        } - _RESUMABLE_CHANGES
        if changed:
            raise ValueError(f"{file} was written with different settings: {sorted(changed)}")
        self.runner.load_model_state(state["model"])
        self.runner.load_optimizer_state(self.opt, state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.cursor = state["step"], state["epoch"], state["cursor"]
        self.history, self.seconds = state["history"], state.get("seconds", 0.0)
        _set_rng_state(state["rng"])
        return True

    # -- the loop ---------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.dist
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
        samples = self._next_samples()
        # Every rank draws the whole global batch's layouts (cheap integer work) so that each
        # sample gets the same COD layout as in a single-process run, then keeps its share.
        layouts = make_layouts(samples, cfg.cod(), gen, cfg.loss_on_prompt)
        mine = ctx.share(len(samples))
        batch = make_batch(
            samples[mine],
            self.target,
            cfg.cod(),
            gen,
            self.pad_id,
            cfg.loss_on_prompt,
            self.cache,
            layouts=layouts[mine],
        ).to(ctx.device)
        count = ctx.all_reduce_sum(batch.layout.supervised.sum().cpu())
        # DDP/FSDP average gradients over ranks: scale so the mean is sum(KL) / global count.
        normalizer = max(int(count), 1) / ctx.world_size

        def autocast() -> Any:
            return torch.autocast(
                ctx.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"
            )

        self.opt.zero_grad(set_to_none=True)
        if cfg.segment_len:
            loss_sum, sums = partitioned_backward(
                self.runner,
                self.drafter,
                batch,
                cfg.kind,
                cfg.segment_len,
                normalizer,
                no_sync=self.runner.no_sync,
                autocast=autocast,
            )
        else:
            with autocast():
                loss, sums = self.runner(drafter_loss_sum, batch, cfg.kind)
            (loss / normalizer).backward()
            loss_sum = float(loss.detach())
        grad_norm = self.runner.clip_grad_norm(cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        # Logged figures are global: sums over every rank's elements.
        totals = ctx.all_reduce_sum(
            torch.cat([torch.tensor([loss_sum], dtype=torch.float64), sums.flatten()])
        )
        sums = totals[1:].view_as(sums)
        return {
            "step": self.step,
            "loss": float(totals[0]) / max(int(count), 1),
            "grad_norm": grad_norm,
            "lr": self.sched.get_last_lr()[0],
            **stats_from_sums(sums),
        }

    def run(
        self,
        stop_at: int | None = None,
        progress: bool = True,
        time_budget_s: float | None = None,
    ) -> TrainResult:
        """Train until ``cfg.steps`` (or ``stop_at``, to simulate an interruption).

        ``time_budget_s`` is a safety net for wall-clock-bounded runs: training stops
        (with a checkpoint) once that many seconds of steps are spent, and exports anyway.
        """
        from tqdm.auto import tqdm

        cfg = self.cfg
        end = min(cfg.steps, stop_at if stop_at is not None else cfg.steps)
        threads = torch.get_num_threads()
        deterministic = torch.are_deterministic_algorithms_enabled()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        torch.use_deterministic_algorithms(True)
        try:
            with tqdm(
                total=cfg.steps,
                initial=self.step,
                desc=f"train {cfg.kind}",
                disable=not (progress and self.dist.is_main),
            ) as bar:
                while self.step < end and not (
                    time_budget_s is not None and self.seconds >= time_budget_s
                ):
                    t0 = time.perf_counter()
                    rec = self.train_step()
                    self.seconds += time.perf_counter() - t0
                    rec["seconds"] = round(self.seconds, 2)
                    out_of_time = time_budget_s is not None and self.seconds >= time_budget_s
                    last = self.step == end or out_of_time
                    if self.step % cfg.log_every == 0 or last:
                        self.history.append(rec)
                        self._log(rec)
                    acc = "/".join(f"{a:.2f}" for a in rec["acc"] if a == a)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=acc, refresh=False)
                    bar.update(1)
                    if self.step % cfg.checkpoint_every == 0 or last:
                        self.save_checkpoint()
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
        exported: dict[str, str] = {}
        # Under FSDP the trained drafter's parameters are shards that keep the process group
        # alive; the result gets the gathered drafter, so the group can go before exit.
        drafter = self.runner.plain_drafter()
        stopped_early = time_budget_s is not None and self.seconds >= time_budget_s
        if (self.step >= cfg.steps or stopped_early) and cfg.export:
            exported = self.export(drafter)
        return TrainResult(drafter, self.history, self.step, self.seconds, exported)

    def _log(self, rec: dict[str, Any]) -> None:
        """Rank 0 appends each logged step to ``out/train_log.jsonl`` (repeats after a resume)."""
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / LOG_FILE, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(rec) + "\n")

    def export(self, drafter: PEagleDrafter | None = None) -> dict[str, str]:
        """Write the servable drafter (see :func:`~vllm_peagle.training.export.export_run`):
        ``drafter``, or the trained one gathered (a collective under FSDP)."""
        drafter = drafter if drafter is not None else self.runner.plain_drafter()
        if not self.dist.is_main:
            return {}
        return export_run(
            drafter.eval(),
            self.out,
            target=self.cfg.target,
            num_speculative_tokens=self.cfg.num_depths,
            summary={
                "config": asdict(self.cfg),
                "steps": self.step,
                "train_seconds": round(self.seconds, 1),
                "history": self.history,
            },
        )


def train(cfg: TrainConfig, resume: bool = True, progress: bool = True) -> TrainResult:
    """Train (resuming from ``cfg.out/checkpoint`` when present) and export.

    Under torchrun this process becomes one rank of the job (see
    :mod:`~vllm_peagle.training.distributed`); only rank 0 prints, checkpoints and exports.
    """
    ctx = init_distributed(cfg.device)
    try:
        trainer = Trainer(cfg, ctx)
        if resume and trainer.load_checkpoint() and ctx.is_main:
            print(f"resumed from step {trainer.step}", flush=True)
        result = trainer.run(progress=progress)
        del trainer  # its sharded modules and optimizer state hold the process group
        return result
    finally:
        close_distributed(ctx)
