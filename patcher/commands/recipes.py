"""``ddpatch recipes``: the built-in recipes, listed or shown step by step (a group of the ``ddpatch`` group)."""

from __future__ import annotations

import click

from .. import api
from ..report.console import print_json
from ..report.json_report import recipe_payload, recipes_payload
from ..report.text import recipe_text, recipes_text
from .base import FORMAT, friendly


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def recipes() -> None:
    """List the built-in recipes or show one."""


@recipes.command("list")
@FORMAT
@friendly
def recipes_list(fmt: str) -> None:
    """The known recipes, one line each."""
    items = api.recipes()
    if fmt == "json":
        print_json(recipes_payload(items))
    else:
        click.echo(recipes_text(items), nl=False)


@recipes.command("show")
@click.argument("name")
@FORMAT
@friendly
def recipes_show(name: str, fmt: str) -> None:
    """A recipe's steps: what each matches and writes, with an example of each."""
    recipe, docs = api.recipe_docs(name)
    if fmt == "json":
        print_json(recipe_payload(recipe, docs))
    else:
        click.echo(recipe_text(recipe, docs), nl=False)
