"""ddcnn's one training loop, on Lightning Fabric: every training of a run (local nets, the coarse DNN, the global CNN,
the optional methods, the DDP baseline) trains here.

:func:`fit_batches` trains a classifier on a :class:`~ddcnn.data.datamodule.Batches` source with cross-entropy and
selects its weights on validation, under one frozen :class:`~ddcnn.settings.LoopSettings`, with the caller's
callbacks (:mod:`ddcnn.engine.callbacks`). Fabric does what depends on where it runs (:mod:`ddcnn.engine.launch`):
the device, DDP (spawned on this machine, or across the tasks of an ``srun`` step), the precision (``32-true``,
``bf16-mixed``, ``16-mixed`` with a loss scaler, ``64-true``) with ``backward`` and gradient clipping. The loss is
computed in the network's dtype (float32; float64 under ``64-true``; float32 for the outputs of autocast). The loop
owns the order of the samples and everything a run directory promises:

- **exact resume**: everything random depends only on ``(seed, epoch)``. Epoch ``e`` visits the permutation drawn
  from ``torch.Generator().manual_seed(seed * 100_003 + e)`` (under DDP every rank takes every world-th sample of it,
  padded by wrapping around so that all ranks run the same steps), and the global generators (dropout) are seeded
  from the same generator during that epoch, then restored (:func:`torch.random.fork_rng`). ``last.ckpt`` (written
  atomically as :class:`~ddcnn.engine.callbacks.CheckpointCadence` says, and after the last epoch) holds the
  weights, the optimizer, the schedule, the loss scaler, the best weights so far, the history and the state of the
  early stopping and divergence rules (:class:`~ddcnn.engine.state.TrainState`), so a killed training resumes to
  exactly the weights an uninterrupted one reaches;
- **one improvement rule** (:func:`~ddcnn.engine.convergence.improves`) for selection (the last epoch that improved
  is kept), early stopping (:class:`~ddcnn.engine.callbacks.EarlyStopping`) and ``ReduceLROnPlateau`` (built with
  the same rule; its patience at least 2 below early stopping's);
- **divergence** (:class:`~ddcnn.engine.callbacks.DivergenceRestart`): an epoch that diverged starts the training
  again from its initial weights at lower rates, or raises :class:`~ddcnn.engine.state.Diverged`;
- ``logs/metrics.csv``: one row per epoch, every epoch once across a resume; a convergence record in the result
  (:func:`~ddcnn.engine.convergence.convergence`);
- **one timing rule**: the training clock runs from the caller's ``start`` and adds the time of the earlier processes
  that worked on the training (carried in ``last.ckpt``). Left out of it, alike for every training: process start-up
  and DDP's launch and rendezvous (``startup_s``), the device warm-up (an untimed training forward and backward of
  every batch shape of the epoch, and an evaluation batch of every shape, which leave weights, buffers, optimizer and
  generators as they were: ``warmup_s``), the callbacks' ``on_validation_end`` (``hook_time_s``) and ``on_log``
  (``report_time_s``), and the held-out target split's measurement.

Closure optimizers (``torch.optim.LBFGS``) re-evaluate the batch through a closure at each step. The loop reads every
batch through the ``Batches`` protocol (on the device, ready for the network); it prepares no batch itself. The
network is set up on the device in one place (:meth:`_Training.setup`) and trained by one step function
(:meth:`_Training.train_step`); :meth:`_Training.fit` runs :meth:`_Training.fit_epoch` until the budget or early
stopping ends the training, as ``fit`` does in Lightning Fabric's trainer example.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import update_bn

from ddcnn.data.datamodule import Batches
from ddcnn.engine.callbacks import CheckpointCadence, DivergenceRestart, EarlyStopping, call
from ddcnn.engine.common import data_splits
from ddcnn.engine.convergence import convergence, improves
from ddcnn.engine.gpu import (
    batches_ahead,
    compiled_frames,
    math_flags,
    memory_format,
    peak_memory_bytes,
    place_data,
    profiled,
    reset_peak_memory,
    resolve_policy,
)
from ddcnn.engine.launch import build_fabric, fit_here, fit_spawned
from ddcnn.engine.optim import deterministic, needs_closure, training_optimizer
from ddcnn.engine.state import (
    CHECKPOINT_FORMAT,
    Clock,
    Diverged,
    FitResult,
    TrainState,
    cpu_state,
    load_checkpoint,
    metrics_csv,
)
from ddcnn.engine.sync_norm import convert_batch_norm, has_batch_norm
from ddcnn.io import atomic_torch_save, atomic_write_text, disk_errors
from ddcnn.models.checkpointing import apply_checkpointing, remove_checkpointing
from ddcnn.rundir import TARGET_SPLIT
from ddcnn.settings.loop import LoopSettings, num_batches

log = logging.getLogger(__name__)

__all__ = ["FitResult", "Diverged", "fit_batches", "shard_order"]


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch))


def shard_order(order: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of one epoch's sample order under DDP: every ``world``-th sample, padded by wrapping
    around so that every rank has the same number (as torch's ``DistributedSampler``); the order itself outside.

    The ranks' batches together are then one device's batches, so DDP takes one device's steps (to rounding; tested
    in float64), except that the up to ``world - 1`` wrapped samples count twice in an epoch's last batch when the
    training split does not divide by ``world``, and that dropout draws its masks per rank."""
    if world <= 1:
        return order
    total = -(-len(order) // world) * world
    return torch.cat([order, order[: total - len(order)]])[rank::world]


def _seed_global_rng(seed: int, device: torch.device) -> None:
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def _loss_dtype(logits: torch.Tensor) -> torch.Tensor:
    """Logits in the dtype the loss is computed in: the network's own (float32; float64 under ``64-true``), float32
    for the float16/bfloat16 outputs of an autocast region."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


# --- the loop -----------------------------------------------------------------------------------------------------
class _Training:
    """One training: :func:`fit_batches`' settings, network, data and folder; :meth:`run` trains it in one rank
    (every rank under DDP). Picklable, so that spawned DDP ranks receive it whole.

    Its steps, in the order of an epoch (:meth:`fit_epoch`): :meth:`train_epoch`, :meth:`restart` after a
    divergence, :meth:`validate`, :meth:`run_after_epoch` (the stage's hook), :meth:`select`,
    :meth:`step_scheduler`, :meth:`checkpoint_due`, :meth:`decide_stop`, :meth:`save`, :meth:`report` and the
    ``on_epoch_end`` hook."""

    # Set by run(), from the data and the device: the batches of an epoch and of a validation (this rank's), where
    # the data are placed, the network on the device (module: plain; model: as Fabric set it up) and its optimizer.
    n_train: int
    batch: int
    train_batches: int
    eval_batch_size: int
    val_batches: int
    prefetch: bool
    policy: dict[str, Any]
    format: torch.memory_format
    net_dtype: torch.dtype
    fabric: Any
    module: nn.Module
    model: nn.Module
    raw_opt: torch.optim.Optimizer
    opt: torch.optim.Optimizer
    sched: Any
    closure_steps: bool
    resume_settings: dict[str, Any]
    last_write: float

    def __init__(
        self,
        settings: LoopSettings,
        net: nn.Module,
        data: Batches,
        folder: str,
        callbacks: Sequence[Any],
        start: float,
    ) -> None:
        self.settings, self.net, self.data, self.folder = settings, net, data, folder
        self.callbacks = list(callbacks)
        self.early_stopping, self.cadence = EarlyStopping(settings), CheckpointCadence(settings)
        self.divergence_rule = DivergenceRestart(settings)
        spawned = settings.launcher == "spawn"
        threads = max(1, torch.get_num_threads() // settings.num_devices) if spawned else None
        # The clock's start (perf_counter), the CPU threads of a spawned rank, and the start-up left out of the clock.
        self.start, self.threads, self.startup_s = start, threads, 0.0

    # -- the network on the device: the one place where it is set up --
    def setup(self, fabric) -> None:
        net = self.net
        if fabric.world_size > 1 and has_batch_norm(net):
            # DDP normalises over the global batch, as the one-device run does: exact DDP (see ddcnn.engine.sync_norm).
            net = convert_batch_norm(net, fabric.device)
        if self.settings.activation_checkpointing == "all":  # "global": the global CNN's stage hands it "all"
            net = apply_checkpointing(net)
        if self.policy["channels_last"]:
            net = net.to(memory_format=memory_format(self.policy))
        self.module = net
        # Fabric unwraps a compiled module, sets it up and compiles it again; evaluation runs the plain module.
        self.model = fabric.setup_module(torch.compile(net) if self.policy["compile"] else net)
        self.fabric = fabric

    def train_batch(self, idx: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb, yb = self.data.train_batch(idx, epoch, self.fabric.device)
        return (xb.contiguous(memory_format=self.format) if self.policy["channels_last"] else xb), yb

    def eval_batch(self, split: str, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xb, yb = self.data.eval_batch(split, idx, self.fabric.device)
        if self.settings.precision == "64-true" and xb.is_floating_point():  # evaluation runs the plain module
            xb = xb.double()
        return (xb.contiguous(memory_format=self.format) if self.policy["channels_last"] else xb), yb

    def batches_ahead(self, batches: list[torch.Tensor], epoch: int) -> Iterator[tuple[torch.Tensor, tuple]]:
        """``(idx, batch)`` of this epoch's training batches (:func:`~ddcnn.engine.gpu.batches_ahead`: the next one
        prefetched on a side stream when they stream from pinned memory to a GPU)."""
        return batches_ahead(lambda idx: self.train_batch(idx, epoch), batches, self.prefetch, self.fabric.device)

    def build_optimizer(self, lr_scale: float) -> None:
        """The optimizer (its rates times ``lr_scale``) and the schedule
        (:func:`~ddcnn.engine.optim.training_optimizer`), set up by Fabric."""
        self.raw_opt, self.sched = training_optimizer(
            self.settings, self.module.parameters(), self.fabric.device, lr_scale
        )
        self.opt = self.fabric.setup_optimizers(self.raw_opt)
        self.closure_steps = needs_closure(self.raw_opt)

    @property
    def stateful(self) -> dict[str, Any]:
        """The objects whose state ``last.ckpt`` holds, by their key there (:class:`TrainState`)."""
        precision = self.fabric.strategy.precision
        return {"net": self.module, "optimizer": self.raw_opt, "scheduler": self.sched, "precision_state": precision}

    def clip(self) -> None:
        s = self.settings
        if s.gradient_clip_val is None:
            return
        if s.gradient_clip_algorithm == "value":
            self.fabric.clip_gradients(self.model, self.opt, clip_val=s.gradient_clip_val)
        else:
            self.fabric.clip_gradients(self.model, self.opt, max_norm=s.gradient_clip_val, error_if_nonfinite=False)

    def no_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and self.fabric.world_size > 1:
            return self.fabric.no_backward_sync(self.model)
        return contextlib.nullcontext()

    # -- one training step: the one step function --
    def train_step(self, xb: torch.Tensor, yb: torch.Tensor, stepping: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one batch, then (``stepping``) the optimizer step; its loss and logits before
        the step."""
        fabric, model, opt = self.fabric, self.model, self.opt
        if self.closure_steps:
            first: list[tuple[torch.Tensor, torch.Tensor]] = []

            def closure() -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                logits = model(xb)
                loss = F.cross_entropy(_loss_dtype(logits), yb)
                fabric.backward(loss)
                self.clip()
                if not first:
                    first.append((loss.detach(), logits.detach()))
                return loss

            opt.step(closure)
            return first[0]
        accumulate = self.settings.accumulate_grad_batches
        with self.no_sync(not stepping):
            logits = model(xb)
            loss = F.cross_entropy(_loss_dtype(logits), yb)
            fabric.backward(loss / accumulate if accumulate > 1 else loss)
        if stepping:
            self.clip()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach(), logits.detach()

    @torch.inference_mode()
    def evaluate(self, split: str = "val") -> torch.Tensor:
        """``(loss sum, correct, count)`` over this rank's share of ``split`` (every world-th sample)."""
        fabric, module = self.fabric, self.module
        module.eval()
        sums = torch.zeros(3, device=fabric.device, dtype=torch.float64)
        idx = torch.arange(fabric.global_rank, self.data.size(split), fabric.world_size, device=self.index_device)
        for k, chunk in enumerate(idx.split(self.eval_batch_size)):
            if k >= self.val_batches:
                break
            xb, yb = self.eval_batch(split, chunk)
            with fabric.autocast():
                logits = module(xb)
            sums[0] += F.cross_entropy(_loss_dtype(logits), yb, reduction="sum").double()
            sums[1] += (logits.argmax(-1) == yb).sum()
            sums[2] += len(yb)
        if fabric.world_size > 1:
            sums = fabric.all_reduce(sums, reduce_op="sum")
        return sums

    @property
    def index_device(self) -> torch.device:
        """Where the data cut their batches (``Batches.index_device``: the device for data held there, else the
        CPU): the sample indices live there, so that cutting a batch copies nothing between host and device."""
        return torch.device(getattr(self.data, "index_device", None) or "cpu")

    def epoch_batches(self, epoch: int) -> list[torch.Tensor]:
        """The sample indices of this rank's training batches in ``epoch``, and seeds the global generators.

        The order is drawn on the CPU (the same permutation on every device) and moved where the data cut their
        batches once per epoch, in one copy; the batches are views of it."""
        gen = _epoch_generator(self.settings.seed, epoch)
        order = torch.randperm(self.n_train, generator=gen) if self.batch < self.n_train else torch.arange(self.n_train)
        order = shard_order(order, self.fabric.global_rank, self.fabric.world_size)
        _seed_global_rng(int(torch.randint(2**62, (1,), generator=gen)), self.fabric.device)
        order = order[: self.train_batches * self.batch]
        if self.index_device.type != "cpu":
            order = order.pin_memory().to(self.index_device, non_blocking=True)
        return list(order.split(self.batch))

    def warm_up(self, epoch: int) -> None:
        """A training step's forward and backward for every batch shape of the epoch (the full batch and a partial
        last one) and an evaluation batch of every shape validation uses, which leave no trace: no optimizer step,
        gradients cleared, buffers (batch-norm statistics) and generators restored. The device's first-use costs
        (CUDA context, cuDNN handles, kernels, allocator; oneDNN primitives on CPU), cuDNN's autotuning of each shape
        and, with ``compile``, the compilation of each shape are then paid here, outside the clock, by every training
        alike, whichever process or calibration used the device before."""
        fabric, module = self.fabric, self.module
        saved = [b.detach().clone() for b in module.buffers()]
        devices = [fabric.device] if fabric.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            batches = self.epoch_batches(epoch)
            shapes = {len(idx): idx for idx in reversed(batches)}  # one batch per size (the first of each)
            self.model.train()
            for idx in reversed(shapes.values()):
                xb, yb = self.train_batch(idx, epoch)
                with self.no_sync(True):
                    loss = F.cross_entropy(_loss_dtype(self.model(xb)), yb)
                    fabric.backward(loss)
                self.opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for buffer, value in zip(module.buffers(), saved, strict=True):
                    buffer.copy_(value)
            with torch.inference_mode(), fabric.autocast():
                module.eval()
                idx = torch.arange(
                    fabric.global_rank, self.data.size("val"), fabric.world_size, device=self.index_device
                )
                chunks = list(idx.split(self.eval_batch_size))[: self.val_batches]
                for chunk in {len(chunk): chunk for chunk in reversed(chunks)}.values():
                    module(self.eval_batch("val", chunk)[0])
        if fabric.device.type == "cuda":
            torch.cuda.synchronize(fabric.device)

    # -- the training, start to end --
    def run(self, fabric, prefit_s: float | None = None) -> FitResult:
        """Train in this rank (see :func:`fit_batches`); ``prefit_s``: a spawned rank's share of the parent's time."""
        status = "failed"
        data = self.data
        try:
            result = self._run(fabric, prefit_s)
            status = "success"
            return result
        finally:
            self.data = data  # the placed view goes; the device copy of the splits is the process's (datamodule)
            if fabric.global_rank == 0:
                call(self.callbacks, "on_fit_end", status)

    def _run(self, fabric, prefit_s: float | None) -> FitResult:
        """Plan the batches, place data and network, start or resume, train, hand back the kept weights."""
        clock = self.start_clock(prefit_s)
        self.plan(fabric.world_size)
        engine = self.place(fabric, clock)
        state = self.start_or_resume(clock)
        first_epoch = state.epoch
        compile_time_s = self.fit(state, engine)
        return self.finish(state, engine, first_epoch, compile_time_s)

    def start_clock(self, prefit_s: float | None) -> Clock:
        """The training clock, from the caller's start (a spawned DDP rank: from now, plus the parent's set-up of the
        training), the start-up already left out."""
        if prefit_s is not None:
            self.start = time.perf_counter() - prefit_s
            if self.threads is not None:
                torch.set_num_threads(self.threads)
        clock = Clock(self.start)
        clock.left_out["startup"] = self.startup_s
        return clock

    def plan(self, world: int) -> None:
        """The batches of an epoch and of a validation in this rank, and the settings a resume must agree on."""
        s = self.settings
        self.n_train = self.data.size("train")
        self.batch = min(int(self.data.batch_size), self.n_train)
        per_rank = -(-self.n_train // world)
        self.train_batches = num_batches(-(-per_rank // self.batch), s.limit_train_batches, "limit_train_batches")
        self.eval_batch_size = int(self.data.eval_batch_size)
        per_rank_val = -(-self.data.size("val") // world)
        self.val_batches = num_batches(
            -(-per_rank_val // self.eval_batch_size), s.limit_val_batches, "limit_val_batches"
        )
        if self.val_batches == 0 and s.monitor.startswith("val_"):
            raise ValueError(
                f"limit_val_batches={s.limit_val_batches!r} skips validation, so monitor={s.monitor} has nothing "
                f"to select on: monitor train_loss (mode min) or train_acc (max), or validate."
            )
        own = {"batch_size": self.batch, "n_train": self.n_train} | ({"world_size": world} if world > 1 else {})
        self.resume_settings = s.resume_record() | own

    def place(self, fabric, clock: Clock) -> dict[str, Any]:
        """The data and the network on the device, under the GPU policy; the policy used (``FitResult.engine``)."""
        gpu = self.settings.gpu_policy()
        reset_peak_memory(fabric.device)
        # Where the batches come from: the stored splits on the device when they fit, else pinned host memory
        # (CUDA) with the next batch prefetched. Inside the clock: the streamed path pays its copies there too.
        self.data, placement = place_data(self.data, fabric.device, gpu["data_on_device"], gpu["device_data_fraction"])
        self.prefetch = placement == "pinned"
        with clock.outside("warmup"):  # the network on the device (the first use of a device pays for its context)
            # A 2D convnet's weights are 4D as its inputs are (5D: 3D); anything else has no channels-last format.
            weight_dims = max((p.dim() for p in self.net.parameters()), default=0)
            self.net_dtype = next((p.dtype for p in self.net.parameters() if p.is_floating_point()), torch.float32)
            self.policy = resolve_policy(
                fabric.device,
                deterministic=self.settings.deterministic,
                channels_last=gpu["channels_last"],
                tf32=gpu["tf32"],
                cudnn_benchmark=gpu["cudnn_benchmark"],
                compile=gpu["compile"],
                input_dims=weight_dims,
            )
            self.format = memory_format(self.policy)
            self.setup(fabric)
        return {
            **self.policy,
            "data_on_device": placement == "device",
            "data_placement": placement,
            "prefetch": self.prefetch,
            "profile_steps": int(gpu["profile_steps"]),
        }

    def start_or_resume(self, clock: Clock) -> TrainState:
        """A fresh state (the outputs of an earlier training of this folder removed), or the one of ``last.ckpt``,
        with the optimizer built."""
        folder = Path(self.folder)
        last = folder / "last.ckpt"
        # a restart starts from the initial weights (also for non-finite weights where divergence is not checked)
        self.divergence_rule.initial_net = cpu_state(self.module)
        state = TrainState(clock=clock, owners=(self.early_stopping, self.divergence_rule))
        checkpoint = load_checkpoint(last, self.resume_settings)
        self.build_optimizer(self.divergence_rule.lr_scale)  # a resumed optimizer's state brings its attempt's rates
        rank = self.fabric.global_rank
        if checkpoint is None:
            if rank == 0:  # outputs of an earlier training of this folder (force=true) must not pass for this one's
                (folder / "logs" / "metrics.csv").unlink(missing_ok=True)
                (folder / "best.ckpt").unlink(missing_ok=True)
            return state
        state.load_state_dict(checkpoint, self.stateful)
        if rank == 0:
            log.info("%s: resuming from %s (after epoch %d)", folder, last, checkpoint["epoch"])
        return state

    def fit(self, state: TrainState, engine: dict[str, Any]) -> float | None:
        """Train the epochs left (after the warm-up, outside the clock), under the training's generators (restored
        afterwards), deterministic algorithms, math flags and profiler; the compile time of the warm-up, if any."""
        s, fabric, clock = self.settings, self.fabric, state.clock
        devices = [fabric.device] if fabric.device.type == "cuda" else []
        steps = s.profile_steps if fabric.global_rank == 0 else 0
        profile = profiled(steps, Path(self.folder) / "profile" / "trace.json", fabric.device)
        compile_time_s = None
        self.cadence.written()
        with (
            torch.random.fork_rng(devices=devices),
            deterministic(s.deterministic),
            math_flags(self.policy, fabric.device),
            contextlib.closing(profile),
        ):
            if not self.finished(state):
                began_warmup = time.perf_counter()
                with clock.outside("warmup"):
                    self.warm_up(state.epoch)
                if self.policy["compile"]:  # the first training and evaluation passes compile the network
                    compile_time_s = time.perf_counter() - began_warmup
            compiled_before = compiled_frames() if self.policy["compile"] else None
            while not self.finished(state) or self.train_again(state):
                self.fit_epoch(state, profile)
            if compiled_before is not None:  # compilations inside the clock: a shape the warm-up did not cover
                engine["compile_recompiles"] = compiled_frames() - compiled_before
        return compile_time_s

    def train_again(self, state: TrainState) -> bool:
        """Whether a callback's ``on_train_end`` (every rank, with the kept weights; they decide alike) asks for
        another attempt, ``(reason, lr_factor)``: then the training starts again from its initial weights at the
        rates times the factor, recorded as a restart (as a divergence's)."""
        if state.best_net is None or not any(hasattr(c, "on_train_end") for c in self.callbacks):
            return False
        self.module.load_state_dict(state.best_net)
        self.module.eval()
        restarts = self.divergence_rule.restarts
        asked = [a for a in call(self.callbacks, "on_train_end", state.epoch - 1, self.module, restarts) if a]
        if not asked:
            return False
        reason, factor = asked[0]
        self.start_over(state, state.epoch - 1, reason, factor)
        return True

    def finished(self, state: TrainState) -> bool:
        return state.epoch >= self.settings.max_epochs or self.early_stopping.stopped_epoch is not None

    def start_over(self, state: TrainState, epoch: int, reason: str, lr_factor: float) -> None:
        """A new attempt after ``epoch``: from the initial weights, the learning rates times ``lr_factor`` once more,
        recorded as a restart (:class:`~ddcnn.engine.callbacks.DivergenceRestart`); nothing of the last one kept."""
        self.divergence_rule.restart(epoch, reason, lr_factor)
        self.early_stopping.stopped_epoch = None
        state.start_over()
        self.module.load_state_dict(self.divergence_rule.initial_net)
        self.build_optimizer(self.divergence_rule.lr_scale)

    def fit_epoch(self, state: TrainState, profile) -> None:
        """One epoch: train; after a divergence, restart; else validate, hand the row to the hooks, select, step the
        schedule, decide on stopping and checkpointing, report."""
        epoch, lr = state.epoch, float(self.raw_opt.param_groups[0]["lr"])
        sums, points = self.train_epoch(state, profile)
        train_loss = float(sums[0] / sums[2])
        reason = self.divergence_rule.reason(train_loss)
        if reason is not None:
            self.restart(state, epoch, reason)
            return
        row = self.validate(epoch, lr, state.step, sums, state.clock)
        if not math.isfinite(row["val_loss"] or 0.0):
            self.restart(state, epoch, f"val_loss {row['val_loss']}: the weights after the epoch are not finite")
            return
        self.run_after_epoch(row, state.clock)
        state.add(row)
        self.select(state, row)
        self.step_scheduler(row)
        due = self.checkpoint_due(epoch)
        self.decide_stop(state, epoch)
        if due or self.finished(state):
            if self.fabric.global_rank == 0:
                self.save(state)
            self.cadence.written()
        self.report(state.clock, epoch, row, points)
        call(self.callbacks, "on_epoch_end", epoch, row)

    def train_epoch(self, state: TrainState, profile) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """One pass over this rank's batches of ``state.epoch``: ``(loss sum, correct, count)`` over every rank, and
        the mean loss of every ``log_every_n_steps`` steps for the reporter. The first epoch of an attempt records
        the initial loss (under DDP the global first batch's) and the number of classes."""
        s, fabric, world = self.settings, self.fabric, self.fabric.world_size
        batches = self.epoch_batches(state.epoch)
        self.model.train()
        sums = torch.zeros(3, device=fabric.device, dtype=torch.float64)
        window, points = [], []
        wanted = any(getattr(c, "wants_steps", True) for c in self.callbacks if hasattr(c, "on_log"))
        log_steps = bool(s.log_every_n_steps and fabric.global_rank == 0 and wanted)
        first = None  # the first batch's loss, read after the epoch's steps: no host sync among them
        for k, (_, (xb, yb)) in enumerate(self.batches_ahead(batches, state.epoch)):
            stepping = (k + 1) % s.accumulate_grad_batches == 0 or k == len(batches) - 1
            loss, logits = self.train_step(xb, yb, stepping)
            profile.step()
            if self.divergence_rule.initial_loss is None and first is None:
                first = fabric.all_reduce(loss.clone(), reduce_op="mean") if world > 1 else loss
                self.divergence_rule.num_classes = int(logits.shape[-1])
            sums[0] += loss.double() * len(yb)
            sums[1] += (logits.argmax(-1) == yb).sum()
            sums[2] += len(yb)
            if stepping:
                state.step += 1
                if log_steps:
                    window.append(loss)
                    if state.step % s.log_every_n_steps == 0:
                        points.append((state.step, torch.stack(window).float().mean()))
                        window = []
        if world > 1:
            sums = fabric.all_reduce(sums, reduce_op="sum")
        if first is not None:
            self.divergence_rule.initial_loss = float(first)
        return sums, points

    def restart(self, state: TrainState, epoch: int, reason: str) -> None:
        """Start again from the initial weights with lower learning rates, or raise :class:`Diverged` when no
        restart is left. Weights that are not finite (a validation loss that is not) start again even where
        divergence is not checked (``divergence_restarts`` null), at most ``NOT_FINITE_RETRIES`` times and then at
        the same rates (:class:`~ddcnn.engine.callbacks.DivergenceRestart`): the same attempt again, whose draws are
        those of ``(seed, epoch)``, so only a kernel's occasional fault differs."""
        where = f"the training in {Path(self.folder)} diverged in epoch {epoch} ({reason})"
        rule = self.divergence_rule
        scale = rule.next_scale(len(rule.restarts))
        if scale is None:
            raise rule.failure(where, len(rule.restarts), epoch, reason)
        self.start_over(state, epoch, reason, scale)
        if self.fabric.global_rank == 0:
            log.warning("%s: restarting from the initial weights with the learning rate x %g", where, rule.lr_scale)

    def validate(self, epoch: int, lr: float, step: int, sums: torch.Tensor, clock: Clock) -> dict[str, float]:
        """The epoch's row of ``logs/metrics.csv``: its training sums ``sums`` and the validation's metrics (batch
        norm's statistics first recomputed from ``precise_bn`` training batches where that is set)."""
        if self.val_batches:
            if self.settings.precise_bn and has_batch_norm(self.module):
                batches = self.epoch_batches(epoch)[: self.settings.precise_bn]
                update_bn((self.train_batch(idx, epoch)[0] for idx in batches), self.model)
            val = self.evaluate("val")
            val_loss, val_acc = float(val[0] / val[2]), float(val[1] / val[2])
        else:
            val_loss = val_acc = None
        return {
            "epoch": epoch,
            "step": step,
            "lr": lr,
            "train_loss": float(sums[0] / sums[2]),
            "train_acc": float(sums[1] / sums[2]),
            "val_loss": val_loss,
            "val_acc": val_acc,
            "time_s": clock(),
            **self.target_metrics(clock),
        }

    def target_metrics(self, clock: Clock) -> dict[str, float]:
        """``val_target_acc``: the accuracy on the held-out target split where the data have one
        (``data.val_target_fraction``), outside the clock: a measurement for the fixed targets, never a choice."""
        if not self.val_batches or TARGET_SPLIT not in data_splits(self.data):
            return {}
        with clock.outside("target"):
            sums = self.evaluate(TARGET_SPLIT)
        return {"val_target_acc": float(sums[1] / sums[2])}

    def run_after_epoch(self, row: dict[str, float], clock: Clock) -> None:
        """The callbacks' ``on_validation_end`` (rank 0, outside the clock): the metrics they return join ``row``."""
        fabric = self.fabric
        if not any(hasattr(c, "on_validation_end") for c in self.callbacks):
            return
        with clock.outside("hook"):
            extra: dict[str, float] = {}
            if fabric.global_rank == 0:
                self.module.eval()
                for metrics in call(self.callbacks, "on_validation_end", row["epoch"], dict(row), self.module):
                    extra.update({k: v for k, v in (metrics or {}).items() if k not in extra})
            if fabric.world_size > 1:
                extra = fabric.broadcast(extra, src=0)
            row.update({k: v for k, v in extra.items() if k not in row})

    def select(self, state: TrainState, row: Mapping[str, float]) -> None:
        """Keep this epoch's weights when its monitored metric improves on the kept epoch's (:func:`improves`)."""
        s = self.settings
        if improves(row[s.monitor], state.best_metric, s.monitor_mode, s.min_delta):
            state.best_net, state.best_metric, state.best_epoch = cpu_state(self.module), row[s.monitor], row["epoch"]

    def step_scheduler(self, row: Mapping[str, float]) -> None:
        if self.sched is None:
            return
        if isinstance(self.sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.sched.step(row[self.settings.monitor])
        else:
            self.sched.step()

    def checkpoint_due(self, epoch: int) -> bool:
        """Whether the cadence (:class:`~ddcnn.engine.callbacks.CheckpointCadence`) asks for a checkpoint after
        ``epoch``; every rank follows rank 0's clock."""
        due = self.cadence.due(epoch)
        if self.fabric.world_size > 1:
            due = bool(self.fabric.broadcast(due, src=0))
        return due

    def decide_stop(self, state: TrainState, epoch: int) -> None:
        """Early stopping after ``epoch`` (:class:`~ddcnn.engine.callbacks.EarlyStopping`)."""
        s = self.settings
        if not self.early_stopping.decide(epoch, state.best_epoch, state.history, self.divergence_rule.num_classes):
            return
        if self.fabric.global_rank == 0:
            log.debug(
                "%s: no improvement of %s by more than %g for %d epochs, stopping after epoch %d",
                Path(self.folder),
                s.monitor,
                s.min_delta,
                s.patience,
                epoch,
            )

    def save(self, state: TrainState) -> None:
        """``last.ckpt`` and ``logs/metrics.csv``, atomically (rank 0)."""
        folder = Path(self.folder)
        atomic_torch_save(state.state_dict(self.stateful, self.resume_settings), folder / "last.ckpt")
        atomic_write_text(folder / "logs" / "metrics.csv", metrics_csv(state.history))

    def report(self, clock: Clock, epoch: int, row: Mapping[str, float], points: list) -> None:
        """The epoch's row and step losses to the callbacks' ``on_log`` (rank 0, outside the clock)."""
        if self.fabric.global_rank != 0 or not any(hasattr(c, "on_log") for c in self.callbacks):
            return
        with clock.outside("report"):
            call(self.callbacks, "on_log", epoch, row, [(s, float(v)) for s, v in points])

    def finish(
        self, state: TrainState, engine: dict[str, Any], first_epoch: int, compile_time_s: float | None
    ) -> FitResult:
        """``best.ckpt``, the network with the kept weights in the layout and dtype it came in, and the result."""
        s, fabric, clock = self.settings, self.fabric, state.clock
        folder = Path(self.folder)
        best_path = folder / "best.ckpt"
        if state.best_net is None:
            raise ValueError(
                f"{s.monitor} was NaN in every epoch of the training in {folder}: it diverged. Lower the learning "
                f"rate, then run again with force=true."
            )
        if s.write_best and fabric.global_rank == 0 and (first_epoch < s.max_epochs or not best_path.is_file()):
            best = {"format": CHECKPOINT_FORMAT, "epoch": state.best_epoch, "monitor": s.monitor}
            atomic_torch_save({**best, "metric": state.best_metric, "net": state.best_net}, best_path)
        self.module.load_state_dict(state.best_net)
        remove_checkpointing(self.module)  # the caller gets the network's own forward back
        if self.policy["channels_last"]:  # the caller gets the network in the layout it handed over
            self.module.to(memory_format=torch.contiguous_format)
        if s.precision == "64-true":  # and in the dtype it handed over (predictions, exports read it so)
            self.module.to(self.net_dtype)
        stopped = self.early_stopping.stopped_epoch
        stopped_by = "early_stopping" if stopped is not None else "budget"
        left_out = clock.left_out
        return FitResult(
            net=self.module,
            best_epoch=int(state.best_epoch),
            best_metric=float(state.best_metric),
            history=state.history,
            fit_time_s=clock(),
            previous_time_s=clock.previous,
            resumed_from_epoch=state.resumed_from[-1] if state.resumed_from else None,
            hook_time_s=left_out["hook"],
            stopped_epoch=stopped,
            restarts=self.divergence_rule.restarts,
            initial_loss=self.divergence_rule.initial_loss,
            startup_s=left_out["startup"],
            warmup_s=left_out["warmup"],
            report_time_s=left_out["report"],
            global_rank=fabric.global_rank,
            world_size=fabric.world_size,
            precision=s.precision,
            engine=engine,
            gpu_peak_memory_bytes=peak_memory_bytes(fabric.device),
            compile_time_s=compile_time_s,
            min_epochs=s.min_epochs,
            stopped_by=stopped_by,
            convergence=convergence(
                state.history,
                stopped_by,
                s.min_epochs,
                bool(s.scheduler),
                self.divergence_rule.num_classes,
                monitor=s.monitor,
                monitor_mode=s.monitor_mode,
                patience=s.patience,
                best_epoch=int(state.best_epoch),
                plateau=self.early_stopping.plateau,
                n_val=self.data.size("val") if self.val_batches else None,
                max_epochs=s.max_epochs,
                batch_norm=("precise" if s.precise_bn else "running") if has_batch_norm(self.module) else None,
            ),
        )


def fit_batches(
    net: nn.Module,
    data: Batches,
    folder: str | Path,
    settings: LoopSettings,
    callbacks: Sequence[Any] = (),
    start: float | None = None,
) -> FitResult:
    """Train classifier ``net`` on ``data`` with cross-entropy, selecting its weights on validation (module doc).

    Resumes from ``folder/last.ckpt`` when it exists (and was written by this loop under the same settings); otherwise
    starts afresh and removes a stale ``folder/logs/metrics.csv``. At the end, ``folder/best.ckpt`` holds the selected
    weights (keys ``format``, ``epoch``, ``monitor``, ``metric``, ``net``) unless ``settings.write_best`` is false.

    Args:
        net: Maps a batch of ``data`` to class logits ``(B, K)``; trained in place (and moved to the device).
        data: The batches (:class:`~ddcnn.data.datamodule.Batches`): ``batch_size`` samples per step and per device,
            ``eval_batch_size`` per evaluation batch; splits ``train`` and ``val``.
        folder: Where ``last.ckpt``, ``best.ckpt`` and ``logs/metrics.csv`` go (created if missing).
        settings: How it trains (:class:`~ddcnn.settings.LoopSettings`: optimizer, schedule, epochs, precision,
            early stopping, checkpoints, divergence, devices, GPU policy), checked where they were built.
        callbacks: What the caller adds to the training (:mod:`ddcnn.engine.callbacks`: ``on_validation_end``,
            ``on_log``, ``on_epoch_end``, ``on_fit_end``). With ``launcher="spawn"`` they travel to the ranks by
            pickling: module-level classes or functions, no lambdas or closures.
        start: ``time.perf_counter()`` at the start of the caller's stage, which the training time counts from
            (default: the call of this function).

    Returns:
        The network with its best weights and the training's history and times (:class:`FitResult`). Under DDP
        across ``srun`` tasks every rank returns (``global_rank`` says which); spawned DDP returns rank 0's result.

    Raises:
        ValueError: For a bad setting (naming it), a ``last.ckpt`` of another program or written under other settings.
        Diverged: With ``divergence_restarts`` set, when the last allowed attempt diverges too.
        ArtifactWriteError: When the disk is full or not writable (the training resumes from its last checkpoint).
    """
    start = time.perf_counter() if start is None else float(start)
    settings = dataclasses.replace(
        settings,
        seed=data.seed if settings.seed is None else settings.seed,
        min_epochs=settings.least_epochs,
        launcher=settings.launcher or ("local" if settings.num_devices == 1 else "spawn"),
    )
    _check_data(data)
    began = time.perf_counter()
    training = _Training(settings, net, data, str(folder), callbacks, start)
    fabric = build_fabric(settings.device, settings.num_devices, settings.launcher, settings.precision)
    with disk_errors(f"training in {folder}"):
        if settings.launcher == "spawn":
            return fit_spawned(fabric, training, net, start)
        return fit_here(fabric, training, settings.launcher, began)


def _check_data(data: Batches) -> None:
    for split in ("train", "val"):
        if data.size(split) == 0:
            raise ValueError(f"{split}: no samples; the {split} split must not be empty.")
    if int(data.batch_size) < 1 or int(data.eval_batch_size) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {data.batch_size} and {data.eval_batch_size}.")
