"""What a command was pointed at: an engine directory, a cached engine by its key or a key prefix, a config (a path
or a bundled name), or an architecture file. The one resolver behind ``kiln serve``, ``loadtest`` and ``bench``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kiln.engines.cache import CacheCorruptError, CacheEntryNotFoundError, EngineCache, EntryHold
from kiln.engines.cache.keys import MIN_PREFIX, is_key_prefix
from kiln.engines.cache.layout import entry_of_payload, layout_root
from kiln.pipeline.cache_remote import pull_engine
from kiln.pipeline.config import find_config, remote_spec, remote_turned_off
from kiln.pipeline.console import warn
from kiln.runtime.engine import is_engine_dir
from kiln.runtime.errors import KilnError

TargetKind = Literal["engine", "config", "architecture"]


class TargetError(KilnError):
    """A target that is none of the things a command takes."""


@dataclass(frozen=True)
class Target:
    """``engine``: ``path`` is an engine directory, that of entry ``cache_key`` of the cache at ``cache_root`` when it
    is a cached one; ``config``: ``path`` is a config file; ``architecture``: a ``config.json``-style file."""

    kind: TargetKind
    path: Path
    cache_key: str | None = None
    cache_root: Path | None = None
    hold: EntryHold | None = field(default=None, compare=False, repr=False)  # a cached engine's, kept while in use

    @property
    def name(self) -> str:
        """How to call it: the short key of a cached engine, an engine folder's name, or a config's."""
        if self.cache_key:
            return self.cache_key[:12]
        if self.kind == "engine":  # an engine folder named "engine" is named by the folder holding it
            return self.path.parent.name if self.path.name == "engine" else self.path.name
        return self.path.stem


def resolve_target(text: str, cache_root: Path, *, no_engines: str | None = None) -> Target:
    """``text`` as an engine directory (a cache entry's folder included), a config or architecture file (a path, or
    a name under the bundled configs), or a key or key prefix of an engine in the cache at ``cache_root`` (else on
    its remote tier, pulled first). A cached engine's files are checked against its manifest first
    (CacheCorruptError). ``no_engines``: a command that takes no engine refuses one with this TargetError message
    (after the engine's name), before anything is looked up or pulled."""
    path = Path(text).expanduser()
    for engine_dir in (path, path / "engine"):  # a cache entry's folder holds its engine in engine/
        if is_engine_dir(engine_dir):
            if no_engines is not None:
                raise TargetError(f"{engine_dir}: an engine directory; {no_engines}")
            return _engine(engine_dir.resolve())
    if path.is_dir():
        raise TargetError(f"{text}: a folder, and not an engine directory (no engine.json or kiln_trtllm.json); "
                          f"{_what_to_give(no_engines)}")
    if (found := find_config(text)) is not None:
        return Target("architecture" if found.suffix == ".json" else "config", found)
    if is_key_prefix(text):
        if no_engines is not None:
            raise TargetError(f"{text}: a cache key (an engine's); {no_engines}")
        remote = remote_spec()
        if remote is None and not layout_root(cache_root).is_dir():
            raise TargetError(f"cache key {text}: there is no engine cache at {cache_root}; set $KILN_CACHE to the "
                              f"cache that holds it, or $KILN_CACHE_REMOTE to the team's remote cache")
        cache = EngineCache.open_configured(cache_root, remote=remote, recorded_remote=not remote_turned_off(),
                                            warn=warn)
        try:
            key = cache.entries.complete_key(text)
        except CacheEntryNotFoundError:
            if cache.remote is None:
                raise
            pulled = pull_engine(cache, text)  # a team's engine this machine has not got yet
            return _engine(pulled.payload_dir, pulled.hold)
        return _engine(cache.entries.payload_dir(key))
    if path.is_symlink():
        raise TargetError(f"{text}: a symbolic link that leads to nothing (a link loop or a missing target); point "
                          f"it at an engine directory or a config")
    short_key = not no_engines and re.fullmatch(r"[0-9a-f]+", text) and len(text) < MIN_PREFIX
    key = f"too short for a cache key's prefix (at least {MIN_PREFIX} hex digits)" if short_key else "not a cache key"
    repo = ("; a Hugging Face repo id goes in a config's model.path (Kiln builds from a config: copy a bundled one, "
            "such as configs/llama3-8b-fp8.yaml)") if re.fullmatch(r"[\w.-]+/[\w.-]+", text) else ""
    raise TargetError(f"{text}: no such {'config or architecture file' if no_engines else 'engine directory or config'}"
                      f", and {key}; {_what_to_give(no_engines)}{repo}")


def _what_to_give(no_engines: str | None) -> str:
    """The targets a command takes, as advice: a config or architecture file where it takes no engine."""
    config = "a config (a path or a name under configs/, e.g. tiny-llama-fp8.yaml)"
    if no_engines is not None:
        return f"give {config} or an architecture file (configs/models/llama3-8b.json)"
    return f"give the engine directory `kiln build` printed, a key from `kiln cache ls`, or {config}"


def _engine(engine_dir: Path, hold: EntryHold | None = None) -> Target:
    """An engine directory as a target: a cached one checked against its manifest and held (``hold``, or a new one)
    from now on, so that no other process's eviction removes it before this one loads it (not held in a cache this
    user cannot write, which says so)."""
    in_cache = entry_of_payload(engine_dir)
    if in_cache is None or in_cache[1] != "entries":
        return Target("engine", engine_dir)
    root, _, key = in_cache
    cache = EngineCache.open_configured(root, warn=warn)
    hold = hold or (EntryHold(engine_dir.parent) if cache.read_only is None else None)
    found = cache.entries.lookup(key, record=False)  # the files against the manifest
    if not found.hit:
        if hold is not None:
            hold.release()
        if found.reason == "incompatible":  # a newer Kiln's, which that Kiln serves (its key is not this Kiln's)
            fix = "serve it with the Kiln that built it, or build its config with this one (another key)"
        elif cache.read_only is None:
            fix = f"rebuild it (`kiln build --force`) or remove it (`kiln cache rm {key[:12]}`)"
        else:
            fix = "rebuild or remove it where the cache is writable (this user cannot write it here)"
        raise CacheCorruptError(f"cache entry {key[:12]}: {found.detail}; {fix}")
    return Target("engine", engine_dir, key, root, hold)
