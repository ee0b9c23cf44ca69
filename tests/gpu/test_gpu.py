"""GPU tier: what only a CUDA machine can show. Marked ``gpu``; it cannot pass by skipping (tests/conftest.py):

* No GPU on the machine (no driver lists one): every test skips with "no GPU on this machine". A driver that lists
  GPUs torch cannot use (a CPU build of torch, a CUDA init error, ``device_count() == 0``): every test FAILS at
  setup with that reason, before any training starts. The other allowed skip is a named capability of the
  GPUs (``capability(...)``): float8 matmuls below compute capability 8.9. A missing package is not a
  capability: flash-attn (not in ``make setup``: a wheel built for one CUDA and torch pair) and Horovod (built
  by ``make setup`` with NCCL where CUDA is present) fail with the command that installs them. Every skip and
  its reason is listed in the terminal summary; any other reason fails the session.
* Every engine, on all N visible GPUs, under ``train.deterministic=true`` (deterministic kernels, cuBLAS'
  fixed workspace, NCCL Ring/Simple), equals the single-GPU run with the same global batch: single (rerun,
  bitwise), ddp, fsdp, fsdp_offload, zero1, zero2, zero2_offload, zero3, zero3_offload, horovod in bf16 within
  ``BF16_REL``; with an even N also fsdp_tp (tp 2) and pipeline (2 stages); MoE
  (deepseek_moe_tiny, fp32) on fsdp without and (N >= 2) with expert parallelism within ``MOE_REL``. One GPU
  runs world 1 and the session prints what a multi-GPU machine adds.
* The plan's peak per GPU against the measured ``max_memory_allocated`` of each of those runs (``PLAN_BAND``),
  and of a 1B model on fsdp and zero3 (15%).
* fp16 on every engine that takes it: an inf gradient injected at one step (``SHARDYARD_TEST_POISON_GRAD``, on
  the last rank) makes the scaler skip that update, halve its scale and grow it again; compared with the
  single-GPU run WITHOUT the inf (equal before the inf, bitwise on one GPU, different after it, its scale never
  lowered) and with the single-GPU run with the same inf (``FP16_REL``).
* fp8 (float8 matmuls, compute capability 8.9+) on single, ddp, fsdp, fsdp_offload against that engine's bf16
  run: within 2e-2 and, under deterministic settings, not equal to it (float8 really ran).
* FlashAttention-2 on packed rows against sdpa; QLoRA's 4-bit base in measured memory; ZeRO-Infinity swapping
  from the GPUs; MFU against the measured peak; the speed options on fsdp; what a CPU machine refuses
  (``backend.device=cuda``, nccl, fp16 on FSDP/ZeRO, QLoRA, FlashAttention-2) planned for these GPUs.

The rest of the suite runs on CPU with the GPUs hidden (``tests/conftest.py``); these tests hand them back to their
own runs (``use_gpus``), each ``python train.py`` a fresh interpreter, and never initialise CUDA in the pytest
process itself (anything that needs CUDA here runs in a child). Run: ``pytest tests/gpu -q -s`` (``-s`` prints
the figures: per-engine worst differences, plan against measured memory).
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

from conftest import NO_GPU, ROOT, TINY, capability, gpu_env, gpu_tier, train_py, use_gpus

N, BROKEN = gpu_tier()
pytestmark = [pytest.mark.gpu] + ([pytest.mark.skip(reason=NO_GPU)] if N == 0 and BROKEN is None else [])

BF16_REL = 2e-2
"""bf16 tolerance: the largest relative difference per logged step (losses and gradient norms) between an engine
and one GPU. Deterministic settings make each run repeatable, not two engines equal: bf16 keeps 8 significant
bits (2^-8 = 0.4% per value), and other reduction orders and kernels (NCCL, FSDP's reduce-scatter, DeepSpeed's
bf16 weights) over 9 steps of the tiny model stay within 2%, the CPU tier's bound for bf16 against fp32
(tests/dist/test_engines.py)."""
FP16_REL = 2e-2
"""The same for fp16 (10 significant bits, but DeepSpeed's fp16 engines hold fp16 weights where torch autocasts
fp32 ones)."""
MOE_REL = 1e-3
"""MoE in fp32 (no TF32: torch's default matmul precision): only reduction orders differ, as the V3 tiny's
fsdp_offload against fsdp (tests/dist/test_device_rules.py); a routing that changed would move the loss more."""
PLAN_BAND = (0.5, 1.5)
"""The tiny runs' measured peak over the plan's: the plan holds, at any engine and world, within half of it either
way (tiny models: the allocator's 512-byte rounding and small temporaries weigh more), once WORKSPACES is taken
off the measured peak; the 1B test bounds it to 15%."""
WORKSPACES = 4 * 4096 * 8 * 1024
"""What the plan leaves out on purpose (plan.py: cuBLAS' workspaces, allocated through torch's caching allocator
and so in ``max_memory_allocated``): ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (train.deterministic) is 8 x 4 MiB per
handle and stream; up to 4 streams run matmuls (the compute stream, FSDP's and DeepSpeed's side streams). At most
128 MiB: beside the 1B model's 15 GiB nothing, beside the tiny model's tens of MiB the whole difference."""

ENGINES = ["ddp", "fsdp", "fsdp_offload", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "horovod"]
"""The engines that run at any world, one GPU included (FSDP and ZeRO shard over that one rank)."""
EVEN = N if N % 2 == 0 else 0
"""fsdp_tp (tp 2) and pipeline (2 stages) run on all N GPUs when N is even (the global batch of 8N divides over
their N/2 data-parallel ranks); an odd N > 1 leaves them out, and the session says so."""
EP = math.gcd(8, N) if N else 1
"""deepseek_moe_tiny's 8 routed experts over N data-parallel shards: the largest degree dividing both."""
MULTI = {"fsdp_tp": ["backend=fsdp_tp", "backend.tp=2"],
         "pipeline": ["backend=pipeline", "backend.stages=2", "backend.microbatches=2"]}
MULTI_GPU_ADDS = ("a machine with 2+ GPUs adds: every engine at world N (data parallel across GPUs, NCCL reductions), "
                  "fsdp_tp (tp 2), pipeline (2 stages) and MoE with expert parallelism (backend.ep)")
FP16_ENGINES = ["single", "ddp", "fsdp", "fsdp_offload", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload",
                "horovod"]
"""fsdp_tp and pipeline refuse fp16 (no loss scaling there: ``UserError``)."""
FP8_ENGINES = ["single", "ddp", "fsdp", "fsdp_offload"]
"""The engines that build float8 linears (DeepSpeed, horovod, fsdp_tp and pipeline refuse precision=fp8)."""


def world(n: int) -> list[str]:
    return [f"launch.nproc_per_node={n}"]


WORLD = f"launch.nproc_per_node={N}"


ONE = ["backend=single", "launch.nproc_per_node=1"]
RUN = [*TINY, "train.steps=9", "train.eval_every_n_steps=0", f"train.global_batch_size={8 * max(N, 1)}",
       "optim.lr=3e-3", "train.deterministic=true"]
"""Micro-batch 4: the engines accumulate 2 micro-batches on each of N ranks, single-GPU 2N."""
BF16 = [*RUN, "precision=bf16"]
MOE = [*RUN, "model=deepseek_moe_tiny", "precision=fp32"]

POISONED_STEP = 4
PARAM = "model.layers.1.mlp.up_proj.weight"
FP16 = [*RUN, "precision=fp16", "precision.initial_scale_power=10", "precision.loss_scale_window=3",
        "precision.hysteresis=1"]
"""Scale 1024, doubled after 3 clean steps; DeepSpeed lowers it at the first overflow (hysteresis 1), as torch's
GradScaler does."""


def overflow(rank: int) -> dict:
    """The drill: on ``rank``, the gradient of PARAM is inf at POISONED_STEP (before any reduction)."""
    return {"SHARDYARD_TEST_POISON_GRAD": f"{POISONED_STEP}:{rank}:{PARAM}=inf"}


def layout(engine: str) -> list[str]:
    """An engine's overrides at this machine's world."""
    if engine == "single":
        return ONE
    if engine in MULTI:
        return [*MULTI[engine], *world(EVEN)]
    if engine == "moe-fsdp":
        return ["backend=fsdp", *world(N)]
    if engine == "moe-ep":
        return ["backend=fsdp", f"backend.ep={EP}", *world(N)]
    return [f"backend={engine}", *world(N)]


BF16_RUNS = [*ENGINES, *(MULTI if EVEN >= 2 else [])]
MOE_RUNS = ["moe-fsdp", *(["moe-ep"] if EP >= 2 else [])]


@pytest.fixture(scope="module", autouse=True)
def _gpus():
    if BROKEN:  # before any run: the tier fails with the reason, every test of it
        pytest.fail(f"GPU tier: {BROKEN}", pytrace=False)
    if N == 1:
        what = f"world 1 (FSDP and ZeRO shard over that one rank); {MULTI_GPU_ADDS}"
    else:
        what = (f"world {N}; " + (f"fsdp_tp and pipeline at world {EVEN}; " if EVEN else
                                  "fsdp_tp and pipeline need an even GPU count (not run); ")
                + (f"expert parallelism at ep={EP}" if EP >= 2 else "no ep divides both 8 experts and the world"))
    print(f"\nGPU tier: {N} GPU(s) visible; every engine runs at {what}")
    with pytest.MonkeyPatch.context() as mp:
        use_gpus(mp)
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


def worst(got, ref) -> float:
    assert len(got) == len(ref) > 0, (got, ref)
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def assert_close(got, ref, rel, what):
    w = worst(got, ref)
    print(f"{what}: worst relative difference {w:.2e} (tolerance {rel:.0e})")
    assert w <= rel, f"{what}: worst relative difference {w:.2e} > {rel:.0e}\n got {got}\n ref {ref}"


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
        return "Horovod is built without NCCL"
    return None


def needs(engine: str) -> None:
    """Horovod is part of ``make setup``: missing or without NCCL on a GPU machine it is a broken setup (fail,
    with the fix), unless the machine was set up without it on purpose (SHARDYARD_SKIP_HOROVOD=1: named skip)."""
    if engine == "horovod" and horovod_on_gpus():
        pytest.fail(f"{horovod_on_gpus()}: run `bash scripts/build_horovod.sh` on this CUDA machine (it builds "
                    "Horovod with NCCL)", pytrace=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of the tier's recipes, made once on first use and shared: ``runs("bf16", "fsdp")``,
    ``runs("fp16", "zero2")`` (with the inf on the last rank), ``runs("fp16-clean", "single")``,
    ``runs("moe", "moe-ep")``, ``runs("fp8", "ddp")``, ``runs("bf16-again", "single")``."""
    made: dict = {}
    recipes = {"bf16": (BF16, None), "bf16-again": (BF16, None), "fp16-clean": (FP16, None),
               "fp16": (FP16, "inf"), "moe": (MOE, None), "fp8": ([*BF16, "precision=fp8"], None)}

    def get(recipe: str, engine: str):
        if (recipe, engine) not in made:
            overrides, inf = recipes[recipe]
            lay = layout(engine)
            ranks = 1 if engine == "single" else EVEN if engine in MULTI else N
            env = overflow(ranks - 1) if inf else None
            made[recipe, engine] = train(tmp_path_factory.mktemp(f"{recipe}-{engine}"), *overrides, *lay, env=env)
        return made[recipe, engine]
    return get


def assert_on_the_gpus(proc, s, records, ranks: int) -> None:
    assert s["world_size"] == ranks and f"({ranks}/node on cuda)" in proc.stdout, proc.stdout[-2000:]
    last = records[-1]
    assert last["memory/max_allocated_gib"] > 0 and "memory/rss_gib" not in last  # CUDA memory, not host RSS
    assert s["deterministic"] == {"algorithms": True, "cudnn": True, "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                                  "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}, s["deterministic"]


def test_a_deterministic_single_gpu_run_equals_itself_bitwise(runs):
    """What makes ``got != ref`` mean something below: two runs of one recipe on one GPU are equal, bit for bit."""
    a, b = runs("bf16", "single"), runs("bf16-again", "single")
    assert_on_the_gpus(*a, ranks=1)
    for key in ("train_losses", "grad_norms"):
        assert curve(a[1], key) == curve(b[1], key), key


@pytest.mark.parametrize("engine", BF16_RUNS)
def test_engine_on_every_gpu_matches_single_gpu_in_bf16(engine, runs):
    needs(engine)
    ranks = EVEN if engine in MULTI else N
    proc, s, records = runs("bf16", engine)
    assert_on_the_gpus(proc, s, records, ranks)
    ref = runs("bf16", "single")[1]
    for key in ("train_losses", "grad_norms"):
        assert_close(curve(s, key), curve(ref, key), BF16_REL, f"{engine} x{ranks} GPUs vs 1 GPU, bf16, {key}")
    got = curve(s)
    assert got[-1] < got[0] - 0.3, got
    assert "loss_scale" not in records[-1]  # bf16 needs no loss scaling


@pytest.mark.parametrize("engine", MOE_RUNS)
def test_moe_on_every_gpu_matches_single_gpu_with_and_without_expert_parallelism(engine, runs):
    proc, s, records = runs("moe", engine)
    assert_on_the_gpus(proc, s, records, N)
    ref = runs("moe", "single")[1]
    for key in ("train_losses", "grad_norms"):
        assert_close(curve(s, key), curve(ref, key), MOE_REL, f"{engine} x{N} GPUs vs 1 GPU, MoE fp32, {key}")


@pytest.mark.parametrize("engine", ["single", *BF16_RUNS, *MOE_RUNS])
def test_the_plan_holds_the_measured_peak_of_every_engine(engine, runs):
    """``memory_plan_bytes`` (the plan's allocated peak per GPU at this world) against ``memory_peak_bytes``
    (``max_memory_allocated`` over the run), from the runs above."""
    needs(engine)
    s = runs("moe" if engine.startswith("moe") else "bf16", engine)[1]
    ratio = max(s["memory_peak_bytes"] - WORKSPACES, 0) / s["memory_plan_bytes"]
    print(f"{engine} x{s['world_size']}: measured {s['memory_peak_bytes'] / 2**20:.1f} MiB, plan "
          f"{s['memory_plan_bytes'] / 2**20:.1f} MiB ({100 * (ratio - 1):+.0f}% with {WORKSPACES >> 20} MiB of "
          "cuBLAS workspaces taken off)")
    assert PLAN_BAND[0] <= ratio <= PLAN_BAND[1], (engine, s["memory_peak_bytes"], s["memory_plan_bytes"])


@pytest.mark.parametrize("engine", FP16_ENGINES)
def test_fp16_loss_scaler_skips_an_inf_gradient_backs_off_and_grows_again(engine, runs):
    needs(engine)
    _, s, records = runs("fp16", engine)
    _, clean, clean_records = runs("fp16-clean", "single")  # one GPU, no inf
    ranks = 1 if engine == "single" else N
    assert s["world_size"] == ranks
    scales = [r["loss_scale"] for r in records]  # the dynamic loss scale, logged at every step under fp16
    clean_scales = [r["loss_scale"] for r in clean_records]
    losses, clean_losses = curve(s), curve(clean)
    assert len(scales) == len(losses) == len(clean_losses) == 9, (scales, losses)
    # Without the inf the scale is never lowered: the halving below is the inf's, not an fp16 overflow of its own.
    assert all(b >= a for a, b in zip(clean_scales, clean_scales[1:])), clean_scales
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
    before, after = losses[:POISONED_STEP], losses[POISONED_STEP]  # steps 1-4 (the inf's loss is computed first)
    if engine == "single":  # deterministic, one GPU: equal to the clean run bit for bit until the dropped update
        assert before == clean_losses[:POISONED_STEP], (before, clean_losses)
        assert after != clean_losses[POISONED_STEP], (after, clean_losses)  # step 5 runs on step 3's weights
    else:
        assert_close(before, clean_losses[:POISONED_STEP], FP16_REL, f"{engine} fp16 before the inf vs 1 GPU clean")
        assert_close(losses, curve(runs("fp16", "single")[1]), FP16_REL, f"{engine} x{N} fp16 vs 1 GPU, same inf")


@functools.lru_cache(maxsize=None)
def float8_matmuls() -> bool:
    return float(in_child("import torch; print('%d.%d' % torch.cuda.get_device_capability())")) >= 8.9


@pytest.mark.parametrize("engine", FP8_ENGINES)
def test_fp8_on_the_gpus_stays_within_2e_2_of_bf16_and_is_not_bf16(engine, runs):
    if not float8_matmuls():
        pytest.skip(capability("float8 matmuls need compute capability 8.9+ (precision=fp8 is refused below)"))
    proc, s, records = runs("fp8", engine)
    assert_on_the_gpus(proc, s, records, 1 if engine == "single" else N)
    got, ref = curve(s), curve(runs("bf16", engine)[1])
    assert_close(got, ref, 2e-2, f"{engine} fp8 vs bf16")
    assert got != ref and got[-1] < got[0] - 0.3, (got, ref)  # deterministic runs: a difference is float8's


SHAPE = [o for o in TINY if not o.startswith("data.seq_len")]
FLASH_MISSING = ("flash-attn is not installed (not part of make setup, a wheel built for one CUDA and torch pair): "
                 "pip install flash-attn --no-build-isolation")
"""A missing package is a setup to complete, not a capability the GPUs lack: the tests that need it fail."""

PACKED = {"sft-packed": ["data=sft", "data.seq_len=256"],  # conversations packed, positions restart per conversation
          "document-mask": ["data.document_mask=true", "data.seq_len=256"]}  # pre-training rows, per document


@pytest.mark.parametrize("packing", list(PACKED))
def test_flash_attention_2_on_packed_rows_equals_sdpa(packing, tmp_path):
    if importlib.util.find_spec("flash_attn") is None:
        pytest.fail(FLASH_MISSING, pytrace=False)
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
        "import json, torch; from shardyard.training.metrics import measured_peak_tflops, peak_tflops; "
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


@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_plan_predicts_the_cuda_peak_of_a_1b_model(engine, tmp_path):
    """The plan's allocated peak per GPU against ``max_memory_allocated`` over the whole run (15%)."""
    proc, s, _ = train(tmp_path, *BIG, f"backend={engine}")
    print(f"\n{engine}: measured {s['memory_peak_bytes'] / 2**30:.2f} GiB, plan {s['memory_plan_bytes'] / 2**30:.2f} GiB")
    assert 0.95e9 < s["params"] < 1.1e9
    assert "plan per GPU rank" in proc.stdout and "measured max_memory_allocated" in proc.stdout
    assert s["memory_peak_bytes"] == pytest.approx(s["memory_plan_bytes"], rel=0.15), \
        (engine, s["memory_peak_bytes"] / 2**30, s["memory_plan_bytes"] / 2**30)


CUDA_ONLY = {  # refused on a machine without GPUs: tests/unit/test_config.py, tests/dist/test_qlora.py
    "device-cuda": ("single", [*ONE, "backend.device=cuda"]),
    "nccl": ("ddp", ["backend=ddp", "backend.dist_backend=nccl", WORLD]),
    "fsdp-fp16": ("fsdp", ["backend=fsdp", "precision=fp16", WORLD]),
    "zero2-fp16": ("zero2", ["backend=zero2", "precision=fp16", WORLD]),
    "qlora": ("single", [*ONE, "peft=qlora", "precision=bf16"]),
    "flash-attention-2": ("single", [*ONE, "model.attn_implementation=flash_attention_2", "precision=bf16"]),
}
"""Each is planned here (``plan.only``); each also trains in this tier: fsdp/zero2 fp16 in the scaler drill,
qlora and flash-attention-2 in their own tests, nccl (the engines' default on CUDA) in a short run below."""


@functools.lru_cache(maxsize=None)
def gpu_name() -> str:
    return in_child("import torch; print(torch.cuda.get_device_name(0))")


@pytest.mark.parametrize("option", list(CUDA_ONLY))
def test_what_a_machine_without_gpus_refuses_is_planned_for_these_gpus(option, tmp_path):
    engine, overrides = CUDA_ONLY[option]
    if option == "flash-attention-2" and importlib.util.find_spec("flash_attn") is None:
        pytest.fail(FLASH_MISSING, pytrace=False)
    proc = train_py(*TINY, *overrides, "plan.only=true", run_dir=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = 1 if engine == "single" else N
    # Planned for this machine's GPUs (their name, their count, GPU memory per rank), not its host RAM.
    assert f"plan for {ranks}x " in proc.stdout and "(this machine)" in proc.stdout, proc.stdout[-2000:]
    assert gpu_name().split()[-1] in proc.stdout and "peak/GPU" in proc.stdout, proc.stdout[-2000:]
    if engine != "single":  # the table has a row per engine that runs at this world: the chosen one fits
        rows = [line for line in proc.stdout.splitlines() if line.split()[:1] == [engine]]
        assert rows and "| yes" in rows[0], proc.stdout[-2000:]


def test_nccl_reduces_a_short_ddp_run_with_the_deterministic_algorithm(tmp_path):
    """backend.dist_backend=nccl trains (2 steps): NCCL itself reports its version and the Ring/Simple choice
    that ``train.deterministic`` put in the workers' environment."""
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV"}
    proc, s, records = train(tmp_path, *RUN, "train.steps=2", *CUDA_ONLY["nccl"][1], env=env)
    assert_on_the_gpus(proc, s, records, N)
    out = proc.stdout + proc.stderr
    print("\n".join(line for line in out.splitlines() if "NCCL INFO" in line and ("version" in line or "NCCL_" in line)))
    assert "NCCL version" in out, out[-3000:]
    if N >= 2:  # a communicator of 2+ ranks reads its environment (world 1: DDP needs no collective)
        for key, value in (("NCCL_ALGO", "Ring"), ("NCCL_PROTO", "Simple")):
            assert f"{key} set by environment to {value}" in out, out[-3000:]


@pytest.mark.parametrize("option", ["model.compile=true", "model.loss_chunk=100",
                                    "model.activation_checkpointing=selective"])
def test_speed_options_on_the_gpus_keep_the_losses(option, runs, tmp_path):
    """On fsdp (the CPU tier proves each option applied behind every engine's wrapper, tests/dist/
    test_speed_features.py; this shows CUDA kernels and inductor's GPU code give the same training)."""
    got = curve(train(tmp_path, *BF16, "backend=fsdp", WORLD, option)[1])
    assert_close(got, curve(runs("bf16", "single")[1]), BF16_REL, f"fsdp x{N} GPUs with {option} vs 1 GPU")


DS_TP = 2 if N >= 2 else 1
"""engine=deepspeed's tensor-parallel degree on this machine: 2 ranks over NCCL, or 1 on one GPU."""


def test_deepspeed_inference_on_the_gpus_generates_the_tokens_of_transformers_generate(tmp_path):
    """engine=deepspeed on CUDA (shardyard.inference.ds_inference): DeepSpeed's AutoTP at tp 2 over NCCL (tp 1 on one GPU,
    where tp 2 is refused naming tp_size) in fp32 generates greedily, KV-cached, the tokens transformers' own
    ``generate`` gives on one GPU, for LLaMA (grouped-query attention) and DeepSeek-V3 (MLA + MoE); each rank on
    its own GPU holding its share. The CPU tier's test at tp 2 over gloo: tests/dist/test_ds_inference.py."""
    out = tmp_path / "ds.pt"
    code = f"""
import json, sys, torch
sys.path.insert(0, "tests/dist")
import test_ds_inference as t
from shardyard.inference import ds_inference
from shardyard.core.errors import UserError
refused = None
if {DS_TP} == 1:
    try:
        ds_inference.check(2, t._model("llama_gqa").config, "cuda")
    except UserError as err:
        refused = err.key
ds_inference.run_ranks({DS_TP}, t._tp_generate, {str(out)!r}, {DS_TP}, "cuda", device_type="cuda")
got = torch.load({str(out)!r})
want = {{name: t._reference(name, "cuda") for name in t.MODELS}}
report = {{name: dict(equal=torch.equal(got[name]["tokens"], want[name]), q_rows=got[name]["q_rows"],
                      device=got[name]["device"], got=got[name]["tokens"].tolist(), want=want[name].tolist())
          for name in t.MODELS}}
print(json.dumps(dict(refused=refused, models=report)))
"""
    result = json.loads(in_child(code))
    print(f"engine=deepspeed at tp {DS_TP} on {N} GPU(s): {result}")
    if DS_TP == 1:
        assert result["refused"] == "tp_size", result  # tp 2 on one GPU: refused before any rank starts
    for name, r in result["models"].items():
        rows, full = r["q_rows"]
        assert rows * DS_TP == full and r["device"] == "cuda:0", (name, r)  # rank 0's share, on its GPU
        assert r["equal"], (name, r["got"], r["want"])
