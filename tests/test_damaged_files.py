"""Damaged input is refused in one line or read exactly, never drawn wrong.

Real files from one fragmentation OOM in lab mode (a fresh process): TensorFlow's binary
MemoryDump, its text dump from the log, and the trace saved with to_json. The class tests cut
each at every point and take pieces out of each; each result is refused with a TraceDataError
of one line, or equal to the whole file's.
"""

import json
import os
from pathlib import Path

import pytest

from conftest import run_fresh
from tfmem_widgets import Trace, TraceDataError, load_memory_dump, parse_bfc_dump

MAKE = """
import glob, json, os, sys, tensorflow as tf, tfmem_widgets
from tfmem_widgets import trace
tfmem_widgets.setup(lab_mb=64)
out = sys.argv[1]
def fill(n):
    with tf.device("CPU:0"):
        return tf.zeros((n,))
with trace(keep=os.path.join(out, "kept")) as t:
    ts = [fill(k * (1 << 17)) for k in range(1, 13)]
    kept = ts[0::2]; del ts
    try:
        fill(6 << 20)                      # 24 MiB: 40 MiB free, no hole of 24 MiB
    except tf.errors.ResourceExhaustedError:
        pass
t.to_json(os.path.join(out, "trace.json"))
open(os.path.join(out, "log.txt"), "w").write(t.log)
dumps = sorted(glob.glob(os.path.join(t.logdir, "bfc_dump_*")))
print(json.dumps({"dump": dumps[-1], "events": len(t.events())}))
"""


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    out = tmp_path_factory.mktemp("real")
    made = run_fresh(MAKE.replace("sys.argv[1]", repr(str(out))), env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    return {"dump": Path(made["dump"]), "trace": out / "trace.json", "log": (out / "log.txt").read_text(),
            "events": made["events"], "dir": out}


def refused(call, *args) -> str:
    with pytest.raises(TraceDataError) as info:
        call(*args)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def chunks(m):
    return [(c.address, c.size, c.in_use) for c in m.chunks]


# -- the text dump (fault 5) ----------------------------------------------------------------------

def test_the_whole_text_dump_reads_as_the_binary_one(real):
    assert chunks(parse_bfc_dump(real["log"])) == chunks(load_memory_dump(real["dump"]))


def test_a_text_dump_without_a_whole_region_is_refused(real):
    lines = real["log"].splitlines(keepends=True)
    starts = [k for k, line in enumerate(lines) if "Next region of size" in line]
    assert len(starts) >= 3
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else next(
            i for i in range(start + 1, len(lines)) if "Summary of in-use" in lines[i])
        message = refused(parse_bfc_dump, "".join(lines[:start] + lines[end:]))
        assert "does not add up" in message or "missing lines" in message


def test_a_text_dump_missing_any_one_line_or_with_one_size_changed_is_refused_or_the_same(real):
    whole = chunks(parse_bfc_dump(real["log"]))
    lines = real["log"].splitlines(keepends=True)
    for k in range(len(lines)):
        text = "".join(lines[:k] + lines[k + 1:])
        try:
            assert chunks(parse_bfc_dump(text)) == whole, f"line {k} left out, drawn otherwise"
        except TraceDataError as exc:
            assert "\n" not in str(exc)
    for k, line in enumerate(lines):
        if " of size " in line and ("InUse at" in line or "Free  at" in line):
            size = line.split(" of size ")[1].split()[0]
            changed = line.replace(f" of size {size}", f" of size {int(size) + 256}")
            refused(parse_bfc_dump, "".join(lines[:k] + [changed] + lines[k + 1:]))


def test_a_pasted_dump_with_no_stated_totals_says_it_was_not_cross_checked(real):
    lines = [line for line in real["log"].splitlines(keepends=True) if " at " in line or "Next region" in line]
    m = parse_bfc_dump("".join(lines))
    assert any("not cross-checked" in n for n in m.notes)


@pytest.mark.parametrize("bad", [None, 42, b"bytes"])
def test_parse_bfc_dump_of_something_else_is_one_line(bad):
    refused(parse_bfc_dump, bad)


def test_a_bad_address_is_one_line(real):
    text = real["log"].replace("InUse at 7", "InUse at xx7", 1)
    refused(parse_bfc_dump, text)


# -- the binary dump (fault 6) --------------------------------------------------------------------

def test_every_cut_of_a_binary_dump_is_refused(real, tmp_path):
    data = real["dump"].read_bytes()
    whole = load_memory_dump(real["dump"])
    cut = tmp_path / "cut"
    loaded = 0
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        try:
            m = load_memory_dump(cut)
        except TraceDataError as exc:
            assert "\n" not in str(exc)
            continue
        assert m == whole, f"cut at {n} of {len(data)} drawn otherwise"
        loaded += 1
    assert loaded <= 1  # at most the cut of a trailing default field


def test_a_binary_dump_with_a_chunk_taken_out_is_refused(real, tmp_path):
    from tensorflow.core.protobuf import bfc_memory_map_pb2

    dump = bfc_memory_map_pb2.MemoryDump()
    dump.ParseFromString(real["dump"].read_bytes())
    for k in range(len(dump.chunk)):
        edited = bfc_memory_map_pb2.MemoryDump()
        edited.CopyFrom(dump)
        del edited.chunk[k]
        path = tmp_path / f"without_{k}"
        path.write_bytes(edited.SerializeToString())
        refused(load_memory_dump, path)


def test_a_missing_dump_file_is_one_line(tmp_path):
    assert "cannot read" in refused(load_memory_dump, tmp_path / "nothing_here")
    refused(load_memory_dump, None)


# -- the saved trace (fault 7) --------------------------------------------------------------------

def resign(data):
    from tfmem_widgets.tracing.files import checksum

    data = {k: v for k, v in data.items() if k != "sha256"}
    data["sha256"] = checksum(data)
    return data


def saved(tmp_path, data, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_every_cut_of_a_saved_trace_is_refused(real, tmp_path):
    text = real["trace"].read_text()
    path = tmp_path / "cut.json"
    step = max(1, len(text) // 4000)  # every byte of a small file; evenly spaced cuts of a large one
    for n in list(range(0, len(text), step)) + [len(text) - 1]:
        path.write_text(text[:n])
        refused(Trace.load, path)


def test_a_saved_trace_edited_without_its_checksum_is_refused(real, tmp_path):
    data = json.loads(real["trace"].read_text())
    data["allocators"][next(iter(data["allocators"]))]["size"][0] += 256
    assert "checksum" in refused(Trace.load, saved(tmp_path, data))


def test_a_saved_trace_with_an_event_taken_out_is_refused_even_re_signed(real, tmp_path):
    data = json.loads(real["trace"].read_text())
    name = next(iter(data["allocators"]))
    columns = data["allocators"][name]
    n = len(columns["kind"])
    assert n >= 20
    for k in range(n):
        edited = json.loads(real["trace"].read_text())
        for column, values in edited["allocators"][name].items():
            if column != "texts":
                del values[k]
        assert "checksum" in refused(Trace.load, saved(tmp_path, edited))
        if 0 < k < n - 1:
            # Re-signed, the events themselves give it away: the in-use figure jumps. (The first or
            # the last taken out leaves a shorter trace that holds together: only the checksum tells.)
            assert "event" in refused(Trace.load, saved(tmp_path, resign(edited)))


def test_a_saved_trace_with_a_dump_cut_short_or_negative_sizes_is_refused(real, tmp_path):
    data = json.loads(real["trace"].read_text())
    assert data["dumps"]
    name = next(iter(data["dumps"]))
    for k in range(len(data["dumps"][name]["chunks"])):
        edited = json.loads(real["trace"].read_text())
        del edited["dumps"][name]["chunks"][k:]
        refused(Trace.load, saved(tmp_path, resign(edited)))
    edited = json.loads(real["trace"].read_text())
    allocator = next(iter(edited["allocators"]))
    edited["allocators"][allocator]["size"] = [-s for s in edited["allocators"][allocator]["size"]]
    refused(Trace.load, saved(tmp_path, resign(edited)))


def test_the_whole_saved_trace_loads_and_draws_what_it_saved(real):
    t = Trace.load(real["trace"])
    assert len(t.events()) == real["events"]
    assert chunks(t.map()) == chunks(load_memory_dump(real["dump"]))


@pytest.mark.parametrize("content", ["[]", "null", '{"format": "tfmem-trace/2"}', '"text"', "{}",
                                     '{"format": "tfmem-trace/1", "allocators": []}'])
def test_json_of_the_wrong_shape_is_one_line(tmp_path, content):
    path = tmp_path / "wrong.json"
    path.write_text(content)
    refused(Trace.load, path)


def test_a_missing_or_binary_trace_file_is_one_line(tmp_path):
    refused(Trace.load, tmp_path / "nothing.json")
    path = tmp_path / "binary.json"
    path.write_bytes(os.urandom(64) + b"\xff")
    refused(Trace.load, path)


def test_an_oom_whose_allocator_made_no_other_move_in_the_block_still_shows_the_dump(real):
    # On a GPU a single too-large tensor leaves no event in the GPU's allocator (its shape lives on
    # the host), only TensorFlow's dump: seen on the H200.
    from tfmem_widgets.tf.messages import OomInfo

    dump = load_memory_dump(real["dump"])
    oom = OomInfo(dump.allocator, "OOM when allocating tensor with shape[629145600] and type float", 2516582400)
    t = Trace({}, False, {}, oom=oom, dumps={dump.allocator: dump})
    m = t.map()
    assert chunks(m) == chunks(dump) and m.failed_request_bytes == 2516582400
    assert any("no allocation in this allocator" in n for n in m.notes)
    text = repr(t)
    assert "no allocator events" in text and f"OOM in {dump.allocator}" in text and "failed request" in text
    with pytest.raises(TraceDataError):
        t.events()
