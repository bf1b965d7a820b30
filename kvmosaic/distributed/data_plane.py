"""What an instance's data-plane servers admit: peers holding the cluster secret, on the address the
cluster needs, with messages no larger than its shapes allow.

The front end resolves the secret and the listening address into the DistributedConfig it hands
every instance through Ray (``secure``), so an instance started later (a replacement) gets them too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvmosaic.config import DistributedConfig
from kvmosaic.distributed.auth import MIN_SECRET_BYTES, cluster_secret

LOOPBACK = "127.0.0.1"
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024**2
_CONTROL_BYTES = 1024**2  # a message's lists, numbers and tensor references beside its tensors' bytes


@dataclass(frozen=True, slots=True)
class DataPlaneAccess:
    """What a data-plane server (the channel, the decode lane) checks on every connection."""

    secret: bytes = field(repr=False)  # never in a log line or a repr
    handshake_timeout: float = 10.0  # seconds a new connection has to prove itself
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # the largest message it reads (message_limit)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_BYTES or self.handshake_timeout <= 0 or self.max_message_bytes <= 0:
            raise ValueError("data-plane access needs a secret of 16+ bytes, a positive handshake timeout and "
                             "a positive message limit")


def secure(config: DistributedConfig) -> DistributedConfig:
    """The front end's config with the cluster secret resolved (configured, or new) and the data
    plane's address chosen: loopback when every Ray node is this machine, else each node's IP."""
    secret = config.cluster_secret or cluster_secret(config.cluster_secret_file)
    host = config.data_plane_host or (LOOPBACK if _single_machine() else None)
    return dataclasses.replace(config, cluster_secret=secret, data_plane_host=host)


def bind_host(config: DistributedConfig) -> str:
    """Where this instance's servers listen: the configured address, else this node's IP."""
    import ray

    return config.data_plane_host or ray.util.get_node_ip_address()


def _single_machine() -> bool:
    import ray

    here = ray.util.get_node_ip_address()
    return all(node["NodeManagerAddress"] == here for node in ray.nodes() if node["Alive"])


def message_limit(num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  max_batched_tokens: int) -> int:
    """The largest message a creditor of ``num_blocks`` blocks takes or sends: a step's queries and
    new K/V rows, plus every lent key's K/V (a pull) and position, all in float32, twice over for
    blocks shared by several sequences, plus the control part."""
    rows = num_blocks * block_size + max_batched_tokens
    row_bytes = (num_heads + 2 * num_kv_heads) * head_dim * 4 + 2 * 8
    return 2 * rows * row_bytes + _CONTROL_BYTES
