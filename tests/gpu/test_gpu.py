"""GPU tier: nccl and the fp16 paths (loss scaling) of every engine. Marked ``gpu``; skipped without CUDA."""

import json

import pytest
import torch

from conftest import TINY, train_py

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
N = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0
RUN = [*TINY, "train.steps=8", "train.eval_every_n_steps=0", "optim.lr=3e-3", f"launch.nproc_per_node={N}"]


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero2", "zero3"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_gpu(engine, precision, tmp_path):
    proc = train_py(*RUN, f"backend={engine}", f"precision={precision}", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "train/loss" in line]
    assert metrics[-1]["train/loss"] < metrics[0]["train/loss"] - 0.3
    assert ("loss_scale" in metrics[-1]) == (precision == "fp16")


def test_nccl_ddp_matches_single_gpu(tmp_path):
    steps = [*TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8"]
    a = train_py(*steps, "backend=single", "backend.device=cuda", run_dir=tmp_path / "a")
    b = train_py(*steps, "backend=ddp", f"launch.nproc_per_node={N}", run_dir=tmp_path / "b")
    assert a.returncode == b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    la, lb = ([x for _, x in json.load(open(tmp_path / d / "summary.json"))["train_losses"]] for d in "ab")
    assert max(abs(x - y) / y for x, y in zip(la, lb)) <= 1e-4, (la, lb)


def test_mfu_and_cuda_memory_are_reported(tmp_path):
    proc = train_py(*TINY, "backend=single", "backend.device=cuda", "precision=bf16", "train.steps=6",
                    "train.eval_every_n_steps=0", "profile.enabled=true", "profile.steps=[3,4]", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "train/loss" in line][-1]
    from shardyard.metrics import peak_tflops

    peak = peak_tflops(torch.device("cuda", 0), "bf16", None)
    if peak is not None:  # a GPU of the peak table (A100, H100, H200)
        assert 0 < last["mfu"] < 1 and last["mfu"] == pytest.approx(last["tflops_per_device"] / peak)
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
    proc = train_py(*BIG, f"backend={engine}", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.load(open(tmp_path / "summary.json"))
    print(f"\n{engine}: measured {s['memory_peak_bytes'] / 2**30:.2f} GiB, plan {s['memory_plan_bytes'] / 2**30:.2f} GiB")
    assert 0.95e9 < s["params"] < 1.1e9
    assert "plan per GPU rank" in proc.stdout and "measured max_memory_allocated" in proc.stdout
    assert s["memory_peak_bytes"] == pytest.approx(s["memory_plan_bytes"], rel=0.15), \
        (engine, s["memory_peak_bytes"] / 2**30, s["memory_plan_bytes"] / 2**30)


def test_qlora_on_one_gpu(tmp_path):
    """peft=qlora as its recipe runs it: a 4-bit NF4 base (bitsandbytes) with bf16 LoRA adapters on CUDA, from a
    pre-trained export; the assistant-token eval loss falls and the merged export loads."""
    pytest.importorskip("bitsandbytes")
    pre = train_py(*TINY, "backend=single", "backend.device=cuda", "train.steps=30", "optim.lr=3e-3",
                   "train.eval_every_n_steps=0", "checkpoint.save_final=true", run_dir=tmp_path / "pre")
    assert pre.returncode == 0, pre.stderr[-3000:]
    shape = [o for o in TINY if not o.startswith("data.seq_len")]
    ft = train_py(*shape, "backend=single", "backend.device=cuda", "precision=bf16", "data=sft", "data.seq_len=256",
                  "peft=qlora", f"model.weights={tmp_path / 'pre' / 'hf'}", "train.steps=30", "optim.lr=1e-2",
                  "train.eval_every_n_steps=15", "checkpoint.save_final=true", run_dir=tmp_path / "ft")
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    evals = json.load(open(tmp_path / "ft" / "summary.json"))["eval_losses"]
    assert evals[-1][1] < evals[0][1], evals
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "ft" / "hf", local_files_only=True)
    assert (tmp_path / "ft" / "adapter" / "adapter_config.json").exists()
