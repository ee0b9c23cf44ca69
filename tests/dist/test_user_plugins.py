"""A user's own project plugs in by ``_target_`` without forking shardyard: a package written into a temp dir
(on PYTHONPATH) with a model builder (an HF ``PreTrainedModel``, and a plain ``nn.Module``), a document source
and an optimizer factory, plus its own config group files (``hydra.searchpath``). It trains on single, ddp,
fsdp and zero2 (2 ranks) and every engine reproduces the single-process losses; the HF model's export loads."""

import json
import textwrap

import pytest
import torch

from conftest import train_py
from shardyard.testing import TINY, run_many

PACKAGE = '''
"""A user's project: nothing here imports shardyard."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def gpt2(vocab_size: int, width: int, layers: int, heads: int):
    """Any PreTrainedModel: here GPT-2 from its config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=width, n_layer=layers, n_head=heads,
                                      n_positions=256, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.out(y)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A plain nn.Module meeting shardyard.models.build.CausalLM: forward(input_ids) -> logits, blocks in a ModuleList."""

    def __init__(self, vocab_size: int, width: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.zeros(256, width))
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def tiny_lm(vocab_size: int, width: int, layers: int, heads: int):
    return TinyLM(vocab_size, width, layers, heads)


def corpus(documents: int):
    """A document source that is just a list of texts."""
    ops = ["+", "-", "*", "//", "%"]
    return [f"def f{i}(x, y):\\n    return (x {ops[i % 5]} y) {ops[(i * 3) % 5]} {i % 17}\\n" * 3 for i in range(documents)]


def sgd(params, lr: float, weight_decay: float, momentum: float = 0.0):
    """An optimizer factory (not a torch.optim class): DeepSpeed receives the built object."""
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=momentum)
'''

PLUGIN = "defaults:\n  - /schema_{group}_plugin@_here_\n  - _self_\n"  # shardyard's keys typed, the rest for _target_
CONF = {
    "model/user_gpt2.yaml": PLUGIN.format(group="model") + "_target_: userproj.gpt2\nname: user_gpt2\n"
                                                           "vocab_size: 512\nwidth: 64\nlayers: 2\nheads: 4\n",
    # No defaults list at all: shardyard fills its own keys in with their defaults.
    "model/user_tiny.yaml": "_target_: userproj.tiny_lm\nname: user_tiny\nvocab_size: 512\nwidth: 64\nlayers: 2\nheads: 4\n",
    "data/user_corpus.yaml": PLUGIN.format(group="data") + "_target_: userproj.corpus\ndocuments: 400\n",
    "optim/user_sgd.yaml": "_target_: userproj.sgd\nlr: 0.05\nweight_decay: 0.0\nmomentum: 0.9\n",
}


@pytest.fixture(scope="module")
def project(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("userproj")
    (root / "userproj").mkdir()
    (root / "userproj" / "__init__.py").write_text(textwrap.dedent(PACKAGE))
    for rel, text in CONF.items():
        (root / "conf" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "conf" / rel).write_text(text)
    monkeypatch_module.setenv("PYTHONPATH", str(root))  # spawned ranks and subprocesses import it from there
    monkeypatch_module.syspath_prepend(str(root))
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def user_overrides(project, model: str) -> list[str]:
    # data.tokenizer.vocab_size: a BPE tokenizer trained on the user's corpus, within the models' 512 rows.
    return [*[o for o in TINY if not o.startswith("model.")], f"hydra.searchpath=[file://{project / 'conf'}]",
            f"model={model}", "data=user_corpus", "optim=user_sgd", "data.tokenizer.vocab_size=512",
            "train.steps=4", "train.eval_every_n_steps=0", "train.global_batch_size=8", "sched.warmup_steps=0",
            f"data.cache_dir={project / 'cache'}"]


def losses(result):
    return [v for _, v in result["summary"]["train_losses"]]


MODELS, ENGINES = ["user_tiny", "user_gpt2"], ["ddp", "fsdp", "zero2"]


@pytest.fixture(scope="module")
def trained(project, tmp_path_factory):
    """Both user models: single (with the final export) in one process, then every engine on 2 ranks."""
    d = tmp_path_factory.mktemp("user-runs")
    singles = run_many(1, [([*user_overrides(project, m), "backend=single", "checkpoint.save_final=true"],
                            str(d / m / "single")) for m in MODELS])
    jobs = [(m, e) for m in MODELS for e in ENGINES]
    results = run_many(2, [([*user_overrides(project, m), f"backend={e}"], str(d / m / e)) for m, e in jobs])
    return d, {**{(m, "single"): r for m, r in zip(MODELS, singles)}, **dict(zip(jobs, results))}


@pytest.mark.parametrize("model", MODELS)
def test_user_plugins_train_identically_on_every_engine(trained, model):
    d, runs = trained
    want = losses(runs[(model, "single")][0])
    assert len(want) == 4 and want[-1] < want[0], want  # it learns from the user's corpus
    for engine in ENGINES:
        got = losses(runs[(model, engine)][0])
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        assert len(got) == 4 and worst <= 1e-4, (engine, got, want)
    # zero2 was handed the user's optimizer object: its JSON has no optimizer section.
    assert "optimizer" not in json.load(open(d / model / "zero2" / "deepspeed_config.json"))


def test_user_project_through_train_py_with_hf_export(project, tmp_path):
    """The user's command line, exactly: their config dir on the search path, their package on PYTHONPATH (forked
    warm as every train_py run: the server has not imported the user's package, which the run imports from
    PYTHONPATH as a fresh interpreter would)."""
    proc = train_py("launch.nproc_per_node=2", *user_overrides(project, "user_gpt2"), "checkpoint.save_final=true",
                    run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert type(model).__name__ == "GPT2LMHeadModel"
    # The export holds the trained weights where GPT-2 reads them (its attention's Conv1D c_proj is square here:
    # a parameter count passes it transposed, or untrained): it scores the eval set as the run did.
    from shardyard.testing import compose, hf_eval_loss

    engine_loss = json.load(open(tmp_path / "summary.json"))["eval_losses"][-1][1]
    cfg = compose([*user_overrides(project, "user_gpt2"), "launch.nproc_per_node=2"], str(tmp_path))
    got = hf_eval_loss(str(tmp_path / "hf"), cfg, 2)
    assert abs(got - engine_loss) <= 1e-4 * engine_loss, (got, engine_loss)


def test_plain_module_exports_its_weights(trained):
    from safetensors.torch import load_file

    d, runs = trained
    saved = load_file(d / "user_tiny" / "single" / "hf" / "model.safetensors")
    for k, v in runs[("user_tiny", "single")][0]["full"].items():
        assert torch.equal(saved[k], v), k


def test_a_misspelt_plugin_argument_is_refused(project):
    from shardyard.planning.validate import validate
    from shardyard.core.errors import UserError
    from shardyard.testing import compose

    cfg = compose([*user_overrides(project, "user_tiny"), "+model.widht=32"])
    with pytest.raises(UserError) as e:
        validate(cfg, None)
    assert e.value.key == "model.widht" and "userproj.tiny_lm takes" in e.value.problem
    cfg = compose([*user_overrides(project, "user_tiny"), "~model.heads"])
    with pytest.raises(UserError) as e:
        validate(cfg, None)
    assert e.value.key == "model.heads"
