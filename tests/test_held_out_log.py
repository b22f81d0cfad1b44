"""server.held_out_log: the held-out figures a run's evaluations append and its API serves."""

from __future__ import annotations

from matformer.server.held_out_log import HELD_OUT_NAME, HeldOutLog


def test_points_are_by_tier_and_round_and_a_checkpoint_evaluated_again_replaces(tmp_path):
    log = HeldOutLog(tmp_path)
    assert log.points() == {}  # nothing evaluated yet: no file
    log.record(150, {1: 3.5, 0: 3.25}, sequences=128)
    log.record(0, {0: 5.5}, sequences=128)
    assert log.points() == {"0": [(0, 5.5, 128), (150, 3.25, 128)], "1": [(150, 3.5, 128)]}
    log.record(150, {0: 3.0}, sequences=64)  # a larger or smaller evaluation, later: it wins
    assert log.points()["0"] == [(0, 5.5, 128), (150, 3.0, 64)]
    assert log.points()["1"] == [(150, 3.5, 128)]


def test_a_torn_or_foreign_line_is_skipped_and_the_rest_served(tmp_path):
    log = HeldOutLog(tmp_path)
    log.record(10, {0: 4.0}, sequences=8)
    with (tmp_path / HELD_OUT_NAME).open("a") as handle:
        handle.write('["not", "a record"]\n{"round": -1, "sequences": 8, "losses": {"0": 1}}\n'
                     '{"round": 12, "sequences": 8, "losses": {"0": NaN}}\n'
                     '{"round": 11, "sequences": 8, "losses": {"x": 1}}\n{"round": 20, "seq')
    assert log.points() == {"0": [(10, 4.0, 8)]}


def test_a_second_reader_sees_what_a_writer_appended(tmp_path):
    reader, writer = HeldOutLog(tmp_path), HeldOutLog(tmp_path)
    writer.record(0, {0: 5.0}, sequences=4)
    assert reader.points() == {"0": [(0, 5.0, 4)]}
    writer.record(5, {0: 4.0}, sequences=4)  # the file changed: read again
    assert reader.points() == {"0": [(0, 5.0, 4), (5, 4.0, 4)]}
