"""Prompt data (``data=prompts``, for GRPO): each row a prompt the policy completes, and whatever a reward needs.

A record's ``prompt_field`` (default ``prompt``) is a string (the user's turn) or a list of ``{"role",
"content"}`` messages; it is rendered with the chat template and the generation prompt
(``add_generation_prompt=True``: the text ends where the assistant's reply begins), tokenized as SFT does, and
LEFT-padded to ``data.seq_len`` tokens (so every prompt ends at the same column and generation appends after
it). A prompt longer than that is dropped, and counted. Every other field of the record is kept as a JSON object
(e.g. ``{"answer": "42"}``) for the rewards, with where the record came from (``file:line``).

Arrays (``<split>.`` in the token cache, read by ``data.PromptRows``): ``prompt_ids`` ``[n, seq_len]`` int32
(left padding: the pad id), ``prompt_mask`` ``[n, seq_len]`` int8 (1 = a prompt token), and two string columns,
``fields`` (one JSON object per row) and ``where`` (``file:line`` or ``generated:<i>``), each as one UTF-8 byte
buffer and int64 row offsets (``fields.utf8``, ``fields.offsets``: ``data.utf8_column``), so a row takes its own
bytes: no row is padded to the longest one.

Without ``data.paths``: generated arithmetic problems with an ``answer`` field, from the held-out part of the
problem space that ``data=arithmetic`` (the SFT set) never contains (``shardyard.data.synthetic``); their val split
(``data.val_fraction``) is the evaluation set.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import numpy as np

from shardyard.data import synthetic
from shardyard.data.pipeline import utf8_column
from shardyard.core.errors import UserError
from shardyard.data.sft import ROLES, SUFFIXES, Drops, _json_type, named_template, template_for, user_rows


def prompt_messages(value, field: str, where: str) -> list[dict]:
    """The prompt as messages: a string is the user's turn; a list must be ``{"role", "content"}`` messages that
    do not end with the assistant's (the completion follows the prompt)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else _json_type(value)
        raise UserError("data.paths", where, f"Its `{field}` is {what}, not a string or a list of messages.",
                        f"Give `{field}` as a string or a list of {{\"role\", \"content\"}} messages, or name the "
                        "field that holds the prompt: data.prompt_field=<key>.")
    for k, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ROLES):
            raise UserError("data.paths", where, f"Its `{field}`'s element {k} is not a {{\"role\", \"content\"}} "
                            f"message with a string content and a role out of {', '.join(ROLES)}.",
                            f"Fix `{field}`, or leave the record out.")
    if value[-1]["role"] == "assistant":
        raise UserError("data.paths", where, f"Its `{field}` ends with the assistant's turn, so there is nothing "
                        "for the policy to answer.", "End every prompt with the user's (or system's) message.")
    return [{"role": m["role"], "content": m["content"]} for m in value]


class PromptData:
    """``data=prompts``: prompts from ``.jsonl``/``.json``/``.parquet``/``.arrow`` files or HF ``save_to_disk``
    directories, or (no ``paths`` at all) held-out generated arithmetic problems."""

    kind = "prompts"
    """The rows it gives (``objective=grpo`` trains on them; validation checks the pair)."""

    def __init__(self, paths: list[str], prompt_field: str = "prompt", chat_template: str | None = None,
                 max_examples: int = 2000, digits: int = 2, ops: str = "+-", seed: int = 0):
        from shardyard.data.sources import input_files

        self.files: list[Path] = input_files(list(paths), SUFFIXES) if paths else []
        if not self.files:
            synthetic.check(digits, ops, max_examples)
        if not isinstance(prompt_field, str) or not prompt_field:
            raise UserError("data.prompt_field", prompt_field, "It names the field holding each record's prompt.",
                            "Use e.g. data.prompt_field=prompt.")
        named_template(chat_template)
        self.prompt_field, self.chat_template, self.max_examples = prompt_field, chat_template, max_examples
        self.digits, self.ops, self.seed = digits, ops, seed

    def rows(self) -> Iterator[tuple[str, str, list[dict], dict]]:
        """``(stable name, where, prompt messages, the other fields)``; the name decides the train/val split."""
        if not self.files:
            for i, p in enumerate(synthetic.problems(self.max_examples, self.digits, self.ops, self.seed, held=True)):
                yield (f"arithmetic:{p.key}", f"generated:{i}", [{"role": "user", "content": p.question()}],
                       {"answer": str(p.answer)})
            return
        for name, where, record in user_rows(self.files):
            if not isinstance(record, dict) or self.prompt_field not in record:
                keys = sorted(record) if isinstance(record, dict) else _json_type(record)
                raise UserError("data.prompt_field", self.prompt_field, f"The record at {where} has no "
                                f"`{self.prompt_field}` field (its keys: {keys}).", "Correct or remove that record, "
                                "or name the field that holds the prompt: data.prompt_field=<key>.")
            fields = {k: v for k, v in record.items() if k != self.prompt_field}
            yield name, where, prompt_messages(record[self.prompt_field], self.prompt_field, where), fields

    def documents(self) -> Iterator[tuple[str, str]]:
        """Plain text of every prompt (for training a tokenizer when there is none)."""
        for name, _, msgs, _ in self.rows():
            yield name, "\n\n".join(m["content"] for m in msgs)

    def fingerprint(self) -> str:
        from shardyard.data.sources import _files_fingerprint

        settings = f"prompts-v2|{self.prompt_field}|{self.chat_template}"
        if self.files:
            return _files_fingerprint(self.files, settings)
        generated = f"{settings}|{self.max_examples}|{self.digits}|{self.ops}|{self.seed}|{synthetic.HELD_OUT_PERCENT}"
        return hashlib.sha256(generated.encode()).hexdigest()[:16]

    def tokenize_rows(self, tok, seq_len: int, is_val) -> dict:
        """Every prompt rendered with the generation prompt and left-padded: ``{"train": {...}, "val": {...},
        "stats": ...}`` (module doc)."""
        template = template_for(tok, self.chat_template)
        rows: dict[str, list[tuple[list[int], str, str]]] = {"train": [], "val": []}
        stats: dict = {"prompts": 0, "dropped": 0, "longest": 0, "tokens": 0}
        drops = Drops()
        for name, where, msgs, fields in self.rows():
            split = "val" if is_val(name) else "train"
            text = tok.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True)
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
            stats["prompts"] += 1
            if len(ids) > seq_len:
                stats["dropped"] += 1
                drops.drop(split, "prompt", len(ids))
                continue
            stats["longest"] = max(stats["longest"], len(ids))
            stats["tokens"] += len(ids)
            rows[split].append((ids, json.dumps(fields, ensure_ascii=False, sort_keys=True, default=str), where))
            drops.keep(split)
        drops.check("prompts", seq_len, self.files)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out: dict = {split: left_padded(r, seq_len, pad) for split, r in rows.items()}
        stats["summary"] = (f"{stats['prompts']:,} prompts, {stats['dropped']:,} longer than data.seq_len={seq_len} "
                            f"dropped, the longest kept {stats['longest']} tokens")
        out["stats"] = stats
        return out


def left_padded(rows: list[tuple[list[int], str, str]], seq_len: int, pad: int) -> dict[str, np.ndarray]:
    """``(ids, fields JSON, where)`` rows as the arrays ``data.PromptRows`` reads: ids left-padded with ``pad``."""
    n = len(rows)
    out: dict[str, np.ndarray] = {"prompt_ids": np.full((n, seq_len), pad, np.int32),
                                  "prompt_mask": np.zeros((n, seq_len), np.int8)}
    for column, strings in (("fields", [f for _, f, _ in rows]), ("where", [w for _, _, w in rows])):
        out[f"{column}.utf8"], out[f"{column}.offsets"] = utf8_column(strings)
    for r, (ids, _, _) in enumerate(rows):
        if ids:
            out["prompt_ids"][r, seq_len - len(ids):] = ids
            out["prompt_mask"][r, seq_len - len(ids):] = 1
    return out
