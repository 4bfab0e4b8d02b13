"""Filter-parallel convolutions: exact forward and backward against the single-process model, with P=2 processes.

The distributed checks run in spawned processes (``torch.distributed`` on gloo); each rank compares itself with a
single-process copy of the same network and hands back the largest errors, which the test asserts on.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddcnn.baselines.filter_parallel import (
    FilterParallelConv,
    replicated_divergence,
    replicated_parameters,
    split_channels,
    sync_replicated_grads,
    to_filter_parallel,
    to_single_model,
    train_filter_parallel,
)
from ddcnn.baselines.launch import RankInfo, launch, process_group
from ddcnn.baselines.loop import TrainSpec, train_single
from ddcnn.baselines.nets import marques_cifar
from ddcnn.models import resnet_tiny, vgg_tiny

NUM_CLASSES = 5  # odd, so a hard-coded 10 classes cannot pass
SHARES = (0.7, 0.3)
SGD_STEPS = 3
RTOL, ATOL = 1e-4, 1e-6

# (name, builder, input shape): a 2D VGG, a 2D ResNet with projection shortcuts, a 3D VGG, and the CIFAR-10 network
# of Marques et al. (2 convs of 500 and 1500 filters) shrunk to tiny widths, in 2D and 3D.
CASES = [
    ("vgg_tiny-2d", functools.partial(vgg_tiny, 2, 1, NUM_CLASSES), (6, 1, 12, 12)),
    (
        "resnet_tiny-2d",
        # zero_init_residual=False: zeroed last norms would make conv2's gradients vanish and compare trivially.
        functools.partial(resnet_tiny, 2, 2, NUM_CLASSES, zero_init_residual=False),
        (6, 2, 10, 10),
    ),
    ("vgg_tiny-3d", functools.partial(vgg_tiny, 3, 1, NUM_CLASSES), (4, 1, 6, 6, 6)),
    (
        "marques_cifar-2d",
        functools.partial(marques_cifar, 2, 3, NUM_CLASSES, widths=(7, 11), image_size=20),
        (6, 3, 20, 20),
    ),
    (
        "marques_cifar-3d",
        functools.partial(marques_cifar, 3, 1, NUM_CLASSES, widths=(5, 6), kernel_size=3, image_size=10),
        (4, 1, 10, 10, 10),
    ),
]


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far ``a`` is from the reference ``b``, in units of ``torch.allclose``'s tolerance (<= 1 means allclose).

    An absolute term is needed: the bias of a convolution followed by batch norm has an exact gradient of zero,
    computed as round-off of about 1e-9 in both models.
    """
    a, b = a.detach(), b.detach()
    return float(((a - b).abs() / (ATOL + RTOL * b.abs())).max())


def _compare_worker(info: RankInfo, cases: list, shares: tuple[float, ...]) -> None:
    torch.set_num_threads(1)
    report: dict[str, dict] = {}
    with process_group(info):
        for name, build, shape in cases:
            torch.manual_seed(0)
            net = build().train()
            x = torch.randn(shape)
            y = torch.arange(shape[0]) % NUM_CLASSES
            reference = copy.deepcopy(net)
            parallel = to_filter_parallel(net, info.rank, shares)
            convs = {n: m for n, m in parallel.named_modules() if isinstance(m, FilterParallelConv)}

            x_ref, x_par = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            out_ref, out_par = reference(x_ref), parallel(x_par)
            F.cross_entropy(out_ref, y).backward()
            F.cross_entropy(out_par, y).backward()

            errors = {"output": _max_error(out_par, out_ref), "input_grad": _max_error(x_par.grad, x_ref.grad)}
            # Gathered into one model, every rank's slices of every gradient must be the single model's gradient.
            gathered = dict(to_single_model(parallel).named_parameters())
            for pname, p_ref in reference.named_parameters():
                errors[pname] = _max_error(gathered[pname].grad, p_ref.grad)
            # The replicated layers' gradients agree across ranks before any synchronisation (same inputs).
            grads_before = [p.grad.clone() for p in parallel.parameters()]
            replicated = torch.cat([p.grad.reshape(-1) for p in replicated_parameters(parallel)])
            high, low = replicated.clone(), replicated.clone()
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)

            # A few SGD steps (linear in the gradients, unlike Adam, which magnifies round-off of ~0 gradients):
            # the gathered parallel model must equal the reference trained on the same batches.
            opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
            opt_par = torch.optim.SGD(parallel.parameters(), lr=0.1, momentum=0.9)
            for step in range(SGD_STEPS):
                if step:
                    for model, opt in ((reference, opt_ref), (parallel, opt_par)):
                        opt.zero_grad()
                        F.cross_entropy(model(x), y).backward()
                sync_replicated_grads(parallel)
                opt_ref.step()
                opt_par.step()
            single = to_single_model(parallel)
            state_ref = reference.state_dict()
            trained = max(_max_error(v, state_ref[k]) for k, v in single.state_dict().items() if v.is_floating_point())
            report[name] = {
                "errors": errors,
                "same_names": sorted(single.state_dict()) == sorted(state_ref),
                "trained_state": trained,
                "counts": {n: list(m.counts) for n, m in convs.items()},
                "layers": {n: (len(m.post), m.reduce_input_grad, m.partial_output_grad) for n, m in convs.items()},
                "num_convs_ref": sum(isinstance(m, torch.nn.modules.conv._ConvNd) for m in reference.modules()),
                "divergence": replicated_divergence(parallel),
                "grad_gap_between_ranks": float((high - low).max() / replicated.abs().max()),
                "grad_norm": sum(float(g.norm()) for g in grads_before),
            }
        info.save_result(report)


@pytest.fixture(scope="module")
def comparison() -> dict[int, dict]:
    return launch(_compare_worker, 2, (CASES, SHARES), timeout_s=120)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_forward_and_every_gradient_match_single_process(comparison: dict[int, dict], case: str) -> None:
    for rank in (0, 1):
        errors = comparison[rank][case]["errors"]
        assert len(errors) > 3
        bad = {k: v for k, v in errors.items() if not v <= 1.0}
        assert not bad, f"rank {rank}, {case}: not allclose(rtol={RTOL}, atol={ATOL}), error/tolerance: {bad}"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_shares_are_unequal_and_cover_every_conv(comparison: dict[int, dict], case: str) -> None:
    result = comparison[0][case]
    assert len(result["counts"]) == result["num_convs_ref"] > 0
    for name, counts in result["counts"].items():
        assert len(counts) == 2 and counts[0] > counts[1] >= 1, (name, counts)
    assert result["counts"] == comparison[1][case]["counts"]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_sgd_steps_match_and_replicas_stay_in_sync(comparison: dict[int, dict], case: str) -> None:
    for rank in (0, 1):
        assert comparison[rank][case]["trained_state"] <= 1.0
        assert comparison[rank][case]["divergence"] == 0.0
        assert comparison[rank][case]["grad_gap_between_ranks"] < 1e-6
        assert comparison[rank][case]["grad_norm"] > 0


@pytest.fixture(scope="module")
def comparison_3_ranks() -> dict[int, dict]:
    """The paper net over three unequal ranks: gathers from three roots, reduce-scatters with two peers each."""
    cases = [c for c in CASES if c[0] == "marques_cifar-2d"]
    return launch(_compare_worker, 3, (cases, (0.5, 0.3, 0.2)), timeout_s=120)


def test_three_ranks_match_single_process(comparison_3_ranks: dict[int, dict]) -> None:
    for rank in range(3):
        result = comparison_3_ranks[rank]["marques_cifar-2d"]
        bad = {k: v for k, v in result["errors"].items() if not v <= 1.0}
        assert not bad, f"rank {rank}: not allclose(rtol={RTOL}, atol={ATOL}), error/tolerance: {bad}"
        assert result["trained_state"] <= 1.0 and result["divergence"] == 0.0
    assert comparison_3_ranks[0]["marques_cifar-2d"]["counts"] == {"features.0": [4, 2, 1], "features.3": [6, 3, 2]}


# Per split conv: (channel-wise layers absorbed, input gradient all-reduced, output gradient partial).
LAYOUTS = {
    # conv, ReLU, pool twice: both absorb their ReLU and pool, the second is chained to the first.
    "marques_cifar-2d": {"features.0": (2, True, True), "features.3": (2, False, False)},
    # conv, norm, ReLU, pool twice.
    "vgg_tiny-2d": {"features.0": (3, True, True), "features.4": (3, False, False)},
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_sequential_convs_absorb_channelwise_layers_and_chain(comparison: dict[int, dict], case: str) -> None:
    assert comparison[0][case]["layers"] == LAYOUTS[case]
    assert comparison[0][case]["same_names"]


def test_resnet_convs_outside_sequentials_are_not_chained(comparison: dict[int, dict]) -> None:
    """Block convs feed residual sums: never chained; a projection shortcut (conv, norm) absorbs its norm."""
    layers = comparison[0]["resnet_tiny-2d"]["layers"]
    assert all(reduce and not partial for _, reduce, partial in layers.values())
    shortcuts = {name: absorbed for name, (absorbed, _, _) in layers.items() if "downsample" in name}
    assert shortcuts and set(shortcuts.values()) == {1}
    assert all(absorbed == 0 for name, (absorbed, _, _) in layers.items() if name not in shortcuts)
    assert comparison[0]["resnet_tiny-2d"]["same_names"]


def test_split_channels() -> None:
    assert split_channels(8, (0.7, 0.3)) == [6, 2]
    assert split_channels(10, (7, 3)) == [7, 3]
    assert split_channels(9, (1, 1)) == [5, 4]  # tie to the lower rank
    assert split_channels(4, (1.0, 0.0)) == [3, 1]  # every rank keeps one filter
    assert sum(split_channels(129, (0.2, 0.5, 0.3))) == 129
    with pytest.raises(ValueError, match="every rank needs one"):
        split_channels(1, (1, 1))
    with pytest.raises(ValueError, match="shares"):
        split_channels(8, (1, -1))


def test_conv_with_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="groups=1"):
        FilterParallelConv(torch.nn.Conv2d(4, 4, 3, groups=2), 0, (1, 1))


@pytest.mark.slow
def test_train_filter_parallel_matches_single_process_training() -> None:
    """The whole strategy: calibration, training with P=2, gathering; same accuracy as one process."""
    torch.manual_seed(0)
    x = torch.randn(240, 1, 8, 8)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, :, :4].mean(dim=(1, 2, 3)) > 0).long()
    net = vgg_tiny(2, 1, 4)
    spec = TrainSpec(epochs=2, batch_size=32)
    single = train_single(net, x[:200], y[:200], x[200:], y[200:], spec, threads=1)
    parallel = train_filter_parallel(net, x[:200], y[:200], x[200:], y[200:], spec, world_size=2, timeout_s=120)
    assert abs(sum(parallel["shares"]) - 1) < 1e-9 and min(parallel["shares"]) > 0
    assert parallel["steps"] == single["steps"]
    assert parallel["replicated_divergence"] == 0.0
    # Same batches, same exact gradients: the weights agree up to round-off (AdamW turns the round-off of the
    # near-zero gradients of biases before batch norm into small steps, hence the loose bound).
    assert abs(parallel["accuracy"] - single["accuracy"]) <= 0.05
