"""Issue 44's recipes as a user runs them, through ``python train.py recipe=...``: the R1-Zero-style SFT stage
(``recipe=r1_zero_tiny_sft``, shared by the stages after it), then DPO from its export (``recipe=dpo_tiny``, cut to
its first eval): the held-out preference accuracy and margin rise as the recipe's header states; and GRPO from it
(``recipe=r1_zero_tiny_grpo``, cut to its first eval): the held-out greedy accuracy rises. Every figure comes from the run's own
metrics.jsonl; the runs are deterministic on CPU for the seed, the margins below keep slack for another torch."""

import json
from pathlib import Path

import pytest

from conftest import train_py

# The SFT stage is 300 steps (1 min 40 s on a quiet 2-core box); beside the suite's other worker, or on a loaded
# machine, several times that: the fixture's first test gets the time of both.
pytestmark = pytest.mark.timeout(2400)

DPO_ACCURACY = 0.55  # eval/rewards/accuracies at step 20 (measured 0.656, 0.711 at the recipe's step 40; 0.0 at step 0:
#                     policy == reference)
DPO_MARGIN = 0.2    # eval/rewards/margins at step 20 (measured 0.382, 0.545 at step 40; 0.0 at step 0)
DPO_LOSS_DROP = 0.03  # eval/loss at step 20 under step 0's log 2 (measured 0.056, 0.158 at step 40)
GRPO_RISE = 0.08    # eval/accuracy, step 20 over step 0, on the same 128 held-out prompts, greedy (measured 0.336 ->
#                     0.531; 0.375 -> 0.547 with the log-probabilities at the sampling temperature, issue 53; 0.398 ->
#                     0.508 on another machine's CPU, 2026-11-29, whose SFT export differs in its last bits). A policy
#                     that does not learn keeps its greedy answers: its rise is 0 (the evaluation samples nothing)


def evals(run_dir: Path) -> dict[int, dict]:
    """The run's evaluations by step (metrics.jsonl rows carrying eval/ keys)."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if any(k.startswith("eval/") for k in row):
            out.setdefault(row["step"], {}).update(row)
    return out


@pytest.fixture(scope="module")
def sft_export(tmp_path_factory) -> Path:
    """``recipe=r1_zero_tiny_sft`` in a run dir of its own (the command line's hydra.run.dir wins over the recipe's
    fixed one): the worked format is learned (the assistant-token eval loss falls from ~6.2 to 0.08), with its
    teacher's slips (carries forgotten)."""
    run = tmp_path_factory.mktemp("r1_zero_tiny_sft")
    proc = train_py("recipe=r1_zero_tiny_sft", "monitor.console.style=plain", run_dir=run, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    e = evals(run)
    assert e[0]["eval/loss"] > 5.0 and e[max(e)]["eval/loss"] < 0.2, e
    assert (run / "hf" / "config.json").is_file()
    return run / "hf"


def test_dpo_tiny_from_the_sft_export_raises_preference_accuracy_and_margin(sft_export, tmp_path):
    """The recipe's own 40 steps are cut to its first evaluation (step 20; issue 55's suite time), as GRPO's below."""
    proc = train_py("recipe=dpo_tiny", f"model.weights={sft_export}", "train.steps=20", "monitor.console.style=plain",
                    run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "trainable: lora adapters" in proc.stdout  # the reference is the policy with its adapters disabled
    e = evals(tmp_path)
    first, last = e[0], e[max(e)]
    assert max(e) == 20
    # Step 0: the policy is its reference, every implicit reward is 0 and the loss is log 2.
    assert abs(first["eval/loss"] - 0.6931) < 1e-3 and first["eval/rewards/margins"] == 0.0, first
    assert last["eval/rewards/accuracies"] >= DPO_ACCURACY, last
    assert last["eval/rewards/margins"] >= DPO_MARGIN, last
    assert last["eval/loss"] < first["eval/loss"] - DPO_LOSS_DROP, (first, last)


def test_r1_zero_tiny_grpo_from_the_sft_export_raises_held_out_accuracy(sft_export, tmp_path):
    """The SFT stage forgets every carry greedily (its teacher did on 60% of problems); GRPO's answer reward teaches
    it to carry: the held-out greedy accuracy at step 20 beats step 0's by GRPO_RISE on the same prompts (10 more of
    128 answered right; measured 14-25 more). The recipe's own 40 steps are cut to its first evaluation."""
    proc = train_py("recipe=r1_zero_tiny_grpo", f"model.weights={sft_export}", "train.steps=20",
                    "monitor.console.style=plain", run_dir=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    e = evals(tmp_path)
    first, last = e[0], e[20]
    assert last["eval/accuracy"] >= first["eval/accuracy"] + GRPO_RISE, (first, last)
    assert last["eval/reward"] > first["eval/reward"], (first, last)
