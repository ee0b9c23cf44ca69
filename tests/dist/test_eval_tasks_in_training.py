"""``train.eval_tasks`` (issue 45): the lm-evaluation-harness's tasks at every evaluation of a run, on a 2-rank FSDP
run (the model sharded: both ranks join every forward, each scoring its share of the requests). The final
evaluation's row, in ``metrics.jsonl`` and in ``metrics.csv``, holds the scores the harness gives in one process on
the run's export (``harness.harness``: ``shardyard eval``'s scoring, lm-eval's ``HFLM`` over the loaded export):
the shipped multiple-choice ``stdlib_qa`` and a local log-likelihood task whose perplexity is a continuous number."""

import csv
import json

import pytest

from shardyard.testing import TINY, run_many

ROWS = [{"q": "def main(", "t": "):\n    return None"}, {"q": "import os\nimport", "t": " sys"},
        {"q": "for i in", "t": " range(10):"}, {"q": "class Foo", "t": "(object):\n    pass"},
        {"q": "with open(path) as", "t": " f:"}, {"q": "return", "t": " self.value"}, {"q": "x = [", "t": "1, 2]"}]
"""7 rows: with 2 ranks of 4 rows a forward, one rank's share is short (a dummy row)."""


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_harness_scores_at_every_eval_equal_the_harness_on_the_export(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardyard import harness

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tasks / "rows.yaml").write_text(
        f"task: code_rows\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks}/rows.jsonl\n"
        "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{t}}'\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: perplexity\nmetadata:\n  version: 1\n")
    run = tmp_path / "run"
    overrides = [*(o for o in TINY if not o.startswith("monitor=")), "monitor=[console,csv]", "backend=fsdp",
                 "train.steps=2", "train.eval_every_n_steps=0", "train.global_batch_size=8", "optim.lr=3e-3",
                 "checkpoint.save_final=true", "train.eval_tasks=[stdlib_qa,code_rows]", "train.eval_tasks_limit=6",
                 f"train.eval_tasks_include_path={tasks}"]
    ranks = run_many(2, [(overrides, str(run))])[0]

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/stdlib_qa/acc" in r}
    assert sorted(evals) == [0, 2], sorted(evals)  # the untrained model's evaluation and the final one
    last = evals[2]
    assert all("eval/loss" in r for r in evals.values())  # the evaluation's own row
    assert ranks[1]["summary"]["final_eval"] == ranks[0]["summary"]["final_eval"]  # every rank has every score

    export = run / "hf"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    want = harness.harness(model, AutoTokenizer.from_pretrained(export), ["stdlib_qa", "code_rows"],
                           include_path=str(tasks), limit=6)
    for task, metric in [("stdlib_qa", "acc"), ("stdlib_qa", "acc_norm"), ("stdlib_qa", "acc_stderr"),
                         ("code_rows", "perplexity")]:
        got = last[f"eval/{task}/{metric}"]
        assert got == pytest.approx(want[task][metric], rel=1e-6, abs=1e-6), (task, metric, got, want)
    # the trained weights' scores, not the init's: the step-0 perplexity differs
    assert abs(evals[0]["eval/code_rows/perplexity"] - last["eval/code_rows/perplexity"]) > 1e-3 * last[
        "eval/code_rows/perplexity"]

    with open(run / "metrics.csv", newline="") as f:
        by_step = {int(r["step"]): r for r in csv.DictReader(f)}
    for key in ("eval/stdlib_qa/acc", "eval/code_rows/perplexity"):
        assert float(by_step[2][key]) == pytest.approx(last[key], rel=1e-9), key
        assert float(by_step[0][key]) == pytest.approx(evals[0][key], rel=1e-9), key
    assert by_step[1]["eval/stdlib_qa/acc"] == ""  # no evaluation at step 1
