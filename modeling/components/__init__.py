"""Built-in registry entries; importing this package registers them all."""

from matformer.modeling.components import (  # noqa: F401
    embedding,
    hooks,
    kernels,
    liger,
    loss,
    mlp,
    norms,
    positional,
    wersa,
)
