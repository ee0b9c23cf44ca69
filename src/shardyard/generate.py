"""``shardyard generate PATH [KEY=VALUE ...]``: talk to what a run trained (issue 45).

``PATH`` is a run dir, a checkpoint or an HF export of any engine, or ``latest`` (``inference.load``). Prompts come
from ``prompt=TEXT`` (repeatable), a JSONL file (``file=X.jsonl``: rows ``{"prompt": str}`` or ``{"messages":
[{"role", "content"}, ...]}``) or stdin (``file=-``). Rows of messages are rendered with the tokenizer's chat
template (shardyard's ``plain`` one when it has none, or ``chat_template=NAME``); ``chat=true`` makes each plain
prompt one user message. Generation is batched (``batch_size`` prompts, left-padded) and KV-cached
(``generation.generate``): greedy at ``temperature=0`` (the default), else sampled with ``top_k`` / ``top_p`` from
a generator seeded by ``seed``. A row ends at the tokenizer's eos, at ``max_new_tokens``, or once its text holds a
``stop`` string (the completion is cut before it).

One prompt and no ``out``: the completion streams to the terminal as it is generated. Otherwise one JSON row per
prompt (``prompt``, ``completion``, ``tokens``, ``stop_reason``: ``eos`` | ``stop`` | ``length``) goes to
``out=FILE`` (never overwritten) or stdout.

``engine=deepspeed`` runs DeepSpeed's inference engine (``deepspeed.init_inference``, tensor parallel over
``tp_size`` processes: ``shardyard.ds_inference``); ``speculative=mtp`` decodes greedily with the model's MTP depths
as the draft (``shardyard.speculative``) and prints the acceptance rate.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Optional, TextIO

from shardyard.errors import UserError

if TYPE_CHECKING:  # torch is imported where it runs: `shardyard --help` builds this command's help
    import torch


@dataclass
class GenerateOptions:
    """The keys of ``shardyard generate PATH [KEY=VALUE ...]``."""

    prompt: list = field(default_factory=list)
    """A prompt (repeatable: ``prompt=a prompt=b``; or one list, ``prompt='[a, b]'``)."""
    file: Optional[str] = None
    """A JSONL file of prompts, one row each: ``{"prompt": "..."}`` or ``{"messages": [{"role": "user", "content":
    "..."}]}``; ``-`` reads stdin."""
    chat: bool = False
    """Render plain prompts as one user message through the chat template (rows of messages always are)."""
    chat_template: Optional[str] = None
    """The chat template: null = the tokenizer's own (else shardyard's ``plain``), a built-in name (``plain``,
    ``chatml``) or a Jinja string."""
    max_new_tokens: int = 64
    """Tokens generated per prompt at most."""
    temperature: float = 0.0
    """0: greedy (argmax); above 0: sampling at this temperature."""
    top_k: int = 0
    """Sample only among the k most probable tokens (0: all)."""
    top_p: float = 1.0
    """Sample only from the nucleus holding this much probability (1: all)."""
    seed: int = 0
    """Seeds the sampling generator: the same seed gives the same completions."""
    stop: list = field(default_factory=list)
    """Stop strings (repeatable, or a list ``stop='[a, b]'``; ``\\n`` is a newline): a row ends once its text holds
    one, and its completion is cut before it."""
    batch_size: int = 8
    """Prompts generated together (left-padded to the longest of the batch)."""
    out: Optional[str] = None
    """Write the JSONL rows here (a new file: an existing one is never overwritten); default stdout."""
    stream: Optional[bool] = None
    """Print the completion token by token; default: when there is one prompt and no ``out``."""
    engine: str = "hf"
    """``hf``: the model in this process (CPU or one GPU); ``deepspeed``: DeepSpeed's inference engine, tensor
    parallel over ``tp_size`` processes."""
    tp_size: int = 1
    """``engine=deepspeed``: tensor-parallel degree (processes; GPUs on a GPU machine)."""
    speculative: str = "none"
    """``mtp``: greedy speculative decoding with the model's multi-token-prediction depths as the draft."""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto`` (a GPU when there is one)."""
    dtype: Optional[str] = None
    """``float32``, ``bfloat16`` or ``float16``; default fp32 on CPU, bf16 on a GPU that has it."""


_CHOICES = {"engine": ("hf", "deepspeed"), "speculative": ("none", "mtp"), "device": ("auto", "cpu", "cuda"),
            "dtype": (None, "float32", "bfloat16", "float16")}


def parse(args: list[str]) -> tuple[str, GenerateOptions]:
    """``PATH KEY=VALUE ...`` -> the path and the options; a wrong key or value is a ``UserError`` naming it."""
    if not args or "=" in args[0]:
        raise UserError("path", args[0] if args else "(none)", "shardyard generate needs the path of what to load "
                        "first.", 'Write e.g. `shardyard generate outputs/<date>/<time> prompt="def main("` (or '
                        "`shardyard generate latest ...`: the newest run under ./outputs).")
    opts = GenerateOptions()
    kinds = {f.name: f for f in fields(GenerateOptions)}
    for arg in args[1:]:
        key, eq, value = arg.partition("=")
        if not eq or key not in kinds:
            raise UserError(key if eq else "shardyard generate", arg, "It is not a key of shardyard generate." if eq
                            else "Arguments after PATH are KEY=VALUE.",
                            f"Use one of {', '.join(kinds)} (shardyard generate --help says what each does).")
        setattr(opts, key, _value(key, value, kinds[key].type, getattr(opts, key)))
    return args[0], opts


def _value(key: str, value: str, kind: Any, now: Any) -> Any:
    kind = str(kind)
    if kind == "list":
        items = _yaml_list(key, value) if value.startswith("[") else [value]
        return [*now, *(_unescape(str(v)) if key == "stop" else str(v) for v in items)]
    if value.lower() in ("null", "none") and kind.startswith("Optional"):
        return None
    if "bool" in kind:
        if value.lower() not in ("true", "false"):
            raise UserError(key, value, "It is true or false.", f"Write {key}=true or {key}=false.")
        return value.lower() == "true"
    if kind in ("int", "float"):
        try:
            return int(value) if kind == "int" else float(value)
        except ValueError:
            raise UserError(key, value, f"It must be a{'n integer' if kind == 'int' else ' number'}.",
                            f"Write e.g. {key}={1 if kind == 'int' else 0.7}.") from None
    if key in _CHOICES and value not in _CHOICES[key]:
        raise UserError(key, value, f"It is one of {', '.join(str(c) for c in _CHOICES[key] if c)}.",
                        f"Write e.g. {key}={_CHOICES[key][1]}.")
    return value


def _yaml_list(key: str, value: str) -> list:
    import yaml

    try:
        items = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise UserError(key, value, f"It is not a list ({str(e).splitlines()[0]}).",
                        f"Write {key}='[a, b]', or give {key}=... once per item.") from None
    if not isinstance(items, list):
        raise UserError(key, value, "It is not a list.", f"Write {key}='[a, b]', or give {key}=... once per item.")
    return items


def _unescape(s: str) -> str:
    return s.replace("\\\\", "\0").replace("\\n", "\n").replace("\\t", "\t").replace("\0", "\\")


# ---------------------------------------------------------------------------------------------- prompts
def read_prompts(opts: GenerateOptions, stdin: TextIO | None = None) -> list[Any]:
    """The prompts: strings, or lists of messages (chat rows), in order: ``prompt=`` ones, then the file's."""
    rows: list[Any] = list(opts.prompt)
    if opts.file is not None:
        name = "<stdin>" if opts.file == "-" else opts.file
        if opts.file == "-":
            lines = (stdin or sys.stdin).read().splitlines()
        else:
            try:
                with open(opts.file, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except OSError as e:
                raise UserError("file", opts.file, f"It cannot be read ({e.strerror}).",
                                "Give a JSONL file of prompts, or file=- for stdin.") from None
        for n, line in enumerate(lines, 1):
            if line.strip():
                rows.append(_row(line, f"{name}:{n}"))
    if not rows:
        raise UserError("prompt", "(none)", "There is no prompt to generate from.",
                        'Give prompt="..." (repeatable), file=prompts.jsonl or file=- (stdin).')
    return rows


def _row(line: str, where: str) -> Any:
    fix = 'Each line is one JSON object: {"prompt": "text"} or {"messages": [{"role": "user", "content": "text"}]}.'
    try:
        row = json.loads(line)
    except ValueError as e:
        raise UserError("file", where, f"That line is not JSON ({e}).", fix) from None
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return row["prompt"]
    messages = row.get("messages") if isinstance(row, dict) else None
    if (isinstance(messages, list) and messages and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                        and isinstance(m.get("content"), str) for m in messages)):
        return messages
    raise UserError("file", where, "That line has neither a string \"prompt\" nor a list of \"messages\" with a "
                    "string role and content each.", fix)


def render(tokenizer: Any, prompt: Any, opts: GenerateOptions) -> str:
    """A prompt's text: a string as it is (``chat=true``: as one user message), messages through the template."""
    if isinstance(prompt, str) and not opts.chat:
        return prompt
    from shardyard.sft import template_for

    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, chat_template=template_for(tokenizer, opts.chat_template),
                                         tokenize=False, add_generation_prompt=True)


# --------------------------------------------------------------------------------------- stop and stream
class Watcher:
    """``generation.generate``'s ``stop`` hook (called once per generated token with every row's completion so
    far): ends a row whose text holds a stop string, and prints row 0's new text as it comes (``out``), holding back
    what could still become a stop string or an unfinished UTF-8 character."""

    def __init__(self, tokenizer: Any, stops: list[str], out: TextIO | None = None, offset: int = 0):
        self.tok, self.stops, self.out = tokenizer, [s for s in stops if s], out
        self.offset = offset  # columns of ``ids`` before the completion (speculative decoding passes whole rows)
        self.printed = ""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        import torch

        texts = [self.text(row[self.offset:]) for row in ids.tolist()]
        if self.out is not None:
            self._show(texts[0])
        return torch.tensor([cut(t, self.stops)[1] for t in texts], dtype=torch.bool, device=ids.device)

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _show(self, text: str) -> None:
        text, stopped = cut(text, self.stops)
        if not stopped:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            hold = max((k for k in range(1, hold + 1) if any(s.startswith(text[-k:]) for s in self.stops)), default=0)
            text = text[:len(text) - hold]
        text = text.rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            assert self.out is not None
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text

    def finish(self, completion: str) -> None:
        """Print what is left of the final completion."""
        if self.out is not None and completion.startswith(self.printed):
            self.out.write(completion[len(self.printed):] + "\n")
            self.out.flush()
            self.printed = completion


def cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (and whether one was there)."""
    at = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


# ------------------------------------------------------------------------------------------ generation
def complete(model: torch.nn.Module, tokenizer: Any, prompts: list[Any], opts: GenerateOptions, *,
             lockstep: bool = False, stream: TextIO | None = None,
             on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per prompt (``prompt``, ``completion``, ``tokens``, ``stop_reason``), ``batch_size`` at a time through
    ``generation.generate`` (or ``speculative.generate_mtp`` per prompt). ``stream``: row 0's text as it comes
    (one prompt). ``lockstep``: every batch runs all ``max_new_tokens`` forwards (tensor-parallel ranks)."""
    import torch

    from shardyard.generation import generate

    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = next((i for i in (tokenizer.pad_token_id, eos) if i is not None), 0)
    g = torch.Generator(device=device).manual_seed(opts.seed)
    rows: list[dict] = []
    for start in range(0, len(prompts), opts.batch_size):
        batch = prompts[start:start + opts.batch_size]
        encoded = [tokenizer(render(tokenizer, p, opts), add_special_tokens=False).input_ids or [pad] for p in batch]
        width = max(map(len, encoded))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
        watcher = Watcher(tokenizer, opts.stop, stream)
        if opts.speculative == "mtp":
            outs = [_speculative(model, ids[i:i + 1, width - len(e):], opts, eos, watcher)
                    for i, e in enumerate(encoded)]
        else:
            out, kept = generate(model, ids, mask, max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
                                 top_k=opts.top_k, top_p=opts.top_p, eos_id=eos, pad_id=pad, generator=g,
                                 lockstep=lockstep, stop=watcher if (opts.stop or stream) else None)
            outs = [o[m.bool()].tolist() for o, m in zip(out, kept)]
        for prompt, tokens in zip(batch, outs):
            text, stopped = cut(watcher.text(tokens), opts.stop)
            reason = "stop" if stopped else "eos" if tokens and tokens[-1] == eos else "length"
            row = {"prompt": prompt, "completion": text, "tokens": len(tokens), "stop_reason": reason}
            rows.append(row)
            if on_row is not None:
                on_row(row)
        if stream is not None:
            watcher.finish(rows[0]["completion"])
    return rows


def _speculative(model: torch.nn.Module, ids: torch.Tensor, opts: GenerateOptions, eos: int | None,
                 watcher: Watcher) -> list[int]:
    from shardyard import speculative

    stop = watcher if (opts.stop or watcher.out is not None) else None
    tokens, stats = speculative.generate_mtp(model, ids, max_new_tokens=opts.max_new_tokens, eos_id=eos, stop=stop)
    print(f"shardyard | speculative=mtp: {stats.accepted}/{stats.drafted} drafted tokens accepted "
          f"({100 * stats.acceptance_rate:.1f}%), {len(tokens)} tokens in {stats.forwards} forwards of the main "
          f"model ({stats.tokens_per_forward:.2f} tokens per forward: the speed-up over one token per forward, "
          "before the drafts' own cost)",
          file=sys.stderr, flush=True)
    return tokens.tolist()


def check(opts: GenerateOptions) -> None:
    """The options' values that need no model."""
    if opts.max_new_tokens < 1:
        raise UserError("max_new_tokens", opts.max_new_tokens, "It must be at least 1.", "Use e.g. max_new_tokens=64.")
    if opts.batch_size < 1:
        raise UserError("batch_size", opts.batch_size, "It must be at least 1.", "Use e.g. batch_size=8.")
    if opts.temperature < 0:
        raise UserError("temperature", opts.temperature, "It cannot be negative.", "Use 0 (greedy) or e.g. 0.8.")
    if opts.top_k < 0:
        raise UserError("top_k", opts.top_k, "It cannot be negative.", "Use 0 (off) or e.g. 50.")
    if not 0 < opts.top_p <= 1:
        raise UserError("top_p", opts.top_p, "It is a probability mass in (0, 1].", "Use 1 (off) or e.g. 0.9.")
    if opts.tp_size < 1:
        raise UserError("tp_size", opts.tp_size, "It must be at least 1.", "Use e.g. tp_size=2.")
    if opts.tp_size > 1 and opts.engine != "deepspeed":
        raise UserError("tp_size", opts.tp_size, "Tensor parallelism is engine=deepspeed's.",
                        "Add engine=deepspeed, or drop tp_size.")
    if opts.speculative == "mtp" and opts.temperature != 0:
        raise UserError("speculative", opts.speculative, f"MTP speculative decoding is greedy, and temperature="
                        f"{opts.temperature} samples.", "Use temperature=0 with speculative=mtp, or speculative=none.")
    if opts.speculative == "mtp" and opts.engine != "hf":
        raise UserError("speculative", opts.speculative, "MTP speculative decoding runs on engine=hf.",
                        "Use engine=hf with speculative=mtp.")
    if opts.out is not None and os.path.exists(opts.out):
        raise UserError("out", opts.out, "That file exists, and shardyard generate never overwrites one.",
                        "Give a new file name, or remove the old file first.")


def _device(opts: GenerateOptions) -> torch.device:
    import torch

    if opts.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise UserError("device", opts.device, "No CUDA GPU is visible to this process.", "Use device=cpu.")
    return torch.device(opts.device)


def _dtype(opts: GenerateOptions) -> torch.dtype | None:
    import torch

    return getattr(torch, opts.dtype) if opts.dtype else None


def run(path: str, opts: GenerateOptions, prompts: list[Any], stdout: TextIO | None = None) -> list[dict]:
    """Load ``path`` and generate (``engine=hf``, in this process); rows written to ``out`` or ``stdout``."""
    from shardyard import inference

    stdout = stdout or sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # what loading says (e.g. the MTP depths loaded): not a JSONL row
        trained = inference.load(path, device=_device(opts), dtype=_dtype(opts))
    if opts.speculative == "mtp":
        from shardyard import speculative

        if not speculative.available(trained.model):
            raise UserError("speculative", opts.speculative, f"The model in {trained.path} has no multi-token-"
                            "prediction depths to draft with.", "Use speculative=none, or a DeepSeek-V3 run "
                            "trained with model.mtp.depth>=1.")
    return _emit(trained.model, trained.tokenizer, prompts, opts, stdout)


def _emit(model: torch.nn.Module, tokenizer: Any, prompts: list[Any], opts: GenerateOptions, stdout: TextIO,
          lockstep: bool = False, write: bool = True) -> list[dict]:
    streaming = opts.stream if opts.stream is not None else (len(prompts) == 1 and opts.out is None)
    sink: TextIO | None = None
    if write and opts.out is not None:
        sink = open(opts.out, "x", encoding="utf-8")  # "x": a file made since check() is not overwritten either
    elif write and not streaming:
        sink = stdout

    def on_row(row: dict) -> None:
        if sink is not None:
            sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            sink.flush()

    t0 = time.perf_counter()
    try:
        rows = complete(model, tokenizer, prompts, opts, lockstep=lockstep,
                        stream=stdout if (streaming and write) else None, on_row=on_row)
    finally:
        if sink is not None and sink is not stdout:
            sink.close()
    if write:
        wall = time.perf_counter() - t0
        tokens = sum(r["tokens"] for r in rows)
        print(f"shardyard | {len(rows)} completion(s), {tokens} tokens in {wall:.2f} s ({tokens / max(wall, 1e-9):.1f} "
              f"tokens/s){f'; rows in {opts.out}' if opts.out else ''}", file=sys.stderr, flush=True)
    return rows


def _deepspeed_rank(path: str, opts: GenerateOptions, prompts: list[Any]) -> None:
    """One tensor-parallel rank of ``engine=deepspeed`` (``ds_inference.run_ranks``): every rank loads the model and
    generates in lockstep (the tensor-parallel forwards are collectives); rank 0 writes."""
    import torch

    from shardyard import ds_inference, inference

    device = _device(opts)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    with contextlib.redirect_stdout(sys.stderr):
        trained = inference.load(path, device=device, dtype=_dtype(opts))
    dtype = next(trained.model.parameters()).dtype
    model = ds_inference.wrap(trained.model, tp_size=opts.tp_size, dtype=dtype, device_type=device.type)
    _emit(model, trained.tokenizer, prompts, opts, sys.stdout, lockstep=True, write=ds_inference.rank() == 0)


def main(args: list[str], stdin: TextIO | None = None, stdout: TextIO | None = None) -> list[dict] | None:
    """The command: parse, check, read the prompts, generate."""
    from shardyard import inference

    path, opts = parse(args)
    check(opts)
    inference.resolve(path)  # a path that is nothing loadable is named before any prompt is read (stdin)
    prompts = read_prompts(opts, stdin)
    if opts.engine == "deepspeed":
        from shardyard import ds_inference

        ds_inference.check(opts.tp_size, inference.model_config(path), _device(opts).type)
        ds_inference.run_ranks(opts.tp_size, _deepspeed_rank, path, opts, prompts, device_type=_device(opts).type)
        return None
    return run(path, opts, prompts, stdout)


def keys_help() -> str:
    """``shardyard generate --help``: the keys, from the docstrings of ``GenerateOptions``."""
    import ast
    import inspect

    lines = ["shardyard generate PATH [KEY=VALUE ...]", "PATH: a run dir, a checkpoint (<run>/checkpoints/step-N), "
             "an HF export (<run>/hf) or `latest` (the newest run under ./outputs). Keys:"]
    try:
        cls = ast.parse(inspect.getsource(GenerateOptions)).body[0]
    except (OSError, TypeError):
        return "\n".join(lines + ["  " + ", ".join(f.name for f in fields(GenerateOptions))])
    assert isinstance(cls, ast.ClassDef)
    for node, doc in zip(cls.body, cls.body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            lines.append(f"  {node.target.id:15} {' '.join(doc.value.value.split())}")
    return "\n".join(lines)
