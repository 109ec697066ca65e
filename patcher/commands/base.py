"""What every ``ddpatch`` command shares: the group that turns every error into one line and an
exit code, the option groups, and settings from the config file. Click only, over ``patcher.api``.

Exit codes, the same for every command (docs/exit-codes.md):
  0    clean: nothing pending, every check passed
  1    findings: changes pending (``check``, ``diff``), a step is no-match, a file was skipped,
       a verify check failed, a selection that leaves out a lossless step
  2    usage or input error (one ``ddpatch: error:`` line on stderr says which)
  3    internal error of ddpatch: not a verdict on the tree
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

from .. import api
from ..report.console import print_json
from ..report.json_report import error_payload
from ..results import EXIT_ERROR, EXIT_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK

EXIT_PENDING = EXIT_FAILED  # changes pending, or a verify check failed
FORMAT = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True, help="Output format.")


class Failure(click.ClickException):
    exit_code = EXIT_ERROR

    def show(self, file=None) -> None:
        click.echo(f"ddpatch: error: {self.format_message()}", err=True)


class Interrupted(Failure):
    """Ctrl-C: one line and exit 130, as a shell reports SIGINT."""

    exit_code = EXIT_INTERRUPTED


#: Set when a config file asks for ``format = "json"``, so that an error after it is read is JSON too.
_JSON_BY_CONFIG: list[bool] = []


def _wants_json(argv: list[str]) -> bool:
    return bool(_JSON_BY_CONFIG) or "--format=json" in argv or any(a == "--format" and b == "json" for a, b in zip(argv, argv[1:]))


class Main(click.Group):
    """The ``ddpatch`` group: every error, click's usage errors included, is one ``ddpatch: error:`` line.

    With ``--format json`` an error also prints a JSON object on stdout (``command``,
    ``error``, ``exit_code``), so that a script always gets one.
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        _JSON_BY_CONFIG.clear()
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `ddpatch`: the help is the answer
                exc.show()
                sys.exit(exc.exit_code)
            message = exc.format_message()
            if isinstance(exc, click.UsageError) and exc.ctx is not None:
                message += f" (see `{exc.ctx.command_path} --help`)"
            self._fail(argv, message, exc.exit_code)
        except click.Abort as exc:  # click turns Ctrl-C (and EOF at a prompt) into Abort
            interrupted = isinstance(exc.__context__, KeyboardInterrupt)
            self._fail(argv, "interrupted" if interrupted else "aborted", EXIT_INTERRUPTED if interrupted else EXIT_ERROR)
        except KeyboardInterrupt:
            self._fail(argv, "interrupted", EXIT_INTERRUPTED)
        except Exception as exc:  # a bug of ours: one line and exit 3, never a verdict on the tree
            if os.environ.get("DDPATCH_DEBUG"):
                raise
            self._fail(argv, f"internal error: {type(exc).__name__}: {exc} (set DDPATCH_DEBUG=1 for the traceback)", EXIT_INTERNAL)
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)

    def _fail(self, argv: list[str], message: str, code: int) -> None:
        if _wants_json(argv):
            print_json(error_payload(self.command_name(argv), message, code))
        click.echo(f"ddpatch: error: {message}", err=True)
        sys.exit(code)

    def command_name(self, argv: list[str]) -> str | None:
        """The command ``argv`` names, a subcommand included (``recipes show``)."""
        at = next((i for i, a in enumerate(argv) if a in self.commands), None)
        if at is None:
            return None
        group = self.commands[argv[at]]
        if isinstance(group, click.Group):
            sub = next((a for a in argv[at + 1:] if a in group.commands), None)
            if sub:
                return f"{argv[at]} {sub}"
        return argv[at]


def friendly(fn):
    """Turn known errors into one clear line and exit code 2 (Ctrl-C: 130)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted("interrupted") from None
        except api.INPUT_ERRORS as exc:
            raise Failure(str(exc)) from None
        except OSError as exc:  # e.g. a full disk while writing: one line, not a traceback
            where = f": {exc.filename}" if exc.filename else ""
            raise Failure(f"{exc.strerror or exc}{where}") from None

    return wrapper


def options(*options):
    """One decorator that adds ``options`` in the order given."""
    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


CONFIG_OPTIONS = (
    click.option("--config", "config_file", type=click.Path(path_type=Path, dir_okay=False), default=None,
                 help="Read settings from this file (a ddpatch.toml, or a pyproject.toml with [tool.ddpatch]) instead of the nearest one."),
    click.option("--isolated", is_flag=True, help="Read no config file."),
)

recipe_options = options(
    click.option("--recipe", "recipe_name", default=None,
                 help="A built-in recipe name or a path to a recipe .toml (default: the config's, else the only recipe that detects the tree)."),
    click.option("--select", default=None, help="Only these step ids (comma-separated)."),
    click.option("--ignore", default=None, help="Skip these step ids (comma-separated)."),
    click.option("--allow-lossy", is_flag=True, help="Accept a --select/--ignore that leaves out a step the recipe needs to stay lossless."),
    click.option("--upstream", default=None, help="Treat the tree as this upstream layout instead of detecting it."),
    click.option("--exclude", "exclude", multiple=True, metavar="GLOB",
                 help="Leave these files or folders out (repeatable): a name anywhere (analysis, profile_*.py) or a path from "
                      "the tree's root (scripts/old/). The report lists what was left out."),
    click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Parallel worker processes, >= 1 (default: number of CPUs)."),
    click.option("--include-vendored", is_flag=True,
                 help="Also check folders that look like copies of third-party packages (third_party/, vendor/, a folder with its "
                      "own pyproject.toml, ...); by default they are listed and not parsed, unless they hold a decoder."),
    click.option("-v", "--verbose", is_flag=True, help="List every site."),
    click.option("--output-format", type=click.Choice(["full", "concise"]), default="full", show_default=True,
                 help="With text output: concise prints one `path:line:col: step status message` line per site."),
    *CONFIG_OPTIONS,
    FORMAT,
)

#: CLI parameter -> config key, for the settings a config file may give.
_CONFIGURABLE = {"recipe_name": "recipe", "select": "select", "ignore": "ignore", "upstream": "upstream", "jobs": "jobs",
                 "fmt": "format", "allow_lossy": "allow-lossy", "presets": "presets", "entries": "entry", "reviewed": "reviewed",
                 "include_vendored": "include-vendored", "exclude": "exclude", "prompts_file": "prompts-file"}


def configured(path, options: dict) -> dict:
    """``options`` with each setting not given on the command line taken from the config file."""
    from click.core import ParameterSource

    from ..config import default_recipe, load_config

    ctx = click.get_current_context()
    config = load_config(path, options.pop("config_file", None), options.pop("isolated", False))
    for param, key in _CONFIGURABLE.items():
        if param in options and key in config.values and ctx.get_parameter_source(param) in (ParameterSource.DEFAULT, None):
            options[param] = tuple(config.values[key]) if param in ("presets", "entries", "reviewed", "exclude") else config.values[key]
    if options.get("fmt") == "json":
        _JSON_BY_CONFIG.append(True)
    if "recipe_name" in options and not options["recipe_name"]:
        options["recipe_name"] = default_recipe(path)
    return options


def report_errors(lines: list[str]) -> None:
    """One ``ddpatch: error:`` line on stderr per failure, the cause (a skipped file) first."""
    for line in lines:
        click.echo(f"ddpatch: error: {line}", err=True)


def lossy_line(lossy: list[str], recipe_name: str) -> list[str]:
    if not lossy:
        return []
    return [f"--select/--ignore leaves out {', '.join(lossy)}, without which recipe {recipe_name} decodes lossy on a hybrid "
            "model; add them back, or pass --allow-lossy"]


def next_step(line: str, fmt: str) -> None:
    if fmt != "json":
        click.echo(f"next: {line}")


def ints(value: str | None, minimum: int | None = None, flag: str = "") -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=flag or None) from None
    if not out:
        raise click.BadParameter(f"expected at least one integer, got {value!r}", param_hint=flag or None)
    if minimum is not None and any(v < minimum for v in out):
        raise click.BadParameter(f"every value must be >= {minimum}, got {value!r}", param_hint=flag or None)
    return out


