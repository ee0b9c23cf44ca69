"""``shardyard eval`` (issue 45) on a run that ``python train.py`` trained: its perplexity is the run's own logged
eval loss (overall and per source of a mixture, from the run dir, a checkpoint and the export), perplexity on other
data is the training eval's computation on that data, and the lm-evaluation-harness's score on the shipped local
task is what ``lm_eval`` itself gives on the export. One tiny two-source run serves every test."""

import json
import math

import pytest

from conftest import TINY, loglikelihood_task, train_py

pytest.importorskip("lm_eval", reason="the eval extra (pip install -e '.[eval]'): make setup installs it")

# Evaluated at steps 0, 1, 2, a checkpoint and its HF export at each step, the final export in <run>/hf.
RUN = [*TINY, "train.steps=2", "train.eval_every_n_steps=1", "train.global_batch_size=8", "checkpoint.every_n_steps=1",
       "checkpoint.save_final=true", "checkpoint.export_hf=true", "data.tokenizer.vocab_size=600"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A ``data=mixture`` run of two synthetic corpora weighted 3:1: ``(run dir, its evals by step)``."""
    from shardyard.testing import synthetic_corpus

    d = tmp_path_factory.mktemp("eval_run")
    for i in (0, 1, 2):
        (d / f"corpus{i}").mkdir()
        synthetic_corpus(str(d / f"corpus{i}/c.jsonl"), 0.1, seed=i)
    mix = ["data=mixture", f"data.sources=[{{name: one, paths: [{d}/corpus0], weight: 3}}, "
                           f"{{name: two, paths: [{d}/corpus1], weight: 1}}]"]
    proc = train_py(*RUN, *mix, run_dir=d / "run")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    evals: dict = {}
    for line in (d / "run" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/loss" in row:
            evals[row["step"]] = row
    return d / "run", evals


def shardyard_eval(*args: str, out) -> dict:
    """``shardyard eval ARGS out=OUT`` in this process; its JSON."""
    from shardyard.inference import evaluate

    evaluate.main([*args, f"out={out}"])
    return json.loads(out.read_text())


@pytest.mark.parametrize("what", ["run", "checkpoint", "export"])
def test_perplexity_is_the_runs_own_eval_loss_per_source(what, run, tmp_path):
    run_dir, evals = run
    path, step = {"run": (run_dir, 2), "checkpoint": (run_dir / "checkpoints/step-00000001", 1),
                  "export": (run_dir / "checkpoints/step-00000001/hf", 1)}[what]
    got = shardyard_eval(str(path), out=tmp_path / "r.json")["perplexity"]
    want = evals[step]
    assert abs(got["loss"] - want["eval/loss"]) <= 1e-4, (got, want)
    assert abs(got["ppl"] - want["eval/ppl"]) <= 1e-4 * want["eval/ppl"]
    for name in ("one", "two"):
        assert abs(got["sources"][name]["loss"] - want[f"eval/loss/{name}"]) <= 1e-4, (name, got, want)
    assert abs(got["sources"]["one"]["weight"] - 0.75) < 0.01  # the mixture's weights, as the run weighed them
    assert want["eval/loss"] != evals[0]["eval/loss"]  # the weights of that step, not the init's


def test_perplexity_on_other_data_is_the_training_evals_on_it(run, tmp_path):
    """``data=text_files`` on a corpus the run never saw, tokenized with the run's tokenizer: the loss over the
    sequences a one-rank training eval of that data scores, computed by an HF model over them."""
    from shardyard.testing import compose, hf_eval_loss

    run_dir, _ = run
    other = ["data=text_files", f"data.paths=[{run_dir.parent}/corpus2]"]
    got = shardyard_eval(str(run_dir), *other, out=tmp_path / "r.json")["perplexity"]
    cfg = compose([*RUN, *other, f"data.tokenizer.path={run_dir}/hf"])
    want = hf_eval_loss(str(run_dir / "hf"), cfg, 1)
    assert abs(got["loss"] - want) <= 1e-4, (got, want)
    assert list(got["sources"]) == ["textfiles"]


def test_harness_score_on_the_shipped_task_equals_lm_eval_on_the_export(run, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from shardyard.evaluation import harness

    export = run[0] / "hf"
    got = shardyard_eval(str(export), "tasks=[stdlib_qa]", "limit=24", "perplexity=false",
                         out=tmp_path / "r.json")["tasks"]["stdlib_qa"]
    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32,device=cpu",
                                  tasks=["stdlib_qa"], limit=24, batch_size=8, log_samples=False,
                                  task_manager=TaskManager(include_path=harness.TASKS_DIR, include_defaults=False))
    want = ref["results"]["stdlib_qa"]
    for metric in ("acc", "acc_norm"):
        assert got[metric] == pytest.approx(want[f"{metric},none"], abs=1e-12), (metric, got, want)
        assert got[f"{metric}_stderr"] == pytest.approx(want[f"{metric}_stderr,none"], abs=1e-12)


def test_a_users_local_task_in_include_path(run, tmp_path):
    """A harness YAML of the user's (``dataset_path: json`` over a local JSONL, ``output_type: loglikelihood``): its
    perplexity is ``exp(-mean(log p(continuation | context)))`` over the rows, computed here from the model's
    logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = run[0] / "hf"
    rows = [{"q": "def main(", "t": "):\n    return None"}, {"q": "import os\nimport", "t": " sys"},
            {"q": "for i in", "t": " range(10):"}, {"q": "class Foo", "t": "(object):\n    pass"}]
    tasks = tmp_path / "tasks"
    loglikelihood_task(tasks, "my_code_ll", rows)
    got = shardyard_eval(str(export), "tasks=[my_code_ll]", f"include_path={tasks}", "perplexity=false",
                         out=tmp_path / "r.json")["tasks"]["my_code_ll"]["perplexity"]

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    logps = []
    for r in rows:  # the continuation's tokens: those of context + continuation after the context's own
        ctx = tok.encode(r["q"], add_special_tokens=False)
        whole = tok.encode(r["q"] + r["t"], add_special_tokens=False)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].double(), -1)
        logps.append(sum(logp[t - 1, whole[t]].item() for t in range(len(ctx), len(whole))))
    want = math.exp(-sum(logps) / len(logps))
    assert got == pytest.approx(want, rel=1e-5), (got, want)


def test_nothing_to_evaluate_is_a_user_error(run):
    """(Through ``evaluate.main``: ``cli.main`` ends a successful command with ``os._exit``, which would end pytest.)"""
    from shardyard.inference import evaluate
    from shardyard.core.errors import UserError

    with pytest.raises(UserError) as e:
        evaluate.main([str(run[0]), "perplexity=false"])
    assert e.value.key == "tasks" and "nothing to evaluate" in e.value.problem
