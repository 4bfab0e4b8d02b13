"""Networks of other libraries (torchvision, timm, MONAI) as ddcnn's local nets and global CNN, and what input sizes a
network accepts.

Each adapter builds the network named by ``arch`` for ddcnn's ``spatial_dims``, ``in_channels`` and ``num_classes``
the way its library does it, and returns the library's own module (its parameter names stay the library's, so a
checkpoint of that library loads into it, :mod:`ddcnn.models.pretrained`):

- timm (2D): ``timm.create_model(arch, pretrained=False, in_chans=in_channels, num_classes=num_classes, **kwargs)``.
- torchvision (2D): ``torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)``; the first
  convolution is replaced by one with ``in_channels`` inputs (same kernel, stride, padding), as torchvision's
  networks take 3 channels.
- MONAI (2D and 3D): ``monai.networks.nets.<arch>(spatial_dims=..., in_channels=..., out_channels=..., **kwargs)``
  (the names each MONAI network uses: ``num_classes`` for EfficientNet and SENet, ``n_input_channels`` for ResNet).

A fresh classifier starts with logits of the scale of its features whatever the class count: some libraries
initialise it for ImageNet's 1000 classes (timm's MobileNetV2/V3/V4, EfficientNet, MNASNet and LCNet, torchvision's and
MONAI's EfficientNet draw its weights from U(+-1/sqrt(num_classes)), Google's rule; torchvision's MNASNet scales them
by the class count too), which for 10 classes and 1280 features makes the logits 6.5 times the
features' scale (a 14x14 MNIST batch through timm's ``mobilenetv2_100``: logits of std 4.7, a first loss of 6.8
instead of ln 10 = 2.3), for 2 classes 14.6 times. :func:`calm_classifier` re-initialises such a classifier as PyTorch
initialises a linear layer (U(+-1/sqrt(in_features)), a gain of 1/sqrt(3) from the features to the logits) and
leaves every other library's choice as it is.

Nothing is downloaded: ``pretrained``/``weights`` arguments that would fetch weights from a hub are refused with the
fix (``model.weights=PATH``, a local file), and a constructor whose own default would download (MONAI's
``EfficientNetBN``: ``pretrained=True``) is called with ``pretrained=False``. Each library is an optional extra of
ddcnn; a missing one is named with the command that installs it.

:func:`smallest_input` finds the smallest input a network accepts (some stop on inputs below a size: MONAI's
DenseNet121 needs 29 pixels per side, after a stride-2 7x7 stem, a max pool and three 2x2 average pools), and
:func:`downsampling` reports the stages of a network that receive an input already collapsed to one pixel (padded
networks such as MobileNetV2 run on 7x7 inputs, but their last stages then see a single pixel). Both work for any
network, ddcnn's own included.

Plain PyTorch: no Lightning or Hydra here.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import math
from collections.abc import Mapping
from types import ModuleType

import torch
from torch import nn
from torch.func import functional_call

from ddcnn.models.layers import conv_like

__all__ = [
    "LIBRARIES",
    "MissingLibrary",
    "require",
    "timm_net",
    "torchvision_net",
    "monai_net",
    "library_of_target",
    "adapter_spec",
    "describe_arch",
    "calm_classifier",
    "smallest_input",
    "Downsampling",
    "downsampling",
]

log = logging.getLogger(__name__)

# library -> (module to import, what installs it)
LIBRARIES: dict[str, tuple[str, str]] = {
    "timm": ("timm", "pip install 'ddcnn[timm]' (or: pip install timm)"),
    "torchvision": ("torchvision", "pip install torchvision (a dependency of ddcnn)"),
    "monai": ("monai", "pip install 'ddcnn[monai]' (or: pip install monai)"),
}

# Where a library's network constructors live: a _target_ under one of these is routed through its adapter.
_TARGET_PREFIXES = {"timm.": "timm", "torchvision.models.": "torchvision", "monai.networks.nets.": "monai"}

_NO_DOWNLOAD = (
    "ddcnn never downloads weights at run time; download the file once and pass it as model.weights=PATH (a state "
    "dict or the library's checkpoint), which loads into every local net and the global CNN."
)


class MissingLibrary(ImportError):
    """A network of a library that is not installed; the message names the install command."""


def require(library: str) -> ModuleType:
    """Import ``library`` (``timm``, ``torchvision``, ``monai``) or raise :class:`MissingLibrary` with the fix."""
    module, install = LIBRARIES[library]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingLibrary(
            f"model={library} needs the {library} package, which is not installed here ({err}); install it with: "
            f"{install}"
        ) from err


def library_of_target(target: str) -> str | None:
    """The library whose network constructor ``target`` names (``torchvision.models.mobilenet_v2`` -> ``torchvision``),
    or ``None`` for anything else (ddcnn's own networks)."""
    for prefix, library in _TARGET_PREFIXES.items():
        if target.startswith(prefix):
            return library
    return None


# Settings of ddcnn's own networks (conf/model/vgg*.yaml, resnet*.yaml) that a library constructor does not take (or,
# width_mult, takes with another meaning): left over when only model._target_ is overridden on such a group.
OWN_NET_SETTINGS = ("norm", "width_mult", "stem")


def adapter_spec(spec: dict) -> tuple[dict, list[str]]:
    """A spec whose ``_target_`` is a library's constructor (``torchvision.models.mobilenet_v2``,
    ``timm.models.mobilenetv2_100``, ``monai.networks.nets.DenseNet121``) as the spec of that library's adapter
    (``arch`` from the constructor's name), so that it gets ``spatial_dims``, ``in_channels`` and ``num_classes`` in
    the library's own terms. Returns the spec and the settings of ddcnn's own networks it dropped."""
    target = str(spec.get("_target_", ""))
    library = library_of_target(target)
    if library is None:
        return spec, []
    out = {k: v for k, v in spec.items() if k not in OWN_NET_SETTINGS}
    out["_target_"] = f"{__name__}.{library}_net"
    name = target.rsplit(".", 1)[1]
    if name in ("create_model", "get_model"):
        out["arch"] = out.pop("model_name", None) or out.get("arch")  # timm.create_model(model_name=...)
    else:
        out["arch"] = name
    return out, sorted(set(spec) & set(OWN_NET_SETTINGS))


def _refuse_download(library: str, arch: str, kwargs: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = kwargs.get(key)
        if value not in (None, False):
            raise ValueError(
                f"model.{key}={value!r} would have {library} download pretrained weights for {arch}: {_NO_DOWNLOAD}"
            )


def _only_2d(library: str, arch: str, spatial_dims: int) -> None:
    if spatial_dims != 2:
        raise ValueError(
            f"{library}'s networks take 2D images but data.spatial_dims={spatial_dims} ({arch}); for volumes use "
            f"model=monai (e.g. model.arch=DenseNet121, built with spatial_dims=3) or ddcnn's own model=resnet18 or "
            f"model=vgg_small."
        )


def _unknown(library: str, arch: str, names: list[str], listing: str) -> ValueError:
    close = difflib.get_close_matches(arch, names, n=5, cutoff=0.5)
    hint = f" Close names: {', '.join(close)}." if close else ""
    return ValueError(f"{library} has no classification network named model.arch={arch!r}.{hint} {listing}")


# A fresh classifier whose weights' std times sqrt(in_features) exceeds this makes logits larger than its features:
# PyTorch's default linear layer has 1/sqrt(3) = 0.58, torchvision's MobileNetV2 0.36, ConvNeXt 0.36; Google's rule
# sqrt(in_features / (3 * num_classes)): 6.5 for 1280 features and 10 classes, 0.65 for 1000 classes.
MAX_CLASSIFIER_GAIN = 1.0
_CALMED: set[tuple] = set()


def calm_classifier(net: nn.Module, num_classes: int, name: str = "") -> float | None:
    """Re-initialise ``net``'s classifier (its last linear layer with ``num_classes`` outputs) as PyTorch initialises
    a linear layer when its initial gain ``std(weight) * sqrt(in_features)`` (the logits' scale over the features')
    exceeds :data:`MAX_CLASSIFIER_GAIN`, so that a fresh network's first loss is near ln(num_classes) whatever the
    class count. Returns the gain it replaced, or ``None`` when the classifier was kept (or there is none)."""
    last = None
    for module in net.modules():
        if isinstance(module, nn.Linear) and module.out_features == num_classes:
            last = module
    if last is None or last.in_features < 2:
        return None
    gain = float(last.weight.detach().float().std()) * math.sqrt(last.in_features)
    if not math.isfinite(gain) or gain <= MAX_CLASSIFIER_GAIN:
        return None
    last.reset_parameters()
    key = (name, num_classes)
    if key not in _CALMED:  # built once per local net and once for the global CNN: said once
        _CALMED.add(key)
        log.info(
            "%s: its classifier was initialised for many classes (logits %.1f times its features' scale for %d "
            "classes); re-initialised as a PyTorch linear layer (0.58), so that training starts near ln %d",
            name or type(net).__name__,
            gain,
            num_classes,
            num_classes,
        )
    return gain


def timm_net(arch: str, spatial_dims: int, in_channels: int, num_classes: int, **kwargs) -> nn.Module:
    """The timm network ``arch`` with ``in_chans=in_channels`` and ``num_classes`` (timm adapts the stem and the head).

    Args:
        arch: A timm model name (``mobilenetv2_100``, ``resnet18``, ``efficientnet_b0``; ``timm.list_models()``).
        spatial_dims: Must be 2: timm's networks are 2D.
        in_channels: Input channels.
        num_classes: Output logits.
        **kwargs: Further arguments of ``timm.create_model`` (``drop_rate``, ``drop_path_rate``, ...).
    """
    timm = require("timm")
    _only_2d("timm", arch, spatial_dims)
    _refuse_download("timm", arch, kwargs, ("pretrained",))
    kwargs.pop("pretrained", None)
    if not timm.is_model(arch):
        raise _unknown("timm", arch, timm.list_models(), "timm.list_models('*name*') lists them.")
    net = timm.create_model(arch, pretrained=False, in_chans=in_channels, num_classes=num_classes, **kwargs)
    calm_classifier(net, num_classes, f"timm {arch}")
    return net


def _first_conv(net: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
    """``(parent, attribute, conv)`` of the first convolution in ``net.modules()`` order."""
    for parent in net.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.modules.conv._ConvNd):
                return parent, name, child
    return None


def torchvision_net(arch: str, spatial_dims: int, in_channels: int, num_classes: int, **kwargs) -> nn.Module:
    """The torchvision classification network ``arch`` for ``in_channels`` inputs and ``num_classes`` classes.

    torchvision builds the classifier for ``num_classes`` itself; its networks take 3 channels, so for another count
    the first convolution is replaced by one with ``in_channels`` inputs and otherwise the same settings (kernel,
    stride, padding, bias), initialised as PyTorch initialises a convolution. Inception v3 and GoogLeNet are built
    without their auxiliary classifiers (``aux_logits=False``), whose second output a classifier's training does
    not take.

    Args:
        arch: A name of ``torchvision.models.list_models(module=torchvision.models)`` (``mobilenet_v2``, ``resnet18``).
        spatial_dims: Must be 2.
        in_channels: Input channels.
        num_classes: Output logits.
        **kwargs: Further arguments of the constructor (``width_mult`` of MobileNetV2, ``dropout``, ...).
    """
    tv = require("torchvision")
    _only_2d("torchvision", arch, spatial_dims)
    _refuse_download("torchvision", arch, kwargs, ("weights", "pretrained"))
    kwargs.pop("weights", None)
    kwargs.pop("pretrained", None)
    names = tv.models.list_models(module=tv.models)
    if arch not in names:
        raise _unknown(
            "torchvision", arch, names, "torchvision.models.list_models(module=torchvision.models) lists them."
        )
    if arch in ("inception_v3", "googlenet"):
        kwargs.setdefault("aux_logits", False)
        kwargs.setdefault("init_weights", True)
    net = tv.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
    found = _first_conv(net)
    if found is not None and found[2].in_channels != in_channels:
        parent, name, conv = found
        if conv.groups != 1:
            raise ValueError(
                f"torchvision {arch}: its first convolution is grouped; it cannot take {in_channels} channels."
            )
        setattr(parent, name, conv_like(conv, in_channels, conv.out_channels))
    calm_classifier(net, num_classes, f"torchvision {arch}")
    return net


# MONAI constructors that take **kwargs and pass them to a class with other argument names.
_MONAI_NAMES_BY_MODULE = {
    "monai.networks.nets.resnet": ("n_input_channels", "num_classes"),
    "monai.networks.nets.senet": ("in_channels", "num_classes"),
}


def monai_net(arch: str, spatial_dims: int, in_channels: int, num_classes: int, **kwargs) -> nn.Module:
    """The MONAI network ``arch`` for ``spatial_dims`` (2 or 3), ``in_channels`` and ``num_classes``.

    MONAI's classification networks take ``spatial_dims`` and name their channels and classes ``in_channels`` and
    ``out_channels`` (DenseNet), ``num_classes`` (EfficientNetBN, SENet) or ``n_input_channels`` (ResNet); each gets
    the names it declares.

    Args:
        arch: A name in ``monai.networks.nets`` (``DenseNet121``, ``DenseNet``, ``resnet18``, ``EfficientNetBN``).
        spatial_dims: 2 or 3.
        in_channels: Input channels.
        num_classes: Output logits.
        **kwargs: Further arguments of the constructor (``init_features``, ``growth_rate``, ``block_config`` of
            ``DenseNet``; ``dropout_prob``, ...).
    """
    require("monai")
    nets = importlib.import_module("monai.networks.nets")
    ctor = getattr(nets, arch, None)
    if not callable(ctor) or (inspect.isclass(ctor) and not issubclass(ctor, nn.Module)):
        names = [n for n in dir(nets) if not n.startswith("_") and callable(getattr(nets, n))]
        raise _unknown("monai", arch, names, "dir(monai.networks.nets) lists them.")
    _refuse_download("monai", arch, kwargs, ("pretrained",))
    kwargs.pop("pretrained", None)
    params = inspect.signature(ctor).parameters
    if "in_channels" in params or "n_input_channels" in params:
        channels = "in_channels" if "in_channels" in params else "n_input_channels"
        classes = "out_channels" if "out_channels" in params else "num_classes"
    elif ctor.__module__ in _MONAI_NAMES_BY_MODULE:
        channels, classes = _MONAI_NAMES_BY_MODULE[ctor.__module__]
    else:
        raise ValueError(
            f"monai {arch}: its constructor names neither in_channels nor n_input_channels, so ddcnn cannot set the "
            f"input channels; choose a classification network such as DenseNet121, DenseNet or EfficientNetBN."
        )
    if classes not in params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ValueError(f"monai {arch}: its constructor takes no {classes}; it is not a classification network.")
    if "pretrained" in params:  # EfficientNetBN's default (pretrained=True) would download
        kwargs["pretrained"] = False
    net = ctor(spatial_dims=spatial_dims, **{channels: in_channels, classes: num_classes}, **kwargs)
    calm_classifier(net, num_classes, f"monai {arch}")
    return net


# --- what sizes a network takes -------------------------------------------------------------------
_SMALLEST: dict[tuple, int | None] = {}


def _runs(net: nn.Module, spatial_dims: int, in_channels: int, size: int) -> bool:
    try:
        with torch.no_grad():
            net(torch.zeros(1, in_channels, *(size,) * spatial_dims))
    except (RuntimeError, ValueError):  # too small: conv/pool kernels (RuntimeError), norms of one pixel (ValueError)
        return False
    return True


def smallest_input(
    net: nn.Module, spatial_dims: int, in_channels: int, key: tuple | None = None, largest: int | None = None
) -> int | None:
    """The smallest side ``s`` such that ``net`` runs on an input of ``s`` pixels along every axis, or ``None`` when
    it runs on none up to ``largest`` (default 1024 in 2D, 128 in 3D: it fails for another reason than size).

    Found by trying zeros (batch 1, eval mode, no gradients, on the CPU): doubling from 1 until the network runs,
    then bisecting. With ``key`` (e.g. the library, architecture, dimensions and channels) the answer is remembered
    for the process.
    """
    if key is not None and key in _SMALLEST:
        return _SMALLEST[key]
    largest = largest or (1024 if spatial_dims == 2 else 128)
    was_training = net.training
    net.eval()
    try:
        low, high = 0, 1  # low: the largest size known to fail (0: none tried); high: the size to try next
        while not _runs(net, spatial_dims, in_channels, high):
            if high >= largest:
                high = 0
                break
            low, high = high, min(2 * high, largest)
        while high and high - low > 1:
            middle = (low + high) // 2
            if _runs(net, spatial_dims, in_channels, middle):
                high = middle
            else:
                low = middle
    finally:
        net.train(was_training)
    answer = high or None
    if key is not None:
        _SMALLEST[key] = answer
    return answer


class Downsampling:
    """The downsampling stages of a network on one input shape (:func:`downsampling`).

    Attributes:
        stages: Number of downsampling stages (layers with a stride above 1; parallel ones on the same input, a
            residual block's strided convolution and its strided shortcut, count once).
        collapsed: Stages whose input is already a single pixel along every axis they stride.
        design_size: The side that the product of the strides maps to one pixel: inputs of at least this size reach
            the last stage with more than one pixel.
        final_shape: Spatial shape of the last strided stage's output.
    """

    def __init__(self, stages: int, collapsed: int, design_size: int, final_shape: tuple[int, ...]) -> None:
        self.stages = stages
        self.collapsed = collapsed
        self.design_size = design_size
        self.final_shape = final_shape


def _stride(module: nn.Module, spatial_dims: int) -> tuple[int, ...] | None:
    """The stride of a layer (a module without children: a block that records its stride is not a layer)."""
    if next(module.children(), None) is not None:
        return None
    stride = getattr(module, "stride", None)
    if stride is None or not isinstance(stride, int | tuple | list):
        return None
    values = (stride,) * spatial_dims if isinstance(stride, int) else tuple(int(s) for s in stride)
    if len(values) == 1:
        values = values * spatial_dims
    return values if len(values) == spatial_dims and max(values) > 1 else None


def downsampling(
    net: nn.Module, shape: tuple[int, ...], state: Mapping[str, torch.Tensor] | None = None
) -> Downsampling:
    """Run ``net`` once on zeros of ``(1, C, *spatial)`` = ``shape`` (eval mode, no gradients) and report its
    downsampling stages: how many there are and how many of them receive a one-pixel input.

    ``state``: parameters and buffers on meta tensors (:func:`ddcnn.models.memory.meta_state`) to run it with, shapes
    only (:func:`torch.func.functional_call`), whatever the input's size."""
    spatial_dims = len(shape) - 1
    seen: dict[tuple, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}

    def hook(module, inputs, output) -> None:
        stride = _stride(module, spatial_dims)
        x = inputs[0] if inputs else None
        if stride is None or not isinstance(x, torch.Tensor) or x.dim() != spatial_dims + 2:
            return
        key = (x.untyped_storage()._cdata, tuple(x.shape))  # one stage per input: parallel strided layers count once
        size = tuple(int(s) for s in x.shape[2:])
        out = tuple(int(s) for s in output.shape[2:]) if isinstance(output, torch.Tensor) else size
        if key not in seen:
            seen[key] = (stride, size, out)

    handles = [m.register_forward_hook(hook) for m in net.modules() if _stride(m, spatial_dims) is not None]
    was_training = net.training
    try:
        with torch.no_grad():
            if state is None:
                net.eval()(torch.zeros(1, *shape))
            else:
                functional_call(net.eval(), dict(state), (torch.zeros(1, *shape, device="meta"),))
    finally:
        net.train(was_training)
        for h in handles:
            h.remove()
    stages = list(seen.values())
    collapsed = sum(1 for stride, size, _ in stages if all(n == 1 for n, s in zip(size, stride, strict=True) if s > 1))
    design = max(
        (math.prod(stride[a] for stride, _, _ in stages) for a in range(spatial_dims)),
        default=1,
    )
    final = stages[-1][2] if stages else tuple(shape[1:])
    return Downsampling(len(stages), collapsed, design, final)


def describe_arch(spec: dict) -> str:
    """``timm mobilenetv2_100`` for an adapter's spec, else its ``_target_``."""
    target = str(spec.get("_target_", ""))
    for library in LIBRARIES:
        if target == f"{__name__}.{library}_net":
            return f"{library} {spec.get('arch')}"
    return target
