"""Supervised fine-tuning data (``data=sft``): conversations -> chat template -> tokens with labels on the
assistant's tokens only -> rows of ``seq_len`` tokens, packed (several conversations per row, none seeing
another) or padded (one per row).

A row is three aligned arrays: ``input_ids``, ``targets`` (the next token where that token is the
assistant's, else -100, the ignore index of the loss) and ``position_ids`` (restarting at 0 at every
conversation). The restart is what keeps packed conversations apart: ``model.packed_kwargs`` turns the
positions into a block-diagonal causal mask (sdpa, eager), and FlashAttention-2 reads them as varlen
boundaries, so position and attention never cross a conversation.

Sources: ``.jsonl``/``.json``/``.parquet``/``.arrow`` files or HF ``save_to_disk`` directories of chat conversations (``{"messages": [{"role", "content"}, ...]}``)
or instruction pairs (``instruction``/``input``/``output``, ``prompt``/``response``, ``question``/``answer``);
without ``data.paths`` (and only then), an embedded instruction set the project makes from data it has:
questions about the standard library's functions and classes (their signatures), answered by the first
paragraph of their docstrings.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from pathlib import Path
from typing import Iterator

import numpy as np

from shardyard.core.errors import UserError

IGNORE = -100
"""Label of a token the loss skips (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""

TEMPLATES = {
    # Works with any vocabulary (no special tokens beyond EOS): the default when the tokenizer has no template.
    "plain": ("{% if bos_token %}{{ bos_token }}{% endif %}{% for m in messages %}"
              "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
              "{% elif m['role'] == 'user' %}### Question:\n{{ m['content'] }}\n\n"
              "{% else %}### Answer:\n{{ m['content'] }}{{ eos_token }}\n\n{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}### Answer:\n{% endif %}"),
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}
"""Built-in chat templates, by the name ``data.chat_template`` gives."""

SYSTEM = "You answer questions about the Python standard library."


# ------------------------------------------------------------------------------------------ conversations
_SKIPPED_PACKAGES = frozenset({"test", "tests", "idlelib"})
"""Standard-library packages whose docstrings are not questions a user asks."""


def stdlib_qa(max_examples: int) -> Iterator[tuple[str, list[dict]]]:
    """The embedded instruction set: for each public documented function, method and class of the standard
    library (read with ``ast``, nothing imported), "What does ``mod.f(sig)`` do?" -> the docstring's first
    paragraph. In file order, so the set and its train/val split are stable."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.glob("*.py")), key=lambda p: p.name)
    files += sorted((p for p in root.glob("*/__init__.py") if p.parent.name not in _SKIPPED_PACKAGES),
                    key=lambda p: p.parent.name)
    n = 0
    for path in files:
        module = path.parent.name if path.parent != root else path.stem  # a package: its directory's name
        if module.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for qual, node in _documented(tree):
            doc = ast.get_docstring(node) or ""
            answer = doc.strip().split("\n\n")[0].strip()
            if len(answer) < 20:
                continue
            answer = " ".join(answer.split())[:400]
            if isinstance(node, ast.ClassDef):
                question = f"What is the class `{module}.{qual}` for?"
            else:
                question = f"What does `{module}.{qual}({ast.unparse(node.args)})` do?"
            yield f"stdlib:{module}.{qual}", [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}]
            n += 1
            if n >= max_examples:
                return


def _documented(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.ClassDef]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("_"):
                        yield f"{node.name}.{sub.name}", sub


ROLES = ("system", "user", "assistant")
"""The roles a conversation's messages may have (the templates render these three; the loss reads the
assistant's)."""


def to_messages(record: dict, where: str) -> list[dict]:
    """One record (``where``: its file and line) as a list of ``{"role", "content"}`` messages (chat or
    instruction format). A field of the wrong type or an unknown role exits 2 naming ``where``."""
    if not isinstance(record, dict):
        raise UserError("data.paths", where, f"The record is {_json_type(record)}, not a JSON object.",
                        "Fix or remove it: every record is a JSON object.")
    if "messages" in record:
        msgs = record["messages"]
        if not (isinstance(msgs, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs)):
            raise UserError("data.paths", where, "Its `messages` must be a list of {\"role\", \"content\"} objects.",
                            "Fix the record, or leave the file out of data.paths.")
        for k, m in enumerate(msgs):
            if m["role"] not in ROLES:
                raise UserError("data.paths", where, f"Message {k} has the role {m['role']!r}, which no template "
                                f"renders (roles: {', '.join(ROLES)}).", "Rename the role, or leave the record out.")
            if not isinstance(m["content"], str):
                raise UserError("data.paths", where, f"Message {k}'s `content` is {_json_type(m['content'])}, not a "
                                "string.", "Give every message's content as a string.")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    for q, a in (("instruction", "output"), ("prompt", "response"), ("question", "answer")):
        if q in record and a in record:
            for key in (q, a, "input", "system"):
                if key in record and not isinstance(record[key], str) and not (key in ("input", "system")
                                                                               and record[key] is None):
                    raise UserError("data.paths", where, f"Its `{key}` is {_json_type(record[key])}, not a string.",
                                    f"Give `{key}` as a string.")
            prompt = record[q] + (f"\n\n{record['input']}" if record.get("input") else "")
            msgs = [{"role": "system", "content": record["system"]}] if record.get("system") else []
            return msgs + [{"role": "user", "content": prompt}, {"role": "assistant", "content": record[a]}]
    raise UserError("data.paths", where, f"The record has neither `messages` nor an instruction pair (its keys: "
                    f"{sorted(record)}).", "Use {\"messages\": [...]}, {\"instruction\", \"input\", \"output\"}, "
                    "{\"prompt\", \"response\"} or {\"question\", \"answer\"} records.")


def _json_type(value) -> str:
    from shardyard.data.pipeline import JSON_TYPES

    return JSON_TYPES.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------------------------ source
SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
"""What ``data.paths`` may name: JSONL files, JSON files holding an array of records or one per line, Parquet and
Arrow files (and directories written by HF ``datasets``' ``save_to_disk``, ``shardyard.data.corpus``)."""


def user_rows(files: list[Path]) -> Iterator[tuple[str, str, dict]]:
    """``(stable name, where, record)`` of every record of ``files`` (``corpus.Records.rows``), named relative to
    the files' common directory (a copied corpus keeps its train/val split)."""
    from shardyard.data.corpus import Records

    root = os.path.commonpath([str(p.parent) for p in files])
    for p in files:
        yield from Records(p, os.path.relpath(p, root)).rows()


class SFTData:
    """``data=sft``: conversations from ``.jsonl``/``.json`` files, or (no ``paths`` at all) the embedded
    standard-library instruction set."""

    def __init__(self, paths: list[str], chat_template: str | None = None, packing: bool = True,
                 truncation: str = "truncate", max_examples: int = 3000):
        if truncation not in ("truncate", "drop"):
            raise UserError("data.truncation", truncation, "Unknown truncation policy.",
                            "Use truncate (keep the first data.seq_len tokens) or drop (leave the conversation out).")
        from shardyard.data.pipeline import input_files

        # Paths given are the data, whatever they hold: no file of a known format exits 2 (never the embedded set).
        self.files: list[Path] = input_files(list(paths), SUFFIXES) if paths else []
        if max_examples < 1:
            raise UserError("data.max_examples", max_examples, "It must be at least 1.", "Use e.g. 3000.")
        named_template(chat_template)  # a bad name is refused at validation, not after the tokenizer is built
        self.chat_template, self.packing, self.truncation, self.max_examples = (chat_template, packing, truncation,
                                                                                max_examples)

    def conversations(self) -> Iterator[tuple[str, list[dict]]]:
        """``(stable name, messages)``; the name decides the train/val split."""
        if not self.files:
            yield from stdlib_qa(self.max_examples)
            return
        for name, where, record in user_rows(self.files):
            yield name, to_messages(record, where)

    def documents(self) -> Iterator[tuple[str, str]]:
        """Plain text of every conversation (for training a tokenizer when there is none)."""
        for name, msgs in self.conversations():
            yield name, "\n\n".join(m["content"] for m in msgs)

    def fingerprint(self) -> str:
        import sys

        from shardyard.data.pipeline import _files_fingerprint

        settings = f"sft|{self.chat_template}|{self.packing}|{self.truncation}|{self.max_examples}"
        return _files_fingerprint(self.files, settings if self.files else f"{settings}|stdlib|{sys.version}")

    def tokenize_rows(self, tok, seq_len: int, is_val) -> dict:
        """Render, tokenize, label and pack every conversation: ``{"train": rows, "val": rows, "stats": ...}``."""
        template = template_for(tok, self.chat_template)
        docs: dict[str, list[tuple[list[int], list[int]]]] = {"train": [], "val": []}
        stats = {"conversations": 0, "truncated": 0, "dropped": 0, "label_tokens": 0, "tokens": 0}
        drops = Drops()
        for name, msgs in self.conversations():
            split = "val" if is_val(name) else "train"
            ids, labels = encode(tok, msgs, template)
            stats["conversations"] += 1
            length, labelled = len(ids), any(t != IGNORE for t in labels[1:])
            if len(ids) > seq_len:
                stats["truncated"] += 1
                if self.truncation == "drop":
                    stats["dropped"] += 1
                    drops.drop(split, "long", length)
                    continue
                ids, labels = ids[:seq_len], labels[:seq_len]
            targets = labels[1:] + [IGNORE]  # position t predicts token t+1; nothing after the last token
            if all(t == IGNORE for t in targets):
                stats["dropped"] += 1  # truncation cut every assistant token (or there is none): nothing to learn
                drops.drop(split, "cut" if labelled else "unlabelled", length if labelled else 0)
                continue
            stats["label_tokens"] += sum(t != IGNORE for t in targets)
            stats["tokens"] += len(ids)
            docs[split].append((ids, targets))
            drops.keep(split)
        drops.check("conversations", seq_len, self.files)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out: dict = {split: pack(d, seq_len, pad, self.packing) for split, d in docs.items()}
        out["stats"] = stats
        return out


class Drops:
    """The records a source leaves out of its rows, by split and reason, and those it keeps: a split that every
    record of it was left out of is refused (``check``) naming the key at fault and the counts, never reported
    later as a split with no record at all."""

    REASONS = {
        "long": ("longer than data.seq_len={L} (data.truncation=drop)", "data.seq_len"),
        "cut": ("with every response token past data.seq_len={L} (the prompt fills the row)", "data.seq_len"),
        "prompt": ("longer than data.seq_len={L}", "data.seq_len"),
        "same": ("whose chosen and rejected are the same tokens within data.seq_len={L}", "data.seq_len"),
        "tie": ("whose chosen and rejected are the same", "data.paths"),
        "empty": ("with an empty chosen or rejected reply", "data.paths"),
        "unlabelled": ("with no assistant turn to learn from", "data.paths"),
    }
    """Reason -> (how the message words it, the key at fault)."""

    def __init__(self) -> None:
        self.dropped: dict[str, dict[str, int]] = {"train": {}, "val": {}}
        self.kept = {"train": 0, "val": 0}
        self.longest = 0

    def drop(self, split: str, reason: str, length: int = 0) -> None:
        self.dropped[split][reason] = self.dropped[split].get(reason, 0) + 1
        self.longest = max(self.longest, length)

    def keep(self, split: str) -> None:
        self.kept[split] += 1

    def count(self, reason: str) -> int:
        return sum(d.get(reason, 0) for d in self.dropped.values())

    def check(self, what: str, seq_len: int, files: list[Path]) -> None:
        """A ``UserError`` when a split holds no record and records of it were left out: the key of the most
        common reason (``data.seq_len``, or ``data.paths`` for records that hold nothing to learn), the counts by
        reason and the files; files that hold no record at all: a ``UserError`` naming ``data.paths``."""
        if files and not any(self.kept.values()) and not any(any(d.values()) for d in self.dropped.values()):
            named = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise UserError("data.paths", named, f"The files hold no record at all, so no {what} (empty files, or "
                            "JSON arrays with no element).",
                            "Point data.paths at the files that hold the data.")
        for split in ("train", "val"):
            dropped = self.dropped[split]
            if self.kept[split] or not dropped:
                continue
            reasons = sorted(dropped.items(), key=lambda kv: -kv[1])
            key = self.REASONS[reasons[0][0]][1]
            counts = ", ".join(f"{n:,} {self.REASONS[r][0].format(L=seq_len)}" for r, n in reasons)
            named = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            source = f" of data.paths ({named})" if files else ""
            if key == "data.seq_len":
                fix = (f"Raise data.seq_len (the longest left out is {self.longest:,} tokens)" if self.longest else
                       "Raise data.seq_len") + ", shorten the records, or use other data."
            else:
                fix = "Correct those records, or leave them out of the data."
            raise UserError(key, seq_len if key == "data.seq_len" else named or "(generated)",
                            f"All {sum(dropped.values()):,} {what}{source} in the {split} split were left out "
                            f"({counts}), so that split holds none to {'train' if split == 'train' else 'evaluate'} "
                            "on.", fix)


def template_for(tok, name: str | None) -> str:
    """``data.chat_template``: null = the tokenizer's own (else ``plain``), a built-in name, or a Jinja string."""
    return named_template(name) or tok.chat_template or TEMPLATES["plain"]


def named_template(name: str | None) -> str | None:
    """The template ``data.chat_template`` names (a built-in or a Jinja string), or None for the tokenizer's."""
    if name is None:
        return None
    if name in TEMPLATES:
        return TEMPLATES[name]
    if "{%" in name or "{{" in name:
        return name
    raise UserError("data.chat_template", name, "It is neither a built-in template nor a Jinja template.",
                    f"Use null (the tokenizer's own), one of {sorted(TEMPLATES)}, or a Jinja string.")


def encode(tok, messages: list[dict], template: str, first: int = 0) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation, and per token its id where it belongs to an assistant turn
    (else ``IGNORE``); ``first``: only the assistant turns from message ``first`` on (a preference pair's
    response, not the assistant turns of its prompt).

    The assistant's span of turn i is found in the text: ``render(messages[:i], add_generation_prompt)`` is a
    prefix of ``render(messages[:i + 1])`` for any sane template, and the difference is the assistant's reply
    with its end-of-turn marker (the model must learn to stop). Tokens are assigned by their character
    offsets, which works for every template, with or without ``{% generation %}`` markers."""
    def render(msgs: list[dict], prompt: bool) -> str:
        return tok.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=prompt)

    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first:
            continue
        start, end = render(messages[:i], True), render(messages[:i + 1], False)
        if not (full.startswith(end) and end.startswith(start)):
            raise UserError("data.chat_template", "(this template)", "Rendering a conversation turn by turn does not "
                            "give prefixes of the whole, so the assistant's tokens cannot be told apart.",
                            "Use a template that renders turn by turn (e.g. data.chat_template=plain or chatml).")
        spans.append((len(start), len(end)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [IGNORE] * len(ids)
    for k, (a, _) in enumerate(enc["offset_mapping"]):
        if any(s <= a < e for s, e in spans):
            labels[k] = ids[k]
    return ids, labels


def pack(docs: list[tuple[list[int], list[int]]], seq_len: int, pad: int, packing: bool) -> dict[str, np.ndarray]:
    """Rows of ``seq_len``: conversations in order, as many per row as fit (``packing``) or one per row, the
    rest padding (targets ``IGNORE``, positions restarting at 0 so the padding is a segment of its own)."""
    rows: list[tuple[list[int], list[int], list[int]]] = []
    cur: tuple[list[int], list[int], list[int]] = ([], [], [])
    for ids, targets in docs:
        if cur[0] and (not packing or len(cur[0]) + len(ids) > seq_len):
            rows.append(cur)
            cur = ([], [], [])
        cur[0].extend(ids)
        cur[1].extend(targets)
        cur[2].extend(range(len(ids)))
    if cur[0]:
        rows.append(cur)
    n = len(rows)
    out = {"input_ids": np.full((n, seq_len), pad, np.int32), "targets": np.full((n, seq_len), IGNORE, np.int32),
           "position_ids": np.zeros((n, seq_len), np.int32)}
    for r, (ids, targets, pos) in enumerate(rows):
        k = len(ids)
        out["input_ids"][r, :k], out["targets"][r, :k], out["position_ids"][r, :k] = ids, targets, pos
        out["position_ids"][r, k:] = np.arange(seq_len - k)
    return out
