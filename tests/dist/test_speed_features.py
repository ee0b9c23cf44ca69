"""The options that buy throughput or memory change nothing a user would see in the losses (issue 34):
chunked cross-entropy (``model.loss_chunk``), selective and every-k activation checkpointing, regional
``torch.compile`` and float8 linears (``precision=fp8``, torchao's emulation on CPU), each on the engines that
take it, against the single-process run without it. What each saves is measured in tests/unit/test_speed_memory.py.

Tolerances: chunking and checkpointing only reorder fp32 sums (1e-5 relative on a single process, the engines'
own 1e-4 of tests/dist/test_engines.py on 2 ranks); inductor fuses fp32 ops differently from eager (1e-4);
float8 rounds every block matmul's inputs to 3-4 mantissa bits, so 50 steps stay within 2e-2 of bf16's loss."""

import pytest

from shardyard.testing import TINY, run_many

STEPS = [*TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8"]
LONG = [*TINY, "train.steps=50", "train.eval_every_n_steps=0", "train.global_batch_size=8", "train.log_every_n_steps=5"]
CHUNK = "model.loss_chunk=48"  # 256 tokens per micro-batch: five chunks of 48 and one of 16
SELECTIVE = "model.activation_checkpointing=selective"
COMPILE = "model.compile=true"
PIPELINE = ["backend=pipeline", "backend.stages=2", "backend.microbatches=2"]


def curve(result, key="train_losses"):
    return [v for _, v in result["summary"][key]]


def worst(got, ref):
    assert len(got) == len(ref) > 0
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("speed1")
    jobs = {"ref": [], "chunk": [CHUNK], "selective": [SELECTIVE],
            "every2": ["model.activation_checkpointing=full", "model.activation_checkpointing_every=2"],
            "compile": [COMPILE]}
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
    for e in ["ddp", "fsdp", "zero2"]:
        jobs[(e, "compile")] = [*STEPS, f"backend={e}", COMPILE]
    jobs[("pipeline", "compile")] = [*STEPS, *PIPELINE, COMPILE]
    for e in ["ddp", "fsdp"]:
        for p in ["bf16", "fp8"]:
            jobs[(e, p)] = [*LONG, f"backend={e}", f"precision={p}"]
    return dict(zip(jobs, run_many(2, [(o, str(d / f"{e}-{k}")) for (e, k), o in jobs.items()])))


@pytest.mark.parametrize("option", ["chunk", "selective", "every2"])
def test_single_process_losses_and_norms_unchanged(option, single):
    for key in ("train_losses", "grad_norms"):
        assert worst(curve(single[option], key), curve(single["ref"], key)) <= 1e-5, (option, key)


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero2", "zero3", "fsdp_tp", "pipeline"])
def test_chunked_loss_and_selective_checkpointing_on_the_engines(engine, single, world2):
    for r in world2[(engine, "chunk+selective")]:
        for key in ("train_losses", "grad_norms"):
            assert worst(curve(r, key), curve(single["ref"], key)) <= 1e-4, (engine, key)


@pytest.mark.parametrize("engine", ["single", "ddp", "fsdp", "zero2", "pipeline"])
def test_regional_compile_gives_the_same_losses(engine, single, world2):
    got = single["compile"] if engine == "single" else world2[(engine, "compile")][0]
    assert worst(curve(got), curve(single["ref"])) <= 1e-4, engine


@pytest.mark.parametrize("engine", ["single", "ddp", "fsdp"])
def test_fp8_stays_within_2e_2_of_bf16_over_50_steps(engine, single, world2):
    fp8, bf16 = (single["fp8"], single["bf16"]) if engine == "single" else \
        (world2[(engine, "fp8")][0], world2[(engine, "bf16")][0])
    got, ref = curve(fp8), curve(bf16)
    assert len(got) == 10 and worst(got, ref) <= 2e-2, (engine, got, ref)
    assert got != ref  # float8 really ran: its rounding moves the losses
    assert ref[-1] < ref[0] - 0.5 and got[-1] < got[0] - 0.5  # and both trained
