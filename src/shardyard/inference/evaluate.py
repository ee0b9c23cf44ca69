"""``shardyard eval PATH [KEY=VALUE ...] [train.py data overrides]``: score a run, a checkpoint or an HF export.

1. **Perplexity**: the held-out loss of the run's data (or of the data the overrides name, e.g. ``data=text_files
   'data.paths=[...]'``), prepared by ``shardyard.data.pipeline`` exactly as training prepares it (the same token caches and
   val split; with overrides, tokenized with the model's own tokenizer), over exactly the sequences a training
   eval scores (``train.eval_batches`` micro-batches per data-parallel rank, ``data.eval_batches``' order), and
   weighed as ``loop.evaluate`` weighs them: a source's loss is the mean over its label tokens, a mixture's the
   mixture-weighted mean of its sources' (``eval/loss/<source>`` each). On the run's own data and precision it is
   the run's logged ``eval/loss`` at the step the weights are from. ``eval_batches=0`` scores the whole val split.
2. **The lm-evaluation-harness** (``lm-eval``, the ``eval`` extra; imported only when ``tasks`` is given) on the
   tasks named: the harness's own, the YAML tasks in ``include_path`` (local ``data_files``: absolute, or relative
   to the directory ``shardyard eval`` runs in, as ``datasets`` reads them), and the tasks shipped in
   ``shardyard/evaluation/tasks`` (always included: ``stdlib_qa``). The loaded model object is handed to the harness's
   own ``HFLM`` wrapper, so scores are those of ``lm_eval --model hf --model_args pretrained=EXPORT``.

Results: a table on the console and one JSON file (``out``; default ``<run dir>/eval/<UTC time>.json``, never
overwritten).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from shardyard.config import options
from shardyard.core.errors import UserError
from shardyard.evaluation.harness import build_tasks, check_tasks, harness, require_harness



@dataclass
class EvalOptions:
    """The keys ``shardyard eval`` takes for itself; every other ``KEY=VALUE`` is a ``train.py`` override of the
    data to compute perplexity on (``data=...``, ``data.*``, ``train.eval_batches``, ``train.micro_batch_size``)."""

    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks, e.g. ``tasks=[stdlib_qa,hellaswag]`` (needs ``pip install shardyard[eval]``);
    none: perplexity only."""
    include_path: Optional[str] = None
    """A directory of the user's harness task YAMLs (searched beside the shipped ``shardyard/evaluation/tasks``)."""
    limit: Optional[float] = None
    """At most this many documents per task (a fraction when below 1); all when unset."""
    num_fewshot: Optional[int] = None
    """Few-shot examples per prompt; each task's own default when unset."""
    batch_size: int = 8
    """Requests per forward in the harness."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N``; ``auto``: the first GPU when there is one, else the CPU."""
    dtype: Optional[str] = None
    """The weights' dtype for evaluation (``float32``, ``bfloat16``, ``float16``); the saved one when unset."""
    perplexity: Optional[bool] = None
    """Compute the held-out perplexity; default: when data overrides are given, or the run trained a language
    model (its eval logged ``eval/ppl``)."""
    eval_batches: Optional[int] = None
    """Perplexity over this many micro-batches per data-parallel rank of the run (the run's
    ``train.eval_batches`` when unset: the same sequences its own evals scored); 0: the whole val split."""
    seed: int = 1234
    """The harness's random, numpy and torch seeds (few-shot sampling)."""
    out: Optional[str] = None
    """The results' JSON file; default ``<run dir>/eval/<UTC time>.json`` (``./eval/`` for a bare export). An
    existing file is never overwritten."""


def parse(args: list[str]) -> tuple[str, EvalOptions, list[str]]:
    """``PATH``, this command's options and the ``train.py`` overrides from the command line."""
    paths = [a for a in args if "=" not in a]
    if len(paths) != 1:
        raise UserError("shardyard eval", " ".join(args) or "(nothing)",
                        "It takes one PATH (a run dir, a checkpoint or an HF export) and KEY=VALUE arguments"
                        + (f"; {len(paths)} arguments without '=' were given ({', '.join(paths)})." if paths else
                           ", and no PATH was given."),
                        "Write e.g. `shardyard eval outputs/DATE/TIME tasks=[stdlib_qa]`.")
    opts = EvalOptions()
    types = {f.name: f.type for f in fields(EvalOptions)}
    overrides = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq:
            continue
        if key not in types:
            overrides.append(arg)
            continue
        setattr(opts, key, _value(key, value, str(types[key])))
    return paths[0], opts, overrides


def _value(key: str, text: str, kind: str) -> Any:
    """One key's value: a list key's names (``tasks=[a, b]``, ``tasks=a,b``), else ``options.value``'s reading
    (``null``, ``true``/``false``, a number) with this command's ranges: no negative count (``batch_size`` 1 or
    more), and ``limit`` a count or a fraction below 1 (``options.limit``)."""
    options.nonempty(key, text)
    if kind.startswith("list"):
        names = [t.strip().strip("'\"") for t in text.strip().strip("[]").split(",")]
        return [t for t in names if t]
    got = options.value(key, text.strip(), kind)
    if key == "limit":
        return options.limit(key, got)
    least = 1 if key == "batch_size" else 0
    if isinstance(got, int) and not isinstance(got, bool) and got < least:
        raise UserError(key, text, f"It must be a whole number of {least} or more.", f"Use e.g. {key}=8.")
    if key == "seed" and isinstance(got, int) and got >= 1 << 32:  # numpy's seeds: below 2**32
        raise UserError(key, text, "It must be below 2**32 (numpy's seeds are).", "Use e.g. seed=1234.")
    return got


# ----------------------------------------------------------------------------------------------- main
def main(args: list[str]) -> None:
    """The command: load PATH (``shardyard.inference.load``), score it, print the table, write the JSON."""
    from shardyard.inference import loading as inference

    path, opts, overrides = parse(args)
    dtype = options.dtype(opts.dtype)
    device = options.device(opts.device)  # device=foo, or a GPU this process does not see: before anything loads
    manager = loaded = None
    if opts.include_path and not opts.tasks:
        raise UserError("include_path", opts.include_path, "It names a directory of task YAMLs, and no tasks=[...] "
                        "asks for a task.", "Add tasks=[NAME] (a task of that directory), or drop include_path.")
    if opts.out is not None:  # a file it cannot write is named before anything is computed
        _out_path(opts.out, None)
    if opts.tasks:  # before the model loads: a misspelt task, a task YAML that does not build, no harness
        require_harness()
        manager = check_tasks(opts.tasks, opts.include_path)
        loaded = build_tasks(manager, opts.tasks)
    trained = inference.load(path, device=device, dtype=dtype)
    out = _out_path(opts.out, trained.run_dir)
    results = evaluate(trained, opts, overrides, manager, loaded)
    results["path"] = str(trained.path)
    print(table(results))
    print(f"shardyard | results: {_write(out, results)}")


def evaluate(trained: Any, opts: EvalOptions, overrides: list[str], manager: Any = None,
             loaded: dict | None = None) -> dict:
    """Perplexity and harness scores of a loaded model (``inference.Trained``): ``{"perplexity": {...} | None,
    "tasks": {task: {metric: value, metric_stderr: ...}}, "options": {...}}``. ``manager``: the harness's
    ``TaskManager`` holding ``opts.tasks`` (``check_tasks``'), when already built; ``loaded``: the tasks built
    (``build_tasks``')."""
    results: dict = {"options": dataclasses.asdict(opts), "overrides": list(overrides), "perplexity": None,
                     "tasks": {}}
    wants_perplexity = opts.perplexity if opts.perplexity is not None else (bool(overrides)
                                                                             or _trained_lm(trained.run_dir))
    if not wants_perplexity and not opts.tasks:
        raise UserError("tasks", "(none)", f"There is nothing to evaluate on {trained.path}: no tasks were named, "
                        "and no perplexity is computed (perplexity=false, or a model with no language-model run "
                        "around it and no data named).",
                        "Name harness tasks (tasks=[stdlib_qa]) or the data for a perplexity (data=text_files "
                        "'data.paths=[...]').")
    if wants_perplexity:
        cfg = perplexity_config(trained, overrides)
        layout = run_layout(trained.run_dir, cfg)
        batches = cfg.train.eval_batches if opts.eval_batches is None else opts.eval_batches
        results["perplexity"] = perplexity(trained.model, cfg, batches=batches, **layout)
    if opts.tasks:
        results["tasks"] = harness(trained.model, trained.tokenizer, opts.tasks, include_path=opts.include_path,
                                   limit=opts.limit, num_fewshot=opts.num_fewshot, batch_size=opts.batch_size,
                                   seed=opts.seed, manager=manager, loaded=loaded)
    return results


def _out_path(out: str | None, run_dir: str | None) -> str:
    if out is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%S-%fZ")
        out = os.path.join(run_dir or ".", "eval", f"{stamp}.json")
    if os.path.isdir(out):
        raise UserError("out", out, "It is a directory, and out names the results' JSON file.",
                        f"Give a file name, e.g. out={os.path.join(out, 'results.json')}.")
    if os.path.exists(out):
        raise UserError("out", out, "That file exists, and shardyard eval never overwrites results.",
                        "Give another out=FILE, or leave out unset (a new timestamped file in the run's eval/).")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):  # the directories made for it: under the nearest one that exists
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError("out", out, f"It cannot be written: {parent} is " + ("a file, not a directory." if not
                        os.path.isdir(parent) else "not writable."),
                        "Give a file in a directory you can write, or leave out unset.")
    return out


def _write(out: str, results: dict) -> str:
    """The results' JSON written to ``out`` (a new file); when a file took that name meanwhile, or the directory
    cannot be written after all, beside it or in the working directory, so the results computed are not lost."""
    text = json.dumps(results, indent=1, default=str)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%S-%fZ")
    stem = os.path.splitext(os.path.basename(out))[0] or "results"
    for path in (out, os.path.join(os.path.dirname(out), f"{stem}-{stamp}.json"), f"eval-{stamp}.json"):
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "x", encoding="utf-8") as f:  # never overwrite
                f.write(text)
            if path != out:
                print(f"shardyard | {out} could not be written (a file took the name, or its directory is not "
                      f"writable): the results went to {path}", file=sys.stderr, flush=True)
            return path
        except OSError:
            continue
    print(text)  # the last resort: on stdout
    raise UserError("out", out, "Neither it nor a file beside it or in the working directory could be written; "
                    "the results are printed above as JSON.", "Give out= a file in a directory you can write.")


def _trained_lm(run_dir: str | None) -> bool:
    """The run trained a language model: its evals logged a perplexity (``objective=lm``; DPO and GRPO runs log
    their own metrics instead)."""
    if not run_dir:
        return False
    summary = os.path.join(run_dir, "summary.json")
    if os.path.isfile(summary):
        with open(summary) as f:
            return "eval/ppl" in (json.load(f).get("final_eval") or {})
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics) as f:
            return any('"eval/ppl"' in line for line in f)
    return False


# ----------------------------------------------------------------------------------------------- perplexity
def perplexity_config(trained: Any, overrides: list[str]) -> Any:
    """The config whose data the perplexity is computed on: the run's own (its resolved config) when there are no
    overrides; else the run's config (or the defaults, for a bare export) with the overrides applied, composed
    as ``train.py`` composes them, and the model's tokenizer (the data tokenized as the model reads it)."""
    from hydra.errors import HydraException
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from shardyard import config

    if not overrides:
        if trained.cfg is None:
            raise UserError("perplexity", "true", f"{trained.path} is an HF export without a shardyard run around "
                            "it, so there is no run data to compute the perplexity on.",
                            "Name the data (e.g. data=text_files 'data.paths=[/corpus/*.txt]'), or set "
                            "perplexity=false.")
        return trained.cfg
    try:
        composed = config.compose(overrides, run_dir=str(trained.run_dir or "."))
    except (HydraException, OmegaConfBaseException) as e:
        problem = str(e).split("Config search path")[0].strip()
        raise UserError("shardyard eval", " ".join(overrides), f"The overrides do not compose: {problem}",
                        "Give data overrides as train.py takes them (`python train.py --help` lists the groups), "
                        "or shardyard eval's own keys (`shardyard eval --help`).") from None
    base = trained.cfg if trained.cfg is not None else composed
    cfg = OmegaConf.create(OmegaConf.to_container(base, resolve=True))
    assert isinstance(cfg, DictConfig)
    OmegaConf.set_struct(cfg, False)
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    for key in keys:  # a group choice (data=mixture) replaces its section; a key (train.eval_batches=4) is set alone
        value = OmegaConf.select(composed, key)
        OmegaConf.update(cfg, key, OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value)
                         else value, merge=False, force_add=True)
    given = {k.split(".")[0] for k in keys}
    if "data" in keys and "data.seq_len" not in keys and trained.cfg is not None:
        cfg.data.seq_len = trained.cfg.data.seq_len  # another data option, read in the run's sequence length
    if "data" in given or trained.cfg is None:
        cfg.data.tokenizer.path = _tokenizer_dir(trained)
    return cfg


def _tokenizer_dir(trained: Any) -> str:
    """A directory holding the model's ``tokenizer.json``: the export's own, or the run's tokenizer cache."""
    from shardyard.data import pipeline as data

    candidates = [str(trained.path)]
    if trained.cfg is not None:
        found = data.tokenizer_path(trained.cfg)
        candidates.append(found or data.tokenizer_dir(trained.cfg.data, data.open_sources(trained.cfg.data)))
    if trained.run_dir:
        candidates.append(os.path.join(trained.run_dir, "hf"))
    for d in candidates:
        if os.path.isfile(os.path.join(d, "tokenizer.json")):
            return d
    raise UserError("data", "(overrides)", f"The model's tokenizer (tokenizer.json) was found in none of "
                    f"{', '.join(candidates)}, so other data cannot be tokenized as the model reads it.",
                    "Prepare the run's own data once (`shardyard data` with the run's overrides), or evaluate its "
                    "HF export (checkpoint.export_hf=true writes one).")


def run_layout(run_dir: str | None, cfg: Any) -> dict:
    """``{"world": data-parallel ranks, "micro_batch", "global_batch"}`` of the run (its ``plan.json``): the
    sequences a training eval scores are the first ``eval_batches x micro_batch x world`` of each val split, and
    a mixture's weights are the ones over ``train.steps x global_batch`` samples. Without a run: one rank, the
    config's batch sizes."""
    plan_file = os.path.join(run_dir, "plan.json") if run_dir else ""
    if plan_file and os.path.isfile(plan_file):
        with open(plan_file) as f:
            plan = json.load(f)
        dims = plan.get("dims") or {}
        world = int(dims.get("dp_replicate", 1)) * int(dims.get("dp_shard", 1)) if dims else int(plan["world_size"])
        return {"world": max(world, 1), "micro_batch": int(plan["micro_batch_size"]),
                "global_batch": int(plan["global_batch_size"])}
    micro = int(cfg.train.micro_batch_size)
    return {"world": 1, "micro_batch": micro, "global_batch": int(cfg.train.get("global_batch_size") or micro)}


def perplexity(model: Any, cfg: Any, *, batches: int, micro_batch: int, world: int = 1,
               global_batch: int | None = None) -> dict:
    """The held-out loss and perplexity of ``model`` on ``cfg``'s data (see the module docstring): ``{"loss",
    "ppl", "tokens", "sequences", "sources": {name: {"loss", "ppl", "tokens", "sequences", "weight"}}}``; each
    source scored on the sequences ``world`` ranks' ``loop.evaluate`` scores (``batches`` micro-batches of
    ``micro_batch`` each per rank; 0: the whole split), its loss token-exact: the sum of each micro-batch's mean
    times its label count, over the label count."""
    import torch

    from shardyard.data import pipeline as data
    from shardyard.models.loss import causal_lm_loss
    from shardyard.objectives import to_device

    prepared = data.prepare(cfg)
    val = data.open_val(prepared, cfg.data)
    device = next(model.parameters()).device
    sources = {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for part, (name, rows) in zip(prepared.parts, val.items()):
            if isinstance(rows, data.PromptRows):
                raise UserError("data", cfg.data.get("_target_"), f"Source {name}'s rows are prompts without "
                                "targets (GRPO's data), which have no perplexity.",
                                "Name text data (data=text_files ...), or set perplexity=false.")
            if batches:
                chunks: Any = (b for r in range(world) for b in data.eval_batches(rows, batches, micro_batch, r, world))
                seqs = batches * world * micro_batch
            else:  # the whole split, in micro-batches (the last one shorter)
                chunks = (rows.get(list(range(i, min(i + micro_batch, len(rows)))))
                          for i in range(0, len(rows), micro_batch))
                seqs = len(rows)
            total, count = torch.zeros((), dtype=torch.float64), 0
            for x, y in chunks:
                n = int((y != -100).sum())
                if n == 0:
                    continue
                mean = causal_lm_loss(model, to_device(x, device), y.to(device)).float()
                total += (mean * n).double().cpu()
                count += n
            loss = float(total / max(count, 1))
            sources[name] = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count, "sequences": seqs,
                             "weight": part.weight}
    model.train(was_training)
    if len(sources) > 1:
        weights = _mixture_weights(prepared, cfg, global_batch or micro_batch * world)
        for name, w in weights.items():
            sources[name]["weight"] = w
        loss = sum(weights[n] * s["loss"] for n, s in sources.items())
    else:
        loss = next(iter(sources.values()))["loss"]
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": sum(s["tokens"] for s in sources.values()),
            "sequences": sum(s["sequences"] for s in sources.values()), "sources": sources}


def _mixture_weights(prepared: Any, cfg: Any, global_batch: int) -> dict[str, float]:
    """The mixture's weights as the run's ``TrainStream.weights()`` holds them (``epochs`` caps applied over the
    run's samples): what ``loop.evaluate`` weighs its sources' losses with."""
    from shardyard.data import pipeline as data

    total = int(cfg.train.steps) * global_batch
    mixed = data.open_train(prepared, cfg.data, int(cfg.seed), total)
    return dict(zip(mixed.names, mixed.weights))


def table(results: dict) -> str:
    """The console table: task, metric, value, stderr; then the perplexity and loss per source."""
    lines = []
    if results.get("tasks"):
        lines.append(f"{'task':24} {'metric':16} {'value':>10} {'stderr':>10}")
        for task, metrics in results["tasks"].items():
            for metric, value in metrics.items():
                if metric.endswith("_stderr") or "_stderr," in metric:
                    continue
                err = metrics.get(metric.replace(",", "_stderr,") if "," in metric else f"{metric}_stderr")
                lines.append(f"{task:24} {metric:16} {value:10.4f} "
                             f"{'-' if err is None else format(err, '10.4f'):>10}")  # the harness's N/A: -
    ppl = results.get("perplexity")
    if ppl:
        lines.append(f"{'data':24} {'loss':>10} {'perplexity':>12} {'tokens':>10}")
        if len(ppl["sources"]) > 1:
            for name, s in ppl["sources"].items():
                lines.append(f"{name:24} {s['loss']:10.4f} {s['ppl']:12.3f} {s['tokens']:10,}")
        lines.append(f"{'(all)' if len(ppl['sources']) > 1 else next(iter(ppl['sources'])):24} {ppl['loss']:10.4f} "
                     f"{ppl['ppl']:12.3f} {ppl['tokens']:10,}")
    return "\n".join(lines)


def keys_help() -> str:
    """``shardyard eval --help``: its own keys, from ``EvalOptions``' field docstrings."""
    return options.keys_help(EvalOptions, ["shardyard eval PATH [KEY=VALUE ...] [train.py data overrides]",
                                 "PATH: a run dir, a checkpoint dir or an HF export. Keys:"], width=13)


if __name__ == "__main__":  # python -m shardyard.inference.evaluate PATH ... (also `shardyard eval`)
    from shardyard.core.errors import report_and_exit

    try:
        main(sys.argv[1:])
    except UserError as err:
        report_and_exit(err)
