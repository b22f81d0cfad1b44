"""Buffers a component computes from its settings at build (a sinusoidal table, ALiBi slopes,
a random projection from a fixed seed): no checkpoint holds them.

A model loaded from a checkpoint is built on the meta device, where nothing is computed
(modeling/checkpoint/pretrained.py), and its parameters then take the checkpoint's tensors;
its computed buffers are computed again, for real, by the method that computed them at
build. So a component that registers such a buffer derives from ``ComputedBuffers``, says
what it computes in ``computed_buffers`` and registers it with ``register_computed_buffers``.
"""

from __future__ import annotations

from torch import Tensor, nn


class ComputedBuffers(nn.Module):
    """A module whose non-persistent buffers are all ``computed_buffers()``."""

    def computed_buffers(self) -> dict[str, Tensor]:
        """Name → value of each buffer, computed from the module's settings alone."""
        raise NotImplementedError

    def register_computed_buffers(self) -> None:
        for name, value in self.computed_buffers().items():
            self.register_buffer(name, value, persistent=False)


def fill_computed_buffers(model: nn.Module) -> bool:
    """Compute every buffer left on the meta device again, for real, as the build computes it.
    False, and ``model`` unchanged, when a module holds one it does not declare: that module
    computes it in a way only building it for real repeats."""
    computed: list[tuple[nn.Module, dict[str, Tensor]]] = []
    for module in model.modules():
        stale = {name for name, b in module.named_buffers(recurse=False) if b.is_meta}
        if not stale:
            continue
        values = module.computed_buffers() if isinstance(module, ComputedBuffers) else {}
        if not stale <= values.keys():
            return False
        computed.append((module, values))
    for module, values in computed:
        for name, value in values.items():
            setattr(module, name, value)
    return True
