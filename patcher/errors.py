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


class RefereeError(Exception):
    """A serving engine that gave the referee no usable answer (one line for the user, exit 2)."""

    exit_code = 2


class EngineUnreachable(RefereeError):
    """The engine's address refused the connection, did not resolve, or did not answer in time."""


class EngineAnswerError(RefereeError):
    """The engine answered, but not with what its API documents (an HTTP error, no JSON, too large, a field missing)."""


class NoAcceptanceCounters(RefereeError):
    """The engine's answer has no acceptance counters: speculative decoding is off (the message says how to turn it on)."""


class NotGreedy(RefereeError):
    """The engine reports sampling settings that are not greedy: its tokens cannot be compared with greedy decoding."""


class PromptTooLong(RefereeError):
    """The prompt and the new tokens do not fit the engine's context."""


class TokenizerMismatch(RefereeError):
    """The engine's tokenizer splits a probe text differently from the target's tokenizer."""
