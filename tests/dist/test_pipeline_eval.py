"""Pipeline evaluation (``PipelineBackend.eval_loss``) on 4 real gloo ranks: the last stage computes the loss and
sends two numbers to the other stages; the hidden states go point to point from stage to stage; no logits leave
the last stage. The eval losses equal the single process's, and sampling (the pruned model's forward, which
still hands the logits to every rank) samples what the single process samples."""

import json
import os

import pytest
import torch

from shardyard.testing import TINY, on_ranks, run_many

RUN = [*TINY, "model.num_layers=4", "train.steps=2", "train.eval_every_n_steps=1", "train.global_batch_size=8",
       "train.sample_tokens=4"]
LAYOUTS = {"1f1b x4": ["backend=pipeline", "backend.stages=4", "backend.microbatches=4", "train.micro_batch_size=8"],
           "interleaved 2 x dp 2": ["backend=pipeline", "backend.stages=2", "backend.schedule=interleaved",
                                    "backend.virtual_stages=2", "backend.microbatches=2", "train.micro_batch_size=4"]}
SENT = ("broadcast", "all_reduce", "send", "all_gather", "gather", "scatter", "reduce", "all_to_all")


def _counted_run(rank: int, world: int, overrides: list, run_dir: str) -> None:
    """``testing.run_many``'s job on a pool rank, with the bytes each ``eval_loss`` call hands to
    ``torch.distributed``'s collectives and point-to-point sends (FSDP's own all-gathers of a stage's parameters go
    through its functional collectives, not these) written to ``sent<rank>.json``: one ``{function: bytes}`` per
    call."""
    import torch.distributed as dist

    from shardyard import testing
    from shardyard.backends.pipeline import PipelineBackend

    calls: list[dict] = []
    inside: list[dict] = []
    plain = {name: getattr(dist, name) for name in SENT}

    def counting(name):
        def call(tensor, *args, **kwargs):
            if inside:
                tensors = tensor if isinstance(tensor, list) else [tensor]
                inside[-1][name] = inside[-1].get(name, 0) + sum(t.numel() * t.element_size() for t in tensors)
            return plain[name](tensor, *args, **kwargs)
        return call

    plain_eval = PipelineBackend.eval_loss

    def eval_loss(self, inputs, targets):
        inside.append({"rows": inputs.shape[0], "seq": inputs.shape[1]})
        try:
            return plain_eval(self, inputs, targets)
        finally:
            calls.append(inside.pop())

    for name in SENT:
        setattr(dist, name, counting(name))
    PipelineBackend.eval_loss = eval_loss  # type: ignore[method-assign]
    try:
        testing._one_run(rank, world, overrides, run_dir)
    finally:
        for name in SENT:
            setattr(dist, name, plain[name])
        PipelineBackend.eval_loss = plain_eval  # type: ignore[method-assign]
    with open(os.path.join(run_dir, f"sent{rank}.json"), "w") as f:
        json.dump(calls, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp-eval")
    # The same 16 eval sequences everywhere: 2 batches x micro 8 x dp 1, or x micro 4 x dp 2.
    out = {"single": run_many(1, [([*RUN, "backend=single", "train.micro_batch_size=8"], str(d / "single"))])[0][0]}
    for name, layout in LAYOUTS.items():
        run_dir = str(d / name.replace(" ", "-"))
        os.makedirs(run_dir)
        on_ranks(4, _counted_run, [*RUN, *layout], run_dir)
        out[name] = [{**torch.load(os.path.join(run_dir, f"rank{r}.pt"), weights_only=False),
                      "sent": json.load(open(os.path.join(run_dir, f"sent{r}.json")))} for r in range(4)]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_sends_two_numbers_from_the_last_stage_and_scores_as_the_single_process(layout, runs):
    """Per eval_loss call: one broadcast of 8 bytes (the loss sum and the label count, fp32) on every rank, and
    point to point only the hidden states a stage hands to the next ([rows, seq, hidden] fp32 for each chunk it
    sends on: the last stage none). Before, every chunk's output went to every rank of the pipeline: the logits
    of the last, [rows, seq, vocab] fp32 (64x the hidden states here), included. The eval losses (steps 0, 1, 2)
    equal the single process's on the same sequences, on every rank."""
    want = runs["single"]["summary"]["eval_losses"]
    assert [s for s, _ in want] == [0, 1, 2]
    hidden = 64  # TINY's model.hidden_size
    interleaved = "interleaved" in layout
    stages = 2 if interleaved else 4
    for rank, r in enumerate(runs[layout]):
        stage = rank // (4 // stages)
        sends = (1 if stage < stages - 1 else 0) + (1 if interleaved else 0)  # chunks s and s + stages, the last none
        assert len(r["sent"]) == 3 * 2  # 3 evals x train.eval_batches
        for call in r["sent"]:
            edge = call["rows"] * call["seq"] * hidden * 4
            assert {k: v for k, v in call.items() if k not in ("rows", "seq")} == \
                {"broadcast": 8, **({"send": sends * edge} if sends else {})}, (rank, call)
        got = r["summary"]["eval_losses"]
        assert [s for s, _ in got] == [0, 1, 2]
        assert all(abs(a - b) <= 1e-5 * b for (_, a), (_, b) in zip(got, want)), (got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sampling_through_the_pruned_model_still_works(layout, runs):
    """The pruned model's forward (``_forward_whole``, now on ``_run_chunks``) still gives every rank the logits:
    every rank samples the single process's text. (A guard for the change to evaluation: sampling was not broken
    before it.)"""
    want = runs["single"]["summary"]["sample"]
    assert want and all(r["summary"]["sample"] == want for r in runs[layout]), \
        ([r["summary"]["sample"] for r in runs[layout]], want)
