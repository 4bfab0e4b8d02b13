"""The ``global_transfer`` stage: the global CNN initialised from the local nets' weights, then trained on full images.

Every tensor whose name and shape match is copied; with the default ``global_model: null`` the global CNN is built
by the same builder as the local nets and every tensor matches (the networks end in global pooling, so the input size
does not enter any weight shape). ``methods.global_transfer.init`` chooses the source:

- ``best`` (default): the local net with the best validation accuracy. One trained network keeps consistent
  features; its sub-domain is where the information lies.
- ``mean``: the average of the ``N`` local nets' parameters. The local nets start from different random weights, so
  their channels are not aligned (permutation symmetry) and the average mixes unrelated filters; it is offered for
  comparison, not as the default.
- an integer ``i``: local net ``i``.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ddcnn.context import Context, build_global_net
from ddcnn.engine.train import seed_everything
from ddcnn.io import load_run_file
from ddcnn.stages.common import skip, stage_seed, train_full_images

__all__ = ["run", "init_global_transfer"]


def init_global_transfer(ctx: Context) -> tuple[nn.Module, dict]:
    """The global CNN initialised from the local nets' weights as ``methods.global_transfer.init`` says.

    Returns:
        The network and a record of the initialisation (source nets, copied and skipped tensors).
    """
    n = ctx.decomposition.num_subdomains
    missing = ctx.run.missing_local(n)
    if missing:
        raise FileNotFoundError(
            f"global_transfer starts from the local nets, but local nets {missing} have not finished in "
            f"{ctx.run.root}; run the local stage first."
        )
    init = ctx.settings.methods.global_transfer.init
    if init == "best":
        val = [ctx.run.meta("local", i)["accuracy"]["val"] for i in range(n)]
        sources = [max(range(n), key=lambda i: (val[i], -i))]
    elif init == "mean":
        sources = list(range(n))
    elif isinstance(init, int) and not isinstance(init, bool) and 0 <= init < n:
        sources = [init]
    else:
        raise ValueError(
            f"methods.global_transfer.init must be 'best', 'mean' or a local net index 0..{n - 1}, got {init!r}."
        )
    states = [load_run_file(ctx.run.stage_dir("local", i) / "net.pt") for i in sources]
    source: dict[str, torch.Tensor] = {}
    for key, value in states[0].items():
        if value.is_floating_point() and len(states) > 1:
            source[key] = torch.stack([s[key] for s in states]).mean(0)
        else:  # integer buffers (BatchNorm's num_batches_tracked) are counters, not weights: take the first
            source[key] = value
    seed_everything(stage_seed(ctx, "global"))  # the global CNN's initial weights
    net = build_global_net(ctx.settings, ctx.data)
    target = net.state_dict()
    copied = {k: v for k, v in source.items() if k in target and target[k].shape == v.shape}
    skipped = sorted(set(target) - set(copied))
    if not copied:
        raise ValueError(
            "global_transfer: no tensor of the local nets fits the global CNN (names or shapes differ); use the same "
            "model for both (global_model: null)."
        )
    net.load_state_dict(copied, strict=False)
    record = {"init": init, "sources": sources, "copied_tensors": len(copied), "skipped_tensors": skipped}
    return net, record


def run(ctx: Context, device=None) -> dict:
    """The global CNN initialised from the local nets' weights, trained on full images."""
    if (done := skip(ctx, "global_transfer")) is not None:
        return done
    start = time.perf_counter()
    net, record = init_global_transfer(ctx)
    ctx.run.make_stage_dir("global_transfer")
    return train_full_images(ctx, "global_transfer", net, start, device, record, measure_start=True)
