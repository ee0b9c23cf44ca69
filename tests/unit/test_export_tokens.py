"""Issue 53, point 1: the special tokens of a model's config are its tokenizer's. The builders' HF configs keep
transformers' defaults for their family (LLaMA and DeepSeek-V2: bos 1, eos 2; DeepSeek-V3: bos 0, eos 1) unless
told; shardyard's byte-level BPE tokenizers put ``<|endoftext|>`` at 0 and ``!``, ``"`` at 1 and 2. Every export's
``config.json`` and ``generation_config.json`` say ``tokenizer.json``'s ids, transformers' ``generate`` then ends
exactly at the tokenizer's end token, and an export written before (with the defaults) loads with a one-line
warning and the tokenizer's ids."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from conftest import Whole, byte_bpe, generation_ends_at_the_tokenizers_eos

from shardyard.training import export
from shardyard.inference import loading as inference
from shardyard.models.build import SpecialTokens, build_model, use_special_tokens

EOT = "<|endoftext|>"
SHAPES = {
    "llama": dict(_target_="shardyard.models.build.llama", hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4),
    **{family: dict(_target_=f"shardyard.models.build.{family}", hidden_size=64, intermediate_size=176, num_layers=2,
                    num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                    first_k_dense_replace=1) for family in ("deepseek_v2", "deepseek_v3")}}
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """Laid out as shardyard's own BPE tokenizers are (``token_cache._train_tokenizer``): ``<|endoftext|>`` at 0 is
    bos, eos and pad; ``!`` and ``"`` are 1 and 2."""
    tok = byte_bpe("def main():\n    return print('hello, world!')\n" * 4)
    tok.bos_token = EOT
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(str(path))
    assert tok.convert_ids_to_tokens([0, 1, 2]) == [EOT, "!", '"']
    return str(path)


def _model(family: str, **keys):
    m = {**SHAPES[family], "name": family, "vocab_size": 300, **keys}
    return OmegaConf.create(m)


def _ids(path) -> list[dict]:
    return [{k: json.loads((path / f).read_text()).get(k) for k in IDS}
            for f in ("config.json", "generation_config.json")]


@pytest.mark.parametrize("family", list(SHAPES))
def test_an_export_says_the_tokenizers_special_tokens_and_generate_ends_at_its_eos(family, tokenizer_dir, tmp_path):
    """A model built as an older worker built it (its family's defaults), exported both ways: the rank-0 writer
    (``save_pretrained``) and the holders' config writer (``_save_config``)."""
    from transformers import AutoTokenizer

    mtp = {"mtp": dict(depth=1, weight=0.3, final_weight=None, final_weight_from_step=None)} \
        if family == "deepseek_v3" else {}
    model = build_model(_model(family, **mtp), seed=0)
    assert model.generation_config.eos_token_id in (1, 2)  # transformers' default: "!" or '"' in this vocabulary
    export.save_hf(Whole(model), tokenizer_dir, str(tmp_path / "hf"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    want = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    assert want == dict.fromkeys(IDS, 0)
    assert _ids(tmp_path / "hf") == [want, want]
    generation_ends_at_the_tokenizers_eos(tmp_path / "hf")

    again = build_model(_model(family, **mtp), seed=0)
    (tmp_path / "config").mkdir()
    export._save_config(again, str(tmp_path / "config"), SpecialTokens.of(tok))
    assert _ids(tmp_path / "config") == [want, want]


def test_the_builder_takes_the_tokenizers_ids_and_keeps_only_special_end_tokens(tokenizer_dir):
    """What a worker builds (``build_model(..., tokens=)``, every family through ``call_builder``); a config's list
    of end tokens (a chat model's end of turn beside its eos) keeps those the tokenizer calls special."""
    from transformers import AutoTokenizer

    tokens = SpecialTokens.of(AutoTokenizer.from_pretrained(tokenizer_dir))
    assert tokens == SpecialTokens(0, 0, 0, frozenset({0}))
    for family in SHAPES:
        model = build_model(_model(family), seed=0, tokens=tokens)
        for config in (model.config, model.generation_config):
            assert [getattr(config, k) for k in IDS] == [0, 0, 0], family
        assert use_special_tokens(model, tokens) == []  # agrees: nothing to change
    chat = SpecialTokens(bos=7, eos=8, pad=None, special=frozenset({7, 8, 9}))
    model.generation_config.eos_token_id = [9, 2, 8]  # 9: end of turn, special; 2: not
    model.generation_config.pad_token_id = 9
    changed = use_special_tokens(model, chat)
    g = model.generation_config
    assert (g.bos_token_id, g.eos_token_id, g.pad_token_id) == (7, [9, 8], 9)
    assert changed == ["bos_token_id 0 -> 7", "eos_token_id 0 -> 8", "pad_token_id 0 -> None"]
    assert (model.config.eos_token_id, model.config.pad_token_id) == (8, None)  # the config: 0, not special here


def test_an_export_written_before_loads_with_the_tokenizers_ids_and_one_warning(tokenizer_dir, tmp_path, capsys):
    """An export whose config.json and generation_config.json say LLaMA's defaults (as every export did before):
    ``inference.load`` (``shardyard generate``/``eval``) warns in one line and ends completions at the tokenizer's
    eos only; a fresh export loads without a word."""
    from shardyard.inference.generate import eos_ids

    export.save_hf(Whole(build_model(_model("llama"), seed=0)), tokenizer_dir, str(tmp_path / "hf"))
    capsys.readouterr()
    fresh = inference.load(str(tmp_path / "hf"))
    assert capsys.readouterr().err == ""
    for name in ("config.json", "generation_config.json"):
        f = tmp_path / "hf" / name
        f.write_text(json.dumps({**json.loads(f.read_text()), "bos_token_id": 1, "eos_token_id": 2}))
    old = inference.load(str(tmp_path / "hf"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err and "eos_token_id 2 -> 0" in err and "bos_token_id 1 -> 0" in err
    for trained in (fresh, old):
        g = trained.model.generation_config
        assert (g.bos_token_id, g.eos_token_id, g.pad_token_id) == (0, 0, 0)
        assert trained.model.config.eos_token_id == 0
        assert eos_ids(trained.tokenizer, trained.model) == [0]
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(old.model(ids).logits, fresh.model(ids).logits)
