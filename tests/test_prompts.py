"""``ddpatch verify --prompts-file``: every format upstream's benchmarks read, every bad input refused in one line naming the
file and line before a verifier starts, and the child's tokenizing (``tokenize_records``) on the shipped pair's real
tokenizer, without a chat template and with one (``patcher/verify/models/prompts.py``)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from cli_support import run

from patcher.verify.models import prompts as P

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "vendored" / "ddtree"
PAIR_TARGET = ROOT / "patcher" / "data" / "trained_pair" / "target"
#: A Qwen-shaped chat template (our own): it shows whether the generation prompt and enable_thinking=False were passed.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def runs(monkeypatch):
    """The options each ``run_verify`` got: a verifier that would have started."""
    seen: list[dict] = []

    def fake(tree, timeout=600.0, progress=None, **options):
        from patcher.results import Outcome

        seen.append(options)
        return Outcome({"checks": [{"check": "c", "passed": True}]}, 0.0)

    monkeypatch.setattr("patcher.verify.process.runner.run_verify", fake)
    return seen


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- the formats
def test_each_jsonl_shape_is_read_as_upstreams_benchmarks_read_it(tmp_path):
    f = write(tmp_path / "mixed.jsonl", [
        {"turns": ["Compose a travel blog post.", "Rewrite it in limericks."]},  # upstream's cache (MT-Bench)
        "",
        {"question": "How many clips?", "answer": "72"},  # GSM8K
        {"problem": "Find x."},  # MATH-500
        {"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Return x.\"\"\"\n", "entry_point": "f"},
        {"task_id": 2, "prompt": "Write a function to add.", "test_list": []},  # MBPP: as is
        {"prompt": ["First turn.", "Second turn."], "category": "writing"},  # MT-Bench as the hub publishes it
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    ])
    fmt, records = P.read_prompts(f)
    assert fmt == "jsonl"
    got = [(r["line"], r["shape"], r.get("text", r.get("messages"))) for r in records]
    assert got == [
        (1, "turns", "Compose a travel blog post."),
        (3, "question", "How many clips?\nPlease reason step by step, and put your final answer within \\boxed{}."),
        (4, "problem", "Find x.\nPlease reason step by step, and put your final answer within \\boxed{}."),
        (5, "humaneval", "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
                         "def f(x):\n    \"\"\"Return x.\"\"\"\n\n```"),
        (6, "prompt", "Write a function to add."),
        (7, "turns", "First turn."),
        (8, "messages", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
    ]
    assert [r.get("later_turns", 0) for r in records] == [1, 0, 0, 0, 0, 1, 0]
    assert all(r["file"] == str(f) for r in records)


def test_plain_text_is_one_prompt_per_line_and_the_format_is_chosen_per_file(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_bytes("\ufeffWrite a haiku.\r\n\r\n   \nExplain \u2028 recursion.\n".encode())  # a BOM, CRLF, blank lines
    assert P.read_prompts(text) == ("text", [
        {"file": str(text), "line": 1, "shape": "text", "text": "Write a haiku."},
        {"file": str(text), "line": 4, "shape": "text", "text": "Explain \u2028 recursion."},
    ])
    sniffed = write(tmp_path / "rows.txt", ["", {"question": "q"}])  # no suffix: the first non-blank line decides
    assert P.read_prompts(sniffed)[0] == "jsonl"
    braces = write(tmp_path / "code.txt", ["{not json", "x"])
    assert P.read_prompts(braces)[0] == "text"
    named = write(tmp_path / "rows.json", [{"turns": ["a"]}])  # .json: JSONL, one object per line
    assert P.read_prompts(named)[1][0]["text"] == "a"
    unicode_line = tmp_path / "u.jsonl"  # a raw U+2028 inside a JSON string is one line, not two
    unicode_line.write_text('{"turns": ["a\u2028b"]}\n', encoding="utf-8")
    assert [r["text"] for r in P.read_prompts(unicode_line)[1]] == ["a\u2028b"]


def test_the_first_n_prompts_are_kept_and_the_default_is_the_first_eight(tmp_path):
    f = write(tmp_path / "p.txt", [f"prompt {i}" for i in range(10)])
    default = P.verify_options(f)
    assert P.DEFAULT_FILE_PROMPTS == 8 and [r["text"] for r in default["prompt_records"]] == [f"prompt {i}" for i in range(8)]
    assert default["prompts_source"] == {"file": str(f), "format": "text", "prompts": 8, "of": 10, "shapes": ["text"],
                                         "later_turns_left_out": 0}
    assert [r["line"] for r in P.verify_options(f, 3)["prompt_records"]] == [1, 2, 3]
    assert len(P.verify_options(f, 10)["prompt_records"]) == 10
    short = write(tmp_path / "short.txt", ["a", "b"])
    assert len(P.verify_options(short)["prompt_records"]) == 2, "a shorter file: all of it"
    with pytest.raises(P.PromptsFileError, match=r"^--prompts 3: .*short.txt holds 2 prompts$"):
        P.verify_options(short, 3)
    json.dumps(default)  # it travels to the child as JSON
    assert P.describe_source(default["prompts_source"]) == f"8 of 10 prompts of {f} (plain text); the first ones (--prompts N for more)"


# ----------------------------------------------------------------------------- bad input: one line, exit 2, nothing runs
BAD = [
    ("empty.jsonl", "", r"empty.jsonl: empty: no prompt in it"),
    ("blank.txt", "\n  \n\n", r"blank.txt: empty: no prompt in it"),
    ("notjson.jsonl", '{"turns": ["a"]}\n\n{"turns": ["b"],\n', r"notjson.jsonl:3: not JSON \("),
    ("array.json", '[{"turns": ["a"]},\n {"turns": ["b"]}]\n', r"array.json:1: not JSON .*write one object per line"),
    ("scalar.jsonl", '{"turns": ["a"]}\n"just a string"\n', r"scalar.jsonl:2: a JSON str, not an object"),
    ("nokey.jsonl", '{"turns": ["a"]}\n{"text": "hi", "id": 3}\n', r"nokey.jsonl:2: no prompt key: expected one of messages, turns, "
                                                                   r"question, problem, prompt; the object has id, text"),
    ("blankq.jsonl", '{"question": "  "}\n', r"blankq.jsonl:1: empty prompt \(question is blank\)"),
    ("noturns.jsonl", '{"turns": []}\n', r"noturns.jsonl:1: empty prompt \(turns is an empty list\)"),
    ("blankturn.jsonl", '{"turns": ["", "b"]}\n', r"blankturn.jsonl:1: empty prompt \(turns\[0\] is blank\)"),
    ("strturns.jsonl", '{"turns": "a"}\n', r"strturns.jsonl:1: turns must be a list of strings, got a JSON str"),
    ("numq.jsonl", '{"question": 3}\n', r"numq.jsonl:1: question must be a string, got a JSON int"),
    ("nomsg.jsonl", '{"messages": []}\n', r"nomsg.jsonl:1: empty prompt \(messages is an empty list\)"),
    ("blankmsg.jsonl", '{"messages": [{"role": "user", "content": " "}]}\n', r"blankmsg.jsonl:1: empty prompt \(every message"),
    ("badmsg.jsonl", '{"messages": [{"role": "user"}]}\n', r"badmsg.jsonl:1: messages\[0\] must be an object with a string role"),
    ("answered.jsonl", '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n',
     r"answered.jsonl:1: messages end with an assistant message"),
    ("latin1.txt", b"fine\nna\xefve\n", r"latin1.txt:2: not UTF-8 text"),
]


@pytest.mark.parametrize("name,content,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_naming_the_file_and_line_and_nothing_runs(tmp_path, runs, name, content, pattern):
    f = tmp_path / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(P.PromptsFileError, match=pattern):
        P.read_prompts(f)
    text = run("verify", TREE, "--prompts-file", f)
    assert text.exit_code == 2 and not runs, text.output
    lines = text.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpatch: error: ") and re.search(pattern, lines[0]), lines
    as_json = run("verify", TREE, "--prompts-file", f, "--format", "json")
    payload = json.loads(as_json.stdout)
    assert as_json.exit_code == 2 and payload["exit_code"] == 2 and payload["command"] == "verify" and not runs
    assert re.search(pattern, payload["error"]) and str(f) in payload["error"]


@pytest.mark.parametrize("args,needle", [
    (("--prompts-file", "missing.jsonl"), "--prompts-file missing.jsonl: no such file"),
    (("--prompts-file", "."), "--prompts-file .: not a file"),
    (("--prompts-file", "p.txt", "--prompts", "5"), "--prompts 5: p.txt holds 2 prompts"),
    (("--prompts-file", "p.txt", "--preset", "tiny-qwen3_5"), "--prompts-file needs a model that reads text"),
    (("--prompts-file", "p.txt", "--generate"), "--prompts-file feeds a tree's decoders"),
])
def test_bad_use_is_one_line_and_exit_2(tmp_path, runs, args, needle):
    write(tmp_path / "p.txt", ["a", "b"])
    tree = () if "--generate" in args else (TREE,)
    result = run("verify", *tree, *args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and not runs and len(lines) == 1 and lines[0].startswith("ddpatch: error: ") and needle in lines[0], lines


def test_the_parsed_prompts_reach_the_verifier_as_json(tmp_path, runs):
    f = write(tmp_path / "gsm8k.jsonl", [{"question": f"q{i}", "answer": "1"} for i in range(12)])
    assert run("verify", TREE, "--prompts-file", f.name, "--prompts", "3").exit_code == 0
    (options,) = runs
    assert [(r["line"], r["text"].split("\n")[0]) for r in options["prompt_records"]] == [(1, "q0"), (2, "q1"), (3, "q2")]
    assert options["prompts_source"]["prompts"] == 3 and options["prompts_source"]["of"] == 12 and options["prompts"] == 3
    assert json.loads(json.dumps(options["prompt_records"])) == options["prompt_records"]
    assert run("verify", TREE, "--prompts-file", f, "--preset", "trained-qwen3_5", "--preset", "tiny-qwen3_5").exit_code == 0
    assert len(runs[1]["prompt_records"]) == P.DEFAULT_FILE_PROMPTS and runs[1]["prompts"] is None, "the default: the first 8"
    assert run("verify", TREE).exit_code == 0 and "prompt_records" not in runs[2], "no file, no records"


# ----------------------------------------------------------------------------- the child: through the tokenizer
@pytest.fixture(scope="module")
def plain_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PAIR_TARGET, local_files_only=True)
    assert not tok.chat_template, "the shipped pair has no chat template: the raw-text path"
    return tok


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory, plain_tokenizer):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chat_tokenizer")
    plain_tokenizer.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)  # as the child loads a target folder


def records(tmp_path, lines):
    return P.verify_options(write(tmp_path / "p.jsonl", lines), len(lines))["prompt_records"]


def test_without_a_chat_template_the_raw_text_is_encoded(tmp_path, plain_tokenizer):
    recs = records(tmp_path, [{"turns": ["def add(a, b):"]}, {"messages": [{"role": "user", "content": "import os"}]}])
    ids = P.tokenize_records(recs, plain_tokenizer, 2048, 64)
    assert ids == [plain_tokenizer.encode("def add(a, b):"), plain_tokenizer.encode("import os")]
    assert all(isinstance(i, int) for i in ids[0]) and len(ids[0]) > 1
    assert P.template_note(plain_tokenizer) == "raw text: the target's tokenizer has no chat template"
    chat = records(tmp_path, [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}])
    with pytest.raises(ValueError, match=r"p.jsonl:1: a chat of 2 messages needs a chat template"):
        P.tokenize_records(chat, plain_tokenizer, 2048, 64)


def test_with_a_chat_template_it_is_applied_as_upstreams_benchmark_applies_it(tmp_path, chat_tokenizer):
    recs = records(tmp_path, [{"turns": ["hi", "more"]}, {"messages": [{"role": "system", "content": "Be brief."},
                                                                       {"role": "user", "content": "hi"}]}])
    ids = P.tokenize_records(recs, chat_tokenizer, 2048, 64)
    generation = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # add_generation_prompt=True, enable_thinking=False
    assert ids == [chat_tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n" + generation),
                   chat_tokenizer.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" + generation)]
    assert P.template_note(chat_tokenizer).startswith("the target's chat template (add_generation_prompt=True, enable_thinking=False)")


def test_a_prompt_longer_than_the_context_is_refused_by_its_line_before_any_is_returned(tmp_path, plain_tokenizer):
    config = json.loads((PAIR_TARGET / "config.json").read_text())
    context = config["max_position_embeddings"]
    long = " ".join(["import os"] * context)  # well over the context in tokens
    recs = records(tmp_path, [{"turns": ["short"]}, {"turns": ["short too"]}, {"turns": [long]}])
    with pytest.raises(ValueError, match=rf"/p.jsonl:3: the prompt is \d+ tokens; the target's context is {context} positions "
                                         rf"\(max_position_embeddings\) and verify adds 64 new tokens, so at most {context - 64} fit"):
        P.tokenize_records(recs, plain_tokenizer, context, 64)
    n = len(plain_tokenizer.encode("short"))
    assert P.tokenize_records(recs[:1], plain_tokenizer, n + 64, 64), "a prompt that just fits"
    with pytest.raises(ValueError, match=r"/p.jsonl:1: the prompt is"):
        P.tokenize_records(recs[:1], plain_tokenizer, n + 63, 64)
    assert len(P.tokenize_records(recs, plain_tokenizer, None, 64)[2]) > context, "no known context: not checked"
    with pytest.raises(ValueError, match=r"--max-new-tokens 64 leaves no room"):
        P.tokenize_records(recs[:1], plain_tokenizer, 64, 64)


def test_the_childs_value_error_becomes_one_fatal_line(tmp_path, plain_tokenizer, monkeypatch, capsys):
    """The child reports a ValueError as ``fatal`` (``worker.answer``), which the parent turns into one line and exit 2."""
    from patcher.verify.child import worker

    recs = records(tmp_path, [{"turns": ["short"]}, {"turns": [" ".join(["x"] * 5000)]}])
    monkeypatch.setattr(worker, "run", lambda cfg: {"ids": P.tokenize_records(cfg["prompt_records"], plain_tokenizer, 2048, 64)})
    worker.answer({"prompt_records": recs}, worker.NoDdpatch())
    event = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    fatal = event["result"].get("fatal", "")
    assert set(event["result"]) == {"fatal"} and fatal.startswith(f"{tmp_path / 'p.jsonl'}:2: the prompt is 5000 tokens"), event


def test_the_module_imports_only_the_stdlib_at_module_level_and_the_docs_name_its_keys():
    tree = ast.parse((ROOT / "patcher" / "verify" / "models" / "prompts.py").read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert top <= {"__future__", "json", "pathlib"} and not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
    docs = (ROOT / "docs" / "verifier.md").read_text()
    section = docs[docs.index("## Your own prompts"):]
    assert all(f"| `{key}` |" in section for key in P.KEYS)
    assert f"the first {P.DEFAULT_FILE_PROMPTS} (all of a shorter file)" in section


def test_verify_generate_leaves_a_configured_prompts_file_aside(tmp_path, monkeypatch):
    from patcher.results import Outcome

    seen = {}
    monkeypatch.setattr("patcher.verify.judge.generate_mode.run_generate",
                        lambda **k: seen.update(k) or Outcome({"checks": [{"check": "c", "passed": True}]}, 0.0))
    (tmp_path / "ddpatch.toml").write_text('prompts-file = "p.txt"\n')  # read from the working folder: --generate has no PATH
    (tmp_path / "p.txt").write_text("a\n")
    assert run("verify", "--generate", "--mode", "mtp").exit_code == 0 and "prompts_file" not in seen and seen["modes"] == ["mtp"]
