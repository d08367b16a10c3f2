#!/usr/bin/env python3
"""gen_tb_fixture.py — TensorBoard event records written by TensorBoard's own code, as the reference that
tests/lua/test_tensorboard.lua compares ds4's records with, byte for byte.

    pip install tensorboard numpy && python3 tests/gen_tb_fixture.py tests/fixtures/tensorboard/events.bin

The records (fixed wall times and steps, so the bytes do not depend on when this runs):
  1. the file_version event ("brain.Event:2") at wall time 1700000000.5;
  2. scalars at step 7: a = 3, loss = 0.25, reward/mean = -1.5 (tags in sorted order, as ds4 writes them);
  3. a text table at step 9 under "completions": [["prompt", "completion"], ["1+1=", "\\boxed{2}"]], through the
     text plugin's summary op (tensorboard.plugins.text.summary_v2.text_pb, TensorFlow-free);
  4. a text string at step 10 under "notes": "hello *world*".
Framing is TensorBoard's RecordWriter (TFRecord: length, masked CRC-32C, data, masked CRC-32C)."""
import io
import sys

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.text import summary_v2 as text_summary
from tensorboard.summary.writer.record_writer import RecordWriter


def main(path):
    buf = io.BytesIO()
    w = RecordWriter(buf)
    w.write(event_pb2.Event(wall_time=1700000000.5, file_version="brain.Event:2").SerializeToString())
    s = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v)
                                   for t, v in (("a", 3.0), ("loss", 0.25), ("reward/mean", -1.5))])
    w.write(event_pb2.Event(wall_time=1700000001.25, step=7, summary=s).SerializeToString())
    table = text_summary.text_pb("completions", np.array([["prompt", "completion"], ["1+1=", "\\boxed{2}"]]))
    w.write(event_pb2.Event(wall_time=1700000002.0, step=9, summary=table).SerializeToString())
    note = text_summary.text_pb("notes", np.array("hello *world*"))
    w.write(event_pb2.Event(wall_time=1700000003.0, step=10, summary=note).SerializeToString())
    with open(path, "wb") as f:
        f.write(buf.getvalue())


if __name__ == "__main__":
    main(sys.argv[1])
