"""Where training runs and in what precision: devices, autocast, loss scaling, compile.

    device = resolve_device("cuda:1")          # DeviceUnavailable if this machine has none
    precision = Precision("bf16", device)      # fp32 | bf16 | fp16
    with precision.autocast():
        loss = model.loss(batch, reduction="sum")

The weights stay float32 under every precision ("master weights"): autocast runs the
matrix products in bf16/fp16 and the loss in float32, so gradients, optimizer states and
what a federated client hands to compression are float32.

fp16 needs a loss scale, or small gradients flush to zero. ``LossScale`` is dynamic, as
``torch.amp.GradScaler`` is, with one difference: a step whose gradient overflows is
recomputed at half the scale instead of skipped. A federated round cannot skip its
gradient, and recomputing keeps standalone training's step count what the plan says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from matformer.modeling.errors import ConfigError, DeviceUnavailable

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The device ``name`` (cpu | cuda | cuda:N | mps) denotes on this machine.

    Raises DeviceUnavailable when it is not a device name or this machine lacks it: a
    request for a GPU never falls back to the CPU silently. "cuda" means cuda:0.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceUnavailable(
            f"device {name!r} is not a device name; use cpu, cuda, cuda:N or mps.") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build)"
            raise DeviceUnavailable(
                f"device {name!r}: this machine has no usable CUDA device (torch "
                f"{torch.__version__}, built with {built}); use --device cpu, or install a "
                "CUDA build of torch on a machine with an NVIDIA GPU.")
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            raise DeviceUnavailable(
                f"device {name!r}: this machine has {count} CUDA device(s), "
                f"cuda:0..cuda:{count - 1}; pick one of those.")
        return torch.device("cuda", index)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceUnavailable(
                f"device {name!r}: Apple's MPS backend is not available on this machine; "
                "use --device cpu.")
        return torch.device("mps")
    raise DeviceUnavailable(f"device {name!r}: type {device.type!r} is not supported; use "
                            "cpu, cuda, cuda:N or mps.")


@dataclass(kw_only=True, slots=True)
class LossScale:
    """fp16's dynamic loss scale: halved after an overflow, doubled after ``interval``
    clean steps in a row (torch.amp.GradScaler's defaults)."""

    scale: float = 2.0 ** 16
    interval: int = 2000
    clean_steps: int = 0

    def unscale(self, parameters: Iterable[nn.Parameter]) -> bool:
        """Divide every gradient by the scale; True when all are finite. After an overflow
        the scale is halved: recompute the step's gradient."""
        grads = [p.grad for p in parameters if p.grad is not None]
        finite = True
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
            finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if not finite:
            self.scale /= 2
            self.clean_steps = 0
            if self.scale < 1.0:
                raise ConfigError(
                    "fp16 gradients overflow even at loss scale 1: the model's activations "
                    "leave fp16's range; train with --precision bf16 or fp32.")
            return False
        self.clean_steps += 1
        if self.clean_steps == self.interval:
            self.scale *= 2
            self.clean_steps = 0
        return True


@dataclass(slots=True)
class Precision:
    """The numeric recipe of a training step on ``device``."""

    name: str = "fp32"  # fp32 | bf16 | fp16
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    loss_scale: LossScale | None = None  # fp16 only

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ConfigError(f"precision {self.name!r} is not one of {', '.join(PRECISIONS)}.")
        if self.name == "bf16" and self.device.type == "cuda" \
                and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"{torch.cuda.get_device_name(self.device)} has no bf16 support; "
                              "use --precision fp16 or fp32.")
        if self.name == "fp16" and self.loss_scale is None:
            self.loss_scale = LossScale()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype autocast computes matrix products in."""
        return _DTYPES.get(self.name, torch.float32)

    @property
    def scale(self) -> float:
        """What a loss is multiplied by before backward (1 but under fp16)."""
        return 1.0 if self.loss_scale is None else self.loss_scale.scale

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward pass runs in: autocast to bf16/fp16, or nothing."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def unscale(self, parameters: Iterable[nn.Parameter]) -> bool:
        """Gradients back to their true size; False when they overflowed (fp16 only), and
        the step's gradient must be computed again."""
        return True if self.loss_scale is None else self.loss_scale.unscale(parameters)


def compile_model(model: nn.Module) -> nn.Module:
    """``model`` with its forward compiled by ``torch.compile`` (in place: parameters,
    state dict and methods stay the module's own). Shapes vary from batch to batch, so
    dynamic shapes are on from the start rather than after the first recompile."""
    model.compile(dynamic=True)
    return model

