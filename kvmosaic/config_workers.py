"""Configs of the work that runs on Ray actors: the distributed KV cache's instances, disaggregated
prefill and decode workers, and how a lost one is replaced. Validated in ``__post_init__`` like every
config (kvmosaic.config re-exports them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a lost worker (a Ray actor) is replaced: after a back-off that doubles from ``backoff`` up to
    ``max_backoff`` seconds, at most ``max_restarts`` times per worker slot within ``window`` seconds."""

    max_restarts: int = 3
    window: float = 600.0
    backoff: float = 0.5
    max_backoff: float = 10.0
    start_timeout: float = 300.0  # seconds a new worker may take to load its model and answer

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if min(self.window, self.start_timeout) <= 0 or self.backoff < 0 or self.max_backoff < self.backoff:
            raise ValueError("restart window and start_timeout must be > 0, 0 <= backoff <= max_backoff")


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """The distributed KV cache (``kvmosaic.distributed``): instances on Ray that lend each other blocks."""

    num_instances: int = 2
    ray_address: str | None = None  # None: start a local Ray runtime
    enable_borrowing: bool = True  # False: each instance is on its own (long requests preempted or rejected)
    heartbeat_interval: float = 0.5  # seconds between an instance's heartbeats to the gManager
    missed_heartbeats: int = 10  # heartbeats missed in a row before an instance is declared dead
    min_swap_blocks: int = 1  # DGFM resolves a cycle only if every edge carries at least this many blocks
    dgfm_interval: int = 8  # cluster steps between debt-cycle checks; 0 disables DGFM
    rpc_timeout: float = 60.0  # seconds any call to another actor may take before it counts as lost
    lend_lock_timeout: float = 0.5  # a creditor busy scheduling longer than this refuses the loan (no deadlock)
    instance_concurrency: int = 8  # threads per instance actor (step + remote attention + lending)
    lockstep: bool = False  # True: the front end steps every instance at once (tests); False: each runs its loop
    poll_wait: float = 0.02  # seconds the front end waits for an instance's outputs (independent stepping)
    # seconds a poll may take before its instance counts as hung: a poll only reads the loop's outbox,
    # so a live instance answers at once, and a stopped one is replaced this soon (not after rpc_timeout)
    poll_timeout: float = 10.0
    # Where Ray puts the instance actors: "spread" over the cluster's nodes or "pack" (Ray's default:
    # near the driver); ``instance_nodes`` pins instance i to Ray node id instance_nodes[i] instead.
    placement: str = "spread"
    kv_pull: bool = True  # a creditor returns lent K/V rows instead of partials when they are fewer bytes
    decode_lane: bool = True  # decode rows' micro-attention through the creditor's C++ server, not the channel
    # microseconds the lane's two ends poll for the next call / the answer before they sleep (0: sleep at once)
    lane_spin_us: int = 50
    # between instances of one machine, the lane's calls go through rings in shared memory, not the socket
    lane_shared_memory: bool = True
    instance_nodes: tuple[str, ...] = ()
    # a file of the data plane's shared secret (hex or text), for front ends or instances started
    # apart; else KVMOSAIC_CLUSTER_SECRET; neither: the front end makes one (docs/security.md)
    cluster_secret_file: str | None = None
    cluster_secret: bytes | None = field(default=None, repr=False)  # resolved by the front end (data_plane.secure)
    # where instances' data-plane servers listen; None: the front end picks loopback for a one-machine
    # cluster, else each node's IP. Never every interface.
    data_plane_host: str | None = None
    handshake_timeout: float = 10.0  # seconds a data-plane connection has to prove it holds the secret
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # how a dead or hung instance is replaced

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise ValueError("num_instances must be >= 1")
        if self.placement not in ("spread", "pack"):
            raise ValueError(f"placement must be 'spread' or 'pack', not {self.placement!r}")
        if self.instance_nodes and len(self.instance_nodes) != self.num_instances:
            raise ValueError(f"instance_nodes names {len(self.instance_nodes)} nodes, "
                             f"for {self.num_instances} instances")
        if self.heartbeat_interval <= 0 or self.missed_heartbeats < 1:
            raise ValueError("heartbeat_interval must be > 0 and missed_heartbeats >= 1")
        if self.min_swap_blocks < 1 or self.dgfm_interval < 0:
            raise ValueError("min_swap_blocks must be >= 1 and dgfm_interval >= 0")
        if self.rpc_timeout <= 0 or self.poll_timeout <= 0 or self.lend_lock_timeout < 0:
            raise ValueError("rpc_timeout must be > 0 and lend_lock_timeout >= 0")
        if not 0 <= self.lane_spin_us <= 100_000:
            raise ValueError("lane_spin_us must be in [0, 100000]")
        if self.instance_concurrency < 2:
            raise ValueError("instance_concurrency must be >= 2 (step and remote attention run side by side)")
        if self.handshake_timeout <= 0:
            raise ValueError("handshake_timeout must be > 0")
        if self.data_plane_host in ("", "0.0.0.0", "::"):
            raise ValueError("data_plane_host must name one address, not every interface")
        if self.cluster_secret is not None and len(self.cluster_secret) < 16:
            raise ValueError("cluster_secret must hold at least 16 bytes")
        if self.cluster_secret_file is not None and not os.path.isfile(self.cluster_secret_file):
            raise ValueError(f"cluster_secret_file {self.cluster_secret_file!r} is not a file")

    @property
    def dead_after(self) -> float:
        """Seconds without a heartbeat after which the gManager declares an instance dead."""
        return self.heartbeat_interval * self.missed_heartbeats


KV_TRANSFER_DTYPES = ("auto", "int8")  # auto: a prefix's K/V travels as its cache holds it


def check_kv_transfer_dtype(name: str) -> None:
    if name not in KV_TRANSFER_DTYPES:
        raise ValueError(f"kv transfer dtype must be one of {KV_TRANSFER_DTYPES}, got {name!r}")


@dataclass(frozen=True)
class DisaggConfig:
    """Disaggregated prefill and decode (``kvmosaic.disagg``): prefill workers and decode workers
    joined by bounded queues; on Ray when built by ``build_engine``."""

    prefill_workers: int = 1
    decode_workers: int = 1
    ray_address: str | None = None  # None: start a local Ray runtime
    max_pending_prefills: int = 64  # requests queued for prefill; more are refused (503)
    max_pending_inserts: int = 8  # prefixes queued per decode worker; more hold the prefill threads back
    max_routed_blocks: int = 65536  # prompt block hashes remembered to route prompts to their blocks
    step_wait: float = 0.02  # seconds step() waits for the first output
    rpc_timeout: float = 60.0  # seconds an insert, generate, abort or stats call may take
    prefill_timeout: float = 600.0  # seconds one prefill may take
    transfer_timeout: float = 30.0  # seconds a decode worker waits for a prefix's K/V before recomputing it
    # While a call runs, its worker is pinged this often; one that does not answer a ping within
    # ping_timeout is hung (stopped, wedged) and lost, however long the call itself may take.
    ping_interval: float = 5.0
    ping_timeout: float = 10.0
    kv_transfer_dtype: str = "auto"  # "auto": the cache's own format; "int8": a float cache's K/V as int8 records
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # how a dead or hung worker is replaced

    def __post_init__(self) -> None:
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("disaggregated serving needs at least one prefill and one decode worker")
        if min(self.max_pending_prefills, self.max_pending_inserts, self.max_routed_blocks) < 1:
            raise ValueError("disaggregation queue bounds must be >= 1")
        if min(self.step_wait, self.rpc_timeout, self.prefill_timeout, self.transfer_timeout, self.ping_interval,
               self.ping_timeout) <= 0:
            raise ValueError("disaggregation timeouts must be > 0")
        check_kv_transfer_dtype(self.kv_transfer_dtype)
