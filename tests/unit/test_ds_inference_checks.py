"""engine=deepspeed's refusals (shardyard.inference.ds_inference.check, wrap): each a UserError naming ``tp_size``,
``engine`` or ``dtype`` with the value and the fix; and at tp 1, in this process, DeepSpeed's inference engine
generates greedily the tokens of transformers' own ``generate`` (tp 2: tests/dist/test_ds_inference.py)."""

import sys

import pytest
import torch
from transformers import LlamaConfig

from shardyard.inference import ds_inference
from shardyard.core.errors import UserError

PAD = 0


def _config(heads: int, kv_heads: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=16 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads)


def _refusal(*args) -> UserError:
    with pytest.raises(UserError) as err:
        ds_inference.check(*args)
    return err.value


def test_a_tp_size_not_sharing_the_heads_equally_is_refused_with_the_sizes_that_do():
    ds_inference.check(2, _config(8, 2), "cpu")  # divides both: accepted
    err = _refusal(4, _config(8, 2), "cpu")  # divides the 8 query heads, not the 2 key/value heads
    assert (err.key, err.value) == ("tp_size", 4)
    assert "8 attention heads and 2 key/value heads" in err.problem and err.fix.endswith("one of [1, 2].")
    err = _refusal(4, _config(6, 6), "cpu")
    assert (err.key, err.value) == ("tp_size", 4) and err.fix.endswith("one of [1, 2, 3, 6].")
    assert _refusal(0, _config(8, 8), "cpu").key == "tp_size"


def test_more_ranks_than_visible_gpus_and_a_plain_module_at_tp_2_are_refused():
    # The CPU tiers hide the GPUs (tests/conftest.py): none is visible here.
    assert torch.cuda.device_count() == 0
    err = _refusal(2, _config(8, 8), "cuda")
    assert (err.key, err.value) == ("tp_size", 2) and "0 GPU(s) are visible" in err.problem
    assert "device=cpu" in err.fix
    ds_inference.check(2, _config(8, 8), "cpu")  # the same on CPU: ranks over gloo
    err = _refusal(2, None, "cpu")
    assert err.key == "tp_size" and "plain torch module" in err.problem
    ds_inference.check(1, None, "cpu")  # tp 1 needs no heads to split


def test_engine_deepspeed_without_deepspeed_or_on_another_device_is_refused(monkeypatch):
    err = _refusal(1, _config(8, 8), "mps")  # DeepSpeed installed: a device it does not run on here
    assert (err.key, err.value) == ("engine", "deepspeed") and "'mps'" in err.problem
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # Python's own "not importable" marker
    err = _refusal(1, _config(8, 8), "cpu")
    assert (err.key, err.value) == ("engine", "deepspeed") and "not installed" in err.problem
    assert "engine=hf" in err.fix


def _tiny_llama() -> torch.nn.Module:
    from shardyard.models.build import llama

    torch.manual_seed(0)
    return llama(vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2,
                 initializer_range=0.2).eval()


def test_tp1_in_process_generates_the_tokens_of_transformers_generate():
    from deepspeed.inference.engine import InferenceEngine

    from shardyard.models.generation import generate

    model = _tiny_llama()
    ids = torch.tensor([[PAD, PAD, 5, 9, 11], [7, 3, 200, 41, 8]])
    mask = (ids != PAD).long()
    model.generation_config.eos_token_id = None
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=True,
                          pad_token_id=PAD)[:, ids.size(1):]
    got = []
    ds_inference.run_ranks(1, lambda: got.append(ds_inference.wrap(model, tp_size=1, dtype=torch.float32)))
    engine = got[0]
    assert isinstance(engine, InferenceEngine) and engine.module is model
    tokens, _ = generate(engine, ids, mask, max_new_tokens=8, temperature=0.0, eos_id=None, pad_id=PAD)
    assert torch.equal(tokens, want), (tokens, want)


def test_a_dtype_the_accelerator_does_not_take_is_refused_naming_dtype():
    with pytest.raises(UserError) as err:
        ds_inference.wrap(_tiny_llama(), tp_size=1, dtype=torch.float64)
    assert (err.value.key, err.value.value) == ("dtype", "float64") and "float32" in err.value.fix
