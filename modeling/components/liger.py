"""Liger's fused Triton kernels as ``liger`` implementations of norm, mlp and loss entries.

Each subclasses the ``torch`` entry it replaces, so parameters keep their canonical names and
checkpoints move freely between the two. Their priority is below torch's: they run only when
asked for (``MATFORMER_NORM_RMSNORM=liger``, ``MATFORMER_MLP_SWIGLU=liger``,
``MATFORMER_LOSS_CROSS_ENTROPY=liger`` or ``registry.set_preferences``), and need the
``liger-kernel`` package and CUDA (``pip install -e ".[cuda]"``). Asked for where they cannot
run, the registry falls back to torch and says so once; inputs they cannot take (CPU tensors
of a model moved off the GPU) go to the torch entry, also reported once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from matformer.modeling.components.loss import IGNORE_INDEX, CrossEntropy
from matformer.modeling.components.mlp import SwiGLU, prefix
from matformer.modeling.components.norms import RMSNorm
from matformer.modeling.registry import registry

log = logging.getLogger("matformer.liger")

LIGER = dict(requires=["liger_kernel"], priority=-10)  # below torch's 0: never picked unasked

# (category, variant, reason) already reported: once per process, not once per layer.
_reported: set[tuple[str, str, str]] = set()


class LigerEntry:
    """Mixin for a Liger subclass of a torch entry: availability, and delegation to torch."""

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def delegate(self, reason: str, *args: Any, **kwargs: Any) -> Tensor:
        """The torch entry's forward, for inputs Liger cannot take; says so once."""
        impl = type(self).matformer_implementation
        key = (impl.category, impl.variant, reason)
        if key not in _reported:
            _reported.add(key)
            log.warning("matformer: liger %s/%s %s; using torch for such inputs",
                        impl.category, impl.variant, reason)
        return super().forward(*args, **kwargs)  # next in the MRO: the torch entry


@registry.register("norm", "rmsnorm", "liger", **LIGER,
                   metadata={"doc": "Liger's fused RMSNorm (CUDA, liger-kernel)"})
class LigerRMSNorm(LigerEntry, RMSNorm):
    """Liger's RMSNorm in "llama" casting mode, which is what the torch entry computes:
    normalise in fp32, cast back to the input's dtype, then multiply by the weight."""

    def forward(self, x: Tensor) -> Tensor:
        if not x.is_cuda:
            return self.delegate("needs CUDA tensors", x)
        if x.dtype != self.weight.dtype:  # torch would promote; Liger writes x's dtype
            return self.delegate("needs input and weight of one dtype", x)
        from liger_kernel.transformers.functional import liger_rms_norm

        # in_place=False: in place, Liger overwrites the incoming gradient, which autograd may
        # still hand to another branch (a residual, a hook).
        return liger_rms_norm(x, self.weight, self.eps, casting_mode="llama", in_place=False)


@registry.register("mlp", "swiglu", "liger", **LIGER,
                   metadata={"doc": "Liger's fused SiLU·mul (CUDA, liger-kernel)"})
class LigerSwiGLU(LigerEntry, SwiGLU):
    """The nested SwiGLU FFN with Liger's fused silu(gate)·up on the first ``width`` neurons."""

    def forward(self, x: Tensor, width: int) -> Tensor:
        if not x.is_cuda:
            return self.delegate("needs CUDA tensors", x, width)
        from liger_kernel.transformers.functional import liger_swiglu

        gate = F.linear(x, prefix(self.gate_proj.weight, 0, width))  # (B, T, width)
        up = F.linear(x, prefix(self.up_proj.weight, 0, width))
        hidden = self.dropped(liger_swiglu(gate, up))
        return F.linear(hidden, prefix(self.down_proj.weight, 1, width))


@registry.register("loss", "cross_entropy", "liger", **LIGER,
                   metadata={"doc": "Liger's fused cross-entropy on logits (CUDA, liger-kernel)"})
class LigerCrossEntropy(LigerEntry, CrossEntropy):
    """Liger's cross-entropy, which writes the logits' gradient during forward instead of
    keeping softmax for backward. It runs on fp32 logits, as the torch entry does; logits
    already fp32 that require grad are overwritten with that gradient, so do not read them
    after the loss."""

    def forward(self, logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
        if not logits.is_cuda:
            return self.delegate("needs CUDA tensors", logits, labels, reduction)
        targets = labels.flatten()  # (B·T,)
        if reduction == "mean" and not bool((targets != IGNORE_INDEX).any()):
            return super().forward(logits, labels, reduction)  # torch's NaN; Liger's mean is 0
        from liger_kernel.transformers.functional import liger_cross_entropy

        return liger_cross_entropy(logits.flatten(0, 1).float(), targets,
                                   ignore_index=IGNORE_INDEX, reduction=reduction)
