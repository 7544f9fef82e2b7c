"""Errors a user can cause: the CLI prints ``str(e)`` and exits with ``exit_code``; tracebacks are for bugs."""


class KilnError(Exception):
    """An error caused by input or environment; the CLI prints str(e) and exits non-zero."""

    exit_code: int = 2


class EngineFormatError(KilnError):
    """An engine directory that is missing, corrupt, foreign or of another format version."""


class FingerprintMismatchError(KilnError):
    """An engine built for another GPU or toolchain; the message says what differs."""


class InvalidRequestError(KilnError, ValueError):
    """A request that is malformed for this engine (bad token ids, text without a tokenizer)."""
