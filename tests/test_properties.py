"""Property tests (hypothesis) of every recipe step, and of the whole recipe.

Programs are drawn from templates: the idioms the steps match (and those they must leave
alone), with random names, between unrelated functions, classes, decorators, comments and
blank lines. For each program and step, through the engine (prefilters included):

* the output parses;
* every changed line is in the neighbourhood of a reported site: the top-level block (a
  template's output) holding the site's line, or the block defining the function the site
  names (lazy-import reports the import and names the function it moves into), or it is
  an import or provenance line the engine inserts at the top;
* applying twice equals applying once, and the second run reports nothing applied;
* the prefilters lose nothing: the sites equal those of the step run on the whole file.
"""

from __future__ import annotations

import ast
import difflib
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import libcst as cst
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from libcst.metadata import MetadataWrapper, PositionProvider

from patcher.engine.codemods import CODEMODS
from patcher.engine.codemods.base import APPLIED, site_positions
from patcher.engine.pipeline import process_file, transform_source
from patcher.engine.recipe import load_recipe

RECIPE = load_recipe("qwen3_6-gdn")
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])

names = st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6).map(lambda s: "v_" + s)
comments = st.sampled_from(["", "  # keep", "  # noqa: E501", "  # ddpatch? no"])


@dataclass
class Block:
    text: str

    @property
    def defines(self) -> set[str]:
        return {n.name for n in ast.walk(ast.parse(self.text)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


@st.composite
def idiom(draw, kinds=None) -> Block:
    """One top-level block: an idiom some step matches, or one it must leave alone."""
    fn, a, b, c, d, k = (draw(names) for _ in range(6))
    note = draw(comments)
    kind = draw(st.sampled_from(kinds or sorted(TEMPLATES)))
    return Block(TEMPLATES[kind].format(fn=fn, a=a, b=b, c=c, d=d, k=k, note=note))


TEMPLATES = {
    "cache-owner": (
        "def {fn}(model, target, {a}):\n"
        "    {c} = DynamicCache()\n"
        "    {d} = DynamicCache(){note}\n"
        "    target({a}, past_key_values={c})\n"
        "    model({a}, past_key_values={d})\n"
    ),
    "cache-draft-with-target-config": (
        "def {fn}(model, target, {a}):\n"
        "    {d} = DynamicCache(config=target.config)\n"
        "    model({a}, past_key_values={d})\n"
    ),
    "cache-local-class": "class DynamicCache:{note}\n    pass\n\n\ndef {fn}(target, {a}):\n    {c} = DynamicCache()\n    target({a}, past_key_values={c})\n",
    "decode-loop": (
        "def {fn}(model, target, {a}, {b}):\n"
        "    {c} = DynamicCache()\n"
        "    target({a}, past_key_values={c})\n"
        "    while {b}:{note}\n"
        "        out = target(\n"
        "            {a},\n"
        "            past_key_values={c},\n"
        "            use_cache=True,\n"
        "        )\n"
        "        {c}.crop({k})\n"
        "        for {d} in range(3):\n"
        "            model({a}, past_key_values={c})\n"
    ),
    "crop-not-a-cache": "def {fn}({a}, {b}):\n    return {a}.crop({b}){note}\n",
    "crop-negative": "def {fn}(past_key_values, {k}):\n    past_key_values.crop(-{k})\n",
    "crop-keyword-only": (
        "def {fn}(*, past_key_values: DynamicCache, {k}: int = 0) -> None:{note}\n"
        "    try:\n"
        "        past_key_values.crop({k})\n"
        "    except ValueError:\n"
        "        raise\n"
    ),
    "embed": "def {fn}(target, {a}):\n    {b} = target.model.embed_tokens({a}){note}\n    return {a}.get_input_embeddings()\n",
    "embed-lambda-and-default": (
        "def {fn}(target, {a}, {b}=None):\n"
        "    embed = lambda {c}: target.model.embed_tokens({c}){note}\n"
        "    return embed({a}) if {b} is None else {b}\n"
    ),
    "embed-own": (
        "class {fn}:\n"
        "    def get_input_embeddings(self):\n"
        "        return self.language_model.embed_tokens{note}\n\n"
        "    def setup(self):\n"
        "        self.model.embed_tokens = None\n"
    ),
    "timing": "def {fn}():\n    torch.cuda.synchronize(){note}\n    return time.perf_counter()\n",
    "timing-guarded": "def {fn}():\n    if torch.cuda.is_available():\n        torch.cuda.synchronize()\n    torch.xpu.synchronize()\n",
    "timing-method": (
        "class {fn}:\n"
        "    @staticmethod\n"
        "    def {a}() -> float:{note}\n"
        "        torch.cuda.synchronize()\n"
        "        return time.perf_counter()\n\n"
        "    async def {b}(self):\n"
        "        torch.cuda.synchronize()\n"
    ),
    "timing-nested": (
        "def {fn}({a}):\n"
        "    def {b}():\n"
        "        torch.cuda.synchronize(){note}\n"
        "    with torch.no_grad():\n"
        "        return [{b}() for _ in range({a})]\n"
    ),
    "idioms-in-strings": (
        "def {fn}():\n"
        '    """torch.cuda.synchronize(); {a}.crop(3); target.model.embed_tokens; DynamicCache()"""\n'
        "    return 'torch.cuda.synchronize()'  # torch.cuda.synchronize(){note}\n"
    ),
    "flash-required": (
        "def {fn}(args):\n"
        "    {a}_flash_attn = {b}()\n"
        "    if not {a}_flash_attn:\n"
        '        raise RuntimeError("flash_attn must be installed"){note}\n'
        '    draft_attn_implementation = "flash_attention_2"\n'
        '    return load(attn_implementation="flash_attention_2")\n'
    ),
    "flash-user-choice": (
        "def {fn}(args, flash_attn_version):\n"
        '    impl = "flash_attention_2" if args.flash_attn else "sdpa"\n'
        "    if not args.supports_flash_attn:\n"
        '        raise ValueError(f"no Flash Attention {{flash_attn_version}}"){note}\n'
        "    return impl\n"
    ),
    "datasets-user": "def load({a}):{note}\n    return load_dataset({a})\n",
    "compact": "def compact_dynamic_cache(past_key_values, past_length, keep_current_indices):{note}\n    return past_length\n",
    "compact-other": "def compact_{fn}(past_key_values, past_length, keep_current_indices):\n    return past_length\n",
    "legacy-cache": (
        "def {fn}(model, target, {a}, {b}):\n"
        "    {c} = DynamicCache()\n"
        "    {d} = DynamicCache(){note}\n"
        "    target({a}, past_key_values={c})\n"
        "    model(target_hidden={b}, past_key_values={d})\n"
        "    return {d}.to_legacy_cache(), {c}.to_legacy_cache(), {d}[0], {c}.get_max_cache_shape()\n"
    ),
    "legacy-not-a-cache": "def {fn}({a}, {b}):\n    return {a}[0], {b}.seen_tokens{note}\n",
    "kv-trim": (
        "def {fn}(past_key_values, {k}):\n"
        "    for {c} in past_key_values.layers:{note}\n"
        "        {c}.keys = {c}.keys[..., :{k}, :]\n"
        "        {c}.values = {c}.values[..., :{k}, :]\n"
    ),
    "kv-edit": (
        "def {fn}({a}_cache, {b}):\n"
        "    for {c} in {a}_cache.layers:\n"
        "        {c}.keys[:, :, {b}:] = 0{note}\n"
        "    {a}_cache.batch_select_indices({b})\n"
    ),
    "kv-not-a-cache": "class {fn}:\n    def {a}(self, {b}):\n        for {c} in self.layers:\n            {c}.keys = {b}.values(){note}\n",
}

#: The templates about each codemod; a step's test always has one of them.
OWN = {
    "target-cache-config": ["cache-owner", "cache-draft-with-target-config", "cache-local-class", "decode-loop"],
    "use-accessor": ["embed", "embed-own", "embed-lambda-and-default"],
    "crop-compat": ["decode-loop", "crop-not-a-cache", "crop-negative", "crop-keyword-only"],
    "guard-call": ["timing", "timing-guarded", "timing-method", "timing-nested", "idioms-in-strings"],
    "attn-fallback": ["flash-required", "flash-user-choice"],
    "lazy-import": ["datasets-user"],
    "wrap-call": ["decode-loop", "cache-owner"],
    "decorate-function": ["compact", "compact-other"],
    "removed-api": ["legacy-cache", "legacy-not-a-cache"],
    "cache-surgery": ["kv-trim", "kv-edit", "kv-not-a-cache"],
}


@st.composite
def filler(draw) -> Block:
    """Code no step is about."""
    fn, a, b = (draw(names) for _ in range(3))
    kind = draw(st.sampled_from(["assign", "function", "decorated", "class", "comment", "async", "try", "string", "match"]))
    note = draw(comments)
    if kind == "assign":
        return Block(f"{fn} = {draw(st.integers(0, 99))}{note}\n")
    if kind == "function":
        return Block(f"def {fn}({a}, {b}=None):\n    \"\"\"{a} and {b}.\"\"\"\n    return {a}{note}\n")
    if kind == "decorated":
        return Block(f"@functools.lru_cache(maxsize=None)\n@{a}\ndef {fn}({b}):\n    return [{b} for {b} in range(2)]\n")
    if kind == "class":
        return Block(f"class {fn}({a}):\n    {b} = 1{note}\n\n    def {b}_(self):\n        return self.{b}\n")
    if kind == "async":
        return Block(f"async def {fn}({a}):\n    async with {a} as {b}:\n        return await {b}{note}\n")
    if kind == "try":
        return Block(f"try:\n    import flash_attn as {a}\nexcept ImportError:{note}\n    {a} = None\n")
    if kind == "string":
        return Block(f'{fn} = """\ntorch.cuda.synchronize()\n{a}.crop(1)\n"""\n')
    if kind == "match":
        return Block(f"def {fn}({a}):\n    match {a}:\n        case [{b}, *_]:\n            return {b}\n        case _:\n            return None\n")
    return Block(f"# {fn} {a}\n")


HEADER = (
    '"""A generated module."""\n'
    "import functools\n"
    "import time\n\n"
    "import torch\n"
    "from datasets import load_dataset\n"
    "from transformers import DynamicCache\n"
)


@st.composite
def program(draw, own=None) -> tuple[str, list[tuple[int, int, Block]]]:
    """Source text, and each top-level block with its first and last line (1-based; blank lines before it count in)."""
    blocks = draw(st.lists(st.one_of(idiom(), filler()), max_size=5))
    if own:
        blocks.insert(draw(st.integers(0, len(blocks))), draw(idiom(own)))
    elif not blocks:
        blocks = [draw(idiom())]
    text, spans = HEADER, [(1, HEADER.count("\n"), Block(HEADER))]
    for block in blocks:
        start = text.count("\n") + 1
        text += "\n" * draw(st.integers(1, 2)) + block.text
        spans.append((start, text.count("\n"), block))
    return text, spans


def run_engine(text: str, specs) -> tuple[str, list]:
    """The engine's result for one file: (new text, sites)."""
    recipe = replace(RECIPE, steps=tuple(spec for spec, _ in specs))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "module.py")
        path.write_text(text)
        result = process_file(Path(tmp), path, specs, recipe)
    assert result.error is None, result.error
    return (result.patched if result.patched is not None else text), result.sites + result.notes  # notes: sites left alone


def check_properties(text: str, spans, specs) -> None:
    new, sites = run_engine(text, specs)
    ast.parse(new)

    allowed: set[int] = set()
    for site in sites:
        for start, end, block in spans:
            if start <= site.line <= end or (site.function and site.function in block.defines):
                allowed.update(range(start, end + 1))
    old_lines, new_lines = text.splitlines(keepends=True), new.splitlines(keepends=True)
    header_end = spans[0][1]
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        touched = set(range(i1 + 1, i2 + 1)) or {i1, i1 + 1}  # an insertion touches the lines around it
        inserted = new_lines[j1:j2]
        engine_lines = all(line.startswith(("import ", "from ", "# ddpatch: recipe")) or not line.strip() for line in inserted)
        if tag == "insert" and engine_lines and i1 <= header_end:
            continue
        assert touched & allowed if tag == "insert" else touched <= allowed, (
            f"lines {sorted(touched)} changed outside any site's block:\n{''.join(difflib.unified_diff(old_lines, new_lines))}"
        )

    again, sites_again = run_engine(new, specs)
    assert again == new, "applying twice must equal applying once"
    assert not [s for s in sites_again if s.status == APPLIED]

    whole, whole_sites, _ = transform_source(text, list(specs), in_package=False)
    assert {(s.step, s.line, s.column) for s in sites} == {(s.step, s.line, s.column) for s in whole_sites}, "a prefilter lost a site"


SPECS = [(spec, CODEMODS[spec.codemod]) for spec in RECIPE.steps]


def test_every_codemod_and_template_is_covered():
    assert set(OWN) == set(CODEMODS)
    assert {kind for kinds in OWN.values() for kind in kinds} == set(TEMPLATES)


@pytest.mark.parametrize("spec", [spec for spec, _ in SPECS], ids=[spec.id for spec, _ in SPECS])
@SETTINGS
@given(data=st.data())
def test_step_properties(spec, data):
    text, spans = data.draw(program(OWN[spec.codemod]))
    check_properties(text, spans, [(spec, CODEMODS[spec.codemod])])


@SETTINGS
@given(data=program())
def test_recipe_properties(data):
    text, spans = data
    check_properties(text, spans, SPECS)


@settings(max_examples=15, deadline=None)
@given(data=program(), picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=12))
def test_site_positions_equal_position_provider(data, picks):
    module = cst.parse_module(data[0])
    full = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    nodes = list(full)
    chosen = [nodes[i % len(nodes)] for i in picks]
    got = site_positions(module, chosen)
    assert all(got[n] == full[n] for n in chosen)
