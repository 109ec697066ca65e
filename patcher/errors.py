"""The errors that mean "bad input" (one line for the user, exit 2) or "ddpatch itself failed" (exit 3).

Each layer raises its own; they live here, below every layer, so that the API and the CLI can
name them without importing the engine. Imports: nothing.
"""

from __future__ import annotations


class EngineError(Exception):
    """Bad input that stops a recipe run (a missing path, an unknown upstream)."""


class RecipeError(ValueError):
    """A recipe that cannot be found or read."""


class JournalError(Exception):
    """Nothing recorded to revert, or a file changed since the apply."""


class CIError(Exception):
    """Bad input or an unreadable repository: one line for the user, exit 2."""


class VerifyError(Exception):
    """Bad input, or a run stopped by its timeout, that produced no result (one line for the user)."""

    exit_code = 2


class VerifierCrash(VerifyError):
    """An internal error: the verifier itself crashed or died. Never a verdict on the tree."""

    exit_code = 3


#: Errors that mean bad input to apply, diff, check, revert and recipes.
INPUT_ERRORS = (EngineError, RecipeError, JournalError, ValueError)
