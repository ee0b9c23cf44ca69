"""The options that buy throughput or memory change nothing a user would see in the losses (issue 34):
chunked cross-entropy (``model.loss_chunk``), selective and every-k activation checkpointing, regional
``torch.compile`` and float8 linears (``precision=fp8``, torchao's emulation on CPU), each on the engines that
take it, against the single-process run without it. What each saves is measured in tests/unit/test_speed_memory.py.

Same losses would also hold for an option an engine's wrapper silently dropped, so each run's own record of its
first step (``summary.json``'s ``speed_options``, ``model.SpeedProbe``) shows the option applied on that engine
(issue 42): the chunks the chunked head computed behind the DDP/FSDP/DeepSpeed wrappers, the entries into
dynamo's compiled code, and (``debug.measure_activations``) the bytes the blocks' forward left alive for backward,
as a fraction of the same engine's run without checkpointing, beside the single process's fraction and the plan's.

Tolerances: chunking and checkpointing only reorder fp32 sums (1e-5 relative on a single process, the engines'
own 1e-4 of tests/dist/test_engines.py on 2 ranks); inductor fuses fp32 ops differently from eager (1e-4);
float8 rounds every block matmul's inputs to 3-4 mantissa bits, so 40 steps stay within 2e-2 of the single
process's bf16 loss (on FSDP too; 40 steps move the loss by more than 0.5: both trained)."""

import functools

import pytest

from shardyard.models.build import build_model
from shardyard.models.shape import model_shape
from shardyard.testing import TINY, compose, run_many

MEASURE = "debug.measure_activations=true"  # the probe's bytes kept for backward (its counts are always on)
STEPS = [*TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8", MEASURE]
LONG = [*TINY, "train.steps=40", "train.eval_every_n_steps=0", "train.global_batch_size=8", "train.log_every_n_steps=4"]
CHUNK = "model.loss_chunk=48"  # 256 tokens per micro-batch: five chunks of 48 and one of 16
SELECTIVE = "model.activation_checkpointing=selective"
COMPILE = "model.compile=true"
TILES = "model.mlp_tiles=3"  # 256 tokens per micro-batch: tiles of 86, 85 and 85
PIPELINE = ["backend=pipeline", "backend.stages=2", "backend.microbatches=2"]
CHUNKS = 6  # per micro-batch of 256 tokens (CHUNK); world 2 runs one micro-batch a step, single two
CHUNKED = {"ddp", "fsdp", "zero2", "zero3"}  # the engines whose runs below take model.loss_chunk
REF = [*TINY, "train.steps=1", "train.eval_every_n_steps=0", "train.global_batch_size=8", MEASURE]  # one step: the probe's


def curve(result, key="train_losses"):
    return [v for _, v in result["summary"][key]]


def probe(result):
    return result["summary"]["speed_options"]


def kept_fraction(run, ref):
    """What the blocks' forward left for backward with checkpointing, as a fraction of the same engine's without."""
    return probe(run)["block_kept_bytes"] / probe(ref)["block_kept_bytes"]


@functools.cache
def planned_fraction(mode, every=1):
    """The plan's figure for the same fraction (``plan._activation_parts``'s blocks, per token)."""
    shape = model_shape(build_model(compose(TINY).model, 0, on_meta=True))
    a, n = shape["activation_bytes_per_token"]["fp32"], shape["blocks"]
    checkpointed = len(range(0, n, every)) / n
    own = a["selective_blocks"] if mode == "selective" else n * a["ckpt_per_block"]
    return ((1 - checkpointed) * a["blocks"] + checkpointed * own) / a["blocks"]


def worst(got, ref):
    assert len(got) == len(ref) > 0
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("speed1")
    jobs = {"ref": [], "chunk": [CHUNK], "selective": [SELECTIVE],
            "every2": ["model.activation_checkpointing=full", "model.activation_checkpointing_every=2"],
            "compile": [COMPILE], "tiles": [TILES]}
    runs = run_many(1, [([*STEPS, "backend=single", *extra], str(d / k)) for k, extra in jobs.items()])
    long = {p: run for p, run in zip(["bf16", "fp8"], run_many(1, [([*LONG, "backend=single", f"precision={p}"],
                                                                      str(d / p)) for p in ["bf16", "fp8"]]))}
    return {**{k: r[0] for k, r in zip(jobs, runs)}, **{p: r[0] for p, r in long.items()}}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    d = tmp_path_factory.mktemp("speed2")
    jobs = {}
    for e in ["ddp", "fsdp", "zero2"]:
        jobs[(e, "chunk+selective")] = [*STEPS, f"backend={e}", CHUNK, SELECTIVE]
    jobs[("zero3", "chunk+selective")] = [*STEPS, "backend=zero3", CHUNK]  # ZeRO-3 refuses selective (its hooks)
    jobs[("fsdp_tp", "chunk+selective")] = [*STEPS, "backend=fsdp_tp", SELECTIVE]  # its head is split: no chunks
    jobs[("pipeline", "chunk+selective")] = [*STEPS, *PIPELINE, SELECTIVE]  # its loss gets the logits: no chunks
    for e in ["ddp", "fsdp", "zero2"]:  # the same engines without checkpointing, for the memory it saves
        jobs[(e, "ref")] = [*REF, f"backend={e}", CHUNK]
    jobs[("fsdp_tp", "ref")] = [*REF, "backend=fsdp_tp"]
    jobs[("pipeline", "ref")] = [*REF, *PIPELINE]
    for e in ["ddp", "fsdp", "zero2"]:
        jobs[(e, "compile")] = [*STEPS, f"backend={e}", COMPILE]
    for e in ["ddp", "fsdp", "zero3"]:  # ZeRO-3: its parameter hooks gather inside each tile's recompute
        jobs[(e, "tiles")] = [*STEPS, f"backend={e}", TILES]
    jobs[("pipeline", "compile")] = [*STEPS, *PIPELINE, COMPILE]
    # DDP's float8 is single's (prepare_replica): FSDP's sharded float8 weights differ. Its reference is the single
    # process's bf16 run (FSDP's bf16 equals single's bf16: tests/dist/test_engines.py, 5e-4; here 4e-5 over 50 steps)
    jobs[("fsdp", "fp8")] = [*LONG, "backend=fsdp", "precision=fp8"]
    return dict(zip(jobs, run_many(2, [(o, str(d / f"{e}-{k}")) for (e, k), o in jobs.items()])))


@pytest.mark.parametrize("option", ["chunk", "selective", "every2"])
def test_single_process_losses_and_norms_unchanged(option, single):
    for key in ("train_losses", "grad_norms"):
        assert worst(curve(single[option], key), curve(single["ref"], key)) <= 1e-5, (option, key)
    assert probe(single[option])["loss_chunks"] == (2 * CHUNKS if option == "chunk" else None)  # two micro-batches
    assert probe(single["ref"])["loss_chunks"] is None
    if option != "chunk":  # the memory each policy keeps: the plan's fraction of the blocks' activations
        got, plan = kept_fraction(single[option], single["ref"]), planned_fraction(*{
            "selective": ("selective",), "every2": ("full", 2)}[option])
        assert got == pytest.approx(plan, rel=0.15) and got < 0.75, (option, got, plan)


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero2", "zero3", "fsdp_tp", "pipeline"])
def test_chunked_loss_and_selective_checkpointing_on_the_engines(engine, single, world2):
    runs = world2[(engine, "chunk+selective")]
    for r in runs:
        for key in ("train_losses", "grad_norms"):
            assert worst(curve(r, key), curve(single["ref"], key)) <= 1e-4, (engine, key)
        # the chunked head behind the engine's wrapper computed the loss: one micro-batch, six chunks, every rank
        assert probe(r)["loss_chunks"] == (CHUNKS if engine in CHUNKED else None), (engine, probe(r))
    if engine == "zero3":
        return  # no checkpointing here (its hooks refuse selective)
    # the memory selective saves, measured on this engine against its own run without it, on every rank: the
    # single process's fraction (the blocks compute the same tensors, a pipeline stage's in flight, TP's split
    # ones its shard) and the plan's
    alone = kept_fraction(single["selective"], single["ref"])
    for r, ref in zip(runs, world2[(engine, "ref")]):
        got, plan = kept_fraction(r, ref), planned_fraction("selective")
        assert got == pytest.approx(alone, rel=0.05) and got == pytest.approx(plan, rel=0.15), \
            (engine, got, alone, plan, probe(r), probe(ref))


@pytest.mark.parametrize("engine", ["single", "ddp", "fsdp", "zero3"])
def test_tiled_mlps_give_the_same_losses_and_keep_no_mlp_intermediates(engine, single, world2):
    """``model.mlp_tiles`` (issue 56, point 5) behind each engine's wrapper: the same losses and gradient norms as
    the single process without it, every dense block's MLP computed in 3 tiles on every rank (2 blocks x 3 tiles
    per micro-batch: the single process's 2 micro-batches a step, 1 on each of 2 ranks), and what the blocks keep
    for backward is the plan's: the blocks' bytes less their MLPs' intermediates (``mlp_blocks``), as a fraction
    of the same engine's run without tiles (ZeRO-3's is the single process's: no run of it without)."""
    runs = [single["tiles"]] if engine == "single" else world2[(engine, "tiles")]
    shape = model_shape(build_model(compose(TINY).model, 0, on_meta=True))
    a = shape["activation_bytes_per_token"]["fp32"]
    plan = (a["blocks"] - a["mlp_blocks"]) / a["blocks"]
    refs = [single["ref"]] * len(runs) if engine in ("single", "zero3") else world2[(engine, "ref")]
    for r, ref in zip(runs, refs):
        for key in ("train_losses", "grad_norms"):
            assert worst(curve(r, key), curve(single["ref"], key)) <= (1e-5 if engine == "single" else 1e-4), \
                (engine, key)
        assert probe(r)["mlp_tiles"] == 2 * 3 * (2 if engine == "single" else 1), (engine, probe(r))
        got = probe(r)["block_kept_bytes"] / probe(ref)["block_kept_bytes"]  # a micro-batch of 256 tokens each
        assert got == pytest.approx(plan, rel=0.02) and plan < 0.75, (engine, got, plan, probe(r), probe(ref))
    assert probe(single["ref"])["mlp_tiles"] is None


@pytest.mark.parametrize("engine", ["single", "ddp", "fsdp", "zero2", "pipeline"])
def test_regional_compile_gives_the_same_losses(engine, single, world2):
    got = single["compile"] if engine == "single" else world2[(engine, "compile")][0]
    assert worst(curve(got), curve(single["ref"])) <= 1e-4, engine
    # compiled, not eager: every block's forward of the first step ran dynamo's code, on every rank (2 blocks x
    # single's 2 micro-batches; 2 blocks x 1 on 2 ranks; a pipeline stage's block x 2 pipeline micro-batches, and
    # the forwards its schedule's first step runs to learn the stage's shapes: 5 on torch 2.13)
    for r in [single["compile"]] if engine == "single" else world2[(engine, "compile")]:
        calls = probe(r)["compiled_calls"]
        assert calls >= 2 if engine == "pipeline" else calls == (4 if engine == "single" else 2), (engine, probe(r))
    assert probe(single["ref"])["compiled_calls"] is None


@pytest.mark.parametrize("engine", ["single", "fsdp"])
def test_fp8_stays_within_2e_2_of_bf16_over_40_steps(engine, single, world2):
    fp8, bf16 = single["fp8"] if engine == "single" else world2[(engine, "fp8")][0], single["bf16"]
    got, ref = curve(fp8), curve(bf16)
    assert len(got) == 10 and worst(got, ref) <= 2e-2, (engine, got, ref)
    assert got != ref  # float8 really ran: its rounding moves the losses
    assert ref[-1] < ref[0] - 0.5 and got[-1] < got[0] - 0.5  # and both trained
