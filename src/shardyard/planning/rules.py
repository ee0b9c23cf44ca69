"""The rules of each config group that validation checks before any worker starts (``validate.validate`` calls
them in order): the data (``validate_data``), weights and adapters, fine-tuning, the objective and its reference,
evaluation tasks, MoE balance, groups and expert parallelism, precision, the speed options, profiling, the plan
keys and the sweep. Every failure is a ``UserError`` naming the key (exit code 2)."""

from __future__ import annotations

import os
import sys
from typing import Any

from omegaconf import DictConfig

from shardyard.core.errors import UserError
from shardyard.core.facts import ModelFacts, ParallelDims


def at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise UserError(key, value, f"It must be at least {low}.", f"Use {key}={low} or more.")


def validate_plan(pl: DictConfig) -> None:
    for key in ("headroom", "mfu"):
        if not 0 < pl[key] <= 1:
            raise UserError(f"plan.{key}", pl[key], "It is a fraction of the hardware, in (0, 1].",
                            f"Use e.g. plan.{key}={0.9 if key == 'headroom' else 0.4}.")
    at_least("plan.nodes", pl.nodes, 1)
    at_least("plan.search_top", pl.search_top, 1)
    at_least("plan.search_dry_runs", pl.search_dry_runs, 0)


def validate_profile_debug(cfg: DictConfig) -> None:
    pr, dbg, steps = cfg.profile, cfg.debug, cfg.train.steps
    if pr.enabled:
        ok = len(pr.steps) == 2 and 1 <= pr.steps[0] <= pr.steps[1] <= steps
        if not ok:
            raise UserError("profile.steps", list(pr.steps), f"It must be [first, last] with 1 <= first <= last <= "
                            f"train.steps ({steps}).", f"Use e.g. profile.steps=[{min(3, steps)},{min(4, steps)}].")
    if dbg.max_skipped < 1:
        raise UserError("debug.max_skipped", dbg.max_skipped, "It must be at least 1.", "Use e.g. debug.max_skipped=5.")
    if cfg.metrics.peak_tflops is not None and cfg.metrics.peak_tflops <= 0:
        raise UserError("metrics.peak_tflops", cfg.metrics.peak_tflops, "A peak throughput must be positive.",
                        "Use e.g. metrics.peak_tflops=989 (H100 SXM, bf16 dense), or null for the built-in table.")


def validate_data(cfg: DictConfig):
    from shardyard.data.pipeline import check_tokenizer, num_proc, open_sources, tokenizer_source

    d = cfg.data
    tokenizer = tokenizer_source(cfg)
    if tokenizer is not None:
        check_tokenizer(*tokenizer)
    if d.tokenizer.path is None and not 256 < d.tokenizer.vocab_size <= 1 << 20:
        raise UserError("data.tokenizer.vocab_size", d.tokenizer.vocab_size,
                        "A byte-level BPE vocabulary needs more than its 256 base bytes.", "Use e.g. 4096.")
    if not 0 < d.val_fraction < 1:
        raise UserError("data.val_fraction", d.val_fraction, "It must lie strictly between 0 and 1.", "Use e.g. 0.05.")
    if d.seq_len < 2:
        raise UserError("data.seq_len", d.seq_len, "Sequences need at least 2 tokens.", "Use e.g. data.seq_len=256.")
    num_proc(d)
    for key in ("buffer_mb", "shard_mb"):
        at_least(f"data.{key}", d[key], 1)
    return open_sources(d)[0].docs  # sources check their own arguments (paths exist, weights, ...) when built


def validate_weights_and_peft(cfg: DictConfig, device_type: str) -> None:
    """Pretrained weights and adapters: before the model is inspected (which builds the adapters)."""
    import glob

    from shardyard.models import adapters
    from shardyard.backends import engine
    from shardyard.data.pipeline import has_tokenizer
    from shardyard.models.weights import weights_dir

    m, p = cfg.model, cfg.peft
    w = m.get("weights")
    if isinstance(w, str) and not w.strip():  # a variable that expanded to nothing: never a fresh init silently
        raise UserError("model.weights", w, "The value is empty.", "Give the checkpoint's directory, or null (leave "
                        "it unset) for a fresh init.")
    here = cfg.plan.hardware is None  # planning for other machines: their files are not here to check
    if w == "auto" and "path" not in m:
        raise UserError("model.weights", w, "`auto` means the model directory's own weights, and this model option "
                        "has no model.path.", "Give a directory: model.weights=/models/NAME, or null (fresh init).")
    wdir = weights_dir(m) if w != "auto" or "path" in m else None
    if wdir is not None and here:
        if not os.path.isdir(wdir):
            raise UserError("model.weights", w, "No directory is there.",
                            "Point it at a local HF checkpoint (e.g. a run's hf/ export), or null to start from a "
                            "fresh init.")
        if not glob.glob(os.path.join(wdir, "*.safetensors")):
            raise UserError("model.weights", wdir, "It holds no *.safetensors weights (PyTorch .bin files are pickles, "
                            "which shardyard does not load: unpickling runs code from the file).",
                            "Convert it once: python -c \"from transformers import AutoModelForCausalLM as M; "
                            f"M.from_pretrained('{wdir}').save_pretrained('{wdir}-safetensors')\" (copy the tokenizer "
                            "files too), and point model.weights there.")
        check_safetensors_dir("model.weights" if w not in (None, "auto") else "model.path", wdir)
        if cfg.data.tokenizer.path is None and not has_tokenizer(wdir) and not (
                isinstance(m.get("path"), str) and has_tokenizer(os.path.expanduser(m.path))):
            raise UserError("model.weights", wdir, "The pretrained weights come without their tokenizer, and a "
                            "tokenizer trained on this data would give the model token ids that mean nothing to it.",
                            "Put the model's tokenizer files in that directory, or give data.tokenizer.path=DIR.")
    method = adapters.method(p)
    if not method.freezes_base:
        return
    if p.r < 1:
        raise UserError("peft.r", p.r, "An adapter needs rank 1 or more.", "Use e.g. peft.r=16.")
    if p.alpha <= 0:
        raise UserError("peft.alpha", p.alpha, "The update is scaled by alpha / r, so alpha must be positive.",
                        "Use e.g. peft.alpha=32 (2 x r).")
    if not 0 <= p.dropout < 1:
        raise UserError("peft.dropout", p.dropout, "A dropout probability lies in [0, 1).", "Use e.g. 0.05.")
    if w is None:
        print(f"shardyard | warning: peft={p.name} trains adapters on a base model with no pretrained weights "
              "(model.weights is null): the frozen base is a random init.", file=sys.stderr, flush=True)
    if not method.quantized_base:
        return
    if not getattr(engine(cfg.backend), "quantized_base", False):
        raise UserError("peft", "qlora", f"backend={cfg.backend.name} shards or partitions parameters itself, and "
                        "bitsandbytes' packed 4-bit weights cannot be sharded or all-gathered by it.",
                        "Use backend=single or backend=ddp with peft=qlora (each rank holds the 4-bit base), or "
                        "peft=lora on this engine.")
    from shardyard.core import drills

    elsewhere = cfg.plan.hardware is not None and "cpu" not in str(cfg.plan.hardware).lower()  # planning GPUs
    if elsewhere:
        return
    if device_type != "cuda" and not drills.qlora_on_cpu():
        raise UserError("peft", "qlora", "QLoRA keeps the frozen base in 4-bit NF4 through bitsandbytes, a CUDA GPU "
                        "method; this run is on CPU.",
                        "Use peft=lora on CPU (same adapters, fp32/bf16 base), or run on a GPU.")


def check_safetensors_dir(key: str, directory: str) -> None:
    """Every weights file of ``directory`` is whole (``_safetensors_problem``) and every shard its
    ``*.safetensors.index.json`` lists is there; else a ``UserError`` naming ``key`` and the file at fault
    (``model.weights``, ``model.path``, ``objective.reference_weights``)."""
    import glob
    import json

    fix = "Copy or download it again (a cut-short copy is the usual cause), or point the key at a complete checkpoint."
    for index in sorted(glob.glob(os.path.join(directory, "*.safetensors.index.json"))):
        try:
            with open(index, encoding="utf-8") as fh:
                shards = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(key, index, f"The weights index cannot be read ({type(e).__name__}: {e}).", fix) from None
        missing = [n for n in shards if not os.path.isfile(os.path.join(directory, str(n)))]
        if missing:
            named = ", ".join(map(str, missing[:3])) + (" ..." if len(missing) > 3 else "")
            raise UserError(key, os.path.join(directory, str(missing[0])), f"The weights index {index} lists "
                            f"{len(shards)} shard file(s), and {len(missing)} of them are not there ({named}).", fix)
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        problem = _safetensors_problem(f)
        if problem:
            raise UserError(key, f, f"The weights file is not whole: {problem}.", fix)


def _safetensors_problem(path: str) -> str | None:
    """Why a safetensors file is cut short or not one, from its header alone (8 bytes of length, a JSON header,
    then the tensors, whose last end offset must reach the file's end), or None: cheap at any size."""
    import json

    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + n > size:
                return f"it has {size} bytes, fewer than its header's own length ({n} bytes + 8)"
            header = json.loads(f.read(n))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"its header is not a safetensors header ({type(e).__name__}: {e})"
    if 8 + n + end != size:
        return f"it has {size} bytes, and its header places tensor data up to byte {8 + n + end}"
    return None


def validate_balance(b: DictConfig, facts: ModelFacts) -> None:
    """``model.balance`` keys that would do nothing are refused: any of them on a dense model, the bias update on
    routers without a selection bias (DeepSeek-V2's softmax routers)."""
    on = [k for k in ("bias_update_speed", "seq_aux_alpha", "device_aux_alpha", "comm_aux_alpha") if b[k]]
    if on and not facts.moe_layers:
        raise UserError(f"model.balance.{on[0]}", b[on[0]], "It balances the routing of mixture-of-experts layers, "
                        "and this model has none (no router).",
                        f"Leave model.balance.{on[0]}=0 for a dense model, or choose a MoE model "
                        "(model=deepseek_moe_tiny, deepseek_v2_lite, deepseek_v3).")
    if b.bias_update_speed and not facts.router_bias:
        raise UserError("model.balance.bias_update_speed", b.bias_update_speed, "This model's routers have no "
                        "selection bias to move (DeepSeek-V3's e_score_correction_bias): DeepSeek-V2's softmax "
                        "routers are balanced by the auxiliary losses.",
                        "Use model.balance.bias_update_speed=0, and model.balance.seq_aux_alpha (with "
                        "device_aux_alpha and comm_aux_alpha under expert parallelism) to balance them.")


def validate_groups(m: DictConfig, facts: ModelFacts) -> None:
    """Group-limited routing that transformers' router would run wrongly (``model.build``'s own check has refused
    groups that do not divide the experts, and ``topk_group`` outside 1..n_group): a DeepSeek-V3 router scores a
    group by its top-2 experts, so a group needs two; and a token's ``top_k`` experts must fit in its
    ``topk_group`` groups, or its top-k reaches experts the mask excluded. Whether the groups line up with the
    expert-parallel ranks is the plan's note (``plan.routing_notes``), not an error."""
    from shardyard.models.moe import routing_groups

    if not facts.moe_layers:
        return
    rg = routing_groups(m, facts.routed_experts, facts.experts_per_token, 1, 1)
    if rg.groups > 1 and facts.router_bias and rg.per_group < 2:
        raise UserError("model.n_group", rg.groups, f"A DeepSeek-V3 router scores each group by the sum of its 2 best "
                        f"experts, and {rg.groups} groups of model.n_routed_experts={rg.experts} hold "
                        f"{rg.per_group} each.", f"Use a model.n_group of at most {rg.experts // 2} that divides "
                        f"{rg.experts} (DeepSeek-V3: 8 groups of 32), or model.n_group=1 model.topk_group=1.")
    if rg.groups > 1 and rg.top_k > rg.topk_group * rg.per_group:
        raise UserError("model.topk_group", rg.topk_group, f"Each token's model.num_experts_per_tok={rg.top_k} "
                        f"experts are chosen within its topk_group best groups, which hold {rg.topk_group} x "
                        f"{rg.per_group} = {rg.topk_group * rg.per_group} experts.",
                        f"Use model.topk_group>={-(-rg.top_k // rg.per_group)} (at most model.n_group={rg.groups}), "
                        "or fewer experts per token.")


def validate_ep(b: DictConfig, dims: ParallelDims, facts: ModelFacts) -> None:
    """``backend.ep``: an engine that shards experts, a MoE model, and a degree that divides both the routed
    experts (whole experts per rank) and the data-parallel shards it borrows its ranks from; and
    ``backend.ep_capacity_factor``: null, or above 1 with ``ep > 1``."""
    from shardyard.backends import engine

    ep, factor = b.ep, b.get("ep_capacity_factor")
    if factor is not None and not (isinstance(factor, (int, float)) and factor > 1):
        raise UserError("backend.ep_capacity_factor", factor, "It bounds the token rows a rank of an expert-parallel "
                        "group receives to this many times its balanced share, so it must be greater than 1 "
                        "(at 1 or below only a perfectly balanced routing fits).",
                        "Use e.g. backend.ep_capacity_factor=2, or null (the default: dropless, no bound).")
    if factor is not None and ep == 1:
        raise UserError("backend.ep_capacity_factor", factor, "It bounds expert parallelism's receive buffer, and "
                        "backend.ep=1 sends no token to another rank.",
                        "Leave backend.ep_capacity_factor null, or set backend.ep to 2 or more.")
    if ep == 1:
        return
    if "ep" not in getattr(engine(b), "degree_keys", {}):
        raise UserError("backend.ep", ep, f"backend={b.name} does not shard experts: every rank holds every expert.",
                        "Use backend=fsdp (or fsdp_offload, or pipeline for stages x ep) for expert parallelism, "
                        "or backend.ep=1.")
    if not facts.moe_layers:
        raise UserError("backend.ep", ep, "Expert parallelism splits a mixture-of-experts layer's experts, and this "
                        "model has none (no router).", "Use backend.ep=1, or a MoE model (model=deepseek_moe_tiny, "
                        "deepseek_v2_lite, deepseek_v3).")
    shards = dims.shard_group  # one copy's sharding ranks, a sequence group's among them
    if facts.routed_experts % ep:
        raise UserError("backend.ep", ep, f"Each rank of an expert-parallel group holds whole experts, so it must "
                        f"divide the model's {facts.routed_experts} routed experts.",
                        f"Use a divisor of {facts.routed_experts} that also divides the {shards} data-parallel "
                        f"shards: {_common_divisors(facts.routed_experts, shards)}.")
    if shards % ep:
        copy = " of one HSDP copy (backend.replicate)" if dims.dp_replicate > 1 else ""
        raise UserError("backend.ep", ep, f"The expert-parallel groups are made of data-parallel shards{copy}, and "
                        f"there are {shards} ({dims.describe()}), which it must divide.",
                        f"Use one of {_common_divisors(facts.routed_experts, shards)}, or a world size with more "
                        f"ranks per copy: world / (backend.replicate x tp x stages) a multiple of {ep}.")


def validate_sp(cfg: DictConfig, dims: ParallelDims) -> None:
    """``backend.sp`` (Ulysses sequence parallelism) and ``backend.cp`` (all-gather context parallelism): one of them
    at a time, an engine that splits sequences, a sequence length each rank's share divides (sp: whole heads per
    rank too) and the causal-LM objective or one that cuts its own rows (DPO's pairs, GRPO's rollouts:
    ``objectives.Objective.splits_sequences``). Expert parallelism composes (its groups dispatch each rank's share
    of the tokens; the balance losses add the shares' sums over the sequence group: ``models.moe.SequenceSplit``),
    and so do MTP's depths (what they read past a share's edge is taken from the whole sequence:
    ``sequence_parallel.Batch.ahead``)."""
    from shardyard.backends import engine

    b, m = cfg.backend, cfg.model
    sp, cp = int(b.get("sp", 1)), int(b.get("cp", 1))
    if sp == 1 and cp == 1:
        return
    if sp > 1 and cp > 1:
        raise UserError("backend.cp", cp, f"backend.sp={sp} splits the sequences already: one way at a time.",
                        "Use backend.cp=1 with backend.sp (heads that divide by it), or backend.sp=1 with backend.cp.")
    key, n, what = ("backend.sp", sp, "sequence") if sp > 1 else ("backend.cp", cp, "context")
    keys = getattr(engine(b), "degree_keys", {})
    if key.split(".")[1] not in keys:
        engines = "ddp, fsdp, fsdp_offload, fsdp_tp, pipeline, zero1, zero2 or zero3" if cp > 1 else \
            "ddp, fsdp, fsdp_offload, zero1, zero2 or zero3"
        if "cp" in keys:  # the pipeline and fsdp_tp: all-gather context parallelism only
            raise UserError(key, n, f"backend={b.name} splits sequences with backend.cp (all-gather context "
                            "parallelism, any head count), not with Ulysses' all-to-all over the heads.",
                            f"Use backend.cp={n} instead, or backend={engines} for {what} parallelism.")
        raise UserError(key, n, f"backend={b.name} does not split sequences.",
                        f"Use backend={engines} for {what} parallelism, or {key}=1.")
    ok = [d for d in range(2, dims.world_size + 1) if dims.world_size % d == 0]
    heads = m.get("num_heads")
    if sp > 1 and heads and heads % sp:
        ok = [d for d in ok if heads % d == 0]
        raise UserError(key, sp, f"Each rank of a sequence group attends with whole heads, so it must divide "
                        f"the model's {heads} attention heads (model.num_heads).",
                        f"Use backend.sp in {ok or [1]} (dividing both the heads and the world of {dims.world_size}), "
                        "or backend.cp (any head count).")
    seq, parts = int(cfg.data.seq_len), sp if sp > 1 else 2 * cp
    if seq % parts:
        raise UserError(key, n, f"Each rank of a sequence group holds equal shares of the positions ({parts} of them "
                        f"in all), so {parts} must divide data.seq_len={seq}.",
                        f"Use data.seq_len={seq - seq % parts} (a multiple of {parts}), or a {key} that divides it.")
    from shardyard import objectives

    objective = str(cfg.objective.get("name", "lm"))
    if objective != "lm" and "tp" in keys:
        raise UserError(key, n, f"objective={objective} cuts its own rows under {what} parallelism on the data-parallel "
                        "engines (tests/dist/test_sequence_parallel_post_training.py); beside tensor parallel it is not "
                        "tried.", f"Use backend=fsdp (or ddp, zero1-3) with {key}={n}, or {key}=1 on backend={b.name}.")
    if objective != "lm" and cfg.objective.get("precompute_ref_logps"):
        raise UserError("objective.precompute_ref_logps", True, f"The precomputed reference log-probabilities are "
                        f"computed from whole rows on every rank, which {what} parallelism exists to avoid (the "
                        "sequence's activations on one rank).",
                        f"Use objective.precompute_ref_logps=false with {key}={n} (the reference then runs on each "
                        f"rank's share), or {key}=1.")
    if objective != "lm" and not objectives.splits_sequences(cfg.objective):
        raise UserError(key, n, f"{what.capitalize()} parallelism splits pre-training and SFT sequences, and DPO's and "
                        f"GRPO's; objective={objective} ({cfg.objective.get('_target_')}) does not state that it cuts "
                        "its own rows (splits_sequences).",
                        f"Use {key}=1 with this objective, or give its class splits_sequences = True and cut its rows "
                        "with shardyard.backends.sequence_parallel.shard (objectives.Objective).")


def _common_divisors(a: int, b: int) -> str:
    return ", ".join(f"backend.ep={d}" for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0)


def validate_finetune(cfg: DictConfig, src, facts) -> None:
    """SFT rows and early stopping (after the model is inspected)."""
    m, tr = cfg.model, cfg.train
    if cfg.data.document_mask and facts.attn is None:
        raise UserError("data.document_mask", True, "Document masking passes per-document positions and a "
                        "block-diagonal attention mask as keyword arguments that only an HF model (PreTrainedModel) "
                        f"takes; model {m.name} is a plain module.", "Use an HF model (model=hf, deepseek_tiny, "
                        "deepseek7b, ...), or data.document_mask=false.")
    if hasattr(src, "tokenize_rows") and facts.attn is None:
        raise UserError("data", cfg.data._target_, "Its rows carry per-conversation positions and a block-diagonal "
                        "attention mask, passed as keyword arguments that only an HF model (PreTrainedModel) takes; "
                        f"model {m.name} is a plain module.", "Use an HF model (model=hf, deepseek_tiny, deepseek7b, ...).")
    if tr.early_stopping_patience is not None:
        at_least("train.early_stopping_patience", tr.early_stopping_patience, 1)
    at_least("train.warn_after_evals", tr.warn_after_evals, 0)


def validate_objective(cfg: DictConfig, src: Any) -> None:
    """``objective``: its own values (the class checks them as it is built: G, beta, epsilon, the rewards'
    ``_target_``s), the rows it trains on, and what the engine and the model must offer it."""
    from shardyard import objectives
    from shardyard.backends import engine

    o = cfg.objective
    objective = objectives.build(cfg)
    want, have = getattr(objective, "data_kind", "text"), getattr(src, "kind", "text")
    if want != have:
        option = {"text": "a text or conversation option (stdlib_code, text_files, mixture, sft, arithmetic)",
                  "preference": "data=preference", "prompts": "data=prompts"}
        raise UserError("data", cfg.data._target_, f"objective={o.name} trains on {option.get(want, want)}; this "
                        f"data option gives {option.get(have, have)} rows.",
                        f"Use {option.get(want, want)}, or the objective that trains on these rows.")
    if want == "text":
        return
    eng = engine(cfg.backend)
    if not getattr(eng, "post_training", True):
        raise UserError("backend", cfg.backend.name, f"objective={o.name} needs each sequence's log-probabilities "
                        "from one forward of the whole model (and GRPO samples completions with it); this engine "
                        "splits the model into pipeline stages.",
                        "Use backend=fsdp or zero3 (sharded), ddp, zero1/zero2, fsdp_tp, horovod or single.")
    m = cfg.model
    _validate_reference_weights(cfg)
    if m.get("loss_chunk", 0):
        raise UserError("model.loss_chunk", m.loss_chunk, f"objective={o.name} reads each token's log-probability; "
                        "the chunked loss head returns only the summed cross-entropy.", "Use model.loss_chunk=0.")
    if m.get("mtp") is not None and int(m.mtp.depth):
        raise UserError("model.mtp.depth", m.mtp.depth, f"objective={o.name} trains the main head only; multi-token "
                        "prediction depths are a pre-training objective.", "Use model.mtp.depth=0.")


def validate_eval_tasks(cfg: DictConfig) -> None:
    """``train.eval_tasks``: the harness installed, every task one it knows (``harness.check_tasks``: the shipped,
    ``train.eval_tasks_include_path``'s, its own), none a generation task (where its YAML tells), a limit
    ``options.limit`` takes, and an engine whose ranks each run the whole model's forward (every rank scores the
    tasks in lockstep: ``harness.InTraining``)."""
    from shardyard.evaluation import harness
    from shardyard.config import options
    from shardyard.backends import engine

    tr = cfg.train
    tasks = list(tr.get("eval_tasks") or [])
    options.limit("train.eval_tasks_limit", tr.get("eval_tasks_limit"))  # a bad value is refused even unused
    if not tasks:
        if tr.get("eval_tasks_include_path"):
            raise UserError("train.eval_tasks_include_path", tr.eval_tasks_include_path, "It names a directory of "
                            "task YAMLs, and train.eval_tasks names no task.",
                            "Add train.eval_tasks=[NAME] (a task of that directory), or drop the path.")
        return
    if not getattr(engine(cfg.backend), "post_training", True):
        raise UserError("train.eval_tasks", tasks, "The harness scores each request with one forward of the whole "
                        f"model on every rank, and backend={cfg.backend.name} splits the model into pipeline stages.",
                        "Score the run's export after training with `shardyard eval RUN tasks=[...]`, or use "
                        "backend=fsdp, zero3, fsdp_tp, ddp or zero1/zero2 for scores during training.")
    harness.require_harness("train.eval_tasks", "leave train.eval_tasks unset")
    manager = harness.check_tasks(tasks, tr.get("eval_tasks_include_path"), key="train.eval_tasks",
                                  include_key="train.eval_tasks_include_path")
    generating = harness.generation_tasks(manager, tasks)
    if generating:
        raise UserError("train.eval_tasks", generating[0] if len(generating) == 1 else generating,
                        "Generation tasks (output_type generate_until) are not scored during training: only "
                        "log-likelihood and multiple-choice tasks run in lockstep on every rank.",
                        "Score them after the run with `shardyard eval RUN tasks=[...]`, and keep "
                        "train.eval_tasks to log-likelihood and multiple-choice tasks.")
    if cfg.plan.hardware is None:  # built here, before any rank starts: a YAML that does not build is named now
        harness.build_tasks(manager, tasks, key="train.eval_tasks")


def _validate_reference_weights(cfg: DictConfig) -> None:
    """``objective.reference_weights``: a directory of safetensors whose tensors are the policy's, by name and shape
    (read from the files' headers, against the policy built on the meta device), so the reference loads on every
    engine; else exit 2 naming the first tensor that differs."""
    from shardyard.models.build import shape_model
    from shardyard.models.shape import signature
    from shardyard.objectives import held

    w = cfg.objective.get("reference_weights")
    key = "objective.reference_weights"
    if w and cfg.peft.name != "none":
        raise UserError(key, w, f"With peft={cfg.peft.name} the reference is the policy with its adapters disabled "
                        "(no second model), so other reference weights would not be used.",
                        "Drop objective.reference_weights, or train without adapters (peft=none).")
    if w and not held(cfg.objective)[0] and not cfg.objective.get("precompute_ref_logps"):
        raise UserError(key, w, "This objective holds no reference model (GRPO with objective.beta=0: no KL term).",
                        "Drop objective.reference_weights, or set objective.beta above 0.")
    if w is not None and not str(w).strip():  # a variable that expanded to nothing: never the policy's silently
        raise UserError(key, w, "The value is empty.", "Give the reference checkpoint's directory, or null (leave it "
                        "unset) for the policy's own starting weights.")
    if not w or cfg.plan.hardware is not None:  # planning for other machines: their files are not here to check
        return
    import glob

    d = os.path.expanduser(str(w))
    if not os.path.isdir(d) or not glob.glob(os.path.join(d, "*.safetensors")):
        bins = os.path.isdir(d) and bool(glob.glob(os.path.join(d, "*.bin")))
        raise UserError(key, w, "It holds only PyTorch .bin weights (pickles, which shardyard does not load: "
                        "unpickling runs code from the file)." if bins else "No directory of *.safetensors weights "
                        "is there.", "Point it at an HF checkpoint of the policy's architecture in safetensors (e.g. "
                        "an SFT run's hf/ export; transformers' save_pretrained writes them), or null for the "
                        "policy's own starting weights.")
    check_safetensors_dir(key, d)  # whole files, every indexed shard there: what model.weights gets
    from safetensors import SafetensorError, safe_open

    have: dict[str, list[int]] = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        try:
            with safe_open(f, framework="pt") as fh:
                have.update({name: list(fh.get_slice(name).get_shape()) for name in fh.keys()})
        except (SafetensorError, OSError, ValueError) as e:  # a header that parses but safetensors refuses
            raise UserError(key, f, f"The weights file cannot be read ({type(e).__name__}: {e}).",
                            "Copy or download it again, or point objective.reference_weights at a complete "
                            "checkpoint.") from None
    want = signature(shape_model(cfg.model))
    for name, shape in want.items():
        if name not in have or have[name] != shape:
            got = f"shape {have[name]}" if name in have else "no such tensor"
            raise UserError(key, w, f"The reference does not match the policy ({cfg.model.name}): {name} is {shape} "
                            f"in the policy and has {got} there.",
                            "Use a checkpoint of the policy's architecture and size (the same model option and "
                            "shape keys), or null for the policy's own starting weights.")


SWEEP_METRICS = ("train/loss", "eval/loss", "eval/ppl", "lr", "grad_norm", "tokens_per_s", "samples_per_s",
                 "step_time_s", "data_time_s", "tflops_per_device", "mfu", "loss_scale", "skipped_steps")
"""What ``metrics.jsonl`` holds (``loop.train``), so what a sweep can rank by (``memory/*`` too)."""


def validate_sweep(sw: DictConfig) -> None:
    if sw.objective not in SWEEP_METRICS and not str(sw.objective).startswith("memory/"):
        raise UserError("sweep.objective", sw.objective, "The runs log no such metric.",
                        f"Use one of {', '.join(SWEEP_METRICS)} or memory/*.")
    if not 1024 <= sw.base_port <= 65535 - 64 * 16:
        raise UserError("sweep.base_port", sw.base_port, "Job slots take 64 ports each from it, above the "
                        "privileged ports.", f"Use a port between 1024 and {65535 - 64 * 16}, e.g. 29600.")


def _gpu_capability() -> tuple[str, float] | None:
    """The first GPU's name and compute capability from nvidia-smi, leaving CUDA uninitialised in this process
    (a parallel sweep forks its jobs from it); None without nvidia-smi."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        name, cap = out[0].rsplit(",", 1)
        return name.strip(), float(cap)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _refuse_tiles_beside(m: DictConfig, key: str, what: str, clashes: tuple) -> None:
    """``model.<key>`` (tiles above 1) refused beside the first of ``clashes`` that is on: (setting, on, why)."""
    if int(m.get(key, 0)) <= 1:
        return
    for clash, on, why in clashes:
        if on:
            raise UserError(f"model.{key}", m[key], f"{what} are not taken with {clash}: {why}.",
                            f"Use model.{key}=0, or leave {clash.split('=')[0]} at its default.")


def validate_speed_options(cfg: DictConfig) -> None:
    """The keys that buy throughput or memory (docs/performance.md): their values, and the adapters fp8 cannot
    convert. Which engines take each one is the engine's own ``validate``."""
    from shardyard.config import checkpointing_mode

    m = cfg.model
    checkpointing_mode(m)  # raises UserError on a value it does not know
    at_least("model.activation_checkpointing_every", m.get("activation_checkpointing_every", 1), 1)
    at_least("model.loss_chunk", m.get("loss_chunk", 0), 0)
    at_least("model.mlp_tiles", m.get("mlp_tiles", 0), 0)
    selective, compiled = checkpointing_mode(m) == "selective", bool(m.get("compile"))
    _refuse_tiles_beside(m, "mlp_tiles", "Tiled MLPs", (
        ("model.activation_checkpointing=selective", selective,
         "selective checkpointing keeps the MLP's matmul outputs, which the tiles recompute"),
        ("model.compile=true", compiled, "the compiled blocks would trace the tiles' checkpoints (not tried on torch 2.13)"),
        (f"peft={cfg.peft.name}", cfg.peft.name != "none",
         "the plan counts what a frozen base's MLP keeps untiled (the adapters keep their own)"),
        ("precision=fp8", cfg.precision.name == "fp8",
         "each tile would take its own float8 scales, not the untiled MLP's (not tried)")))
    at_least("model.norm_tiles", m.get("norm_tiles", 0), 0)
    _refuse_tiles_beside(m, "norm_tiles", "Tiled norms", (
        ("model.activation_checkpointing=selective", selective,
         "selective checkpointing's policy would save the tiles' outputs it is meant to recompute"),
        ("model.compile=true", compiled, "the compiled blocks would trace the tiles' checkpoints (not tried on torch 2.13)")))
    if m.get("activation_offload"):
        for clash, on, why in (
                (f"model.activation_checkpointing={checkpointing_mode(m)}", checkpointing_mode(m) != "full",
                 "it offloads what full checkpointing keeps of each block, its input"),
                ("model.activation_checkpointing_every", int(m.get("activation_checkpointing_every", 1)) != 1,
                 "the blocks not checkpointed keep every activation on the GPU (not counted with offload)"),
                ("model.compile=true", bool(m.get("compile")),
                 "the compiled blocks would trace its host copies (not tried on torch 2.13)")):
            if on:
                raise UserError("model.activation_offload", True, f"Offloading the checkpointed activations is not "
                                f"taken with {clash}: {why}.",
                                "Use model.activation_checkpointing=full (every block, no compile) with it, or "
                                "model.activation_offload=false.")
    if cfg.precision.name == "fp8" and cfg.peft.name != "none":
        raise UserError("precision", "fp8", f"Float8 linears replace the blocks' nn.Linear layers, which peft="
                        f"{cfg.peft.name} wraps with its adapters (and QLoRA quantizes to 4 bits).",
                        "Use precision=bf16 with adapters, or peft=none for fp8 training.")


def validate_precision(pr: DictConfig, dev: str) -> None:
    import torch

    from shardyard.config.schema import Precision

    precision = Precision(pr.name)
    if precision is Precision.fp8:
        gpu = _gpu_capability() if dev == "cuda" else None
        if gpu is not None and gpu[1] < 8.9:  # float8 tensor cores: Ada (8.9) and Hopper (9.0) on
            raise UserError("precision", "fp8", f"This GPU ({gpu[0]}, compute capability {gpu[1]}) has no float8 "
                            "matmuls (Ada, 8.9, and Hopper, 9.0, and later have them).", "Use precision=bf16.")
    if precision in (Precision.bf16, Precision.fp8) and dev == "cuda":
        gpu = _gpu_capability()
        if gpu is None:  # no nvidia-smi: ask torch (this initialises CUDA here)
            gpu = (torch.cuda.get_device_name(), 8.0 if torch.cuda.is_bf16_supported() else 0.0)
        if gpu[1] < 8.0:  # bf16 tensor cores from Ampere (sm_80) on
            raise UserError("precision", pr.name, f"This GPU ({gpu[0]}, compute capability {gpu[1]}) has no native "
                            "bf16 (Ampere, 8.0, and later have it; older GPUs would emulate it, slowly).",
                            "Use precision=fp16 (loss-scaled) or precision=fp32.")
    if precision is not Precision.fp32 and not torch.amp.autocast_mode.is_autocast_available(dev):
        raise UserError("precision", pr.name, f"This torch build has no autocast for {dev}.", "Use precision=fp32.")
    if precision is Precision.fp16 and dev == "cpu":
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                torch.ones(2, 2) @ torch.ones(2, 2)
        except RuntimeError as e:
            raise UserError("precision", "fp16", f"This CPU torch build cannot run fp16 autocast ({e}).",
                            "Use precision=bf16 or precision=fp32 on CPU.") from None
