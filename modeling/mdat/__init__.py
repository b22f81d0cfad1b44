"""MDAT: the Matformer dataset container.

A container is a folder::

    datasets/<submdat>/   data.db (texts, LMDB), meta.db (other fields, LMDB), sizes.npy
    functions/            custom splitters: .py files registering "splitter" entries
    pretok/<strategy>/    tokenizer.json (a copy, for "huggingface" strategies) and, per
        <submdat>/        tokens.npy, chunk_starts.npy, doc_starts.npy, histogram.npy
    shuffling/            one permutation of sequence ids per shuffle (.npy)
    views/<view>/         view.json and the chosen document indices per submdat (.npy)
    mdat.db               the catalogue

The catalogue is SQLite (Python's ``sqlite3``): small relational data (submdats, strategies,
per-(strategy, submdat) progress, views, shuffles) that must change atomically with progress
counters, be looked up by name, and stay readable after a crash. SQLite gives transactions and
crash safety with no server and no new dependency; JSON files would need hand-made atomic
renames and locking, and LMDB, a key-value store, has no schema to keep rows consistent.

Every long step commits batch by batch and records what it committed in the catalogue, so an
interrupted import or pretokenization leaves a readable container and resumes when run again
(an import checks, by hash, that it resumes with the records it had read). Files and folders
that appear at once (views, shuffles, saetta exports) are built aside and renamed into place
(`atomic`). A shuffle is tied to the data it permutes by a fingerprint (`fingerprints`).

Public API::

    mdat = Mdat.create(path, extended=False)                # or Mdat.open(path)
    mdat.add_jsonl(name, file, text_field="text", compress=False, skip_bad=False)
    mdat.add_folder(name, folder, pattern="**/*.txt")
    mdat.add_records(name, iterable_of_dicts, text_field="text")   # all -> SubmdatInfo
    mdat.submdats(); mdat.submdat(name).text(i); mdat.submdat(name).metadata(i)
    mdat.remove_submdat(name)                               # also an interrupted import
    mdat.add_strategy(dict_or_json_path)                    # -> Strategy, defaults filled
    mdat.pretokenize(strategy, processes=2)                 # resumable
    reader = mdat.sequences(strategy, max_seq_len, view=None)
    len(reader); reader[i]; reader.locate(i)                # tokens; (submdat, document, ...)
    reader.lengths()                                        # every len(reader[i]), no tokens read
    reader.strategy.eos_token_id; reader.view; reader.fingerprint
    mdat.create_view(name, {"wiki": "2G", "laws": 0.1, "code": 1000}, seed=0)
    mdat.remove_view(name)                                  # and its shuffles
    order = mdat.shuffle(view, strategy, max_seq_len, seed) # a permutation of sequence ids
    order = mdat.load_shuffle(view, strategy, max_seq_len, seed)  # StaleShuffle if data moved
    mdat.fingerprint(strategy, max_seq_len, view=None)      # sha256: same data, same ids
    assign(order[:round_size], [("client-a", 2.0), ("client-b", 1.0)])  # ids per client
    export_saetta(reader, order, out, seed=seed); SaettaReader(out)[i]
    train_tokenizer(mdat.submdat(name), "tokenizer.json", vocab_size=8000)
    build_default_mdat(path, limit=None)                    # stdlib docstrings, "bytes128"

Bad input stops an import with a named error (`BadRecord`, `NotUtf8`, `EmptyDocument`)
unless ``skip_bad``; sequences hold no special tokens (see `modeling.mdat.sequences`).
The command line is ``matformer-mdat`` (``scripts/mdat_cli.py``).
"""

from modeling.mdat.catalogue import PretokProgress, ShuffleInfo, SubmdatInfo
from modeling.mdat.container import Mdat
from modeling.mdat.default import (
    DEFAULT_DATA,
    DEFAULT_STRATEGY,
    DEFAULT_SUBMDAT,
    build_default_mdat,
)
from modeling.mdat.saetta import SaettaReader, export_saetta
from modeling.mdat.sequences import SequenceLocation, SequenceReader
from modeling.mdat.shards import assign
from modeling.mdat.strategy import Strategy
from modeling.mdat.submdat import Submdat
from modeling.mdat.tokenizer_training import train_tokenizer
from modeling.mdat.views import View

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
    "assign",
    "build_default_mdat",
    "export_saetta",
    "train_tokenizer",
]
