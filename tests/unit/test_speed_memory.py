"""What the memory options save, measured (issue 34): chunked cross-entropy at a 32k vocabulary and selective
activation checkpointing, each beside the plan's figure for it. One process measures every case, the resident
size following the live tensors (``testing.activation_memory``); the losses they give are tests/dist's. The run's
own record of the same bytes (``summary.json``'s ``speed_options``, ``model.SpeedProbe``), which tests/dist reads
on every engine, is checked here against the system's count."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

MODEL = ["model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=4", "model.num_heads=4",
         "precision=fp32"]
WIDE = ["model.activation_checkpointing=full", "model.intermediate_size=2048", "model.vocab_size=512"]
"""Full checkpointing where the block recomputed in backward, not the loss, sets the peak (a wide MLP, a small
vocabulary): what the tiles bound."""
CASES = {"none": [], "selective": ["model.activation_checkpointing=selective"],
         "full": ["model.activation_checkpointing=full"],
         "vocab32k": ["model.vocab_size=32768"], "vocab32k-chunk512": ["model.vocab_size=32768", "model.loss_chunk=512"],
         "tiles4": ["model.mlp_tiles=4"], "full-tiles4": ["model.activation_checkpointing=full", "model.mlp_tiles=4"],
         "full-wide": WIDE, "full-wide-tiles4": [*WIDE, "model.mlp_tiles=4"]}


@pytest.fixture(scope="module")
def measured():
    code = ("import json, sys; from shardyard.testing import activation_memory; "
            f"cases = {json.dumps({k: MODEL + v for k, v in CASES.items()})}; "
            "print(json.dumps({k: activation_memory(o, 4, 512) for k, o in cases.items()}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_selective_checkpointing_keeps_between_none_and_full(measured):
    none, sel, full = (measured[k] for k in ("none", "selective", "full"))
    assert none["kept"] > 1.3 * sel["kept"] and sel["kept"] > 2 * full["kept"], measured
    assert none["peak"] > sel["peak"] > full["peak"], measured


def test_chunked_loss_never_holds_the_full_logits(measured):
    whole, chunked = measured["vocab32k"], measured["vocab32k-chunk512"]
    logits = 4 * 512 * 32768 * 4  # the fp32 logits of the micro-batch: 256 MiB
    assert whole["peak"] - chunked["peak"] > logits, measured  # the logits, their softmax and gradient: gone
    assert chunked["peak"] < 0.5 * whole["peak"]


def test_tiled_mlps_keep_none_of_the_mlps_intermediates(measured):
    """``model.mlp_tiles=4`` (issue 56, point 5): the blocks no longer keep their MLPs' gate, up, activation and
    product for backward, 4 x 4 x 688 bytes per token in fp32, 4 blocks, 2048 tokens: 86 MiB of what the forward
    leaves alive, by the system's count and the run's own record; under full checkpointing the one block recomputed
    in backward holds a quarter of its MLP's intermediates: where that block sets the peak (WIDE: 16 x 2048 bytes
    per token) the peak falls by at least the plan's 3/4 of one block's MLP, 48 MiB (measured 67: the plan's
    recomputed block is short of its backward's own temporaries, docs/long_context.md)."""
    none, tiles, full, full_tiles = (measured[k] for k in ("none", "tiles4", "full", "full-tiles4"))
    mlp = 16 * 688 * 2048 * 4
    assert none["kept"] - tiles["kept"] == pytest.approx(mlp, rel=0.1), measured
    assert none["probe"]["block_kept_bytes"] - tiles["probe"]["block_kept_bytes"] == mlp, measured
    assert tiles["probe"]["mlp_tiles"] == 4 * 4 and none["probe"]["mlp_tiles"] is None  # 4 blocks x 4 tiles
    assert full_tiles["probe"]["block_kept_bytes"] == full["probe"]["block_kept_bytes"]
    assert full_tiles["probe"]["mlp_tiles"] == 4 * 4  # the training forward's, not the recompute's in backward too
    wide, wide_tiles = measured["full-wide"], measured["full-wide-tiles4"]
    saved = 16 * 2048 * 2048 * 3 / 4
    assert wide["plan"] - wide_tiles["plan"] == pytest.approx(saved, rel=0.01), measured
    assert wide["peak"] - wide_tiles["peak"] > 0.9 * saved, measured


@pytest.mark.parametrize("case", ["none", "selective", "vocab32k", "vocab32k-chunk512", "tiles4", "full-tiles4"])
def test_the_plan_models_what_each_option_keeps(measured, case):
    assert measured[case]["plan"] == pytest.approx(measured[case]["peak"], rel=0.15), measured[case]


@pytest.mark.parametrize("case", list(CASES))
def test_the_runs_record_of_what_the_forward_keeps_is_the_memory_it_holds(measured, case):
    """``speed_options.kept_bytes`` (storages the forward created, alive when backward starts) is what the resident
    size grew by over the forward; its chunk count is the micro-batch's 2048 tokens in chunks of 512."""
    m = measured[case]
    assert m["probe"]["kept_bytes"] == pytest.approx(m["kept"], rel=0.05), m
    assert m["probe"]["loss_chunks"] == (4 if "chunk" in case else None), m
