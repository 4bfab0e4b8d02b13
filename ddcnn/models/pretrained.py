"""Pretrained weights from a local file, loaded into a network whose input channels or class count may differ.

``model.weights=PATH`` names a file that :func:`read_weights` reads: a state dict saved with ``torch.save``, a
library's checkpoint dict that holds it under ``state_dict``, ``model``, ``module`` or ``net`` (timm's training
script, Lightning, many repositories), or a ``.safetensors`` file (timm's and Hugging Face's format; needs the
``safetensors`` package, which timm installs). Keys with a prefix that the network lacks (``module.`` of DDP,
``model.`` or ``net.`` of a training wrapper) are matched without it.

:func:`load_weights` copies every tensor into the network and adapts what a different task changes:

- the first convolution, when the file's has another number of input channels: as timm's ``adapt_input_conv`` does,
  RGB weights summed for one input channel, and otherwise repeated and scaled by ``file channels / channels`` (a
  constant image then gives the response it gave before, exactly for one channel and for multiples of the file's);
  the result equals timm's (a test compares them), and it also covers 3D kernels and files of any channel count;
- the classifier (the last layer with ``num_classes`` outputs), when the file's has another class count or none: kept
  as the network initialised it, i.e. re-initialised, and said so in the returned record.

Any other difference (a tensor of another shape, a tensor of the network the file lacks) is an error that names it:
the file belongs to another architecture or width. Nothing is downloaded.

Plain PyTorch: no Lightning or Hydra here.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

__all__ = ["WeightsError", "read_weights", "adapt_input_conv", "load_weights"]

_CHECKPOINT_KEYS = ("state_dict", "model", "module", "net", "model_state_dict")
_PREFIXES = ("module.", "model.", "net.", "_orig_mod.")


class WeightsError(ValueError):
    """A weights file that cannot be read or does not fit the network; the message names the setting and the fix."""


def read_weights(path: str | Path, setting: str = "model.weights") -> dict[str, torch.Tensor]:
    """The tensors of a weights file: a state dict, a checkpoint dict holding one, or ``.safetensors``; errors name
    ``setting``.

    Raises:
        FileNotFoundError: No such file.
        WeightsError: The file holds no state dict, or Python objects that ``torch.load(weights_only=True)`` refuses.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"{setting}={str(path)!r}: no such file (relative paths start from the directory ddcnn-train runs in); "
            f"pass the path of a local file of weights (a state dict, a checkpoint or .safetensors), or {setting}=null."
        )
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as err:
            raise WeightsError(
                f"{setting}={str(path)!r} is a .safetensors file, which needs the safetensors package: "
                f"pip install safetensors (timm installs it)."
            ) from err
        return dict(load_file(str(path), device="cpu"))
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise WeightsError(
            f"{setting}={str(path)!r} cannot be read as weights ({' '.join(str(err).split())[:300]}). ddcnn reads "
            f"tensors only (torch.load with weights_only=True, no Python objects): save the state dict alone, e.g. "
            f"torch.save(checkpoint['state_dict'], 'weights.pt'), or pass a .safetensors file."
        ) from err
    for key in _CHECKPOINT_KEYS:
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)} if isinstance(obj, dict) else {}
    if not tensors:
        keys = list(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        raise WeightsError(
            f"{setting}={str(path)!r} holds no state dict (found {keys}); save one with "
            f"torch.save(net.state_dict(), PATH), or a checkpoint dict with it under one of {list(_CHECKPOINT_KEYS)}."
        )
    return tensors


def adapt_input_conv(in_channels: int, weight: torch.Tensor) -> torch.Tensor:
    """A first convolution's weights ``(out, c, *kernel)`` for ``in_channels`` inputs, as timm's ``adapt_input_conv``:
    for ``c == 3 * in_channels`` (RGB weights for a grey image, or the RGB triplets of a space-to-depth stem) each
    triplet of channels summed, for one input channel all channels summed; otherwise the channels repeated to
    ``in_channels`` and scaled by ``c / in_channels``. Works for 2D and 3D kernels."""
    dtype = weight.dtype
    w = weight.float()
    out, c = w.shape[:2]
    if in_channels == c:
        return weight
    if c == 3 * in_channels:
        w = w.reshape(out, in_channels, 3, *w.shape[2:]).sum(dim=2)
    elif in_channels == 1:
        w = w.sum(dim=1, keepdim=True)
    else:
        repeat = math.ceil(in_channels / c)
        w = w.repeat(1, repeat, *(1,) * (w.dim() - 2))[:, :in_channels] * (c / float(in_channels))
    return w.to(dtype)


def _classifier_keys(net: nn.Module, num_classes: int) -> set[str]:
    """The parameters of the last layer (linear or convolution) with ``num_classes`` outputs."""
    last = None
    for name, module in net.named_modules():
        outputs = getattr(module, "out_features", None) or getattr(module, "out_channels", None)
        if isinstance(module, nn.Linear | nn.modules.conv._ConvNd) and outputs == num_classes:
            last = name
    if last is None:
        return set()
    return {f"{last}.{p}" for p, _ in net.get_submodule(last).named_parameters(recurse=False)}


def _strip_prefix(state: dict[str, torch.Tensor], target: dict) -> tuple[dict[str, torch.Tensor], str]:
    if any(k in target for k in state):
        return state, ""
    for prefix in _PREFIXES:
        stripped = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if any(k in target for k in stripped):
            return stripped, prefix
    return state, ""


def load_weights(
    net: nn.Module, state: dict[str, torch.Tensor], in_channels: int, num_classes: int, source: str = "model.weights"
) -> dict:
    """Copy ``state`` into ``net``, adapting the first convolution's input channels and leaving a classifier of
    another class count as initialised.

    Returns:
        A record: ``loaded`` (tensors copied), ``first_conv`` (how it was adapted, or ``None``), ``classifier`` (the
        re-initialised tensors and the file's class count, or ``None``), ``ignored`` (tensors of the file the network
        has no place for), ``prefix`` (stripped from the file's keys).

    Raises:
        WeightsError: A tensor of the network is missing from the file or has another shape there (another
            architecture or width), or nothing of the file fits.
    """
    target = net.state_dict()
    state, prefix = _strip_prefix(state, target)
    conv_key = next(
        (f"{name}.weight" for name, m in net.named_modules() if isinstance(m, nn.modules.conv._ConvNd)), None
    )
    classifier = _classifier_keys(net, num_classes)
    out: dict[str, torch.Tensor] = {}
    record: dict = {"first_conv": None, "classifier": None, "prefix": prefix or None}
    reinit: list[str] = []
    file_classes = None
    wrong = []
    for key, value in target.items():
        if key not in state:
            if key in classifier:
                reinit.append(key)
            elif not key.endswith("num_batches_tracked"):
                wrong.append(f"{key} (missing from the file)")
            continue
        have = state[key]
        if have.shape == value.shape:
            out[key] = have.to(value.dtype)
        elif key == conv_key and have.dim() == value.dim() and have.shape[0] == value.shape[0]:
            if have.shape[2:] != value.shape[2:]:
                wrong.append(f"{key} (file {tuple(have.shape)}, network {tuple(value.shape)})")
                continue
            channels = int(value.shape[1])  # the data's channels, or more for a space-to-depth stem
            out[key] = adapt_input_conv(channels, have).to(value.dtype)
            c = int(have.shape[1])
            rule = "summed" if c == 3 * channels or channels == 1 else f"repeated and scaled by {c}/{channels}"
            record["first_conv"] = {
                "tensor": key,
                "file_channels": c,
                "channels": channels,
                "rule": f"the file's {c} channels {rule}",
            }
        elif key in classifier and have.shape[1:] == value.shape[1:]:
            reinit.append(key)
            file_classes = int(have.shape[0])
        else:
            wrong.append(f"{key} (file {tuple(have.shape)}, network {tuple(value.shape)})")
    if wrong:
        raise WeightsError(
            f"{source}: the file does not fit the network: {len(wrong)} tensor(s) differ, e.g. {', '.join(wrong[:4])}. "
            f"It holds weights of another architecture or width; pass the weights of the configured model.arch (only "
            f"the first convolution's channels and the classifier's class count are adapted)."
        )
    if not out:
        raise WeightsError(f"{source}: no tensor of the file fits the network (its keys: {list(state)[:5]}...).")
    if reinit:
        record["classifier"] = {"tensors": sorted(reinit), "file_classes": file_classes, "classes": num_classes}
    record["ignored"] = sorted(set(state) - set(target))
    record["loaded"] = len(out)
    net.load_state_dict(out, strict=False)
    return record
