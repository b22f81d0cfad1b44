"""The sections of run.toml, one typed dataclass each (``[compression]`` is modeling's own
``CompressionConfig``), in modules by what they configure:

    run.py       [run], [checkpoint], [tracking]: the run's name and what it keeps
    model.py     [model], [data], [tiers]: what is trained, on what, in which slices
    training.py  [round], [update], [inner], and what a run needs of [compression]
    access.py    [server], [auth], [tls]: where the servers listen and who may use them
    faults.py    [faults]: members that fail or misbehave, and what their calls may hold
    checks.py    the range checks they share

Each checks its own values when built; checks that need two sections (tiers against the
model, ...) live in ``server.config.RunConfig.validate``.

See ``examples/run.toml`` for every key, its default and what it does.
"""

from server.sections.access import AuthSection, ServerSection, TlsSection
from server.sections.faults import FaultsSection
from server.sections.model import DataSection, ModelSection, TiersSection
from server.sections.run import CheckpointSection, RunSection, TrackingSection
from server.sections.training import (
    OUTER_DEFAULTS,
    InnerSection,
    RoundSection,
    UpdateSection,
    check_compression,
)

__all__ = [
    "OUTER_DEFAULTS",
    "AuthSection",
    "CheckpointSection",
    "DataSection",
    "FaultsSection",
    "InnerSection",
    "ModelSection",
    "RoundSection",
    "RunSection",
    "ServerSection",
    "TiersSection",
    "TlsSection",
    "TrackingSection",
    "UpdateSection",
    "check_compression",
]
