"""QLoRA's path (issue 15), proven on CPU: bitsandbytes 0.50 has CPU kernels for its 4-bit layers, so the drill
SHARDYARD_TEST_QLORA_ON_CPU lifts the CPU refusal users get, and the real path runs: the loaded base quantised to
NF4, LoRA adapters trained on single and DDP (equal within 1e-4), the merged export (dequantised + B A) scoring
the eval set as the engine did. The CUDA run is in the gpu tier."""

import pytest
import torch

from shardyard.planning.validate import validate
from shardyard.core.errors import UserError
from shardyard.testing import TINY, compose, hf_eval_loss, run_many

import bitsandbytes  # noqa: E402,F401  (the finetune extra: make setup installs it; no skip)

# bitsandbytes 0.50 repacks 4-bit weights for its AVX512-BF16 CPU kernels when it evaluates without gradients,
# and asserts that each layer's output features divide by 32 (`_convert_weight_packed_for_cpu`): TINY's
# intermediate size of 176 fails on such CPUs (AMD EPYC here), 192 does not.
MODEL = [o for o in TINY if not o.startswith("model.intermediate_size")] + ["model.intermediate_size=192"]
BASE = [o for o in MODEL if not o.startswith("data.seq_len")]
QL = ["data=sft", "data.seq_len=128", "peft=qlora", "peft.r=4", "peft.dropout=0.0", "optim.lr=1e-2",
      "train.eval_every_n_steps=0", "train.global_batch_size=8", "train.steps=5", "checkpoint.save_final=true"]


def test_qlora_is_refused_on_cpu_and_on_sharding_engines():
    from shardyard.planning.validate import device_type

    # This tier runs on CPU on every machine (tests/conftest.py hides the GPUs); tests/gpu checks that a GPU
    # machine accepts peft=qlora.
    assert device_type(compose(["peft=qlora"])) == "cpu"
    with pytest.raises(UserError) as e:
        validate(compose(["peft=qlora"]), None)
    assert e.value.key == "peft" and "CUDA" in e.value.paragraph()
    with pytest.raises(UserError) as e:
        validate(compose(["peft=qlora", "backend=fsdp"]), None)
    assert e.value.key == "peft" and "backend=single or backend=ddp" in e.value.paragraph()


def test_qlora_trains_a_4bit_base_on_single_and_ddp(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDYARD_TEST_QLORA_ON_CPU", "1")  # the spawned ranks inherit it
    run_many(1, [([*MODEL, "backend=single", "train.steps=2", "train.eval_every_n_steps=0",
                   "checkpoint.save_final=true"], str(tmp_path / "pre"))])
    ql = [*BASE, *QL, f"model.weights={tmp_path / 'pre' / 'hf'}"]
    single = run_many(1, [([*ql, "backend=single"], str(tmp_path / "single"))])[0][0]
    ddp = run_many(2, [([*ql, "backend=ddp"], str(tmp_path / "ddp"))])[0]
    losses = [v for _, v in single["summary"]["train_losses"]]
    assert losses[-1] < losses[0], losses
    full = single["full"]
    q = next(k for k in full if k.endswith("q_proj.base_layer.weight"))
    assert full[q].dtype == torch.uint8  # the frozen base really is packed 4-bit
    for r in ddp:
        for key in ("train_losses", "grad_norms"):
            got, ref = [v for _, v in r["summary"][key]], [v for _, v in single["summary"][key]]
            assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-4, (key, got, ref)
    cfg = compose([*ql, "backend=single"], str(tmp_path / "single"))
    got = hf_eval_loss(str(tmp_path / "single" / "hf"), cfg, 1)
    assert abs(got - single["summary"]["eval_losses"][-1][1]) <= 1e-4 * got
    assert (tmp_path / "single" / "adapter" / "adapter_model.safetensors").exists()
