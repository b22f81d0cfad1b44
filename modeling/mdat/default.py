"""The embedded default dataset: the standard library's docstrings as an MDAT container.

It needs no download (`modeling.corpus.python_docs`), so examples, tests and a local testnet
always have real English text to train on. Building is resumable: running it again on the
same path finishes an interrupted build and otherwise does nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from matformer.modeling.corpus import python_docs
from matformer.modeling.errors import ConfigError
from matformer.modeling.mdat.catalogue import CATALOGUE_NAME
from matformer.modeling.mdat.container import Mdat

DEFAULT_SUBMDAT = "python_docs"
DEFAULT_DATA = Path("runs/python_docs.mdat")  # where the tools build it, relative to the cwd
# Bytes, cut every 128: any max_seq_len of 128, 256, 512, ... reads from it unchanged.
DEFAULT_STRATEGY = {
    "strategy_name": "bytes128",
    "tokenizer_type": "bytes",
    "splitter_class": "fixed_chunks",
    "chunk_size": 128,
}


def default_data_path(documents: int | None) -> Path:
    """runs/python_docs.mdat, or a container of its own for a ``--documents`` limit."""
    if documents is None:
        return DEFAULT_DATA
    return DEFAULT_DATA.with_name(f"python_docs-{documents}.mdat")


def build_default_mdat(
    path: str | os.PathLike[str], limit: int | None = None, *, processes: int = 1,
    progress: bool = False,
) -> Mdat:
    """Create (or finish) ``path`` with submdat "python_docs", pretokenized as "bytes128"."""
    path = Path(path)
    mdat = Mdat.open(path) if (path / CATALOGUE_NAME).is_file() else Mdat.create(path)
    source = f"modeling.corpus.python_docs({limit})"
    built = {info.name: info for info in mdat.submdats()}.get(DEFAULT_SUBMDAT)
    if built is not None and built.source != source:
        mdat.close()
        raise ConfigError(f"{path} already holds {built.source}, not {source}; give another "
                          "path (default_data_path names one per limit) or delete it.")
    if built is None or not built.complete:
        documents = ({"text": text} for text in python_docs(limit))
        mdat.add_records(DEFAULT_SUBMDAT, documents, source=source, progress=progress)
    mdat.add_strategy(DEFAULT_STRATEGY)
    mdat.pretokenize(DEFAULT_STRATEGY["strategy_name"], processes=processes, progress=progress)
    return mdat
