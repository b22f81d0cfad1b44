"""Matformer: train one nested (MatFormer) transformer together on machines of very different
sizes.

Everything imports from this namespace; the subpackages keep their folders at the
repository's root (``setup.py`` maps them here):

    matformer.modeling       models, tiers, checkpoints, MDAT data, batching, compression
    matformer.protocol       the gRPC contract between coordinator and members
    matformer.server         the coordinator (``matformer server --config run.toml``)
    matformer.client         a member, and training on one machine (``matformer train``)
    matformer.local_testnet  a whole run on this machine (``matformer testnet``)
    matformer.scripts        the ``matformer`` command and its verbs
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("matformer")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "unknown (not installed; pip install -e .)"
