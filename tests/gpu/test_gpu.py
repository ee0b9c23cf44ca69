"""GPU tier: what only a CUDA machine can show. Marked ``gpu``; skipped without CUDA (the one tier that may skip).

* Every engine (ddp, fsdp, zero1/2/3, horovod where it is built with NCCL) on all N visible GPUs, in bf16, equals
  the single-GPU run with the same global batch within ``BF16_REL``. With one GPU that is world 1: FSDP and ZeRO
  still run, sharding over the one rank (the session header and each test's output say so).
* fp16 on every engine (single too): an inf gradient injected at one step (``SHARDYARD_TEST_POISON_GRAD``, on the
  last rank) makes the loss scaler skip that update and halve its scale; the scale grows again after
  ``precision.loss_scale_window`` clean steps; the curve equals the single-GPU one with the same overflow.
* FlashAttention-2 on packed rows (varlen: SFT packing, ``data.document_mask=true``) equals sdpa's block-diagonal
  mask within ``BF16_REL``.
* QLoRA: the 4-bit base shows in the measured memory (against LoRA on the same model, as the plan's NF4 accounting
  predicts), and the measured peak stays below the plan's prediction.
* ZeRO-Infinity swaps to NVMe from the GPUs and equals ZeRO-3.
* MFU against the peak measured on this GPU (``shardyard.metrics.measured_peak_tflops``), not the data sheet.
* The plan's allocated peak against ``max_memory_allocated`` for a 1B model (the one big model here).
* The speed options on the GPUs (docs/performance.md): fp8 (real float8 matmuls on compute capability 8.9+) within
  2e-2 of bf16 over 50 steps on single, ddp and fsdp; regional compile, chunked loss and selective checkpointing
  equal to the plain bf16 run within ``BF16_REL``.
* What a CPU machine refuses (``backend.device=cuda``, nccl, fp16 on FSDP/ZeRO, QLoRA, FlashAttention-2) validates.

The rest of the suite runs on CPU with the GPUs hidden (``tests/conftest.py``); these tests hand them back to their
own runs (``use_gpus``), each ``python train.py`` a fresh interpreter, and never initialise CUDA in the pytest
process itself (anything that needs CUDA here runs in a child).
"""

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading

import pytest

from conftest import ROOT, TINY, gpu_count, gpu_env, train_py, use_gpus

N = gpu_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(N == 0, reason="needs CUDA")]

BF16_REL = 2e-2
"""bf16 tolerance: the largest relative difference per logged step between two runs of the same training. bf16
keeps 8 significant bits (a rounding of 2^-8 = 0.4% per value); other reduction orders and kernels (NCCL, FSDP's
reduce-scatter, DeepSpeed's bf16 weights, FlashAttention) over a few steps of the tiny model stay within 2%, the
CPU tier's bound for bf16 against fp32 (tests/dist/test_engines.py)."""
FP16_REL = 2e-2
"""The same for fp16 (10 significant bits, but DeepSpeed's fp16 engines hold fp16 weights where torch autocasts
fp32 ones)."""

ENGINES = ["ddp", "fsdp", "zero1", "zero2", "zero3"] + (["horovod"] if importlib.util.find_spec("horovod") else [])
WORLD = f"launch.nproc_per_node={N}"
ONE = ["backend=single", "launch.nproc_per_node=1"]
RUN = [*TINY, "train.steps=9", "train.eval_every_n_steps=0", f"train.global_batch_size={8 * max(N, 1)}",
       "optim.lr=3e-3"]
"""Micro-batch 4: the engines accumulate 2 micro-batches on each of N ranks, single-GPU 2N."""
BF16 = [*RUN, "precision=bf16"]

POISONED_STEP = 4
PARAM = "model.layers.1.mlp.up_proj.weight"
FP16 = [*RUN, "precision=fp16", "precision.initial_scale_power=10", "precision.loss_scale_window=3",
        "precision.hysteresis=1"]
"""Scale 1024, doubled after 3 clean steps; DeepSpeed lowers it at the first overflow (hysteresis 1), as torch's
GradScaler does."""


def overflow(rank: int) -> dict:
    """The drill: on ``rank``, the gradient of PARAM is inf at POISONED_STEP (before any reduction)."""
    return {"SHARDYARD_TEST_POISON_GRAD": f"{POISONED_STEP}:{rank}:{PARAM}=inf"}


@pytest.fixture(scope="module", autouse=True)
def _gpus():
    with pytest.MonkeyPatch.context() as mp:
        use_gpus(mp)
        print(f"\nGPU tier: {N} GPU(s) visible; every engine runs at world {N}"
              + (" (FSDP and ZeRO shard over that one rank)" if N == 1 else ""))
        yield


def train(run_dir, *overrides, env=None, timeout=900):
    """One ``python train.py`` that must succeed: (process, summary.json, the metrics records of training steps)."""
    proc = train_py(*overrides, run_dir=run_dir, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{overrides}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    summary = json.load(open(run_dir / "summary.json"))
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return proc, summary, [r for r in records if "train/loss" in r]


def curve(summary, key="train_losses"):
    return [v for _, v in summary[key]]


def assert_close(got, ref, rel, what):
    assert len(got) == len(ref) > 0, (what, got, ref)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= rel, f"{what}: worst relative difference {worst:.2e} > {rel:.0e}\n got {got}\n ref {ref}"


def in_child(code: str) -> str:
    """Run Python ``code`` in a fresh interpreter that sees the GPUs; its last line of output."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=gpu_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@functools.lru_cache(maxsize=None)
def horovod_on_gpus() -> str | None:
    """Why backend=horovod cannot run on these GPUs, or None (asked of a child: its import loads CUDA libraries)."""
    proc = subprocess.run([sys.executable, "-c", "import horovod.torch as h; print(h.nccl_built())"], cwd=ROOT,
                          env=gpu_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return f"horovod.torch is not importable: {proc.stderr.strip().splitlines()[-1:]}"
    if proc.stdout.split()[-1:] in ([], ["0"], ["False"]):
        return "Horovod is built without NCCL (scripts/build_horovod.sh builds it with NCCL where CUDA is present)"
    return None


def needs(engine: str) -> None:
    if engine == "horovod" and horovod_on_gpus():
        pytest.skip(horovod_on_gpus())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-GPU reference runs, made once on first use: ``single("bf16")``, ``single("fp16")`` (with the
    overflow at POISONED_STEP, on its one rank)."""
    runs: dict = {}

    def get(recipe: str):
        if recipe not in runs:
            overrides, env = {"bf16": (BF16, None), "fp16": (FP16, overflow(0))}[recipe]
            runs[recipe] = train(tmp_path_factory.mktemp(f"single-{recipe}"), *overrides, *ONE, env=env)
        return runs[recipe]
    return get


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_on_every_gpu_matches_single_gpu_in_bf16(engine, single, tmp_path):
    needs(engine)
    proc, s, records = train(tmp_path, *BF16, f"backend={engine}", WORLD)
    print(f"{engine}: world {N}")
    assert s["world_size"] == N and f"({N}/node on cuda)" in proc.stdout, proc.stdout[-2000:]
    got, ref = curve(s), curve(single("bf16")[1])
    assert_close(got, ref, BF16_REL, f"{engine} x{N} GPUs vs 1 GPU, bf16")
    assert got[-1] < got[0] - 0.3, got
    last = records[-1]
    assert last["memory/max_allocated_gib"] > 0 and "memory/rss_gib" not in last  # CUDA memory, not host RSS
    assert "loss_scale" not in last  # bf16 needs no loss scaling


@pytest.mark.parametrize("engine", ["single", *ENGINES])
def test_fp16_loss_scaler_skips_an_inf_gradient_backs_off_and_grows_again(engine, single, tmp_path):
    _, ref, ref_records = single("fp16")
    if engine == "single":
        s, records = ref, ref_records
    else:
        needs(engine)
        _, s, records = train(tmp_path, *FP16, f"backend={engine}", WORLD, env=overflow(N - 1))
    assert s["world_size"] == (1 if engine == "single" else N)
    print(f"{engine}: world {s['world_size']}")
    scales = [r["loss_scale"] for r in records]  # the dynamic loss scale, logged at every step under fp16
    losses = curve(s)
    assert len(scales) == len(losses) == 9, (scales, losses)
    # The step that first logs a lower scale: torch's GradScaler logs the scale a step ran with (the halving shows
    # at the step after the overflow), DeepSpeed the scale after its update (at the overflow's own step).
    lower = [i + 2 for i in range(len(scales) - 1) if scales[i + 1] < scales[i]]
    assert lower in ([POISONED_STEP], [POISONED_STEP + 1]), (engine, scales)  # once, for the inf gradient only
    d = lower[0]
    assert scales[d - 1] == scales[d - 2] / 2, (engine, scales)  # backed off by half
    assert any(scales[i + 1] == 2 * scales[i] for i in range(d - 1, len(scales) - 1)), (engine, scales)  # regrown
    # The update of the inf step was dropped: applied, the inf gradient (clipped: inf x 0 = NaN) would have made
    # every parameter NaN, and every later loss with it.
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert_close(losses, curve(ref), FP16_REL, f"{engine} fp16 vs 1 GPU fp16 (the same overflow)")


SHAPE = [o for o in TINY if not o.startswith("data.seq_len")]
PACKED = {"sft-packed": ["data=sft", "data.seq_len=256"],  # conversations packed, positions restart per conversation
          "document-mask": ["data.document_mask=true", "data.seq_len=256"]}  # pre-training rows, per document


@pytest.mark.parametrize("packing", list(PACKED))
def test_flash_attention_2_on_packed_rows_equals_sdpa(packing, tmp_path):
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    runs = {impl: train(tmp_path / impl, *SHAPE, *PACKED[packing], *ONE, "precision=bf16", "train.steps=6",
                        "train.eval_every_n_steps=3", "optim.lr=3e-3", f"model.attn_implementation={impl}")[1]
            for impl in ("sdpa", "flash_attention_2")}
    fa2, sdpa = runs["flash_attention_2"], runs["sdpa"]
    for key in ("train_losses", "eval_losses"):
        assert_close(curve(fa2, key), curve(sdpa, key), BF16_REL, f"{packing}: flash_attention_2 vs sdpa, {key}")
    assert curve(fa2) != curve(sdpa)  # another kernel really ran (varlen, not the block-diagonal mask)


# A 103M-parameter-linear LLaMA shape: its linear layers hold 0.41 GB in fp32 and 0.05 GB in NF4, far above what
# activations and the allocator's rounding move between two runs.
MID = ["model.hidden_size=1024", "model.intermediate_size=2816", "model.num_layers=8", "model.num_heads=8",
       "model.num_kv_heads=8"]
MID_LINEAR = 8 * (4 * 1024 * 1024 + 3 * 1024 * 2816)


def test_qlora_holds_a_4bit_base_below_the_plans_peak(tmp_path):
    """peft=qlora as its recipe runs it, on one GPU: bf16 LoRA adapters on an NF4 base (bitsandbytes) loaded from
    a pre-trained export. The base is 4-bit where it counts, in the GPU's memory: the same run with peft=lora
    (an fp32 base) peaks at least half of the plan's NF4 saving higher; the measured peak
    (``max_memory_allocated``) is below the plan's; the assistant-token eval loss falls; the merged export
    loads."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.fail("bitsandbytes is not installed (the finetune extra: make setup installs it)")
    pre = tmp_path / "pre"
    train(pre, *SHAPE, *MID, "data.seq_len=256", *ONE, "train.steps=2", "checkpoint.save_final=true")
    ft = [*SHAPE, *MID, *ONE, "precision=bf16", "data=sft", "data.seq_len=256", f"model.weights={pre / 'hf'}"]
    _, q, _ = train(tmp_path / "qlora", *ft, "peft=qlora", "train.steps=30", "optim.lr=3e-3",
                    "train.eval_every_n_steps=15", "checkpoint.save_final=true")
    _, lora, _ = train(tmp_path / "lora", *ft, "peft=lora", "train.steps=3")
    gib = 2 ** 30
    print(f"\nQLoRA: measured {q['memory_peak_bytes'] / gib:.3f} GiB, plan {q['memory_plan_bytes'] / gib:.3f} GiB; "
          f"LoRA: measured {lora['memory_peak_bytes'] / gib:.3f} GiB, plan {lora['memory_plan_bytes'] / gib:.3f} GiB")
    planned_saving = lora["memory_plan_bytes"] - q["memory_plan_bytes"]
    assert planned_saving > 0.6 * 4 * MID_LINEAR, planned_saving  # the plan counts NF4 bytes for the base
    assert lora["memory_peak_bytes"] - q["memory_peak_bytes"] >= 0.5 * planned_saving, (lora, q)
    assert q["memory_peak_bytes"] <= q["memory_plan_bytes"], (q["memory_peak_bytes"], q["memory_plan_bytes"])
    evals = q["eval_losses"]
    assert evals[-1][1] < evals[0][1], evals
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "qlora" / "hf", local_files_only=True)  # on CPU, no CUDA here
    assert (tmp_path / "qlora" / "adapter" / "adapter_config.json").exists()


# DeepSpeed swaps tensors of 1 MiB and more: 4096 x 128 fp32 embeddings reach the disk on up to 2 ranks, the
# optimizer's sub-group on any number.
SWAP = [*TINY, "model.hidden_size=128", "model.intermediate_size=352", "train.steps=6", "train.eval_every_n_steps=0",
        f"train.global_batch_size={4 * max(N, 1)}", WORLD]


def test_zero_infinity_swaps_to_nvme_from_the_gpus_and_equals_zero3(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    seen: set = set()
    done = threading.Event()

    def watch():  # what is under the NVMe path while the run trains
        while not done.is_set():
            for dirpath, _, files in os.walk(nvme):
                seen.update(os.path.relpath(os.path.join(dirpath, f), nvme) for f in files)
            done.wait(0.05)

    _, z3, _ = train(tmp_path / "zero3", *SWAP, "backend=zero3")
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc, inf, _ = train(tmp_path / "inf", *SWAP, "backend=zero_infinity", f"backend.nvme_path={nvme}")
    finally:
        done.set()
        watcher.join()
    assert f"({N}/node on cuda)" in proc.stdout, proc.stdout[-2000:]
    for key in ("train_losses", "grad_norms"):  # fp32: the same arithmetic, CPU Adam for the fused one
        assert_close(curve(inf, key), curve(z3, key), 1e-4, f"zero_infinity vs zero3 x{N} GPUs, {key}")
    for rank in range(N):  # each rank's fp32 masters and Adam moments went through the disk
        assert any(f.startswith("shardyard-swap-") and f"/optimizer/rank{rank}/" in f for f in seen), (rank, sorted(seen))
    left = [f for _, _, files in os.walk(nvme) for f in files]
    assert not left, left  # removed when the run ended


def test_mfu_is_measured_against_this_gpus_own_peak(tmp_path):
    """MFU's denominator is the matmul rate this GPU really reaches (``measured_peak_tflops``, bf16), passed as
    ``metrics.peak_tflops``; the data sheet's figure (``peak_tflops``' table) bounds it from above."""
    measured, table = json.loads(in_child(
        "import json, torch; from shardyard.metrics import measured_peak_tflops, peak_tflops; "
        "d = torch.device('cuda', 0); print(json.dumps([measured_peak_tflops(d, 'bf16'), peak_tflops(d, 'bf16', None)]))"))
    print(f"\nbf16 peak: measured {measured:.1f} TFLOP/s, data sheet {table} TFLOP/s")
    assert measured > 0
    if table is not None:  # a GPU of the table (A100, H100, H200): the measurement stays under the data sheet
        assert measured <= 1.05 * table, (measured, table)
    _, _, records = train(tmp_path, *TINY, *ONE, "precision=bf16", "train.steps=6", "train.eval_every_n_steps=0",
                          f"metrics.peak_tflops={measured}", "profile.enabled=true", "profile.steps=[3,4]")
    for r in records:
        assert 0 < r["mfu"] < 1 and r["mfu"] == pytest.approx(r["tflops_per_device"] / measured), r
    last = records[-1]
    assert last["memory/max_allocated_gib"] > 0 and last["memory/max_reserved_gib"] >= last["memory/max_allocated_gib"]
    trace = json.load(open(tmp_path / "profile/rank0.trace.json"))
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])  # CUDA kernels are in the trace


# A 1.03B-parameter LLaMA (DeepSeek-LLM architecture), bf16, 4 x 1024 tokens per micro-batch.
BIG = ["model.hidden_size=2048", "model.intermediate_size=5504", "model.num_layers=20", "model.num_heads=16",
       "data.seq_len=1024", "train.micro_batch_size=4", "train.steps=3", "train.eval_batches=1",
       "train.sample_tokens=0", "checkpoint.save_final=false", "monitor=[console]", "precision=bf16",
       "launch.nproc_per_node=1"]


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_plan_predicts_the_cuda_peak_of_a_1b_model(engine, tmp_path):
    """The plan's allocated peak per GPU against ``max_memory_allocated`` over the whole run (15%)."""
    proc, s, _ = train(tmp_path, *BIG, f"backend={engine}")
    print(f"\n{engine}: measured {s['memory_peak_bytes'] / 2**30:.2f} GiB, plan {s['memory_plan_bytes'] / 2**30:.2f} GiB")
    assert 0.95e9 < s["params"] < 1.1e9
    assert "plan per GPU rank" in proc.stdout and "measured max_memory_allocated" in proc.stdout
    assert s["memory_peak_bytes"] == pytest.approx(s["memory_plan_bytes"], rel=0.15), \
        (engine, s["memory_peak_bytes"] / 2**30, s["memory_plan_bytes"] / 2**30)


CUDA_ONLY = {  # refused on a machine without GPUs: tests/unit/test_config.py, tests/dist/test_qlora.py
    "device-cuda": [*ONE, "backend.device=cuda"],
    "nccl": ["backend=ddp", "backend.dist_backend=nccl", WORLD],
    "fsdp-fp16": ["backend=fsdp", "precision=fp16", WORLD],
    "zero2-fp16": ["backend=zero2", "precision=fp16", WORLD],
    "qlora": [*ONE, "peft=qlora", "precision=bf16"],
    "flash-attention-2": [*ONE, "model.attn_implementation=flash_attention_2", "precision=bf16"],
}


@pytest.mark.parametrize("option", list(CUDA_ONLY))
def test_what_a_machine_without_gpus_refuses_validates_here(option, tmp_path):
    if option == "flash-attention-2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    proc = train_py(*TINY, *CUDA_ONLY[option], "plan.only=true", run_dir=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "GPU" in proc.stdout, proc.stdout[-2000:]  # planned for this machine's GPUs


LONG_BF16 = [*TINY, "train.steps=50", "train.eval_every_n_steps=0", f"train.global_batch_size={8 * max(N, 1)}",
             "train.log_every_n_steps=5", "precision=bf16"]


@functools.lru_cache(maxsize=None)
def float8_matmuls() -> bool:
    return float(in_child("import torch; print('%d.%d' % torch.cuda.get_device_capability())")) >= 8.9


@pytest.mark.parametrize("engine", ["single", "ddp", "fsdp"])
def test_fp8_on_the_gpus_stays_within_2e_2_of_bf16(engine, tmp_path):
    if not float8_matmuls():
        pytest.skip("float8 matmuls need compute capability 8.9+ (precision=fp8 is refused below)")
    world = ONE if engine == "single" else [f"backend={engine}", WORLD]
    ref = curve(train(tmp_path / "bf16", *LONG_BF16, *world)[1])
    got = curve(train(tmp_path / "fp8", *LONG_BF16, *world, "precision=fp8")[1])
    assert_close(got, ref, 2e-2, f"{engine} fp8 vs bf16, 50 steps")
    assert got != ref and got[-1] < got[0] - 0.5, got


@pytest.mark.parametrize("option", ["model.compile=true", "model.loss_chunk=100",
                                    "model.activation_checkpointing=selective"])
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_speed_options_on_the_gpus_keep_the_losses(engine, option, single, tmp_path):
    got = curve(train(tmp_path, *BF16, f"backend={engine}", WORLD, option)[1])
    assert_close(got, curve(single("bf16")[1]), BF16_REL, f"{engine} x{N} GPUs with {option} vs 1 GPU")
