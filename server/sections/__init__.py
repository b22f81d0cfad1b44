"""The sections of run.toml, one typed dataclass each, whose keys are declared with
``modeling.settings.setting`` (default, range or choices, help), in modules by what they
configure:

    run.py       [run], [checkpoint], [tracking], [coordinator]: the run's name, what it
                 keeps, where its close runs
    model.py     [model], [data], [tiers]: what is trained, on what, in which slices
    training.py  [round], [update], [inner]: rounds and steps
    access.py    [server], [auth], [tls]: where the servers listen and who may use them
    faults.py    [faults]: members that fail or misbehave, and what their calls may hold
    checks.py    what checks by hand share: a range computed from other keys

Reading a table checks each key against its declaration; a section's ``__post_init__``
checks what involves two keys, and ``server.config.RunConfig.validate`` what involves two
sections (tiers against the model, ...). [compression] is modeling's ``CompressionConfig``,
declared the same way; [policy] is the round policies' own (``server/policies/section.py``).

See ``examples/run.toml`` for every key, its default and what it does.
"""

from matformer.server.sections.access import AuthSection, ServerSection, TlsSection
from matformer.server.sections.faults import FaultsSection
from matformer.server.sections.model import DataSection, ModelSection, TiersSection
from matformer.server.sections.run import (
    CheckpointSection,
    CoordinatorSection,
    RunSection,
    TrackingSection,
)
from matformer.server.sections.training import (
    OUTER_DEFAULTS,
    InnerSection,
    RoundSection,
    UpdateSection,
)

__all__ = [
    "OUTER_DEFAULTS",
    "AuthSection",
    "CheckpointSection",
    "CoordinatorSection",
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
]
