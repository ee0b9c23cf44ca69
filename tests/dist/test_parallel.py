"""Beyond data parallel, proven like every other engine: tensor parallel x FSDP2 (dp 2 x tp 2) and pipeline
stages x FSDP2 (2 stages x dp 2, each schedule) on 4 real gloo ranks compute the single-process run: loss and
global pre-clip grad norm at each of 6 steps within 1e-4, with accumulation 1 and 2; a resume is bit for bit;
the HF export (gathered from every shard and stage) scores the eval set as the engine did. HSDP's copies
(``backend.replicate=2``, issue 57) beside tp and beside stages compute it too, and their checkpoints reshard to
and from the layouts without copies.

The hazards the issue names were checked, not assumed: gloo's reduce_scatter (FSDP2 over dp) averages here
(the grad norms equal the single process's), and the pipeline's batched point-to-point on gloo completes for
all three schedules."""

import pytest

from shardyard.testing import TINY, compose, hf_eval_loss, run_many

# 4 layers: 2 stages x 2 virtual stages (interleaved) each get one.
STEPS = [*TINY, "model.num_layers=4", "train.steps=6", "train.eval_every_n_steps=0", "train.global_batch_size=8"]
EXPORT = "checkpoint.save_final=true"
SAVE = "checkpoint.every_n_steps=3"
SCHEDULES = ["gpipe", "1f1b", "interleaved"]
# Accumulation 1: micro 4 x 1 x dp 2; accumulation 2: micro 2 x 2 x dp 2 (global batch 8 either way).
ACCUM = {1: "train.micro_batch_size=4", 2: "train.micro_batch_size=2"}


def curve(result, key="train_losses"):
    return [v for _, v in result["summary"][key]]


def assert_close(got, ref, rel, what):
    assert len(got) == len(ref) == 6
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= rel, f"{what}: worst relative difference {worst:.2e} > {rel:.0e}\n got {got}\n ref {ref}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    return run_many(1, [([*STEPS, "backend=single"], str(d / "single"))])[0][0]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    """Every 4-rank run in one set of 4 processes (each run with its own process group and run dir)."""
    d = tmp_path_factory.mktemp("w4")
    tp = [*STEPS, "backend=fsdp_tp", "backend.tp=2"]
    # Tensor parallel at accumulation 2 (its step's FSDP2 sync skipped on the first micro-batch), saving and
    # exporting; at accumulation 1 as HSDP's copies x tp 2 below (one run for what were two: issue 55's time).
    jobs = {("tp", 2): [*tp, ACCUM[2], SAVE, EXPORT]}
    def pp(schedule):
        return [*STEPS, "backend=pipeline", "backend.stages=2", f"backend.schedule={schedule}", "backend.microbatches=2"]

    # Every schedule at accumulation 2; accumulation 1 (one micro-batch a step, cut into the pipeline's 2) on 1F1B,
    # whose run also saves and exports: the schedules share that path (each schedule's step is the same call).
    jobs[("1f1b", 1)] = [*pp("1f1b"), ACCUM[1], SAVE, EXPORT]
    for s in SCHEDULES:
        jobs[(s, 2)] = [*pp(s), ACCUM[2]]
    # Resumed from step 3: in the same layout (bit for bit), and the tp checkpoint in plain FSDP over 4 ranks.
    jobs[("tp", "resume")] = [*tp, ACCUM[2], f"checkpoint.resume={d}/tp-2/checkpoints/step-00000003"]
    jobs[("1f1b", "resume")] = [*pp("1f1b"), ACCUM[1], f"checkpoint.resume={d}/1f1b-1/checkpoints/step-00000003"]
    jobs[("fsdp", "from-tp")] = [*STEPS, "backend=fsdp", "train.micro_batch_size=2",
                                 f"checkpoint.resume={d}/tp-2/checkpoints/step-00000003"]
    # HSDP (issue 57): 2 copies x tp 2 from step 1, its step-3 checkpoint resumed by FSDP over 4 ranks (copies and
    # tp to neither); 2 copies of each stage resumed from the stages' step 3 without copies
    hsdp = "backend.replicate=2"
    jobs[("tp", "hsdp")] = [*tp, hsdp, ACCUM[1], SAVE]
    jobs[("fsdp", "from-tp-hsdp")] = [*STEPS, "backend=fsdp", "train.micro_batch_size=2",
                                      f"checkpoint.resume={d}/tp-hsdp/checkpoints/step-00000003"]
    jobs[("1f1b", "hsdp-from-1f1b")] = [*pp("1f1b"), hsdp, ACCUM[1],
                                        f"checkpoint.resume={d}/1f1b-1/checkpoints/step-00000003"]
    keys = list(jobs)
    results = run_many(4, [(jobs[k], str(d / f"{k[0]}-{k[1]}")) for k in keys])
    return {**dict(zip(keys, results)), "dir": d}


@pytest.mark.parametrize("engine,accum", [("tp", 2), ("1f1b", 1), *((s, 2) for s in SCHEDULES),
                                          ("tp", "hsdp")])
def test_matches_single_process(engine, accum, reference, world4):
    for r in world4[(engine, accum)]:  # every rank reports the same numbers: its pipeline's, all-reduced over dp
        assert_close(curve(r), curve(reference), 1e-4, f"{engine} loss")
        assert_close(curve(r, "grad_norms"), curve(reference, "grad_norms"), 1e-4, f"{engine} grad norm")
        assert r["summary"]["world_size"] == 4


def test_each_rank_holds_its_part_only(world4):
    """Tensor parallel: a quarter of every block's q_proj per rank (2 x 2 shards); pipeline: rank r holds the
    layers of stage r // 2 only, the embedding on stage 0 and the head on stage 1."""
    tp = world4[("tp", 2)][0]["local"]
    full = world4[("tp", 2)][0]["full"]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert tp[q].numel() * 4 == full[q].numel()
    for rank, r in enumerate(world4[("1f1b", 1)]):
        layers = {int(k.split(".")[2]) for k in r["local"] if k.startswith("model.layers.")}
        assert layers == ({0, 1} if rank < 2 else {2, 3}), (rank, layers)
        assert ("model.embed_tokens.weight" in r["local"]) == (rank < 2)
        assert ("lm_head.weight" in r["local"]) == (rank >= 2)
    inter = [{int(k.split(".")[2]) for k in r["local"] if k.startswith("model.layers.")}
             for r in world4[("interleaved", 2)]]
    assert inter == [{0, 2}, {0, 2}, {1, 3}, {1, 3}]  # chunks 0 and 2 on stage 0, 1 and 3 on stage 1


def test_hsdp_copies_hold_the_same_part_beside_tp_and_stages(world4, reference):
    """backend.replicate=2 at world 4 (issue 57): beside tp 2, each rank holds half of q_proj (its tp slice, whole
    within its copy; tp 2 x dp 2 holds a quarter), ranks 0 and 2 (the copies of tp slice 0) hold it bit for bit
    after training (the gradients all-reduced across the copies) and ranks 0 and 1 different slices; beside 2
    stages, each stage's ranks are 2 copies that hold the same after steps 4-6, resumed from a checkpoint without
    copies, and train them as the single process does."""
    q = "model.layers.0.self_attn.q_proj.weight"
    tp = world4[("tp", "hsdp")]
    assert tp[0]["local"][q].numel() * 2 == tp[0]["full"][q].numel() == world4[("tp", 2)][0]["local"][q].numel() * 4
    for copies in ((tp[0], tp[2]), (tp[1], tp[3])):
        assert copies[0]["local"].keys() == copies[1]["local"].keys()
        assert all(copies[0]["local"][k].equal(copies[1]["local"][k]) for k in copies[0]["local"])
    assert not tp[0]["local"][q].equal(tp[1]["local"][q])
    pp = world4[("1f1b", "hsdp-from-1f1b")]
    assert len(pp[0]["summary"]["step_wall_s"]) == 3  # steps 4-6: the checkpoint was read
    assert_close(curve(pp[0]), curve(reference), 1e-4, "2 stages x 2 copies, loss")
    assert_close(curve(pp[0], "grad_norms"), curve(reference, "grad_norms"), 1e-4, "2 stages x 2 copies, grad norm")
    for a, b in ((0, 1), (2, 3)):  # stage 0's copies, stage 1's
        assert pp[a]["local"].keys() == pp[b]["local"].keys() and pp[a]["local"].keys() != pp[2 - a]["local"].keys()
        assert all(pp[a]["local"][k].equal(pp[b]["local"][k]) for k in pp[a]["local"])
    one = world4[("1f1b", 1)][0]["local"]["model.embed_tokens.weight"].numel()  # stage 0's half over dp 2
    assert pp[0]["local"]["model.embed_tokens.weight"].numel() == 2 * one


@pytest.mark.parametrize("engine,accum", [("tp", 2), ("1f1b", 1)])
def test_resume_is_bitwise_exact(engine, accum, world4):
    full, again = world4[(engine, accum)], world4[(engine, "resume")]
    assert [s for s, _ in again[0]["summary"]["train_losses"]] == [1, 2, 3, 4, 5, 6]
    assert len(again[0]["summary"]["step_wall_s"]) == 3  # steps 4-6 trained again
    assert curve(again[0]) == curve(full[0]) and curve(again[0], "grad_norms") == curve(full[0], "grad_norms")
    for a, b in zip(full, again):  # every rank's own shards, bit for bit
        assert a["local"].keys() == b["local"].keys()
        assert all(a["local"][k].equal(b["local"][k]) for k in a["local"])


def test_tensor_parallel_checkpoint_resumes_in_plain_fsdp_at_another_data_parallel_size(world4, reference):
    """DCP reshards: the dp 2 x tp 2 checkpoint of step 3 loads into FSDP over 4 ranks, which trains on as the
    single process did: it trains steps 4-6 only (a run that ignored the checkpoint trains 6, and equals the
    single process too) and reports steps 1-3 from the checkpoint's history."""
    for source in ("from-tp", "from-tp-hsdp"):  # dp 2 x tp 2, and HSDP's 2 copies x tp 2 (issue 57)
        moved = world4[("fsdp", source)][0]
        assert len(moved["summary"]["step_wall_s"]) == 3
        assert [s for s, _ in moved["summary"]["train_losses"]] == [1, 2, 3, 4, 5, 6]
        assert_close(curve(moved), curve(reference), 1e-4, f"fsdp x4 {source} checkpoint, loss")


@pytest.mark.parametrize("engine,backend,accum", [("tp", "fsdp_tp", 2), ("1f1b", "pipeline", 1)])
def test_export_gives_the_engines_eval_loss(engine, backend, accum, world4):
    res = world4[(engine, accum)][0]
    engine_loss = res["summary"]["eval_losses"][-1][1]
    got = hf_eval_loss(str(world4["dir"] / f"{engine}-{accum}" / "hf"),
                       compose([*STEPS, f"backend={backend}", ACCUM[accum]]), 2)
    assert abs(got - engine_loss) <= 1e-4 * abs(engine_loss), (got, engine_loss)
