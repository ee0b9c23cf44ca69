"""``train.eval_tasks`` (issue 45): the lm-evaluation-harness's tasks at every evaluation of a run, on a 2-rank FSDP
run (the model sharded: both ranks join every forward, each scoring its share of the requests). The final
evaluation's row, in ``metrics.jsonl`` and in ``metrics.csv``, holds the scores the harness gives in one process on
the run's export (``lm_eval.simple_evaluate`` with lm-eval's ``HFLM`` over the loaded export, ``shardyard eval``'s
seeds): the shipped multiple-choice ``stdlib_qa`` and a local log-likelihood task whose perplexity is a continuous
number, asked for by its tag (so its scores come under the member task's name, not the name the run asked for)."""

import csv
import json
import os

import pytest
import torch

from conftest import loglikelihood_task

from shardyard.testing import TINY, on_ranks

ROWS = [{"q": "def main(", "t": "):\n    return None"}, {"q": "import os\nimport", "t": " sys"},
        {"q": "for i in", "t": " range(10):"}, {"q": "class Foo", "t": "(object):\n    pass"},
        {"q": "with open(path) as", "t": " f:"}, {"q": "return", "t": " self.value"}, {"q": "x = [", "t": "1, 2]"}]
"""7 rows: with 2 ranks of 4 rows a forward, one rank's share is short (a dummy row)."""


def _run_recording_local_rank(rank: int, world: int, overrides: list, run_dir: str) -> None:
    """``testing.run_many``'s job on a pool rank, with the ``LOCAL_RANK`` each of the harness's forwards saw
    (lm-eval's ``HFLM._model_call``, which the lockstep wrapper calls) written to ``local_rank<rank>.json``: a
    ZeRO-3 forward places tensors on ``device_name(LOCAL_RANK)``, so it must be the rank's own there."""
    from lm_eval.models.huggingface import HFLM

    from shardyard import testing

    seen: list = []
    plain = HFLM._model_call

    def recording(self, *args, **kwargs):
        seen.append(os.environ.get("LOCAL_RANK"))
        return plain(self, *args, **kwargs)

    HFLM._model_call = recording  # type: ignore[method-assign]
    try:
        testing._one_run(rank, world, overrides, run_dir)
    finally:
        HFLM._model_call = plain  # type: ignore[method-assign]
    with open(os.path.join(run_dir, f"local_rank{rank}.json"), "w") as f:
        json.dump(seen, f)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_harness_scores_at_every_eval_equal_the_harness_on_the_export(tmp_path):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardyard.evaluation import harness

    tasks = tmp_path / "tasks"
    loglikelihood_task(tasks, "code_rows", ROWS, tag="code_tag")
    run = tmp_path / "run"
    overrides = [*(o for o in TINY if not o.startswith("monitor=")), "monitor=[console,csv]", "backend=fsdp",
                 "train.steps=2", "train.eval_every_n_steps=0", "train.global_batch_size=8", "optim.lr=3e-3",
                 "checkpoint.save_final=true", "train.eval_tasks=[stdlib_qa,code_tag]", "train.eval_tasks_limit=6",
                 f"train.eval_tasks_include_path={tasks}"]
    run.mkdir()
    on_ranks(2, _run_recording_local_rank, overrides, str(run))
    ranks = [torch.load(run / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in range(2):  # every forward of the harness saw the rank's own LOCAL_RANK
        seen = json.loads((run / f"local_rank{r}.json").read_text())
        assert seen and set(seen) == {str(r)}, (r, set(seen))

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/stdlib_qa/acc" in r}
    assert sorted(evals) == [0, 2], sorted(evals)  # the untrained model's evaluation and the final one
    last = evals[2]
    assert all("eval/loss" in r for r in evals.values())  # the evaluation's own row
    assert ranks[1]["summary"]["final_eval"] == ranks[0]["summary"]["final_eval"]  # every rank has every score

    export = run / "hf"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    # The reference: lm-eval's own simple_evaluate (shardyard eval's seeds) over lm-eval's HFLM of the export.
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(export), batch_size=8)
    want = harness.scores(lm_eval.simple_evaluate(
        model=lm, tasks=["stdlib_qa", "code_tag"], limit=6, task_manager=harness.task_manager(str(tasks)),
        log_samples=False, random_seed=1234, numpy_random_seed=1234, torch_random_seed=1234,
        fewshot_random_seed=1234))
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
