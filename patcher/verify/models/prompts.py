"""The user's own prompts for ``ddpatch verify --prompts-file FILE``: read and checked in the parent, tokenized in the child.

The parent (``patcher.api.verify``) calls ``verify_options``: it reads the whole file, refuses bad input in one
line naming the file and line (``PromptsFileError``, before any child starts), keeps the first N prompts and puts
them in the child's cfg as ``prompt_records`` (JSON: each a text or a message list with its file and line) beside
``prompts_source`` (what was read). The child calls ``tokenize_records`` once the target's tokenizer is loaded:
it renders each record as upstream's benchmarks do and refuses a prompt the target's context cannot hold, before
anything decodes.

What a file may hold (the format is chosen per file: a ``.jsonl``/``.json`` suffix, or a first non-blank line that
parses as a JSON object, means JSONL; anything else is plain text, one prompt per line, blank lines skipped):

- ``{"turns": [...]}``: upstream's own benchmark cache (MT-Bench and every other dataset there). The first turn is
  the prompt; the later ones are left out and counted (see ``LATER_TURNS``);
- ``{"question": ...}`` (GSM8K) and ``{"problem": ...}`` (MATH-500, AIME): with the instruction upstream's
  benchmarks append to them;
- ``{"prompt": ...}``: a list is MT-Bench's turns as the hub publishes them; a HumanEval row (it has an
  ``entry_point``) is wrapped in the instruction upstream's benchmarks give it; any other (MBPP) is taken as is;
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a chat, through the chat template as given.

Module level: the stdlib only. The tokenizer arrives as an argument (this module runs in the verifier's child,
which imports nothing of ``patcher``; transformers is reached only through the objects passed in).
"""

from __future__ import annotations

import json
from pathlib import Path

#: Without ``--prompts``, a file's first prompts only: each prompt is decoded by every method at every budget
#: and again by the references, so a whole benchmark (GSM8K: 1,319) would outrun the default ``--timeout``.
DEFAULT_FILE_PROMPTS = 8

#: The keys a JSONL object is read by, in the order they are looked for.
KEYS = ("messages", "turns", "question", "problem", "prompt")

#: What upstream's benchmarks (DFlash's ``benchmark.py``, DDTree's ``model/utils.py``) ask of a math question or a
#: HumanEval stub: the prompt text decides the acceptance, so verify must read the text they decode.
STEP_BY_STEP = "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"

#: Why a record's later turns are not verified (the docs and the result say it).
LATER_TURNS = ("upstream's benchmark decodes each later turn after the model's whole answer to the turns before (up to "
               "2,048 tokens); verify's short decode does not produce that answer, so only the first turn is a prompt "
               "upstream ran, as its sglang/vLLM benchmark also runs only the first turn")

#: The options upstream's benchmarks pass to ``apply_chat_template`` (``tokenize=False``, then ``tokenizer.encode``).
TEMPLATE_OPTIONS = {"add_generation_prompt": True, "enable_thinking": False}


class PromptsFileError(ValueError):
    """A prompts file that cannot be verified on: one line naming the file (and the line)."""


# ----------------------------------------------------------------------------- the parent: read and check
def verify_options(path: str | Path, count: int | None = None) -> dict:
    """The child's cfg entries for ``--prompts-file path`` (``--prompts count``): ``prompt_records`` and
    ``prompts_source``. Raises ``PromptsFileError`` on bad input, for the whole file."""
    fmt, records = read_prompts(path)
    if count is not None and count > len(records):
        raise PromptsFileError(f"--prompts {count}: {path} holds {len(records)} prompt{'s' * (len(records) != 1)}")
    chosen = records[:count if count is not None else DEFAULT_FILE_PROMPTS]
    source = {"file": str(path), "format": fmt, "prompts": len(chosen), "of": len(records),
              "shapes": sorted({r["shape"] for r in chosen}),
              "later_turns_left_out": sum(r.get("later_turns", 0) for r in chosen)}
    return {"prompt_records": chosen, "prompts_source": source}


def read_prompts(path: str | Path) -> tuple[str, list[dict]]:
    """``("jsonl" | "text", records)`` from the file at ``path``; ``PromptsFileError`` names the first bad line."""
    name = str(path)
    p = Path(path).expanduser()
    if not p.exists():
        raise PromptsFileError(f"--prompts-file {name}: no such file")
    if not p.is_file():
        raise PromptsFileError(f"--prompts-file {name}: not a file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise PromptsFileError(f"--prompts-file {name}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise PromptsFileError(f"{name}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    # "\n" only: str.splitlines would also split at U+2028 and friends, which a JSON string may hold unescaped
    lines = [(n, raw.rstrip("\r")) for n, raw in enumerate(text.split("\n"), start=1)]
    filled = [(n, line) for n, line in lines if line.strip()]
    if not filled:
        raise PromptsFileError(f"{name}: empty: no prompt in it (JSONL, one object per line, or one prompt per line)")
    fmt = "jsonl" if p.suffix.lower() in (".jsonl", ".json") or _is_object(filled[0][1]) else "text"
    if fmt == "text":
        return fmt, [{"file": name, "line": n, "shape": "text", "text": line} for n, line in filled]
    return fmt, [_record(json_object(name, n, line, first=n == filled[0][0]), name, n) for n, line in filled]


def _is_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def json_object(name: str, n: int, line: str, first: bool = False) -> dict:
    """Line ``n`` of a JSONL file as an object."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        hint = ": a JSON array is not read; write one object per line" if first and line.lstrip().startswith("[") else ""
        raise PromptsFileError(f"{name}:{n}: not JSON ({exc.msg} at column {exc.colno}){hint}") from None
    if not isinstance(value, dict):
        raise PromptsFileError(f"{name}:{n}: a JSON {type(value).__name__}, not an object with one of the keys {', '.join(KEYS)}")
    return value


def _record(obj: dict, name: str, n: int) -> dict:
    where = f"{name}:{n}"
    key = next((k for k in KEYS if k in obj), None)
    if key is None:
        shown = ", ".join(sorted(obj)[:6]) or "none"
        raise PromptsFileError(f"{where}: no prompt key: expected one of {', '.join(KEYS)}; the object has {shown}")
    value = obj[key]
    base = {"file": name, "line": n}
    if key == "messages":
        return {**base, "shape": "messages", "messages": _messages(value, where)}
    if key == "turns" or key == "prompt" and isinstance(value, list):
        turns = _turns(value, key, where)
        return {**base, "shape": "turns", "text": turns[0], "later_turns": len(turns) - 1}
    text = _text(value, key, where)
    if key in ("question", "problem"):
        return {**base, "shape": key, "text": STEP_BY_STEP.format(text)}
    if "entry_point" in obj:  # a HumanEval row
        return {**base, "shape": "humaneval", "text": HUMANEVAL.format(text)}
    return {**base, "shape": "prompt", "text": text}


def _text(value, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise PromptsFileError(f"{where}: {key} must be a string, got a JSON {type(value).__name__}")
    if not value.strip():
        raise PromptsFileError(f"{where}: empty prompt ({key} is blank)")
    return value


def _turns(value, key: str, where: str) -> list[str]:
    if not isinstance(value, list):
        raise PromptsFileError(f"{where}: {key} must be a list of strings, got a JSON {type(value).__name__}")
    if not value:
        raise PromptsFileError(f"{where}: empty prompt ({key} is an empty list)")
    for i, turn in enumerate(value):
        _text(turn, f"{key}[{i}]", where)
    return value


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise PromptsFileError(f"{where}: messages must be a list of {{role, content}} objects, got a JSON {type(value).__name__}")
    if not value:
        raise PromptsFileError(f"{where}: empty prompt (messages is an empty list)")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptsFileError(f"{where}: messages[{i}] must be an object with a string role and a string content")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in out):
        raise PromptsFileError(f"{where}: empty prompt (every message's content is blank)")
    if out[-1]["role"] == "assistant":
        raise PromptsFileError(f"{where}: messages end with an assistant message: the prompt a decode answers ends with "
                               "the user's turn (drop the answer)")
    return out


def describe_source(source: dict) -> str:
    """One line for the report: which prompts of which file ran."""
    line = (f"{source['prompts']} of {source['of']} prompts of {source['file']} "
            f"({'JSONL: ' + ', '.join(source['shapes']) if source['format'] == 'jsonl' else 'plain text'})")
    if source["prompts"] < source["of"]:
        line += "; the first ones (--prompts N for more)"
    if source.get("later_turns_left_out"):
        line += f"; {source['later_turns_left_out']} later turns left out (only a first turn is a fixed prompt)"
    return line


# ----------------------------------------------------------------------------- the child: through the tokenizer
def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_note(tokenizer) -> str:
    """Which rendering ``tokenize_records`` used with this tokenizer (the result says it)."""
    if has_chat_template(tokenizer):
        opts = ", ".join(f"{k}={v}" for k, v in TEMPLATE_OPTIONS.items())
        return f"the target's chat template ({opts}), as upstream's benchmarks apply it"
    return "raw text: the target's tokenizer has no chat template"


def render(record: dict, tokenizer) -> str:
    """The text upstream's benchmark would encode for ``record``."""
    messages = record.get("messages") or [{"role": "user", "content": record["text"]}]
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, **TEMPLATE_OPTIONS)
    if len(messages) > 1:
        raise ValueError(f"{record['file']}:{record['line']}: a chat of {len(messages)} messages needs a chat template, and "
                         "the target's tokenizer has none: give the prompt as plain text or as turns")
    return messages[0]["content"]


def tokenize_records(records: list[dict], tokenizer, max_context: int | None, max_new_tokens: int) -> list[list[int]]:
    """Each record's token ids, as upstream's benchmarks make them: the chat template when the tokenizer has one
    (``TEMPLATE_OPTIONS``), else the raw text, then ``tokenizer.encode`` with its default special tokens.

    Every record is tokenized before any is returned: a prompt that leaves fewer than ``max_new_tokens`` positions
    of ``max_context`` (the target config's ``max_position_embeddings``; None: unknown, not checked) raises
    ``ValueError`` naming its file and line, so that nothing decodes half the file."""
    room = None if max_context is None else max_context - max_new_tokens
    if room is not None and room < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the target's context of "
                         f"{max_context} positions (max_position_embeddings)")
    out = []
    for record in records:
        ids = list(tokenizer.encode(render(record, tokenizer)))
        where = f"{record['file']}:{record['line']}"
        if not ids:
            raise ValueError(f"{where}: the prompt is no token at all through the target's tokenizer")
        if room is not None and len(ids) > room:
            raise ValueError(f"{where}: the prompt is {len(ids)} tokens; the target's context is {max_context} positions "
                             f"(max_position_embeddings) and verify adds {max_new_tokens} new tokens, so at most {room} fit: "
                             "shorten or drop it, or lower --max-new-tokens")
        out.append(ids)
    return out
