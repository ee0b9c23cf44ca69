# python bench/throughput.py [--steps N] [--rounds R] [--model tiny|1b] [--precision bf16|fp32|fp8] [--compile] ...
"""Tokens/s, MFU and peak memory of one training recipe, four ways (issue 34, point 1).

    python bench/throughput.py --steps 10   # the README's CPU table: --model tiny, fp32, 1 process (80-90 s, 2 cores)
    python bench/throughput.py --steps 10 --rounds 3                       # the same, 3 alternating rounds
    python bench/throughput.py              # on CUDA: --model 1b, bf16, seq 2048, all visible GPUs, 20 steps x 3 rounds
    python bench/throughput.py --model 1b --compile                        # regional torch.compile everywhere
    python bench/throughput.py --model 1b --precision fp8 --engines single,ddp,fsdp   # float8 linears (torchao)
    python bench/throughput.py --approaches shardyard,plain --engines ddp  # a subset
    pip install -e .[bench]                      # torchtitan==0.3.0 (it runs on CUDA only)

On the device it finds (CUDA if available, else CPU) it trains the same model shape, micro-batch, sequence length
and precision with:

* shardyard, one subprocess ``python train.py backend=<engine> ...`` per engine (world size: every visible GPU
  through ``launch.nproc_per_node``, 1 process on CPU; ``single`` always 1), read from the run's metrics.jsonl
  (``tokens_per_s`` of every step: ``train.log_every_n_steps=1``; ``memory/max_allocated_gib`` on CUDA,
  ``memory/rss_gib`` on CPU). It trains on the stdlib-code corpus; the others on random token ids of the same
  shape (a dense model's speed does not depend on the ids);
* a plain hand-written PyTorch loop (this file, ``--_run plain``): the model from shardyard's builder
  (``shardyard.models.build.build_model`` on the ``model`` option), AdamW, autocast in the precision,
  ``F.cross_entropy``, clip, one ``loss.item()`` per step; DDP under torchrun when the world is > 1;
* HF ``transformers.Trainer`` (``--_run hf``) on the same model object and batch, ``use_cpu`` on CPU, ``bf16``,
  ``optim=adamw_torch``, each step timed by a ``TrainerCallback``; DDP under torchrun when the world is > 1;
* torchtitan 0.3.0 (``torchrun -m torchtitan.train --module throughput --config titan_config``: the Llama-3
  model of torchtitan at the same dimensions, built by ``titan_config`` below; FSDP2 over the world, its
  ``tps`` log line parsed). It needs CUDA; on a CPU it is not run, and the table says so.

Every approach takes one ``loss.item()``-like host sync per step and is timed from one step's end to the next
(data loading included, evaluation excluded). The first ``--warmup`` steps of every run are dropped; a run's
figure is the median over its remaining steps; the table gives the median over ``--rounds`` rounds, whose runs
alternate (round-robin, each round starting one approach later) so machine noise hits all alike. AdamW runs
torch's default (foreach) implementation everywhere (torchtitan's default ``fused`` is switched to
``foreach``). Prints, never asserts, exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHAPES = {
    # deepseek_tiny (conf/model/deepseek_tiny.yaml): 5.3M parameters, the data's 4096-token vocabulary
    "tiny": dict(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=8, vocab_size=4096,
                 seq=128, mbs=8),
    # a dense LLaMA of 1.06B parameters (TinyLlama's widths, 18 layers, full multi-head attention)
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_layers=18, num_heads=16, num_kv_heads=16,
               vocab_size=32000, seq=2048, mbs=4),
}
ENGINES = "single,ddp,fsdp,zero2,zero3"
APPROACHES = ("shardyard", "plain", "hf", "torchtitan")
LABEL = {"plain": "plain PyTorch loop", "hf": "HF Trainer", "torchtitan": "torchtitan 0.3.0"}
LR, BETAS, WEIGHT_DECAY, WARMUP_LR_STEPS, SEED = 1e-3, (0.9, 0.95), 0.1, 2, 0


# ------------------------------------------------------------------------------------------ the recipe
def model_overrides(s: dict) -> list[str]:
    """The shape as ``model.*`` overrides of shardyard's ``deepseek_tiny`` option (``shardyard.models.build.llama``)."""
    return ["model=deepseek_tiny", *(f"model.{k}={s[k]}" for k in
            ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size")),
            f"model.max_position_embeddings={max(2048, s['seq'])}"]


def compose_model(spec: dict):
    """The ``model`` option shardyard composes for these overrides (what ``train.py`` builds)."""
    from shardyard.config import compose

    return compose([*model_overrides(spec["shape"]), f"seed={SEED}"], run_dir="unused")


def build_on(spec: dict, device):
    """shardyard's builder on the composed ``model`` option; on CUDA built on the meta device and materialised on
    the GPU (a 1B model's CPU init is slow), as shardyard does for big models."""
    from shardyard.models.build import build_model, materialize

    cfg = compose_model(spec)
    model = build_model(cfg.model, cfg.seed, on_meta=device.type == "cuda")
    materialize(model, device, cfg.seed, cfg.model)
    return model.to(device)


def float8_blocks(model, device) -> None:
    """fp8 as a hand-written loop does it: torchao's float8 linears in the transformer blocks (the LM head stays
    bf16; dims must be multiples of 16), emulated on a CPU."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def wanted(mod, fqn: str) -> bool:
        return (".layers." in f".{fqn}" and isinstance(mod, torch.nn.Linear)
                and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)

    convert_to_float8_training(model, config=Float8LinearConfig(emulate=device.type != "cuda"), module_filter_fn=wanted)


def compile_blocks(model) -> None:
    """Regional compile, as shardyard's ``model.compile`` and torchtitan do it: each decoder layer."""
    for block in model.model.layers:
        block.compile()


def _dist():
    """(rank, local rank, world) from torchrun's variables; a process group when the world is > 1."""
    import torch

    rank, local, world = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    cuda = torch.cuda.is_available() and os.environ.get("SHARDYARD_BENCH_DEVICE") == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return rank, world, device


def _mem_gib(device) -> float:
    """The figure shardyard's metrics carry: CUDA's peak allocated, or the RSS at a step's end on a CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- workers (run as subprocesses)
def worker_info(spec: dict) -> dict:
    """Parameters and FLOPs per token (shardyard's formula, on a meta-device build) and the device's peaks."""
    import torch

    from shardyard.training.metrics import measured_peak_tflops, peak_tflops
    from shardyard.models.build import shape_model
    from shardyard.models.shape import flops_per_token, param_count

    cfg = compose_model(spec)
    model = shape_model(cfg.model)
    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    out = {"params": param_count(model), "flops_per_token": flops_per_token(model, spec["shape"]["seq"]),
           "table_peak": peak_tflops(device, spec["precision"], None),
           "measured_peak": measured_peak_tflops(device, spec["precision"]),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    import transformers

    out["transformers"] = transformers.__version__
    return out


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "CPU"


def worker_plain(spec: dict) -> dict:
    """A plain PyTorch training loop, as one writes it by hand."""
    import math

    import torch
    import torch.nn.functional as F

    rank, world, device = _dist()
    s, steps, precision = spec["shape"], spec["steps"], spec["precision"]
    model = build_on(spec, device)
    model.train()
    if precision == "fp8":
        float8_blocks(model, device)
    if spec["compile"]:
        compile_blocks(model)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min((i + 1) / WARMUP_LR_STEPS,
                                                                 0.55 + 0.45 * math.cos(math.pi * i / steps)))
    dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(precision)
    gen = torch.Generator().manual_seed(SEED + rank)
    times, mems, last = [], [], time.perf_counter()
    for _ in range(steps):
        ids = torch.randint(s["vocab_size"], (s["mbs"], s["seq"] + 1), generator=gen)
        x, y = ids[:, :-1].to(device, non_blocking=True), ids[:, 1:].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the loop logs its loss: one host sync per step
        now = time.perf_counter()
        times.append(now - last)
        last = now
        mems.append(_mem_gib(device))
    tokens = s["mbs"] * s["seq"] * world
    return {"tokens_per_s": [tokens / t for t in times], "memory_gib": max(mems), "world": world}


def worker_hf(spec: dict) -> dict:
    """HF transformers' Trainer on the same model and batch; a callback times every step."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    rank, world, device = _dist()
    s, steps, precision = spec["shape"], spec["steps"], spec["precision"]
    model = build_on(spec, device)

    class Random(torch.utils.data.Dataset):
        def __init__(self, n: int):
            g = torch.Generator().manual_seed(SEED)
            self.ids = torch.randint(s["vocab_size"], (n, s["seq"]), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}  # the model shifts the labels itself

    times: list[float] = []
    mems: list[float] = []

    class Timer(TrainerCallback):
        last = 0.0

        def on_step_begin(self, args, state, control, **kw):
            if not self.last:
                self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)  # Trainer keeps its loss on the device between log steps: wait for the step itself
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now
            mems.append(_mem_gib(device))

    out = tempfile.mkdtemp(prefix="bench-hf-")
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=s["mbs"], max_steps=steps, learning_rate=LR,
        weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=1e-8, max_grad_norm=1.0,
        lr_scheduler_type="cosine", warmup_steps=WARMUP_LR_STEPS, optim="adamw_torch", logging_strategy="no",
        save_strategy="no", eval_strategy="no", report_to=[], use_cpu=device.type == "cpu", bf16=precision == "bf16",
        torch_compile=spec["compile"], dataloader_num_workers=0, disable_tqdm=True, seed=SEED,
        remove_unused_columns=False, skip_memory_metrics=True)
    trainer = Trainer(model=model, args=args, train_dataset=Random(steps * s["mbs"] * world), callbacks=[Timer()])
    trainer.train()
    shutil.rmtree(out, ignore_errors=True)
    tokens = s["mbs"] * s["seq"] * world
    return {"tokens_per_s": [tokens / t for t in times], "memory_gib": max(mems), "world": world}


def titan_config():
    """torchtitan's ``--config``: its trainer config for the Llama-3 model at this run's dimensions (read from the
    spec file named by ``SHARDYARD_BENCH_SPEC``): no activation checkpointing, plain cross-entropy (not its chunked
    loss), AdamW at the same lr/betas/decay in its ``foreach`` implementation, bf16 (or fp32) FSDP2 mixed precision,
    a random-token corpus through its own HF text data loader and a word-level tokenizer (one word per id)."""
    import dataclasses

    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init,
                                          model_registry)
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.trainer import Trainer

    spec = json.loads(Path(os.environ["SHARDYARD_BENCH_SPEC"]).read_text())
    s, fp8, compiled = spec["shape"], spec["precision"] == "fp8", spec["compile"]
    dim, heads, vocab = s["hidden_size"], s["num_heads"], s["vocab_size"]
    model = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(n_layers=s["num_layers"], dim=dim, n_heads=heads, n_kv_heads=s["num_kv_heads"],
                                    hidden_dim=s["intermediate_size"], attn_backend="flex",
                                    rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=max(2048, s["seq"]),
                                                            theta=10000.0)))
    if fp8:  # torchtitan 0.3.0's float8 recipe is rowwise (shardyard's and the plain loop's: tensorwise)
        from torchtitan.components.quantization import Float8LinearConverter

        fp8_config = Float8LinearConverter.Config(filter_fqns=["lm_head"], model_compile_enabled=compiled)
        model = fp8_config.build().convert(model)
    model_spec = dataclasses.replace(model_registry("debugmodel"), flavor=f"shardyard-bench-{spec['model']}",
                                     model=model)
    optimizer = default_adamw(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    optimizer.implementation = "foreach"
    return Trainer.Config(
        model_spec=model_spec, hf_assets_path=spec["titan_tokenizer"], dump_folder=spec["titan_dump"],
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab), optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=WARMUP_LR_STEPS),
        training=TrainingConfig(local_batch_size=s["mbs"], seq_len=s["seq"], steps=spec["steps"], max_norm=1.0,
                                mixed_precision_param="float32" if spec["precision"] == "fp32" else "bfloat16"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=spec["titan_data"]),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        activation_checkpoint=None, compile=CompileConfig(enable=compiled, components=["model", "loss"]))


def titan_assets(spec: dict, work: Path) -> None:
    """A word-level tokenizer (token ``t<i>`` is id ``i``) and a JSONL corpus of random ``t<i>`` words."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    s = spec["shape"]
    tok_dir, data_dir = work / "tokenizer", work / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(s["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tok_dir / "tokenizer.json"))
    rng, doc = random.Random(SEED), 8 * s["seq"]
    docs = max(4 * spec["world"], -(-(spec["steps"] + 2) * s["mbs"] * (s["seq"] + 1) * spec["world"] // doc))
    with open(data_dir / "train.jsonl", "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(f"t{rng.randrange(s['vocab_size'])}" for _ in range(doc))}) + "\n")
    spec.update(titan_tokenizer=str(tok_dir), titan_data=str(data_dir), titan_dump=str(work / "dump"))


# --------------------------------------------------------------------------------- runs (in the parent)
def _tail(text: str, n: int = 300) -> str:
    """What to print of a failed run: shardyard's own error paragraph, else the last lines."""
    lines = [ln for ln in text.splitlines() if ln.strip() and "Failed to load" not in ln]
    for i, ln in enumerate(lines):
        if ln.startswith("shardyard: error"):
            return " ".join(lines[i:i + 4])[:n]
    return " | ".join(lines[-3:])[-n:]


def _env(spec: dict, threads: int | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHARDYARD_BENCH_DEVICE": spec["device"],
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "bench"), str(ROOT / "src"),
                                                     os.environ.get("PYTHONPATH")) if p)}
    if threads:  # torchrun would set OMP_NUM_THREADS=1 for a world > 1
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _run(cmd: list[str], env: dict, timeout: float, cwd: str | None = None) -> tuple[int, str, float]:
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd or str(ROOT), capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -1, out + f"\ntimed out after {timeout:.0f} s", time.perf_counter() - t


def run_worker(kind: str, spec: dict, world: int, work: Path, timeout: float) -> dict:
    """This file as a subprocess (``--_run kind``), under torchrun when the world is > 1."""
    spec_file, out_file = work / f"{kind}-spec.json", work / f"{kind}-out.json"
    out_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({**spec, "out": str(out_file)}))
    me = [str(Path(__file__).resolve()), "--_run", kind, "--_spec", str(spec_file)]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *me]
           if world > 1 else [sys.executable, *me])
    threads = max(1, (os.cpu_count() or 1) // world) if spec["device"] == "cpu" and world > 1 else None
    rc, text, wall = _run(cmd, _env(spec, threads), timeout)
    if rc != 0 or not out_file.exists():
        return {"error": f"exit {rc}: {_tail(text)}", "wall_s": wall}
    return {**json.loads(out_file.read_text()), "wall_s": wall}


def run_shardyard(engine: str, spec: dict, world: int, work: Path, timeout: float, tag: str) -> dict:
    s = spec["shape"]
    run_dir = work / f"shardyard-{engine}-{tag}"
    procs = 1 if engine == "single" else world
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", f"backend={engine}",
           *model_overrides(s), f"data.seq_len={s['seq']}", f"train.micro_batch_size={s['mbs']}",
           "train.grad_accum_steps=1", f"train.steps={spec['steps']}", "train.log_every_n_steps=1",
           "train.eval_every_n_steps=0", "train.eval_batches=1", "train.sample_tokens=0", f"seed={SEED}",
           f"optim.lr={LR}", f"optim.weight_decay={WEIGHT_DECAY}", f"sched.warmup_steps={WARMUP_LR_STEPS}",
           "checkpoint.save_final=false", "monitor=[console]", "monitor.console.style=plain",
           f"precision={spec['precision']}", f"launch.nproc_per_node={procs}"]
    if spec["device"] == "cuda":
        cmd.append("backend.device=cuda")
    if spec["compile"]:
        cmd.append("model.compile=true")
    rc, text, wall = _run(cmd, _env(spec), timeout)
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        return {"error": f"exit {rc}: {_tail(text)}", "wall_s": wall}
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if '"tokens_per_s"' in ln]
    key = "memory/max_allocated_gib" if spec["device"] == "cuda" else "memory/rss_gib"
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"tokens_per_s": [r["tokens_per_s"] for r in sorted(rows, key=lambda r: r["step"])],
            "memory_gib": max((r.get(key, 0.0) for r in rows), default=float("nan")), "world": procs, "wall_s": wall}


TITAN_LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")


def run_titan(spec: dict, world: int, work: Path, timeout: float) -> dict:
    twork = work / "torchtitan"
    shutil.rmtree(twork / "dump", ignore_errors=True)
    if "titan_data" not in spec:
        titan_assets(spec, twork)
    spec_file = twork / "spec.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "-m", "torchtitan.train", "--module", "throughput", "--config", "titan_config"]
    env = {**_env(spec), "SHARDYARD_BENCH_SPEC": str(spec_file)}
    rc, text, wall = _run(cmd, env, timeout, cwd=str(twork))
    found = {int(m[1]): (float(m[2]), float(m[3].replace(",", ""))) for m in TITAN_LINE.finditer(text)}
    if rc != 0 or not found:
        return {"error": f"exit {rc}: {_tail(text)}", "wall_s": wall}
    # its tps is per device (local tokens / time); memory: its max_reserved (it logs no allocated figure)
    return {"tokens_per_s": [found[k][1] * world for k in sorted(found)],
            "memory_gib": max(v[0] for v in found.values()), "world": world, "wall_s": wall}


# -------------------------------------------------------------------------------------------- report
def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def report(a, spec: dict, info: dict, names: list[str], results: dict, skipped: list[str], wall: float) -> None:
    s, world, cpu = spec["shape"], spec["world"], spec["device"] == "cpu"
    fpt, measured, table = info["flops_per_token"], info["measured_peak"], info["table_peak"]
    rows = {}
    for name in names:
        runs = [r for r in results[name] if "tokens_per_s" in r]
        if runs:
            per_run = [statistics.median(r["tokens_per_s"][a.warmup:] or r["tokens_per_s"][-1:]) / r["world"]
                       for r in runs]
            rows[name] = {"tps": statistics.median(per_run), "mem": max(r["memory_gib"] for r in runs),
                          "world": runs[0]["world"]}
    how = "processes" if a.world else "every visible GPU" if not cpu else "1 process on a CPU"
    attention = 12 * s["num_layers"] * s["hidden_size"] * s["seq"]  # H x Q = hidden (full-width heads)
    print(f"\nbench/throughput.py: {spec['model']} ({info['params'] / 1e6:,.1f}M parameters: hidden "
          f"{s['hidden_size']}, {s['num_layers']} layers, {s['num_heads']} heads ({s['num_kv_heads']} kv), "
          f"intermediate {s['intermediate_size']}, vocab {s['vocab_size']}), {spec['precision']}"
          f"{', compiled' if spec['compile'] else ''}, on {spec['device'].upper()}: {info['device_name']} "
          f"({os.cpu_count()} cores, torch {info['torch']}, transformers {info['transformers']})")
    print(f"  micro-batch {s['mbs']} x seq {s['seq']} = {s['mbs'] * s['seq']:,} tokens per step per process; world "
          f"size {world} ({how}; shardyard single: 1) -> {s['mbs'] * s['seq'] * world:,} tokens per step; {a.steps} "
          f"steps per run, the first {a.warmup} dropped, {a.rounds} round(s) alternating; median of the per-step "
          f"figures, then over rounds")
    print(f"  FLOPs per token: shardyard.models.shape.flops_per_token = 6N + 12*L*H*Q*T (PaLM appendix B; attention "
          f"included, N without the input embedding) = 6 x {(fpt - attention) / 6 / 1e6:,.2f}M + 12 x "
          f"{s['num_layers']} x {s['num_heads']} x {s['hidden_size'] // s['num_heads']} x {s['seq']} = "
          f"{fpt / 1e9:,.4f} GFLOP")
    shared = " (on a CPU, per process: the peak over the processes sharing its cores)" if cpu and world > 1 else ""
    print(f"  peak per device: measured {measured:,.2f} TFLOP/s (shardyard.training.metrics.measured_peak_tflops, "
          f"{spec['precision']} matmul); data sheet {_fmt(table, ',.1f')} TFLOP/s (shardyard.training.metrics.peak_tflops"
          f"{'' if table else '; none for a CPU'}). MFU = tokens/s per device x FLOPs per token / measured peak"
          f"{shared}")
    memory = "peak RSS GiB" if cpu else "peak allocated GiB"
    base = rows.get("shardyard single", {}).get("tps")
    head = (f"  {'approach':<26}{'tok/s/device':>14}{'MFU':>9}" + (f"{'MFU sheet':>11}" if table else "")
            + f"{memory:>20}{'x sy single':>13}{'x sy peer':>11}")
    print("\n" + head + "\n  " + "-" * (len(head) - 2))
    for name in (n for n in names if n in rows):
        r = rows[name]
        peer = _peer(name, world)
        vs_peer = _fmt(r["tps"] / rows[peer]["tps"], ".3f") if peer in rows and peer != name else "-"
        # a CPU's cores are shared by its processes: one process's peak is the measured one over their number
        mfu = r["tps"] * fpt / (measured * 1e12 / (r["world"] if cpu else 1))
        label = name + (f" x{r['world']}" if r["world"] > 1 else "")
        print(f"  {label:<26}{r['tps']:>14,.0f}{100 * mfu:>8.2f}%"
              + (f"{100 * r['tps'] * fpt / (table * 1e12):>10.2f}%" if table else "")
              + f"{r['mem']:>20.2f}{_fmt(r['tps'] / base if base else None, '.3f'):>13}{vs_peer:>11}"
              + ("   (memory: its max reserved)" if name == LABEL["torchtitan"] else ""))
    for name in names:
        failed = [r for r in results[name] if "error" in r]
        if failed:
            print(f"  {name}: failed ({len(failed)} of {len(results[name])} runs): {failed[0]['error']}")
    for line in skipped:
        print(f"  {line}")
    print(f"  load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; at the start: "
          f"{spec['load_start']:.2f} (other processes on the machine slow every approach, unevenly)")
    what = "RSS at each step end (the whole process: interpreter, torch, data)" if cpu else \
        "torch.cuda.max_memory_allocated"
    print(f"  x sy peer: against shardyard {'ddp (plain, HF: DDP)' if world > 1 else 'single (plain, HF)'}, fsdp "
          f"(torchtitan: FSDP2). Memory: {what}, the highest of the runs. Wall time of the bench: {wall:.0f} s")


def _peer(name: str, world: int) -> str:
    if name == "torchtitan 0.3.0":
        return "shardyard fsdp"
    if name in (LABEL["plain"], LABEL["hf"]):
        return "shardyard ddp" if world > 1 else "shardyard single"
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="steps per run (default 10 on CPU, 20 on CUDA)")
    ap.add_argument("--rounds", type=int, help="alternating rounds (default 1 on CPU, 3 on CUDA)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps of every run left out (default 3)")
    ap.add_argument("--model", choices=sorted(SHAPES), help="default: tiny on CPU, 1b on CUDA")
    ap.add_argument("--seq", type=int, help="sequence length (default: tiny 128, 1b 2048)")
    ap.add_argument("--mbs", type=int, help="micro-batch per process (default: tiny 8, 1b 4)")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp8"], help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--engines", default=ENGINES, help=f"shardyard engines (default {ENGINES})")
    ap.add_argument("--approaches", default=",".join(APPROACHES), help="subset of " + ",".join(APPROACHES))
    ap.add_argument("--world", type=int, help="processes (default: every visible GPU; 1 on CPU)")
    ap.add_argument("--compile", action="store_true", help="model.compile=true / regional compile / torch_compile")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run before it counts as failed")
    ap.add_argument("--_run", help=argparse.SUPPRESS)
    ap.add_argument("--_spec", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._run:  # a worker
        spec = json.loads(Path(a._spec).read_text())
        res = {"info": worker_info, "plain": worker_plain, "hf": worker_hf}[a._run](spec)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(spec["out"]).write_text(json.dumps(res))
        return

    t_start = time.perf_counter()
    import importlib.util

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a.model = a.model or ("1b" if device == "cuda" else "tiny")
    a.steps = a.steps or (20 if device == "cuda" else 10)
    a.rounds = a.rounds or (3 if device == "cuda" else 1)
    a.warmup = max(0, min(a.warmup, a.steps - 1))
    shape = {**SHAPES[a.model]}
    shape.update({k: v for k, v in (("seq", a.seq), ("mbs", a.mbs)) if v})
    world = a.world or (torch.cuda.device_count() if device == "cuda" else 1)
    spec = {"model": a.model, "shape": shape, "steps": a.steps, "precision": a.precision or
            ("bf16" if device == "cuda" else "fp32"), "compile": a.compile, "device": device, "world": world,
            "load_start": os.getloadavg()[0]}

    wanted = [x.strip() for x in a.approaches.split(",") if x.strip()]
    names, skipped = [], []
    if "shardyard" in wanted:
        names += [f"shardyard {e.strip()}" for e in a.engines.split(",") if e.strip()]
    if "plain" in wanted:
        names.append(LABEL["plain"])
    if "hf" in wanted:
        if spec["precision"] == "fp8":
            skipped.append("HF Trainer: not run at fp8: TrainingArguments has no float8 switch (accelerate's "
                           "fp8 recipes are a configuration of their own).")
        else:
            names.append(LABEL["hf"])
    if "torchtitan" in wanted:
        if device != "cuda":
            skipped.append("torchtitan: not run: it trains on CUDA only (this device is a CPU); its line comes "
                           "from a GPU machine.")
        elif importlib.util.find_spec("torchtitan") is None:
            skipped.append("torchtitan: not run: not installed (pip install -e .[bench], torchtitan==0.3.0).")
        else:
            names.append(LABEL["torchtitan"])

    work = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    print(f"bench/throughput.py: {a.model} {spec['precision']} on {device} (world {world}), {len(names)} approaches "
          f"x {a.rounds} round(s) x {a.steps} steps; work dir {work}", flush=True)
    info = run_worker("info", spec, 1, work, a.timeout)
    if "error" in info:
        print(f"could not measure the model and the device: {info['error']}")
        return
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        for name in order:
            if name.startswith("shardyard "):
                res = run_shardyard(name.split(" ", 1)[1], spec, world, work, a.timeout, f"r{r}")
            elif name == LABEL["plain"]:
                res = run_worker("plain", spec, world, work, a.timeout)
            elif name == LABEL["hf"]:
                res = run_worker("hf", spec, world, work, a.timeout)
            else:
                res = run_titan(spec, world, work, a.timeout)
            results[name].append(res)
            if "error" in res:
                print(f"  round {r + 1}: {name:<24} failed after {res['wall_s']:.1f} s: {res['error'][:160]}",
                      flush=True)
            else:
                tps = statistics.median(res["tokens_per_s"][a.warmup:] or res["tokens_per_s"][-1:])
                print(f"  round {r + 1}: {name:<24} {tps:>12,.0f} tok/s  {res['memory_gib']:.2f} GiB  "
                      f"({res['wall_s']:.1f} s)", flush=True)
    # A peak is a maximum: measured again now that nothing else of ours runs (noise only lowers it).
    from shardyard.training.metrics import measured_peak_tflops

    again = measured_peak_tflops(torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"),
                                 spec["precision"])
    info["measured_peak"] = max(info["measured_peak"], again)
    report(a, spec, info, names, results, skipped, time.perf_counter() - t_start)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # a benchmark prints what went wrong and exits 0
        import traceback

        traceback.print_exc()
        print(f"bench/throughput.py: stopped: {type(e).__name__}: {e}")
    sys.exit(0)
