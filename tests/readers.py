"""Readers for what the monitor plugins wrote, each through the tool's own reader or file format."""

from __future__ import annotations

import csv
import glob
import json
import os
import struct


def jsonl_by_step(run_dir) -> dict[int, dict]:
    """metrics.jsonl merged per step (training and evaluation records of one step together)."""
    out: dict[int, dict] = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        rec = json.loads(line)
        if "step" in rec:
            out.setdefault(rec.pop("step"), {}).update(rec)
    return out


def tensorboard_scalars(logdir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _leveldb_log_records(path):
    """W&B's transaction log (``run-*.wandb``): a LevelDB-style log of 32 KiB blocks after a 7-byte header."""
    data = open(path, "rb").read()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a W&B transaction log"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # FULL
            yield chunk
        elif kind == 2:  # FIRST
            pending = chunk
        elif kind == 3:  # MIDDLE
            pending += chunk
        elif kind == 4:  # LAST
            yield pending + chunk
            pending = b""


def wandb_offline_run(run_dir) -> tuple[dict, dict[int, dict]]:
    """(run config, history by step) from the offline run W&B wrote under ``run_dir/wandb``, decoded with
    W&B's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    config, history = {}, {}
    for raw in _leveldb_log_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            history.setdefault(row["_step"], {}).update(row)
        elif kind in ("config", "run"):
            for item in (rec.config if kind == "config" else rec.run.config).update:
                config[item.key] = json.loads(item.value_json)
    return config, history


def csv_by_step(path) -> dict[int, dict]:
    with open(path, newline="") as f:
        return {int(row.pop("step")): {k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)}
