"""The name a node's producer serves on: the fleet's base name plus the Ray node id, so a trial
finds its node's producer from the node it runs on, with no address passed around.

Why the node id is in the name: nodes of one machine (``ray.cluster_utils.Cluster``, or two
raylets on a big box) share the per-user runtime directory and ``/dev/shm``, so one name per
fleet would make the second node's producer refuse to start.
"""

from __future__ import annotations

import re

from .. import endpoint as endpoints

NODE_ID_CHARS = 16  # hex digits of the node id kept: 64 bits, no collision among a cluster's nodes
_NODE_ID = re.compile(r"[0-9a-f]{16,}")
# A served name is at most 64 characters (endpoint.resolve): the base, a dash, the node id part.
MAX_BASE = 64 - 1 - NODE_ID_CHARS


def check_base(name: str) -> str:
    """``name`` if it can be a fleet's base name; ValueError naming the rule otherwise."""
    if not isinstance(name, str) or not name or len(name) > MAX_BASE:
        raise ValueError(
            f"name={name!r} must be a string of 1-{MAX_BASE} characters (the node id is appended to it)"
        )
    endpoints.resolve(name)  # letters, digits, '.', '_' or '-', starting with a letter or digit
    return name


def node_name(name: str, node_id: str) -> str:
    """The name the producer of fleet ``name`` on node ``node_id`` (a Ray node id, hex) serves on."""
    check_base(name)
    if not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id):
        raise ValueError(f"node_id={node_id!r} is not a Ray node id (hex, as ray.nodes() lists them)")
    return f"{name}-{node_id[:NODE_ID_CHARS]}"


def current_node_id() -> str:
    """The Ray node this process runs on; RuntimeError when Ray is not initialized here."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            "Ray is not initialized in this process: call this inside a Ray task, actor or Tune "
            "trial, or after ray.init(address=...)"
        )
    return ray.get_runtime_context().get_node_id()
