"""The engine cache's remote tier: entries shared through S3-compatible object storage or a shared filesystem."""

from kiln.engines.cache.remote.objects import ObjectInfo, ObjectStore, RemoteCorruptError, RemoteUnavailableError
from kiln.engines.cache.remote.spec import RemoteSpec, open_objects
from kiln.engines.cache.remote.tier import PullResult, PushResult, RemoteTier

__all__ = ["ObjectInfo", "ObjectStore", "PullResult", "PushResult", "RemoteCorruptError", "RemoteSpec", "RemoteTier",
           "RemoteUnavailableError", "open_objects"]
