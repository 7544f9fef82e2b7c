"""Errors a user can cause: the CLI prints ``str(e)`` and exits with ``exit_code``; tracebacks are for bugs."""

from __future__ import annotations


class KilnError(Exception):
    """An error caused by input or environment; the CLI prints str(e) and exits non-zero."""

    exit_code: int = 2


class EngineFormatError(KilnError):
    """An engine directory that is missing, corrupt, foreign or of another format version."""

    @classmethod
    def of_version(cls, found: object, supported: int) -> EngineFormatError:
        """The refusal of an engine whose ``format_version`` is ``found`` where this Kiln reads ``supported``: a
        newer engine asks for a newer Kiln, an older or unreadable one for a rebuild."""
        if isinstance(found, int) and not isinstance(found, bool) and found > supported:
            return cls(f"format_version {found} is newer than the {supported} this version of kiln reads: the engine "
                       f"was built by a newer kiln; upgrade kiln, or rebuild the engine with this one")
        return cls(f"format_version {found!r} is not {supported}; rebuild the engine with this version of kiln")


class FingerprintMismatchError(KilnError):
    """An engine built for another GPU or toolchain; the message says what differs."""


class InvalidRequestError(KilnError, ValueError):
    """A request that is malformed for this engine (bad token ids, text without a tokenizer)."""


class EngineClosedError(KilnError):
    """The LLM was closed, or its engine thread stopped on an error, before the request finished."""


class SamplingError(KilnError):
    """One request's next token could not be sampled (non-finite probabilities, no token allowed, a seed torch
    refuses); only that request fails."""


class NoTokenAllowedError(SamplingError, InvalidRequestError):
    """A request whose own constraints (allowed_token_ids, min_tokens, its structured output) together exclude every
    token: the request's fault, so a server answers it with a 400."""


class DeviceUnavailableError(KilnError):
    """A CUDA device this machine does not have."""


class InsufficientKVMemoryError(KilnError):
    """The KV pool cannot hold even one sequence of the engine's max_seq_len."""


class EngineProcessError(KilnError):
    """The engine process failed to start, or exited while it served."""


class TensorParallelError(KilnError):
    """A tensor-parallel rank could not join, or left: the engine cannot run."""


class TrtllmUnavailableError(KilnError):
    """TensorRT-LLM is not installed, is not 1.2.x, or there is no GPU to run its engine on."""
