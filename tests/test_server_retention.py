"""Checkpoint retention (issue 16, build 4): the newest [checkpoint] keep_last checkpoints stay,
older ones go only once a newer one is complete and state.json no longer lists them, and
what a resume or a loading client needs is never removed."""

from __future__ import annotations

import dataclasses

import pytest
from support.helpers import Clock, checked_tables, run_config
from support.rounds import caps, drive, same

import matformer.server.coordinator as coordinator_module
from matformer.server.checkpoints import CheckpointStore
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.errors import InvalidValue
from matformer.server.sections import CheckpointSection


def folders(c: Coordinator) -> list[str]:
    return sorted(p.name for p in (c.dir / "checkpoints").iterdir())


def retaining(tmp_path, mdat_path, *, keep_first: bool) -> tuple[Coordinator, Clock, str]:
    """A run that checkpoints every 2 rounds and keeps the newest 2, and its one member."""
    config = run_config(tmp_path / "run", mdat_path)
    config.checkpoint.keep_last = 2
    config.checkpoint.keep_first = keep_first
    clock = Clock()
    c = Coordinator(config, clock=clock)
    return c, clock, c.join(caps("a", tier=1))[0].client_id


def test_the_first_checkpoint_stays_by_default(tmp_path, mdat_path):
    assert run_config(tmp_path / "defaults", mdat_path).checkpoint.keep_first
    c, clock, cid = retaining(tmp_path, mdat_path, keep_first=True)
    drive(c, clock, cid, 8)
    assert c.state.checkpoints == [0, 6, 8]
    assert folders(c) == [f"round-{r}" for r in (0, 6, 8)]


def test_only_the_newest_checkpoints_stay_and_the_run_resumes_from_them(tmp_path, mdat_path):
    c, clock, cid = retaining(tmp_path, mdat_path, keep_first=False)
    drive(c, clock, cid, 7)
    assert c.state.checkpoints == [4, 6]
    assert folders(c) == ["round-4", "round-6"]
    # the update log starts at the checkpoint before the latest, so both stay loadable
    assert [u.round for u in c.updates_since(4)] == [4, 5, 6]
    assert c.latest_checkpoint().round == 6
    again = Coordinator(c.config, clock=clock)
    assert again.state.round == 7 and same(again.master, c.master)
    # one more checkpoint retires round 4 (listed state first, folders after)
    drive(c, clock, cid, 1)
    assert c.state.checkpoints == [6, 8] and folders(c)[0] == "round-6"


def test_a_crash_between_retiring_and_removing_is_cleaned_up_on_start(tmp_path, mdat_path,
                                                                     monkeypatch):
    c, clock, cid = retaining(tmp_path, mdat_path, keep_first=False)
    drive(c, clock, cid, 4)
    monkeypatch.setattr(CheckpointStore, "keep_only", lambda self, *_, **__: None)  # "killed"
    drive(c, clock, cid, 2)
    assert c.state.checkpoints == [4, 6] and "round-2" in folders(c)
    monkeypatch.undo()
    again = Coordinator(c.config, clock=clock)
    assert folders(again) == ["round-4", "round-6"]
    assert same(again.master, c.master)


def test_a_failed_save_while_retiring_keeps_every_checkpoint(tmp_path, mdat_path, monkeypatch):
    c, clock, cid = retaining(tmp_path, mdat_path, keep_first=False)
    drive(c, clock, cid, 4)
    real = Coordinator.save

    def full_when_retiring(self):  # the close's own save works; retiring's meets a full disk
        if self.state.checkpoints == [4, 6]:
            raise coordinator_module.RunDirectoryUnavailable("disk full")
        return real(self)

    monkeypatch.setattr(Coordinator, "save", full_when_retiring)
    drive(c, clock, cid, 2)
    assert c.state.round == 6 and c.state.checkpoints == [2, 4, 6]
    assert folders(c) == [f"round-{r}" for r in (2, 4, 6)]


def test_keep_last_below_two_is_refused():
    with pytest.raises(InvalidValue, match=r"\[checkpoint\] keep_last must lie in \[2, "):
        RunConfig.from_dict(checked_tables(checkpoint={"keep_last": 1}))
    config = RunConfig.from_dict(checked_tables())  # and in a config built in code
    with pytest.raises(InvalidValue, match=r"\[checkpoint\] keep_last must lie in \[2, "):
        dataclasses.replace(config, checkpoint=CheckpointSection(keep_last=1))
