"""MDAT, the Matformer dataset container: documents imported into a folder, pretokenized by
named strategies, read back as training sequences of any multiple of the chunk size, with
views, shuffles and saetta exports (docs/architecture.md, "MDAT, the dataset container").
The command line is ``matformer-mdat`` (``scripts/mdat_cli.py``).
"""

from matformer.modeling.mdat.catalogue import PretokProgress, ShuffleInfo, SubmdatInfo
from matformer.modeling.mdat.container import Mdat
from matformer.modeling.mdat.default import (
    DEFAULT_DATA,
    DEFAULT_STRATEGY,
    DEFAULT_SUBMDAT,
    build_default_mdat,
    default_data_path,
)
from matformer.modeling.mdat.saetta import SaettaReader, export_saetta
from matformer.modeling.mdat.sequences import SequenceLocation, SequenceReader
from matformer.modeling.mdat.strategy import Strategy
from matformer.modeling.mdat.submdat import Submdat
from matformer.modeling.mdat.views import View

__all__ = [
    "DEFAULT_DATA",
    "DEFAULT_STRATEGY",
    "DEFAULT_SUBMDAT",
    "Mdat",
    "PretokProgress",
    "SaettaReader",
    "SequenceLocation",
    "SequenceReader",
    "ShuffleInfo",
    "Strategy",
    "Submdat",
    "SubmdatInfo",
    "View",
    "build_default_mdat",
    "default_data_path",
    "export_saetta",
]
