"""modeling.event_file: TensorBoard event files written without TensorBoard, read back by
TensorBoard's own loader (which checks every record's CRC)."""

from __future__ import annotations

import math
import subprocess
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from matformer.modeling.event_file import EventFile, crc32c, masked_crc32c


def test_crc32c_is_castagnolis():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert masked_crc32c(b"") == 0xA282EAD8


def test_tensorboard_reads_the_scalars_as_written(tmp_path):
    events = EventFile(tmp_path)
    events.add_scalars(0, {"loss/tier_0": 5.5, "loss/tier_1": 5.75})
    events.add_scalars(3, {"loss/tier_0": 3.25, "lr": 3e-3})
    events.add_scalars(4, {"huge": 1e40, "nan": float("nan"), "ninf": -math.inf})
    events.add_scalars(5, {})  # nothing to log: no event
    events.close()
    loaded = list(EventFileLoader(str(events.path)).Load())
    assert loaded[0].file_version == "brain.Event:2" and [e.step for e in loaded] == [0, 0, 3, 4]
    reader = EventAccumulator(str(tmp_path))
    reader.Reload()
    assert sorted(reader.Tags()["scalars"]) == ["huge", "loss/tier_0", "loss/tier_1", "lr",
                                                "nan", "ninf"]
    assert [(s.step, s.value) for s in reader.Scalars("loss/tier_0")] == [(0, 5.5), (3, 3.25)]
    assert math.isclose(reader.Scalars("lr")[0].value, 3e-3, rel_tol=1e-7)  # float32
    assert reader.Scalars("huge")[0].value == math.inf  # beyond float32: infinite, not an error
    assert math.isnan(reader.Scalars("nan")[0].value)
    assert reader.Scalars("ninf")[0].value == -math.inf


def test_a_damaged_record_is_refused_by_tensorboards_check(tmp_path):
    events = EventFile(tmp_path)
    events.add_scalars(7, {"a": 1.0})
    events.close()
    data = bytearray(events.path.read_bytes())
    data[-6] ^= 1  # a bit of the last record's data
    events.path.write_bytes(bytes(data))
    assert [e.step for e in EventFileLoader(str(events.path)).Load()] == [0]


def test_two_writers_in_one_folder_never_share_a_file(tmp_path):
    first, second = EventFile(tmp_path), EventFile(tmp_path)
    first.add_scalars(1, {"a": 1.0})
    second.add_scalars(2, {"a": 2.0})
    first.close()
    second.close()
    assert first.path != second.path and first.path.parent == second.path.parent
    for events, step in ((first, 1), (second, 2)):
        assert [e.step for e in EventFileLoader(str(events.path)).Load()] == [0, step]


def test_a_run_records_its_figures_with_tensorboard_absent(tmp_path):
    # a member or coordinator installed without TensorBoard still writes its event files
    code = ("import sys; sys.modules['tensorboard'] = None\n"
            "from pathlib import Path\n"
            "from matformer.modeling.tracking import open_tracker\n"
            f"t = open_tracker('tensorboard', Path({str(tmp_path)!r}), project='p', name='n', "
            "config={})\n"
            "t.log(2, {'loss/tier_0': 4.0}); t.close()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    reader = EventAccumulator(str(tmp_path))
    reader.Reload()
    assert [(s.step, s.value) for s in reader.Scalars("loss/tier_0")] == [(2, 4.0)]
