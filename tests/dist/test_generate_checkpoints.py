"""Generation from a checkpoint equals generation from its HF export (issue 45): fsdp, zero3, pipeline and a LoRA
run (ddp, adapter-only checkpoint over a pretrained base), each trained one step on 2 ranks, its checkpoint read
into one process (``inference.load``) and greedy-decoded token for token against its final export (the same
weights: the run ends at the checkpoint's step). ``shardyard generate`` with engine=deepspeed at tp 2 (on CPU, over
gloo) writes the rows engine=hf writes, the checkpoint hashed once per command. A damaged checkpoint file, or one
whose pickle asks for code, exits 2 naming the path."""

import os

import pytest
import torch

from shardyard.testing import TINY, compose, run_many

RUN = [*TINY, "train.steps=1", "train.eval_every_n_steps=0", "train.global_batch_size=8",
       "checkpoint.every_n_steps=1", "checkpoint.save_final=true"]
ENGINES = {"fsdp": ["backend=fsdp"], "zero3": ["backend=zero3"],
           "pipeline": ["backend=pipeline", "backend.stages=2", "backend.microbatches=2"],
           "lora": ["backend=ddp", "peft=lora", "peft.r=4", "peft.dropout=0.0", "optim.lr=1e-2"]}
PROMPTS = ["def main(", "import os\nclass Parser:"]  # two lengths: the batch is left-padded


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs, one after another on one pool of 2 ranks; LoRA's pretrained base is the fsdp run's export. Each
    run dir gets the resolved ``config.yaml`` a launched run's parent writes (``testing.run_many`` runs workers
    only)."""
    from omegaconf import OmegaConf

    from shardyard.training.rundir import resolved

    d = tmp_path_factory.mktemp("gen")
    jobs = [([*RUN, *extra, *([f"model.weights={d / 'fsdp' / 'hf'}"] if name == "lora" else [])], str(d / name))
            for name, extra in ENGINES.items()]
    run_many(2, jobs)
    for overrides, run_dir in jobs:
        OmegaConf.save(resolved(compose(overrides, run_dir)), os.path.join(run_dir, "config.yaml"))
    return d


def greedy(trained, n=12):
    from shardyard.inference.generate import GenerateOptions, complete

    opts = GenerateOptions(max_new_tokens=n, temperature=0.0, batch_size=2)
    return [(r["completion"], r["tokens"]) for r in complete(trained.model, trained.tokenizer, PROMPTS, opts)]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_checkpoint_generates_as_its_export(engine, runs):
    from shardyard.inference import loading as inference

    run = runs / engine
    ckpt = inference.load(str(run / "checkpoints" / "step-00000001"))
    export = inference.load(str(run / "hf"))
    assert (ckpt.kind, export.kind) == ("checkpoint", "export")
    assert type(ckpt.model).__name__ == type(export.model).__name__  # LoRA: merged into the plain model
    want, got = export.model.state_dict(), ckpt.model.state_dict()
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst == 0.0, worst  # the same fp32 weights (the LoRA merge computed as the export computes it)
    a, b = greedy(ckpt), greedy(export)
    assert a == b and all(n == 12 for _, n in a), (a, b)
    # The run dir itself loads its export; the weights are those the engine held after its step.
    assert inference.load(str(run)).path == str(run / "hf")
    full = torch.load(str(run / "rank0.pt"), weights_only=False)["full"]
    assert all(torch.equal(full[k].float(), v) for k, v in got.items() if k in full)


def test_damaged_checkpoint_exits_2_naming_it(runs, tmp_path):
    import shutil

    from shardyard.inference import loading as inference
    from shardyard.core.errors import UserError

    run = tmp_path / "run"
    shutil.copytree(runs / "fsdp", run, ignore=shutil.ignore_patterns("hf"))
    ckpt = run / "checkpoints" / "step-00000001"
    shard = next(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        inference.load(str(ckpt))
    assert err.value.key == "path" and "sha256" in err.value.problem and str(ckpt) in err.value.problem
    with pytest.raises(UserError) as err:  # the run dir (no export): no checkpoint verifies
        inference.load(str(run))
    assert "step-00000001" in err.value.problem
    os.remove(run / "config.yaml")
    with pytest.raises(UserError, match="run config.yaml"):  # a checkpoint alone has no architecture
        inference.load(str(ckpt))


def test_engine_deepspeed_tp2_writes_the_rows_of_engine_hf(runs, tmp_path, monkeypatch):
    """The fsdp run's checkpoint through ``generate.main``: engine=hf, then engine=deepspeed tp_size=2 on CPU (each
    rank reads the model on the CPU in the target dtype, DeepSpeed's AutoTP splits it): the same JSONL rows. The
    command hashes the checkpoint once (``inference.resolve``); the ranks load what it resolved."""
    import json

    from shardyard.training import integrity
    from shardyard.inference import generate

    calls = []
    verify = integrity.verify
    monkeypatch.setattr(integrity, "verify", lambda *a, **k: calls.append(a[0]) or verify(*a, **k))
    ckpt = str(runs / "fsdp" / "checkpoints" / "step-00000001")
    common = [ckpt, *(f"prompt={p}" for p in PROMPTS), "max_new_tokens=12", "device=cpu", "batch_size=2"]
    generate.main([*common, f"out={tmp_path / 'hf.jsonl'}"])
    assert calls == [ckpt]
    generate.main([*common, "engine=deepspeed", "tp_size=2", f"out={tmp_path / 'ds.jsonl'}"])
    hf, ds = ((tmp_path / n).read_text().splitlines() for n in ("hf.jsonl", "ds.jsonl"))
    assert [json.loads(r)["tokens"] for r in hf] == [12, 12] and ds == hf, (ds, hf)


def test_checkpoint_whose_pickle_asks_for_code_exits_2_naming_the_path(runs, tmp_path):
    """A DCP ``.metadata`` replaced by a pickle that calls a function (its manifest hashes updated, so that it
    verifies): refused before anything in it runs, the error naming ``path`` (not training's checkpoint.resume)."""
    import hashlib
    import json
    import pickle
    import shutil

    from shardyard.inference import loading as inference
    from shardyard.training.integrity import _meta_digest
    from shardyard.core.errors import UserError

    class Evil:
        def __reduce__(self):
            return (os.getcwd, ())

    run = tmp_path / "run"
    shutil.copytree(runs / "fsdp", run, ignore=shutil.ignore_patterns("hf"))
    ckpt = run / "checkpoints" / "step-00000001"
    data = pickle.dumps(Evil())
    (ckpt / ".metadata").write_bytes(data)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["manifest"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta["meta_sha256"] = _meta_digest(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError) as err:
        inference.load(str(ckpt))
    assert (err.value.key, err.value.value) == ("path", str(ckpt)), err.value
    assert ".metadata" in err.value.problem and "trusted" in err.value.fix
