"""``shardyard generate PATH [KEY=VALUE ...]``: talk to what a run trained (issue 45).

``PATH`` is a run dir, a checkpoint or an HF export of any engine, or ``latest`` (``inference.load``). Prompts come
from ``prompt=TEXT`` (repeatable), a JSONL file (``file=X.jsonl``: rows ``{"prompt": str}`` or ``{"messages":
[{"role", "content"}, ...]}``) or stdin (``file=-``). Rows of messages are rendered with the tokenizer's chat
template (shardyard's ``plain`` one when it has none, or ``chat_template=NAME``); ``chat=true`` makes each plain
prompt one user message. Generation is batched (``batch_size`` prompts, left-padded) and KV-cached
(``generation.generate``): greedy at ``temperature=0`` (the default), else sampled with ``top_k`` / ``top_p`` from
a generator seeded by ``seed``. A row ends at the tokenizer's eos, at ``max_new_tokens``, or once its text holds a
``stop`` string (the completion is cut before it).

Every ``KEY=VALUE`` value is taken literally: ``prompt=[1, 2]`` is one prompt, and several prompts (or stop strings)
are several ``prompt=`` (``stop=``) arguments. A prompt whose tokens plus ``max_new_tokens`` do not fit the model's
positions (``max_position_embeddings``, else the run's ``data.seq_len``) is refused before anything is generated.
A row also ends at the model's ``generation_config.eos_token_id`` (an int or a list: a chat model's end of turn).

One prompt and no ``out``: the completion streams to the terminal as it is generated (``stream=true`` with several
prompts is refused: streaming prints one completion). Otherwise one JSON row per
prompt (``prompt``, ``completion``, ``tokens``, ``stop_reason``: ``eos`` | ``stop`` | ``length``) goes to
``out=FILE`` (never overwritten) or stdout.

``engine=deepspeed`` runs DeepSpeed's inference engine (``deepspeed.init_inference``, tensor parallel over
``tp_size`` processes: ``shardyard.inference.ds_inference``); ``speculative=mtp`` decodes greedily with the model's MTP depths
as the draft (``shardyard.inference.speculative``) and prints the acceptance rate, tokens per main-model forward and tokens
per second; ``compare=true`` also decodes the prompts plainly (greedy, KV-cached, one at a time), checks the
tokens are the same (exit 1 if not) and prints the measured speed-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Optional, TextIO

from shardyard.config import options
from shardyard.core.errors import UserError

if TYPE_CHECKING:  # torch is imported where it runs: `shardyard --help` builds this command's help
    import torch


@dataclass
class GenerateOptions:
    """The keys of ``shardyard generate PATH [KEY=VALUE ...]``."""

    prompt: list = field(default_factory=list)
    """A prompt, taken literally (repeat the key for several: ``prompt=a prompt=b``)."""
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
    """A stop string, taken literally but for ``\\n`` (a newline) and ``\\t`` (repeat the key for several): a row
    ends once its text holds one, and its completion is cut before it."""
    batch_size: int = 8
    """Prompts generated together (left-padded to the longest of the batch)."""
    out: Optional[str] = None
    """Write the JSONL rows here (a new file: an existing one is never overwritten); default stdout."""
    stream: Optional[bool] = None
    """Print the completion token by token (one prompt only); default: when there is one prompt and no ``out``."""
    engine: str = "hf"
    """``hf``: the model in this process (CPU or one GPU); ``deepspeed``: DeepSpeed's inference engine, tensor
    parallel over ``tp_size`` processes."""
    tp_size: int = 1
    """``engine=deepspeed``: tensor-parallel degree (processes; GPUs on a GPU machine)."""
    speculative: str = "none"
    """``mtp``: greedy speculative decoding with the model's multi-token-prediction depths as the draft (prints the
    acceptance rate, tokens per forward and tokens/s)."""
    compare: bool = False
    """With ``speculative=mtp``: also decode the prompts plainly (greedy, KV-cached, one at a time), check the
    tokens are identical (exit 1 if not) and print the measured speed-up."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (the first GPU when there is one, else the CPU)."""
    dtype: Optional[str] = None
    """``float32``, ``bfloat16`` or ``float16``; default fp32 on CPU, bf16 on a GPU that has it."""


_CHOICES = {"engine": ("hf", "deepspeed"), "speculative": ("none", "mtp"), "dtype": options.DTYPES}


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
        if key in ("prompt", "stop"):  # one literal item per argument
            if key == "prompt" or not value:  # a stop string of blanks (stop=\\n, stop=" ") is one
                options.nonempty(key, value)
            getattr(opts, key).append(_unescape(value) if key == "stop" else value)
        else:
            setattr(opts, key, options.value(key, value, kinds[key].type, _CHOICES))
    return args[0], opts


def _unescape(s: str) -> str:
    return s.replace("\\\\", "\0").replace("\\n", "\n").replace("\\t", "\t").replace("\0", "\\")


# ---------------------------------------------------------------------------------------------- prompts
def read_prompts(opts: GenerateOptions, stdin: TextIO | None = None) -> list[Any]:
    """The prompts: strings, or lists of messages (chat rows), in order: ``prompt=`` ones, then the file's."""
    return read_prompts_at(opts, stdin)[0]


def read_prompts_at(opts: GenerateOptions, stdin: TextIO | None = None) -> tuple[list[Any], list[str]]:
    """``read_prompts`` and where each came from (``prompt=...`` or ``FILE:LINE``), for the errors that name one."""
    rows: list[Any] = list(opts.prompt)
    places = [f"prompt={p[:40] + '...' if len(p) > 40 else p!r}" for p in opts.prompt]
    if opts.file is not None:
        name = "<stdin>" if opts.file == "-" else opts.file
        try:
            if opts.file == "-":
                lines = (stdin or sys.stdin).read().splitlines()
            else:
                with open(opts.file, encoding="utf-8") as f:
                    lines = f.read().splitlines()
        except OSError as e:
            raise UserError("file", opts.file, f"It cannot be read ({e.strerror}).",
                            "Give a JSONL file of prompts, or file=- for stdin.") from None
        except UnicodeDecodeError as e:
            raise UserError("file", name, f"It is not UTF-8 text (byte {e.start}: {e.reason}): a JSONL file of "
                            "prompts is.", "Give a JSONL file of prompts (UTF-8), e.g. one written by Python's "
                            "json.dumps, one row per line.") from None
        before = len(rows)
        for n, line in enumerate(lines, 1):
            if line.strip():
                rows.append(_row(line, f"{name}:{n}"))
                places.append(f"{name}:{n}")
        if len(rows) == before:
            raise UserError("file", opts.file, f"It holds no prompt ({len(lines)} line(s), none with a JSON row).",
                            'Give a JSONL file with one {"prompt": "..."} or {"messages": [...]} row per line.')
    if not rows:
        raise UserError("prompt", "(none)", "There is no prompt to generate from.",
                        'Give prompt="..." (repeatable), file=prompts.jsonl or file=- (stdin).')
    return rows, places


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
    from shardyard.data.sft import template_for

    import jinja2

    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template_for(tokenizer, opts.chat_template),
                                             tokenize=False, add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:  # the template's own raise_exception too
        whose = "chat_template" if opts.chat_template is not None else "the tokenizer's chat template"
        raise UserError("chat_template", opts.chat_template if opts.chat_template is not None else "(the tokenizer's)",
                        f"Rendering a prompt with {whose} fails ({type(e).__name__}: {e}).",
                        "Give rows of messages the template takes (roles, order), or another template "
                        "(chat_template=plain or chatml).") from None


# --------------------------------------------------------------------------------------- stop and stream
class Watcher:
    """``generation.generate``'s ``stop`` hook (called once per generated token with every row's completion so
    far): ends a row whose text holds a stop string, and prints row 0's new text as it comes (``out``), holding back
    what could still become a stop string or an unfinished UTF-8 character. A stop string newly completed by the
    last token lies in the row's last few tokens: only those are decoded (``window``: the longest stop string's
    bytes plus 8 tokens), so each token costs the same however long the completion grows."""

    def __init__(self, tokenizer: Any, stops: list[str], out: TextIO | None = None):
        self.tok, self.stops, self.out = tokenizer, [s for s in stops if s], out
        self.window = max((len(s.encode("utf-8")) for s in self.stops), default=0) + 8
        self.printed = ""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        import torch

        if self.out is not None:
            self._show(self.text(ids[0].tolist()))
        tails = ids[:, -self.window:].tolist()
        return torch.tensor([cut(self.text(t), self.stops)[1] for t in tails], dtype=torch.bool, device=ids.device)

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
def eos_ids(tokenizer: Any, model: torch.nn.Module) -> list[int]:
    """The tokens that end a row: the tokenizer's eos and the model's ``generation_config.eos_token_id`` (an int
    or a list: Llama-3's ``<|eot_id|>``, a chat model's end of turn), in that order, each once."""
    from shardyard.models.generation import hf_model

    config = getattr(hf_model(model), "generation_config", None)
    more = getattr(config, "eos_token_id", None)
    found = [tokenizer.eos_token_id, *(more if isinstance(more, (list, tuple)) else [more])]
    return list(dict.fromkeys(int(i) for i in found if i is not None))


def positions(model: torch.nn.Module, cfg: Any) -> tuple[int, str] | None:
    """How many positions (prompt and completion) the model takes, and what says so: its config's
    ``max_position_embeddings`` (or ``n_positions``), else the run's ``data.seq_len``; None when neither is known."""
    from shardyard.models.generation import hf_model

    config = getattr(hf_model(model), "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, name, None), int):
            return int(getattr(config, name)), f"its config's {name}"
    seq_len = cfg.get("data", {}).get("seq_len") if cfg is not None else None
    return (int(seq_len), "the run's data.seq_len") if isinstance(seq_len, int) else None


@dataclass
class _Speed:
    """``speculative=mtp``'s counts over the prompts, and the plain decoding's (``compare``)."""

    stats: Any = None
    seconds: float = 0.0
    plain_seconds: float = 0.0
    plain_tokens: int = 0


def complete(model: torch.nn.Module, tokenizer: Any, prompts: list[Any], opts: GenerateOptions, *,
             lockstep: bool = False, stream: TextIO | None = None,
             on_row: Callable[[dict], None] | None = None, places: list[str] | None = None,
             limit: tuple[int, str] | None = None) -> list[dict]:
    """One row per prompt (``prompt``, ``completion``, ``tokens``, ``stop_reason``), ``batch_size`` at a time through
    ``generation.generate`` (or ``speculative.generate_mtp`` per prompt). ``stream``: row 0's text as it comes
    (one prompt). ``lockstep``: every batch runs all ``max_new_tokens`` forwards (tensor-parallel ranks).
    ``limit``: the model's positions (``positions``): a prompt that does not fit with ``max_new_tokens`` is a
    ``UserError`` naming it (``places``: where each prompt came from) before anything is generated."""
    import torch

    from shardyard.models.generation import generate

    device = next(model.parameters()).device
    eos = eos_ids(tokenizer, model)
    pad = next((i for i in (tokenizer.pad_token_id, *eos) if i is not None), 0)
    encoded_all = [tokenizer(render(tokenizer, p, opts), add_special_tokens=False).input_ids or [pad] for p in prompts]
    if limit is not None:
        _check_fits(encoded_all, places or [f"prompt {i + 1}" for i in range(len(prompts))], opts, limit)
    g = torch.Generator(device=device).manual_seed(opts.seed)
    speed = _Speed()
    rows: list[dict] = []
    for start in range(0, len(prompts), opts.batch_size):
        batch = prompts[start:start + opts.batch_size]
        encoded = encoded_all[start:start + opts.batch_size]
        width = max(map(len, encoded))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
        watcher = Watcher(tokenizer, opts.stop, stream)
        if opts.speculative == "mtp":
            outs = [_speculative(model, ids[i:i + 1, width - len(e):], opts, eos, pad, watcher, speed, places,
                                 start + i) for i, e in enumerate(encoded)]
        else:
            out, kept = generate(model, ids, mask, max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
                                 top_k=opts.top_k, top_p=opts.top_p, eos_id=eos, pad_id=pad, generator=g,
                                 lockstep=lockstep, stop=watcher if (opts.stop or stream) else None)
            outs = [o[m.bool()].tolist() for o, m in zip(out, kept)]
        for prompt, tokens in zip(batch, outs):
            ended = bool(tokens) and tokens[-1] in eos
            text, stopped = cut(watcher.text(tokens[:-1] if ended else tokens), opts.stop)
            reason = "stop" if stopped else "eos" if ended else "length"
            row = {"prompt": prompt, "completion": text, "tokens": len(tokens), "stop_reason": reason}
            rows.append(row)
            if on_row is not None:
                on_row(row)
        if stream is not None:
            watcher.finish(rows[start]["completion"])
    if speed.stats is not None:
        _report_speed(speed, opts)
    return rows


def _check_fits(encoded: list[list[int]], places: list[str], opts: GenerateOptions, limit: tuple[int, str]) -> None:
    most, what = limit
    for tokens, place in zip(encoded, places):
        if len(tokens) + opts.max_new_tokens > most:
            room = most - len(tokens)
            need = len(tokens) + opts.max_new_tokens
            raise UserError("max_new_tokens", opts.max_new_tokens, f"The prompt {place} is {len(tokens)} tokens, "
                            f"and with max_new_tokens={opts.max_new_tokens} it needs {need} positions; the model "
                            f"takes {most} ({what}).",
                            f"Use max_new_tokens<={room}." if room > 0 else
                            f"Shorten that prompt to fewer than {most} tokens.")


def _speculative(model: torch.nn.Module, ids: torch.Tensor, opts: GenerateOptions, eos: list[int], pad: int,
                 watcher: Watcher, speed: _Speed, places: list[str] | None, index: int) -> list[int]:
    """One prompt by ``speculative.generate_mtp``; ``compare``: decoded plainly too, the tokens checked equal."""
    import torch

    from shardyard.inference import speculative
    from shardyard.models.generation import generate

    stop = watcher if (opts.stop or watcher.out is not None) else None
    t0 = time.perf_counter()
    tokens, stats = speculative.generate_mtp(model, ids, max_new_tokens=opts.max_new_tokens, eos_id=eos, stop=stop)
    speed.seconds += time.perf_counter() - t0
    speed.stats = stats if speed.stats is None else speed.stats.add(stats)
    got = tokens.tolist()
    if opts.compare:
        plain_stop = Watcher(watcher.tok, opts.stop) if opts.stop else None
        t0 = time.perf_counter()
        out, kept = generate(model, ids, torch.ones_like(ids), max_new_tokens=opts.max_new_tokens, temperature=0.0,
                             eos_id=eos, pad_id=pad, stop=plain_stop)
        want = out[0][kept[0].bool()].tolist()
        speed.plain_seconds += time.perf_counter() - t0
        speed.plain_tokens += len(want)
        if got != want:
            place = places[index] if places else f"prompt {index + 1}"
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise SystemExit(f"shardyard generate: speculative=mtp gave other tokens than plain greedy decoding for "
                             f"{place}: they differ from token {at} on ({got[at:at + 5]} against {want[at:at + 5]}). "
                             "Speculative decoding must give greedy decoding's tokens; in bf16/fp16 a near-tie can "
                             "round differently (speculative.py's docstring): compare in dtype=float32.")
    return got


def _report_speed(speed: _Speed, opts: GenerateOptions) -> None:
    stats = speed.stats
    line = (f"shardyard | speculative=mtp: {stats.accepted}/{stats.drafted} drafted tokens accepted "
            f"({100 * stats.acceptance_rate:.1f}%), {stats.tokens} tokens in {stats.forwards} main-model forwards "
            f"({stats.tokens_per_forward:.2f} tokens per forward), {stats.tokens / max(speed.seconds, 1e-9):.1f} "
            "tokens/s")
    if opts.compare:
        plain = speed.plain_tokens / max(speed.plain_seconds, 1e-9)
        line += (f"; plain greedy decoding: the same tokens, {plain:.1f} tokens/s: speed-up "
                 f"{speed.plain_seconds / max(speed.seconds, 1e-9):.2f}x")
    print(line, file=sys.stderr, flush=True)


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
    if opts.compare and opts.speculative != "mtp":
        raise UserError("compare", opts.compare, "It compares speculative decoding with plain decoding.",
                        "Add speculative=mtp, or drop compare.")
    if not 0 <= opts.seed < 1 << 63:
        raise UserError("seed", opts.seed, "It seeds torch's generator: a whole number from 0 below 2**63.",
                        "Use e.g. seed=0.")
    options.device(opts.device)  # device=foo, or a GPU this process does not see: named before anything loads
    check_template(opts.chat_template)
    if opts.out is not None and os.path.isdir(opts.out):
        raise UserError("out", opts.out, "It is a directory, and out names the file the rows are written to.",
                        f"Give a file name, e.g. out={os.path.join(opts.out, 'rows.jsonl')}.")
    if opts.out is not None and os.path.exists(opts.out):
        raise UserError("out", opts.out, "That file exists, and shardyard generate never overwrites one.",
                        "Give a new file name, or remove the old file first.")
    parent = os.path.dirname(os.path.abspath(opts.out)) if opts.out is not None else None
    if parent is not None and not os.path.isdir(parent):
        raise UserError("out", opts.out, f"Its directory {parent} does not exist.",
                        "Create the directory first, or give a file in an existing one.")
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise UserError("out", opts.out, f"Its directory {parent} is not writable, so no row could be written.",
                        "Give a file in a directory you can write.")


def check_template(template: str | None) -> None:
    """``chat_template``: null, a built-in name, or a Jinja string that compiles (as transformers compiles it:
    a sandboxed environment), checked before anything loads; else a ``UserError`` naming ``chat_template``."""
    from shardyard.data.sft import TEMPLATES, named_template

    try:
        text = named_template(template)
    except UserError as e:
        raise UserError("chat_template", template, e.problem, f"Use null (the tokenizer's own), one of "
                        f"{', '.join(sorted(TEMPLATES))}, or a Jinja string.") from None
    if text is None or template in TEMPLATES:
        return
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).from_string(text)
    except jinja2.TemplateError as e:
        raise UserError("chat_template", template, f"It does not compile as a Jinja template ({type(e).__name__}"
                        f"{f' on line {line}' if (line := getattr(e, 'lineno', None)) else ''}: {e}).",
                        "Correct the template, or use a built-in one (chat_template=plain or chatml).") from None


def _device(opts: GenerateOptions) -> torch.device:
    return options.device(opts.device)


def _dtype(opts: GenerateOptions) -> torch.dtype | None:
    return options.dtype(opts.dtype)


def run(path: str | Any, opts: GenerateOptions, prompts: list[Any], stdout: TextIO | None = None,
        places: list[str] | None = None) -> list[dict]:
    """Load ``path`` (or what ``inference.resolve`` made of it) and generate (``engine=hf``, in this process); rows
    written to ``out`` or ``stdout``."""
    from shardyard.inference import loading as inference

    stdout = stdout or sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # what loading says (e.g. the MTP depths loaded): not a JSONL row
        trained = inference.load(path, device=_device(opts), dtype=_dtype(opts))
    if opts.speculative == "mtp":
        from shardyard.inference import speculative

        if not speculative.available(trained.model):
            raise UserError("speculative", opts.speculative, f"The model in {trained.path} has no multi-token-"
                            "prediction depths to draft with.", "Use speculative=none, or a DeepSeek-V3 run "
                            "trained with model.mtp.depth>=1.")
    return _emit(trained.model, trained.tokenizer, prompts, opts, stdout, places=places,
                 limit=positions(trained.model, trained.cfg))


def _emit(model: torch.nn.Module, tokenizer: Any, prompts: list[Any], opts: GenerateOptions, stdout: TextIO,
          lockstep: bool = False, write: bool = True, places: list[str] | None = None,
          limit: tuple[int, str] | None = None) -> list[dict]:
    streaming = opts.stream if opts.stream is not None else (len(prompts) == 1 and opts.out is None)
    sink: TextIO | None = stdout if write and opts.out is None and not streaming else None

    def on_row(row: dict) -> None:  # out is made at its first row: a run refused before (a prompt too long for
        nonlocal sink  # the model's positions) leaves no empty file behind to block the rerun
        if sink is None and write and opts.out is not None:
            try:
                sink = open(opts.out, "x", encoding="utf-8")  # "x": a file made since check() is not overwritten
            except FileExistsError:
                raise UserError("out", opts.out, "That file was made while the model loaded, and shardyard generate "
                                "never overwrites one.", "Give a new file name, or remove the file first.") from None
            except OSError as e:
                raise UserError("out", opts.out, f"It cannot be written ({e.strerror}).",
                                "Give a file in a directory you can write.") from None
        if sink is not None:
            sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            sink.flush()

    t0 = time.perf_counter()
    try:
        rows = complete(model, tokenizer, prompts, opts, lockstep=lockstep,
                        stream=stdout if (streaming and write) else None, on_row=on_row, places=places, limit=limit)
    finally:
        if sink is not None and sink is not stdout:
            sink.close()
    if write:
        wall = time.perf_counter() - t0
        tokens = sum(r["tokens"] for r in rows)
        print(f"shardyard | {len(rows)} completion(s), {tokens} tokens in {wall:.2f} s ({tokens / max(wall, 1e-9):.1f} "
              f"tokens/s){f'; rows in {opts.out}' if opts.out else ''}", file=sys.stderr, flush=True)
    return rows


def _deepspeed_rank(source: Any, opts: GenerateOptions, prompts: list[Any], places: list[str]) -> None:
    """One tensor-parallel rank of ``engine=deepspeed`` (``ds_inference.run_ranks``): every rank reads the model
    into host memory in the target dtype (``source``: resolved, its checkpoint verified once by the caller) and
    hands it to DeepSpeed, which splits it and moves only this rank's share to its device (``cuda:LOCAL_RANK``);
    the ranks generate in lockstep (the tensor-parallel forwards are collectives); rank 0 writes."""
    from shardyard.inference import ds_inference, loading as inference

    device = _device(opts)
    dtype = _dtype(opts) or inference.default_dtype(device)
    with contextlib.redirect_stdout(sys.stderr):
        trained = inference.load(source, device="cpu", dtype=dtype)
    model = ds_inference.wrap(trained.model, tp_size=opts.tp_size, dtype=dtype, device_type=device.type)
    _emit(model, trained.tokenizer, prompts, opts, sys.stdout, lockstep=True, write=ds_inference.rank() == 0,
          places=places, limit=positions(trained.model, trained.cfg))


def main(args: list[str], stdin: TextIO | None = None, stdout: TextIO | None = None) -> list[dict] | None:
    """The command: parse, check, read the prompts, generate. ``PATH`` is resolved (a checkpoint hashed) once."""
    from shardyard.inference import loading as inference

    path, opts = parse(args)
    check(opts)
    source = inference.resolve(path)  # a path that is nothing loadable is named before any prompt is read (stdin)
    prompts, places = read_prompts_at(opts, stdin)
    if opts.stream and len(prompts) > 1:
        raise UserError("stream", opts.stream, f"Streaming prints one completion as it is generated, and there are "
                        f"{len(prompts)} prompts.", "Drop stream=true (each prompt's row is written as JSONL), or "
                        "give one prompt.")
    if opts.engine == "deepspeed":
        from shardyard.inference import ds_inference

        device_type = _device(opts).type
        ds_inference.check(opts.tp_size, inference.model_config(source), device_type)
        ds_inference.run_ranks(opts.tp_size, _deepspeed_rank, source, opts, prompts, places, device_type=device_type)
        return None
    return run(source, opts, prompts, stdout, places)


def keys_help() -> str:
    """``shardyard generate --help``: the keys, from the docstrings of ``GenerateOptions``."""
    return options.keys_help(GenerateOptions, [
        "shardyard generate PATH [KEY=VALUE ...]", "PATH: a run dir, a checkpoint (<run>/checkpoints/step-N), an HF "
        "export (<run>/hf) or `latest` (the newest run under ./outputs). Keys:"])
