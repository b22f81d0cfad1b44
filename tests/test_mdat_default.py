"""The embedded default container: stdlib docstrings, pretokenized as bytes128."""

import argparse

import numpy as np

from matformer.client import standalone
from matformer.modeling.corpus import python_docs
from matformer.modeling.mdat import DEFAULT_STRATEGY, DEFAULT_SUBMDAT, build_default_mdat


def test_default_container_holds_the_docstrings_pretokenized(tmp_path) -> None:
    docs = list(python_docs(limit=40))
    with build_default_mdat(tmp_path / "d", limit=40) as mdat:
        (info,) = mdat.submdats()
        assert (info.name, info.documents, info.complete) == (DEFAULT_SUBMDAT, 40, True)
        submdat = mdat.submdat(DEFAULT_SUBMDAT)
        assert [submdat.text(i) for i in range(40)] == docs
        name = DEFAULT_STRATEGY["strategy_name"]
        assert mdat.strategy(name).chunk_size == 128
        assert [p.complete for p in mdat.pretok_status(name)] == [True]
        reader = mdat.sequences(name, 256)
        assert np.array_equal(reader[0], np.frombuffer(docs[0].encode()[:256], dtype=np.uint8))
    with build_default_mdat(tmp_path / "d", limit=40) as again:  # already built: no change
        assert again.submdats() == [info]


def test_matformer_train_says_it_builds_the_default_container_only_when_it_does(
        tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(standalone, "default_data_path", lambda documents: tmp_path / "d")
    args = argparse.Namespace(data=None, documents=5)
    for built in (True, False):
        standalone.open_data(args).close()
        said = capsys.readouterr().out
        assert ("building the stdlib docstrings MDAT" in said) is built
