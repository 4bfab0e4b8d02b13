"""BPT-CNN's outer layer: speed-proportional incremental data allocation and asynchronous global weight updates.

After Chen, Li, Bilal, Zhou, Li & Yu, "A Bi-layered Parallel Training Architecture for Large-Scale Convolutional
Neural Networks", IEEE TPDS 30(5):965-976, 2019, https://arxiv.org/abs/1810.07742. Its outer layer trains ``P``
copies of the network on separate data subsets and merges them into a global model held by a parameter server:

* **IDPA** (incremental data partitioning and allocation): the training data are handed out in rounds, each round's
  chunk split between workers in proportion to their computing power, measured as the time one worker takes per
  mini-batch; the first round uses a calibration run, every later round the times reported with the last updates.
  Fast workers get more data, so all finish a round at about the same time. (:func:`idpa_allocate`.)
* **AGWU** (asynchronous global weight update): a worker pushes its update (the change of its weights over its
  allocation) as soon as it is done; the server applies it at once, damped by a factor that decays with the update's
  staleness, the number of global versions since the one the worker started from; the worker pulls the current
  global weights and goes on. (:func:`agwu_weight`.)
* the synchronous variant waits for every worker each round and applies the sample-weighted average of the updates.

The inner layer of the paper (thread-level task parallelism inside each worker) is left to PyTorch's intra-op
threads, one per worker by default, as the single-process reference gets (see
:func:`ddcnn.baselines.launch.threads_per_rank`); pass ``threads`` to give each worker more.

Implementation: rank 0 is the parameter server, ranks ``1..P`` are the workers, exchanging point-to-point
``send``/``recv`` messages over gloo (CPU tensors, also when the workers compute on GPUs). Every message carries a
version number: the server sends ``(version, #indices, stop, round, #rounds)`` with the global weights and the sample
indices of the worker's next allocation (the round places the worker's steps on the learning-rate schedule); a worker
answers ``(version it started from, #samples, ns per mini-batch, #mini-batches)`` with its update. The weights
travel as one flat float vector of every floating-point parameter and buffer (batch-norm running statistics
included). The workers hold the training split in memory (passed once, through shared memory), so handing out data
means handing out sample indices.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddcnn.baselines.launch import RankInfo, device_for, launch, process_group, threads_per_rank
from ddcnn.baselines.loop import TrainSpec, epoch_order, evaluate, make_optimizer, set_lr

__all__ = ["MODES", "agwu_weight", "idpa_allocate", "round_chunks", "train_bpt"]

MODES = ("async", "sync")

# Message tags: the server's any-source receive takes only headers, never another worker's update payload.
_TAG_HEADER, _TAG_WEIGHTS, _TAG_INDICES, _TAG_UPDATE = 1, 2, 3, 4
_SERVER = 0
# Weight of the newest measurement in a worker's running time per mini-batch: smooths out passing hiccups.
_SPEED_EMA = 0.5


# --- the two pure rules ----------------------------------------------------------------------------
def idpa_allocate(speeds: Sequence[float], n_samples: int, granularity: int = 1, min_samples: int = 0) -> list[int]:
    """Split ``n_samples`` between workers in proportion to their ``speeds`` (IDPA's allocation of one round).

    The samples are dealt in whole units of ``granularity`` (a mini-batch, so no worker trains on a ragged batch
    it was not meant to) by largest remainder, ties going to the faster, then the lower-index worker; the
    ``n_samples mod granularity`` samples left over go to the fastest worker. Every worker then gets at least
    ``min_samples`` when there are enough, taken from the worker with the most.

    Args:
        speeds: Computing power of each worker, e.g. mini-batches per second (the inverse of the measured time per
            mini-batch); any positive scale, zeros allowed.
        n_samples: Samples to hand out this round.
        granularity: Unit of the allocation, usually the mini-batch size.
        min_samples: Least number of samples per worker (capped at ``n_samples // len(speeds)``).

    Returns:
        Samples per worker, summing to ``n_samples``.

    Raises:
        ValueError: For no workers, a negative or non-finite speed, all speeds zero, a negative ``n_samples`` or a
            non-positive ``granularity``.
    """
    values = [float(s) for s in speeds]
    if not values or any(not math.isfinite(s) or s < 0 for s in values) or sum(values) <= 0:
        raise ValueError(f"speeds must be finite, non-negative and not all zero, got {list(speeds)!r}.")
    if n_samples < 0 or granularity < 1 or min_samples < 0:
        raise ValueError(
            f"n_samples and min_samples must be >= 0 and granularity >= 1, got {n_samples}, {min_samples}, "
            f"{granularity}."
        )
    total = sum(values)
    units = n_samples // granularity
    exact = [units * s / total for s in values]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(values)), key=lambda i: (-(exact[i] - counts[i]), -values[i], i))
    for i in by_remainder[: units - sum(counts)]:
        counts[i] += 1
    samples = [c * granularity for c in counts]
    fastest = max(range(len(values)), key=lambda i: (values[i], -i))
    samples[fastest] += n_samples - units * granularity
    floor = min(min_samples, n_samples // len(values))
    for i in range(len(samples)):
        while samples[i] < floor:
            donor = max(range(len(samples)), key=lambda j: (samples[j], -j))
            moved = min(floor - samples[i], samples[donor] - floor)
            samples[donor] -= moved
            samples[i] += moved
    return samples


def agwu_weight(staleness: int, gamma: float = 0.5) -> float:
    """AGWU's damping factor of an update computed ``staleness`` global versions ago: ``gamma ** staleness``.

    ``staleness = v_s - v_w``, the server's version when the update arrives minus the version the worker started
    from. A fresh update (``staleness = 0``) counts fully; each version the global model moved on since multiplies
    its weight by the decay coefficient ``gamma``. The paper damps stale updates with a decay coefficient called
    gamma; its exact formula was not available to us (we could read the abstract and a secondary summary only), so
    this geometric decay in the version gap is our approximation of it, not a transcription. ``gamma = 1`` applies
    every update in full (plain asynchronous updates).

    Args:
        staleness: Version gap, ``>= 0``.
        gamma: Decay coefficient in ``(0, 1]``.

    Returns:
        The factor in ``(0, 1]`` that multiplies the update.

    Raises:
        ValueError: If ``staleness`` is negative (an update from the future) or ``gamma`` is outside ``(0, 1]``.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0 (server version minus worker version), got {staleness}.")
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}.")
    return float(gamma) ** int(staleness)


def round_chunks(num_samples: int, rounds_per_epoch: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The sample indices of each round of one epoch: :func:`epoch_order` cut into ``rounds_per_epoch`` equal chunks."""
    return list(epoch_order(num_samples, seed, epoch).tensor_split(rounds_per_epoch))


# --- flat weights --------------------------------------------------------------------------------
def _float_state(model: nn.Module) -> list[torch.Tensor]:
    """Every floating-point parameter and buffer, as tensors sharing the model's storage."""
    return [t for t in model.state_dict().values() if t.is_floating_point()]


def _flatten(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in _float_state(model)])


def _buffer_mask(model: nn.Module) -> torch.Tensor:
    """Where the flat vector of :func:`_flatten` holds buffers (running statistics) rather than parameters."""
    buffers = {name for name, _ in model.named_buffers()}
    return torch.cat(
        [
            torch.full((t.numel(),), name in buffers, dtype=torch.bool)
            for name, t in model.state_dict().items()
            if t.is_floating_point()
        ]
    )


@torch.no_grad()
def _load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for t in _float_state(model):
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def _minibatches(indices: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Mini-batches of ``indices``; a last batch of one sample joins the one before (batch norm needs two)."""
    batches = list(indices.split(batch_size))
    if len(batches) > 1 and len(batches[-1]) < 2:
        batches[-2:] = [torch.cat(batches[-2:])]
    return batches


# --- worker --------------------------------------------------------------------------------------
def _train_allocation(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    device: torch.device,
    slowdown: float,
    spec: TrainSpec | None = None,
    progress: tuple[float, float] = (0.0, 0.0),
) -> tuple[int, float]:
    """Local steps over one allocation; returns (mini-batches, seconds per mini-batch).

    With ``spec``, the learning rate follows its schedule from ``progress[0]`` to ``progress[1]`` of the run.
    """
    model.train()
    batches = _minibatches(indices, batch_size)
    start = time.perf_counter()
    for j, idx in enumerate(batches):
        if spec is not None:
            set_lr(optimizer, spec.lr_at(progress[0] + (progress[1] - progress[0]) * j / len(batches)))
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx].to(device)), y[idx].to(device)).backward()
        optimizer.step()
        if slowdown > 1.0:
            # Emulates a slower device: stretches each step's time by the factor (see train_bpt).
            time.sleep((slowdown - 1.0) * (time.perf_counter() - began))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return len(batches), elapsed / max(len(batches), 1)


def _calibrate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, spec: TrainSpec, device, slowdown: float) -> float:
    """Seconds per mini-batch of a throw-away copy of the model (the worker's first speed measurement)."""
    probe = copy.deepcopy(model)
    optimizer = make_optimizer(probe.parameters(), spec)
    idx = torch.arange(min(len(x), spec.batch_size)).repeat(4)
    _train_allocation(probe, optimizer, x, y, idx[: 2 * spec.batch_size], spec.batch_size, device, slowdown)
    return _train_allocation(probe, optimizer, x, y, idx[2 * spec.batch_size :], spec.batch_size, device, slowdown)[1]


def _worker(
    info: RankInfo,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    spec: TrainSpec,
    device,
    slowdown: float,
    size: int,
) -> None:
    optimizer = make_optimizer(model.parameters(), spec)
    seconds = _calibrate(model, x, y, spec, device, slowdown)
    dist.send(torch.tensor([-1, 0, int(seconds * 1e9), 0], dtype=torch.int64), _SERVER, tag=_TAG_HEADER)
    header = torch.zeros(5, dtype=torch.int64)
    weights = torch.empty(size)
    buffers = _buffer_mask(model)
    while True:
        dist.recv(header, _SERVER, tag=_TAG_HEADER)
        version, n_indices, stop, round_index, rounds = (int(v) for v in header)
        if stop:
            return
        dist.recv(weights, _SERVER, tag=_TAG_WEIGHTS)
        indices = torch.empty(n_indices, dtype=torch.int64)
        if n_indices:
            dist.recv(indices, _SERVER, tag=_TAG_INDICES)
        _load_flat(model, weights)
        progress = (round_index / rounds, (round_index + 1) / rounds)
        batches, seconds = _train_allocation(
            model, optimizer, x, y, indices, spec.batch_size, device, slowdown, spec, progress
        )
        current = _flatten(model).cpu()
        # Parameters travel as changes, buffers as values: see _Server.apply.
        update = torch.where(buffers, current, current - weights)
        reply = torch.tensor([version, n_indices, int(seconds * 1e9), batches], dtype=torch.int64)
        dist.send(reply, _SERVER, tag=_TAG_HEADER)
        dist.send(update, _SERVER, tag=_TAG_UPDATE)


# --- server --------------------------------------------------------------------------------------
class _Server:
    """The parameter-holding rank: global weights, their version, the speeds and IDPA's hand-out of rounds."""

    def __init__(
        self,
        model: nn.Module,
        num_samples: int,
        spec: TrainSpec,
        workers: int,
        rounds_per_epoch: int,
        gamma: float,
        speeds: Sequence[float] | None,
    ) -> None:
        self.weights = _flatten(model)
        self.buffers = _buffer_mask(model)
        self.version = 0
        self.num_samples = num_samples
        self.spec = spec
        self.workers = workers
        self.rounds_per_epoch = rounds_per_epoch
        self.total_rounds = spec.epochs * rounds_per_epoch
        self.gamma = gamma
        self.fixed_speeds = list(speeds) if speeds is not None else None
        self.seconds_per_batch = [float("nan")] * workers
        self.next_round = [0] * workers
        self.allocations: dict[int, list[int]] = {}
        self.samples = [0] * workers
        self.staleness: list[int] = []
        self.batch_times: list[float] = []
        self._chunks: dict[int, list[torch.Tensor]] = {}

    def speeds(self) -> list[float]:
        if self.fixed_speeds is not None:
            return self.fixed_speeds
        return [1.0 / max(t, 1e-9) for t in self.seconds_per_batch]

    def _chunk(self, round_index: int) -> torch.Tensor:
        epoch, k = divmod(round_index, self.rounds_per_epoch)
        if epoch not in self._chunks:
            self._chunks = {epoch: round_chunks(self.num_samples, self.rounds_per_epoch, self.spec.seed, epoch)}
        return self._chunks[epoch][k]

    def assignment(self, worker: int) -> torch.Tensor | None:
        """The next sample indices of ``worker`` (0-based), or ``None`` when it has had every round."""
        r = self.next_round[worker]
        if r >= self.total_rounds:
            return None
        chunk = self._chunk(r)
        if r not in self.allocations:
            # Decided when the first worker reaches the round, from the latest measured speeds (IDPA).
            self.allocations[r] = idpa_allocate(
                self.speeds(), len(chunk), granularity=self.spec.batch_size, min_samples=self.spec.batch_size
            )
        counts = self.allocations[r]
        start = sum(counts[:worker])
        self.next_round[worker] += 1
        self.samples[worker] += counts[worker]
        return chunk[start : start + counts[worker]]

    def send(self, worker: int, indices: torch.Tensor | None) -> None:
        rank = worker + 1
        if indices is None:
            dist.send(torch.tensor([self.version, 0, 1, 0, 1], dtype=torch.int64), rank, tag=_TAG_HEADER)
            return
        header = [self.version, len(indices), 0, self.next_round[worker] - 1, self.total_rounds]
        dist.send(torch.tensor(header, dtype=torch.int64), rank, tag=_TAG_HEADER)
        dist.send(self.weights, rank, tag=_TAG_WEIGHTS)
        if len(indices):
            dist.send(indices.contiguous(), rank, tag=_TAG_INDICES)

    def receive(self) -> tuple[int, int, int, torch.Tensor]:
        """The next update from any worker: (worker, its version, its samples, its update)."""
        header = torch.zeros(4, dtype=torch.int64)
        rank = dist.recv(header, None, tag=_TAG_HEADER)
        version, n_samples, ns_per_batch, batches = (int(v) for v in header)
        update = torch.empty_like(self.weights)
        dist.recv(update, rank, tag=_TAG_UPDATE)
        worker = rank - 1
        if batches:
            # The worker's average time per mini-batch, weighted to recent rounds, is its computing power (IDPA).
            seconds = ns_per_batch / 1e9
            self.seconds_per_batch[worker] = (1 - _SPEED_EMA) * self.seconds_per_batch[worker] + _SPEED_EMA * seconds
            self.batch_times.append(seconds)
        return worker, version, n_samples, update

    def apply(self, update: torch.Tensor, factor: float) -> None:
        """``W += factor * dW`` for parameters; buffers move ``factor`` of the way to the worker's values.

        Running statistics are averages, not sums of steps: adding two workers' changes of the same running mean
        would overshoot it, so they are blended (with ``factor = 1`` replaced, and averaged in the synchronous mode,
        where ``update`` is already the sample-weighted average of the workers' values).
        """
        params = ~self.buffers
        self.weights[params] += factor * update[params]
        self.weights[self.buffers] += factor * (update[self.buffers] - self.weights[self.buffers])

    def calibrate(self) -> None:
        for _ in range(self.workers):
            header = torch.zeros(4, dtype=torch.int64)
            rank = dist.recv(header, None, tag=_TAG_HEADER)
            self.seconds_per_batch[rank - 1] = int(header[2]) / 1e9
        self.calibration = list(self.seconds_per_batch)

    def run_async(self) -> None:
        active = 0
        for worker in range(self.workers):
            indices = self.assignment(worker)
            self.send(worker, indices)
            active += indices is not None
        while active:
            worker, version, n_samples, update = self.receive()
            if n_samples:
                staleness = self.version - version
                self.staleness.append(staleness)
                self.apply(update, agwu_weight(staleness, self.gamma))
                self.version += 1
            indices = self.assignment(worker)
            self.send(worker, indices)
            active -= indices is None

    def run_sync(self) -> None:
        for _ in range(self.total_rounds):
            for worker in range(self.workers):
                self.send(worker, self.assignment(worker))
            total = torch.zeros_like(self.weights)
            count = 0
            for _ in range(self.workers):
                _, version, n_samples, update = self.receive()
                self.staleness.append(self.version - version)
                total += n_samples * update
                count += n_samples
            if count:
                self.apply(total / count, 1.0)
                self.version += 1
        for worker in range(self.workers):
            self.send(worker, None)


def _rank_main(
    info: RankInfo,
    net: nn.Module,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    spec: TrainSpec,
    mode: str,
    rounds_per_epoch: int,
    gamma: float,
    speeds: Sequence[float] | None,
    slowdown: Sequence[float],
    device: str,
    threads: int,
) -> None:
    workers = info.world_size - 1
    dev = device_for(device, max(info.rank - 1, 0))
    torch.set_num_threads(threads if info.rank != _SERVER else 1)
    # Messages are CPU tensors whatever the workers compute on, so gloo carries them (nccl needs CUDA tensors).
    with process_group(info, "gloo"):
        torch.manual_seed(spec.seed + info.rank)
        if info.rank != _SERVER:
            model = net.to(dev)
            _worker(info, model, x_train, y_train, spec, dev, float(slowdown[info.rank - 1]), _flatten(model).numel())
            return
        server = _Server(net.cpu(), len(x_train), spec, workers, rounds_per_epoch, gamma, speeds)
        server.calibrate()
        start = time.perf_counter()
        if mode == "async":
            server.run_async()
        else:
            server.run_sync()
        wall = time.perf_counter() - start
        _load_flat(net, server.weights)
        staleness = server.staleness or [0]
        info.save_result(
            {
                "method": f"BPT-CNN {mode} ({workers} workers + server)",
                "mode": mode,
                "processes": workers,
                "accuracy": evaluate(net, x_test, y_test, spec.eval_batch_size),
                "wall_time_s": wall,
                "step_time_s": statistics.median(server.batch_times) if server.batch_times else float("nan"),
                "updates": len(server.staleness),
                "version": server.version,
                "rounds": server.total_rounds,
                "staleness_mean": statistics.fmean(staleness),
                "staleness_max": max(staleness),
                "gamma": gamma if mode == "async" else None,
                "samples_per_worker": server.samples,
                "allocations": [server.allocations[r] for r in sorted(server.allocations)],
                "calibration_s_per_batch": server.calibration,
                "s_per_batch": server.seconds_per_batch,
                "threads": threads,
                "state_dict": net.state_dict(),
            }
        )


def train_bpt(
    net: nn.Module,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    spec: TrainSpec,
    workers: int = 2,
    mode: str = "async",
    rounds_per_epoch: int = 4,
    gamma: float = 0.5,
    speeds: Sequence[float] | None = None,
    slowdown: Sequence[float] | None = None,
    device: str = "cpu",
    threads: int | None = None,
    timeout_s: float = 600.0,
) -> dict:
    """Train ``net`` with BPT-CNN's outer layer: a parameter server (rank 0) and ``workers`` worker ranks.

    Every epoch the training split is shuffled (:func:`ddcnn.baselines.loop.epoch_order`) and cut into
    ``rounds_per_epoch`` chunks that IDPA hands out in proportion to the workers' speeds. Each worker runs local
    mini-batch steps of ``spec``'s optimizer over its allocation, keeping its optimizer state between rounds; the
    learning rate follows ``spec.schedule`` by the round's place in the run.

    Args:
        net: The initial network (a copy goes to every worker; not modified here).
        x_train, y_train: Training split.
        x_test, y_test: Test split for the reported accuracy (of the final global weights).
        spec: Training settings; ``epochs`` counts passes over the training split by all workers together.
        workers: Number of worker ranks ``P`` (the server is one more process).
        mode: ``"async"`` (AGWU) or ``"sync"`` (wait for all, sample-weighted average of the updates).
        rounds_per_epoch: IDPA rounds per epoch: more rounds mean more frequent merging and speed updates.
        gamma: AGWU decay coefficient, see :func:`agwu_weight`.
        speeds: Fixed relative worker speeds (overrides the measured ones), e.g. ``(2, 1)``.
        slowdown: Per-worker factor ``>= 1`` stretching each mini-batch's time by sleeping, to emulate slower
            devices on a machine of equal cores; ``None`` for none.
        device: ``"cpu"``, or ``"cuda"`` to train each worker on a GPU (``cuda:<worker mod #GPUs>``); messages
            still go through gloo on the CPU.
        threads: CPU threads per worker; ``None`` is :func:`ddcnn.baselines.launch.threads_per_rank` (one). The
            server, mostly waiting, always gets one.
        timeout_s: Deadline of the whole run and of every message.

    Returns:
        ``method``, ``mode``, ``processes`` (workers), ``accuracy`` (test), ``wall_time_s`` (after calibration),
        ``step_time_s`` (median worker time per mini-batch), ``updates``, ``version``, ``rounds``,
        ``staleness_mean``/``_max``, ``gamma``, ``samples_per_worker``, ``allocations`` (samples per worker of each
        round), ``calibration_s_per_batch`` and ``s_per_batch`` (the workers' times per mini-batch, measured before
        training and, as a running average, at the end) and the global ``state_dict``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if workers < 1 or rounds_per_epoch < 1:
        raise ValueError(f"workers and rounds_per_epoch must be positive, got {workers}, {rounds_per_epoch}.")
    if speeds is not None and len(speeds) != workers:
        raise ValueError(f"got {len(speeds)} speeds for {workers} workers.")
    slowdown = [1.0] * workers if slowdown is None else [float(s) for s in slowdown]
    if len(slowdown) != workers or any(s < 1.0 for s in slowdown):
        raise ValueError(f"slowdown needs one factor >= 1 per worker, got {slowdown}.")
    agwu_weight(0, gamma)  # validates gamma before any process starts
    threads = threads or threads_per_rank(workers)
    args = (
        net,
        x_train,
        y_train,
        x_test,
        y_test,
        spec,
        mode,
        rounds_per_epoch,
        gamma,
        speeds,
        slowdown,
        device,
        threads,
    )
    return launch(_rank_main, workers + 1, args, timeout_s)[0]
