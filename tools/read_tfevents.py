#!/usr/bin/env python3
"""Reads TensorBoard event files with Python's standard library only, independently of
kiln's writer: each record's length and data CRC32C (masked as TFRecord masks them) are
checked, and the Event protobuf is decoded by hand from TensorBoard's field numbers
(event.proto: wall_time 1 double, step 2 int64, file_version 3 string, summary 5;
summary.proto: value 1 repeated, Value.tag 1 string, Value.simple_value 2 float).

    python3 tools/read_tfevents.py FILE_OR_DIR...

prints one JSON object a line: {"record", "wall_time", "step", "file_version"} or
{"record", "wall_time", "step", "tag", "value"} per scalar ("record": the event's index
in its file; the float32 value as a Python float, exact). Exits 1 with one line on a damaged file (bad CRC, truncated record, bad protobuf).
"""
import json
import os
import struct
import sys


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class Damaged(Exception):
    pass


def varint(buf, pos):
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise Damaged("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise Damaged("varint too long")


def fields(buf):
    """(field number, wire type, value) of a protobuf message: ints for varints,
    bytes for fixed64/fixed32/length-delimited."""
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = varint(buf, pos)
        elif wt == 1:
            v, pos = buf[pos:pos + 8], pos + 8
        elif wt == 2:
            n, pos = varint(buf, pos)
            v, pos = buf[pos:pos + n], pos + n
        elif wt == 5:
            v, pos = buf[pos:pos + 4], pos + 4
        else:
            raise Damaged("unsupported wire type %d" % wt)
        if pos > len(buf):
            raise Damaged("truncated field %d" % num)
        yield num, wt, v


def decode_event(data):
    ev = {"wall_time": 0.0, "step": 0}
    scalars = []
    for num, wt, v in fields(data):
        if num == 1 and wt == 1:
            ev["wall_time"] = struct.unpack("<d", v)[0]
        elif num == 2 and wt == 0:
            ev["step"] = v - (1 << 64) if v >= 1 << 63 else v
        elif num == 3 and wt == 2:
            ev["file_version"] = v.decode("utf-8")
        elif num == 5 and wt == 2:
            for snum, swt, sv in fields(v):
                if snum != 1 or swt != 2:
                    continue
                tag, value = None, None
                for vnum, vwt, vv in fields(sv):
                    if vnum == 1 and vwt == 2:
                        tag = vv.decode("utf-8")
                    elif vnum == 2 and vwt == 5:
                        value = struct.unpack("<f", vv)[0]
                if value is not None:
                    scalars.append((tag, value))
    return ev, scalars


def read_records(path):
    with open(path, "rb") as f:
        buf = f.read()
    pos = 0
    while pos < len(buf):
        if pos + 12 > len(buf):
            raise Damaged("%s: truncated record header at byte %d" % (path, pos))
        header = buf[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (len_crc,) = struct.unpack("<I", buf[pos + 8:pos + 12])
        if masked_crc(header) != len_crc:
            raise Damaged("%s: length CRC mismatch at byte %d" % (path, pos))
        start = pos + 12
        if start + length + 4 > len(buf):
            raise Damaged("%s: truncated record at byte %d" % (path, pos))
        data = buf[start:start + length]
        (data_crc,) = struct.unpack("<I", buf[start + length:start + length + 4])
        if masked_crc(data) != data_crc:
            raise Damaged("%s: data CRC mismatch at byte %d" % (path, pos))
        yield data
        pos = start + length + 4


def event_files(paths):
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in sorted(os.walk(p)):
                for n in sorted(names):
                    if "tfevents" in n:
                        yield os.path.join(root, n)
        else:
            yield p


def main(argv):
    if not argv:
        print("usage: read_tfevents.py FILE_OR_DIR...", file=sys.stderr)
        return 2
    try:
        for path in event_files(argv):
            for record, data in enumerate(read_records(path)):
                ev, scalars = decode_event(data)
                if "file_version" in ev:
                    print(json.dumps(dict(record=record, **ev)))
                for tag, value in scalars:
                    print(json.dumps({"record": record, "wall_time": ev["wall_time"], "step": ev["step"],
                                      "tag": tag, "value": value}))
    except (Damaged, UnicodeDecodeError, struct.error) as e:
        print("read_tfevents: %s" % e, file=sys.stderr)
        return 1
    except OSError as e:  # a missing or unreadable path: one line, not a traceback
        print("read_tfevents: %s: %s" % (e.filename, e.strerror), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
