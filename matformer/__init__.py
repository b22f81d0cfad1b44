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

import os
from importlib.metadata import PackageNotFoundError, version

# CPU threads that wait for work sleep rather than spin: a spinning thread takes a core that
# another process (a second member, the user's browser) needs (modeling/threads.py). It has
# to be set before torch loads; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    __version__ = version("matformer")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "unknown (not installed; pip install -e .)"
