"""``model=hf model.path=DIR`` trains any local ``AutoModelForCausalLM`` directory: architectures the test creates
with ``save_pretrained`` (Qwen2 with weights and its own tokenizer, Mistral and GPT-2 as configs only)."""

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from shardyard.testing import TINY, compose, hf_eval_loss, run_many

VOCAB = 512


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small real corpus (standard-library sources as .txt files): tokenizing it takes a second."""
    out = tmp_path_factory.mktemp("corpus")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    for f in files:
        (out / f"{f.stem}.txt").write_text(f.read_text(encoding="utf-8", errors="replace"))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory, corpus):
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from transformers import (AutoModelForCausalLM, GPT2Config, MistralConfig, PreTrainedTokenizerFast,
                              Qwen2Config)

    root = tmp_path_factory.mktemp("hf")
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    configs = {"qwen2": Qwen2Config(**small), "mistral": MistralConfig(**small),
               "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)}
    for name, config in configs.items():
        config.save_pretrained(root / name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(configs["qwen2"]).save_pretrained(root / "qwen2")  # weights too
    # Qwen2's directory carries its own tokenizer (300 tokens, trained here): the run must use it.
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([p.read_text() for p in sorted(corpus.glob("*.txt"))],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eot|>"], show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eot|>", pad_token="<|eot|>").save_pretrained(root / "qwen2")
    return root


def overrides(models, corpus, name, tmp):
    return [*[o for o in TINY if not o.startswith("model.")], "model=hf", f"model.path={models / name}",
            "data=text_files", f"data.paths=[{corpus}]", f"data.tokenizer.vocab_size={VOCAB}",
            f"data.cache_dir={tmp}/cache", "backend=single", "train.steps=4", "train.eval_every_n_steps=0",
            "optim.lr=3e-3", "sched.warmup_steps=0", "checkpoint.save_final=true"]


def test_three_architectures_train_from_local_directories(models, corpus, tmp_path):
    names = ["qwen2", "mistral", "gpt2"]
    jobs = [(overrides(models, corpus, n, tmp_path), str(tmp_path / n)) for n in names]
    results = run_many(1, jobs)
    from transformers import AutoConfig

    for name, (ov, run_dir), (rank0,) in zip(names, jobs, results):
        s = rank0["summary"]
        losses = [v for _, v in s["train_losses"]]
        assert len(losses) == 4 and losses[-1] < losses[0], (name, losses)
        want = AutoConfig.from_pretrained(models / name)
        assert json.load(open(Path(run_dir, "hf", "config.json")))["model_type"] == want.model_type
        # The export holds the trained weights, each where its architecture reads it (not a parameter count,
        # which missing keys filled at random, untrained weights or GPT-2's square c_proj transposed keep).
        engine_loss = s["eval_losses"][-1][1]
        got = hf_eval_loss(str(Path(run_dir, "hf")), compose(ov, run_dir), 1)
        assert abs(got - engine_loss) <= 1e-4 * engine_loss, (name, got, engine_loss)
    # Qwen2's weights were loaded: the run's step-0 evaluation is the saved model's own loss on the same data.
    cfg = compose(overrides(models, corpus, "qwen2", tmp_path), run_dir=str(tmp_path / "qwen2"))
    step0 = results[0][0]["summary"]["eval_losses"][0]
    assert step0[0] == 0 and abs(step0[1] - hf_eval_loss(str(models / "qwen2"), cfg, 1)) < 1e-5
    # ... and its own tokenizer tokenized the data (the export carries it); the others trained a BPE of VOCAB.
    qwen_tok = json.load(open(tmp_path / "qwen2" / "hf" / "tokenizer.json"))
    assert len(qwen_tok["model"]["vocab"]) == 300 == len(json.load(open(models / "qwen2" / "tokenizer.json"))["model"]["vocab"])
    assert len(json.load(open(tmp_path / "gpt2" / "hf" / "tokenizer.json"))["model"]["vocab"]) > 300


def test_a_config_only_directory_with_a_bigger_tokenizer_is_refused(models, corpus, tmp_path):
    from shardyard.data import pipeline as data
    from shardyard.planning.validate import validate
    from shardyard.core.errors import UserError

    small = tmp_path / "small"
    shutil.copytree(models / "mistral", small)
    cfg_json = json.load(open(small / "config.json"))
    cfg_json["vocab_size"] = 100
    json.dump(cfg_json, open(small / "config.json", "w"))
    cfg = compose([*overrides(models, corpus, "mistral", tmp_path), f"model.path={small}"])
    plan = validate(cfg, None)
    with pytest.raises(UserError) as e:
        data.prepare(cfg, plan.model.embedding_rows)
    assert "100 embedding rows" in e.value.paragraph()
