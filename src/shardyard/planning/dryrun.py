"""The dry run (``plan.dry_run=true``): the run itself at the recipe's real world size, on this CPU, before a GPU
is rented; it measures what the plan predicts, and the two must agree.

One simulated rank per process, side by side on this machine's cores (``simulate_all``): a fake process group
of the real world size (collectives that move nothing, ``torch.testing._internal.distributed.fake_pg``) and fake
tensors (``FakeTensorMode``: shapes, dtypes and bytes, no storage), under which the engine's own ``init`` and ``prepare`` build the real device mesh, the real
FSDP2 / tensor-parallel / pipeline / expert-parallel wrapping of the model (built on the meta device), the real
optimizer; then two optimizer steps of real micro-batch shapes run under PyTorch's memory tracker
(``torch.distributed._tools``), and the second step's peak of every category is set beside the plan's figure:

    figure          the plan's                          the tracker's (per category, its largest value)
    params          parameters this rank holds          sharded parameters (the whole model on a replica)
    grads           gradients this rank holds           sharded gradients
    optimizer       optimizer state + master weights    optimizer state
    buffers         the engine's own buffers            unsharded parameters and gradients, all-gather and
                                                        reduce-scatter buffers (FSDP2)
    activations     activations of one micro-batch      activations and temporaries
    peak            the device's peak                   the peak of the sum

Which ranks are simulated is the engine's to say (``dry_run_roles``): those whose figures can differ (the first
and the last of an uneven shard, every distinct pipeline stage, the two ends of an expert-parallel group).
What a dry run cannot see: time, communication buffers of the collective library (NCCL's own), the caching
allocator's fragmentation, and routing: a MoE layer routes its tokens uniformly here (fake tensors have no
values to route by), the load balancing aims for and the dropless buffers of a collapsed routing exceed.
The engines that cannot run on fake tensors (DeepSpeed allocates its flat partitions with real storage and
reads them on the host; Horovod's and DDP's gradient buckets are C++ buffers) run one replica (the ``single``
engine's code, which DDP and Horovod wrap; for ZeRO the model in the compute dtype without autocast, as DeepSpeed
runs it) and add what they cannot measure by arithmetic, marked as not compared: the buckets, ZeRO's buffers;
ZeRO's model states are held against DeepSpeed's own estimators.

The verdict is two answers (``main``): whether the measured peak fits the hardware with the plan's margin
(``plan.measured_fit``), and whether every figure compared agrees with the plan; exit 0 only when both hold.
docs/plan.md, "The dry run", shows one (``DOC_RUN``, written by ``python -m shardyard.planning.dryrun --write-doc``).

One rank's simulation and the tracker are :mod:`shardyard.planning.simulation`; this module chooses the ranks, sets
their figures beside :mod:`shardyard.planning.plan`'s and gives the verdict. A module of the ``planning`` package:
it imports the plan, the simulation, ``backends`` (each engine's ``dry_run_roles``), ``config`` and ``core``.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

from omegaconf import DictConfig, open_dict

from shardyard.core.errors import UserError
from shardyard.core.facts import Plan
from shardyard.planning import simulation
from shardyard.planning.simulation import Role

GiB = float(2 ** 30)
TOLERANCE = 0.10
"""A figure agrees with the plan when within 10% of it ..."""
NEGLIGIBLE = 0.02
"""... or when both are under 2% of the rank's planned peak (a category the plan rounds to nothing)."""
FIGURES = ("params", "grads", "optimizer", "buffers", "activations", "peak")


def main(cfg: DictConfig, batch: Plan) -> int:
    """``plan.dry_run=true``: simulate the roles, print the table beside the plan and the verdict: whether the
    measured peak fits the hardware (with the plan's margin) and whether every figure agrees with the plan; 0
    when both hold, 1 otherwise (saying which failed and what to do)."""
    from shardyard.models import adapters
    from shardyard.planning import plan as memory_plan
    from shardyard.planning import hardware as plan_hardware
    from shardyard.backends import engine

    kind = getattr(engine(cfg.backend), "dry_run", None)
    if kind is None:
        raise UserError("backend", cfg.backend.name, "Its engine says nothing of how to dry-run it (a class "
                        "attribute `dry_run`: `engine`, `estimators` or `replica`).",
                        "Dry-run the recipe on an engine of shardyard's (fsdp, fsdp_offload, fsdp_tp, pipeline: the "
                        "real engine; ddp, horovod, single: one replica; zero1-3: one replica as ZeRO runs it, "
                        "and DeepSpeed's estimators), or plan.only=true for the plan alone.")
    hw = plan_hardware.hardware(cfg, batch)
    kinds = memory_plan.estimate_kinds(cfg, batch, hw)
    e = max(kinds, key=lambda k: k.device_peak)
    started = time.time()
    print(f"shardyard | dry run of {cfg.backend.name} at world {batch.world_size} ({hw.name}, {hw.nodes} node(s)); "
          f"{batch.dims.describe()}", flush=True)
    notes: list[str] = []
    unchecked: dict[str, str] = {}  # figure -> why it is the plan's arithmetic, not a measurement
    if kind == "estimators":
        # DeepSpeed's ZeRO engines do not run on fake tensors (see below): one replica runs as ZeRO runs it (the
        # model in the compute dtype, no autocast; the same micro-batch and checkpointing) for the activations;
        # the model states are held against DeepSpeed's own estimators; the buffers are the plan's arithmetic.
        role = Role(0, "one replica, as ZeRO runs it")
        got = simulation.simulate(cfg, batch, role, replica=True, in_compute_dtype=True)
        plan = planned(e, hw)
        rows = [(role, {**plan, "activations": got["activations"], "offloaded": got["offloaded"],
                        "peak": plan["peak"] - plan["activations"] + got["activations"]})]
        why = ("the plan's, held against DeepSpeed's real engines by tests/dist/test_model_states.py (its estimators "
               "assume mixed precision)" if cfg.precision.name == "fp32" else
               "compared together, as model states, with DeepSpeed's estimators (the line on model states)")
        unchecked = {"params": why, "grads": why, "optimizer": why,
                     "buffers": "DeepSpeed's reduce bucket and ZeRO-3's gathered modules are flat buffers it "
                                "allocates with real storage (the plan's arithmetic)"}
        notes.append(deepspeed_check(cfg, batch, hw, e))
        notes.append("activations: one replica of the model in the compute dtype without autocast (as DeepSpeed "
                     "runs it), the run's micro-batch and checkpointing, under fake tensors and PyTorch's memory "
                     "tracker; peak: the plan's model states and buffers with the measured activations")
    else:
        roles = [Role(*r) for r in engine(cfg.backend).dry_run_roles(cfg, batch.dims)] \
            if kind == "engine" else [Role(0, "one replica")]
        rows = list(zip(roles, simulation.simulate_all(cfg, batch, roles, replica=kind == "replica")))
        if kind == "replica":  # the wrapper's buckets by arithmetic: the plan's figure, added to the peak
            buckets = e.device.get("buffers", 0.0) + e.host.get("buffers", 0.0)
            rows = [(role, {**got, "buffers": buckets, "peak": got["peak"] + buckets}) for role, got in rows]
            notes.append(replica_note(cfg, e))
            unchecked["buffers"] = "the wrapper's gradient buckets are C++ buffers (the plan's arithmetic)"
            if adapters.method(cfg.peft).quantized_base:  # 4-bit NF4 kernels are CUDA-only: the base ran unquantised
                nf4 = planned(e, hw)["params"]
                rows = [(role, {**got, "params": nf4, "peak": got["peak"] - got["params"] + nf4}) for role, got in rows]
                notes.append(f"peft={cfg.peft.name}: the base was simulated unquantised (bitsandbytes' 4-bit kernels "
                             f"are CUDA-only); its NF4 parameters are the plan's arithmetic, {nf4 / GiB:.2f} GiB")
                unchecked["params"] = "the NF4 base's bytes (the plan's arithmetic)"
    agree, text = report(rows, kinds, hw, tuple(unchecked))
    if cfg.model.get("activation_offload") and hw.device == "cuda":  # measured apart (the meta device); on CPU
        # the device is host RAM: one pool, as the plan counts it
        for role, got in rows:
            parked = planned(kinds[role.kind], hw)["offloaded"]
            good = agrees(got.get("offloaded", 0.0), parked, parked)
            agree = agree and good
            notes.append(f"{'' if good else 'DISAGREES: '}activations in host RAM (model.activation_offload), rank "
                         f"{role.rank}: {got.get('offloaded', 0.0) / GiB:.2f} GiB measured beside the plan's "
                         f"{parked / GiB:.2f}{'' if good else ' (marked !)'}")
    for n in notes:
        agree = agree and not n.startswith("DISAGREES")
    if unchecked:
        notes.append("not compared (~: the plan's figure stands in the measured column): "
                     + "; ".join(f"{f}: {why}" for f, why in unchecked.items()))
    fit, fit_text = fits(cfg, rows, kinds, hw)
    # this process's largest resident set, and each role's process's (they ran side by side: counted once each)
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
           + simulation.side_by_side(len(rows)) * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2 ** 20
    print("\n".join([t for t in [text, *notes] if t]), flush=True)
    exceptions = f" but those marked ~, not compared ({', '.join(unchecked)})" if unchecked else ""
    agrees_text = (f"yes, every figure within {TOLERANCE:.0%} of the plan{exceptions}" if agree else
                   f"no, it DISAGREES with the plan beyond {TOLERANCE:.0%} (marked !)")
    print(f"shardyard | dry run: fits {hw.nodes} node(s) of {hw.name}: {fit_text}\n"
          f"shardyard | dry run: agrees with the plan: {agrees_text}", flush=True)
    if not fit:
        print(f"shardyard | dry run: does not fit: {advice(cfg, batch, hw, rows, kinds)}", flush=True)
    if not agree:
        print("shardyard | dry run: disagrees: the measured figures are what the engine holds; the plan's figure "
              "marked ! needs correcting (docs/plan.md, \"The dry run\"): trust the measured peak meanwhile", flush=True)
    verdict = "fits and agrees" if fit and agree else " and ".join(
        w for w, bad in (("does not fit", not fit), ("disagrees", not agree)) if bad)
    print(f"shardyard | dry run: {verdict}, exit {0 if fit and agree else 1}; {time.time() - started:.0f} s, "
          f"{rss:.2f} GiB of this machine's memory at most (no real parameter allocated)", flush=True)
    return 0 if fit and agree else 1


def fits(cfg: DictConfig, rows: list[tuple[Role, dict[str, float]]], kinds: list[Any], hw: Any) -> tuple[bool, str]:
    """Whether every simulated rank's measured peak fits the hardware with the plan's margin (``plan.measured_fit``:
    the CUDA runtime added, ``plan.headroom`` of the device), and the sentence that says so of the fullest."""
    from shardyard.planning import plan as memory_plan
    from shardyard.planning import hardware as plan_hardware

    if not rows:
        return True, "nothing simulated"
    checked = [(role, memory_plan.measured_fit(kinds[role.kind], hw, got["peak"], cfg.plan.headroom))
               for role, got in rows]
    role, m = max(checked, key=lambda c: (not c[1].fits, c[1].device_peak))
    ok = all(c.fits for _, c in checked)
    where = f"rank {role.rank} ({role.what})"
    if hw.device == "cpu":
        need, have = m.device_peak * hw.ranks_per_node, hw.host_bytes * cfg.plan.headroom
        size = (f"{hw.ranks_per_node} rank(s) x {m.device_peak / GiB:.2f} GiB (the measured peak of rank {role.rank}, "
                f"{role.what}, with the worker's runtime) = {need / GiB:.2f} GiB of host RAM, of the {have / GiB:.1f} GiB the plan may "
                f"fill ({cfg.plan.headroom:.0%} of {hw.host_bytes / GiB:.1f} GiB)")
    else:
        need, have = m.device_peak + plan_hardware.CUDA_RUNTIME_BYTES, (hw.device_bytes or 0.0) * cfg.plan.headroom
        size = (f"the measured peak of {where}, {m.device_peak / GiB:.2f} GiB + "
                f"{plan_hardware.CUDA_RUNTIME_BYTES / GiB:.0f} GiB of CUDA runtime = {need / GiB:.2f} GiB per GPU, of the "
                f"{have / GiB:.1f} GiB the plan may fill ({cfg.plan.headroom:.0%} of {(hw.device_bytes or 0) / GiB:.1f} GiB)")
    if ok:
        return True, f"yes, {size}"
    return False, f"NO, {size}" + ("" if need > have else f"; {m.shortfall}")


def advice(cfg: DictConfig, batch: Plan, hw: Any, rows: list[tuple[Role, dict[str, float]]], kinds: list[Any]) -> str:
    """What to do when the measured peak does not fit: the fewest nodes (that the recipe can be dry-run at as it is)
    on which the plan fits with the margin this run measured over it, to dry-run next."""
    from shardyard.planning import plan as memory_plan

    over = max([1.0] + [got["peak"] / p for role, got in rows if (p := planned(kinds[role.kind], hw)["peak"]) > 0])
    tighter = cfg.copy()
    with open_dict(tighter):
        tighter.plan.headroom = cfg.plan.headroom / over
    n = memory_plan.nodes_needed(tighter, batch, hw, whole_batch=True)
    if n is not None and n > hw.nodes:
        return (f"dry-run plan.nodes={n}, the fewest nodes of {hw.name} on which the plan fits"
                + (f" with the {over - 1:.0%} this run measured over it" if over > 1 else "")
                + " (and the recipe's layout and global batch can use); or plan.only=true for other engines and "
                  "settings that fit")
    return (f"no node count of {hw.name} up to {memory_plan.MAX_NODES} fits it as it is: plan.only=true lists "
            "other engines and settings (full activation checkpointing, a smaller micro batch) that do")


# ----------------------------------------------------------------------------------------- beside the plan
def planned(e: Any, hw: Any) -> dict[str, float]:
    """The plan's figures for one rank in the dry run's terms (``e``: ``plan.Estimate``): on a CPU plan the
    worker's own runtime is not a tensor, so it is left out of the peak."""
    d = {k: e.device.get(k, 0.0) + e.host.get(k, 0.0) for k in {*e.device, *e.host}}  # offload: fake tensors
    # live in one pool, so what the plan puts in host RAM is counted with the device's; but for the activations
    # model.activation_offload moves, which the simulation parks on the meta device and measures apart
    offloaded = e.host.get("activations", 0.0)
    return {"params": d.get("params", 0.0) + d.get("reference", 0.0), "grads": d.get("grads", 0.0),
            "optimizer": d.get("optimizer", 0.0) + d.get("master", 0.0), "buffers": d.get("buffers", 0.0),
            "activations": d.get("activations", 0.0) - offloaded,
            "peak": e.device_peak + e.host_peak - offloaded - d.get("runtime", 0.0), "offloaded": offloaded}


def agrees(measured: float, plan: float, peak: float) -> bool:
    return abs(measured - plan) <= TOLERANCE * plan or max(measured, plan) <= NEGLIGIBLE * peak


def report(rows: list[tuple[Role, dict[str, float]]], kinds: list[Any], hw: Any,
           unchecked: tuple[str, ...] = ()) -> tuple[bool, str]:
    """The table: per simulated rank its measured figures beside the plan's for that kind of rank (``kinds``:
    ``plan.estimate_kinds``), a figure that disagrees marked ``!``, one not measured (``unchecked``: the plan's
    arithmetic stands in for it) shown as ``-`` and marked ``~``; whether all those compared agree."""
    if not rows:
        return True, ""
    head = f"{'rank':>6} {'role':30} " + " ".join(f"{f:>18}" for f in FIGURES)
    lines = ["GiB per rank: measured (plan); ! where they differ by more than "
             f"{TOLERANCE:.0%} (and more than {NEGLIGIBLE:.0%} of the peak)"
             + ("; - (plan)~ where not compared" if unchecked else ""), head, "-" * len(head)]
    ok, worst = True, (0.0, "")
    for role, got in rows:
        plan = planned(kinds[role.kind], hw)
        cells = []
        for f in FIGURES:
            if f in unchecked:
                cells.append(f"{'-':>8} ({plan[f] / GiB:6.2f})~")
                continue
            good = agrees(got[f], plan[f], plan["peak"])
            ok = ok and good
            cells.append(f"{got[f] / GiB:8.2f} ({plan[f] / GiB:6.2f}){' ' if good else '!'}")
            off = abs(got[f] / plan[f] - 1) if plan[f] and not agrees(got[f], plan[f], 0.0) else 0.0
            if f != "peak" and off > worst[0] and not good:
                worst = (off, f"{f} of rank {role.rank} ({role.what})")
        lines.append(f"{role.rank:>6} {role.what[:30]:30} " + " ".join(cells))
    busiest = max(planned(k, hw)["peak"] for k in kinds)
    lines.append(f"the plan's busiest rank: {busiest / GiB:.2f} GiB per {'GPU' if hw.device == 'cuda' else 'rank'}"
                 f"; measured peak over the simulated ranks: {max((g['peak'] for _, g in rows), default=0) / GiB:.2f} GiB"
                 + (f"; furthest off: {worst[1]} by {worst[0]:.0%}" if worst[1] else ""))
    return ok, "\n".join(lines)


def replica_note(cfg: DictConfig, e: Any) -> str:
    """DDP and Horovod: every rank is one replica (simulated above on the ``single`` engine's code); what the
    wrapper adds is its gradient buckets, which the plan states by arithmetic."""
    buffers = e.device.get("buffers", 0.0)
    return (f"{cfg.backend.name}: every rank holds one whole replica, as simulated; the engine's gradient "
            f"buckets (the plan's buffers, {buffers / GiB:.2f} GiB) are C++ buffers outside fake tensors, "
            "checked by arithmetic (bucket_cap_mb / Horovod's fusion buffer)")


def deepspeed_check(cfg: DictConfig, batch: Plan, hw: Any, e: Any) -> str:
    """DeepSpeed's own model-state estimators at the recipe's size beside the plan's model states (params,
    gradients, optimizer state and master weights, device and host together), within ``TOLERANCE``."""
    import logging

    logging.disable(logging.WARNING)  # its import warns that it found no GPU
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    finally:
        logging.disable(logging.NOTSET)
    b = cfg.backend
    if cfg.precision.name == "fp32":
        return ("model states: DeepSpeed's estimators assume mixed precision (16-bit parameters and gradients), "
                "and this recipe trains in fp32: its figures are held instead against what DeepSpeed's engines "
                "allocate at 2 and 4 ranks in fp32 and bf16 (tests/dist/test_model_states.py, within 10%)")
    P, shape = batch.facts.params, batch.facts.shape
    offload_opt = str(b.get("offload_optimizer", "none")) != "none"
    offload_par = str(b.get("offload_param", "none")) != "none"
    # Without their 1.5 "additional buffer" factor, and their host figure (a node's) only where state is offloaded:
    # without offload it is the host memory of loading the model, not of training.
    if int(b.stage) == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, shape["max_module_params"], hw.ranks_per_node,
                                                            hw.nodes, cpu_offload=offload_opt,
                                                            cpu_offload_params=offload_par, zero_init=True,
                                                            additional_buffer_factor=1.0)
        gpu -= 4 * shape["max_module_params"]  # its largest-layer term is a gathered module: our buffers
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(P, hw.ranks_per_node, hw.nodes, cpu_offload=offload_opt,
                                                         additional_buffer_factor=1.0)
    theirs = gpu + (cpu / hw.ranks_per_node if offload_opt or offload_par else 0.0)
    ours = sum(e.model_states.values())
    good = abs(ours - theirs) <= TOLERANCE * theirs
    return (f"{'' if good else 'DISAGREES: '}model states per rank (device + host): plan {ours / GiB:.2f} GiB, "
            f"DeepSpeed's estimator (ZeRO-{b.stage}{', offload' if offload_opt or offload_par else ''}) "
            f"{theirs / GiB:.2f} GiB ({100 * (ours / theirs - 1):+.0f}%). DeepSpeed is not run on fake tensors: "
            "its ZeRO optimizers allocate their flat partitions with real storage and read them on the host "
            "(docs/plan.md, \"The dry run\")")


# ------------------------------------------------------------------------------------------ docs/plan.md's table
DOC_RUN = ("recipe=deepseek_v3_pipeline_ep", "plan.dry_run=true", "plan.hardware=8xH200-141GB", "plan.nodes=16")
"""The dry run whose table docs/plan.md shows (``write_doc``), checked by tests/unit/test_dryrun.py (its plan
figures, against the plan as it is) and tests/e2e/test_plan_e2e.py (the whole block, against a run)."""
DOC_MARK = "<!-- dry-run table: python -m shardyard.planning.dryrun --write-doc -->"


def doc_block(stdout: str) -> str:
    """The lines of a dry run's output that docs/plan.md shows: the table and the verdict, less what differs from
    one machine or run to the next (the seconds taken, this machine's memory)."""
    import re

    keep, table = [], False
    for line in stdout.splitlines():
        if line.startswith("GiB per rank: measured"):
            table = True
        if line.startswith("shardyard | dry run: "):
            table = False
            keep.append(re.sub(r"; \d+ s, [0-9.]+ GiB of this machine's memory at most.*$", "", line.rstrip()))
        elif table:
            keep.append(line.rstrip())
            table = not line.startswith("the plan's busiest rank")
    return "\n".join(keep)


def doc_table(doc: str) -> str:
    """The block docs/plan.md holds after ``DOC_MARK`` (its fenced text)."""
    after = doc.split(DOC_MARK, 1)[1]
    return after.split("```text\n", 1)[1].split("\n```", 1)[0]


def write_doc(path: str) -> bool:
    """Run ``DOC_RUN`` (``python -m shardyard train``, a minute or two) and write its block into ``path`` after
    ``DOC_MARK``; whether it changed."""
    import subprocess
    import tempfile

    with open(path) as f:
        doc = f.read()
    with tempfile.TemporaryDirectory() as run_dir:
        proc = subprocess.run([sys.executable, "-m", "shardyard", "train", *DOC_RUN, f"hydra.run.dir={run_dir}"],
                              capture_output=True, text=True)
    block = doc_block(proc.stdout)
    if not block:
        raise SystemExit(f"the dry run printed no table (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    head, after = doc.split(DOC_MARK, 1)
    pre, rest = after.split("```text\n", 1)
    new = head + DOC_MARK + pre + "```text\n" + block + "\n```" + rest.split("\n```", 1)[1]
    if new != doc:
        with open(path, "w") as f:
            f.write(new)
    return new != doc


if __name__ == "__main__":  # python -m shardyard.planning.dryrun --write-doc [docs/plan.md]
    if sys.argv[1:2] != ["--write-doc"]:
        raise SystemExit("usage: python -m shardyard.planning.dryrun --write-doc [docs/plan.md]")
    where = sys.argv[2] if len(sys.argv) > 2 else "docs/plan.md"
    print(f"{where}: {'rewritten' if write_doc(where) else 'unchanged'}")
