"""Builds the EngineClient a configuration asks for: one in-process Engine, a Cluster of engine
instances on Ray (kvmosaic.distributed) when a DistributedConfig is given, or prefill and decode
workers on Ray (kvmosaic.disagg) when a DisaggConfig is given."""

from __future__ import annotations

from kvmosaic.config import DisaggConfig, DistributedConfig, EngineConfig
from kvmosaic.engine.protocol import EngineClient
from kvmosaic.worker.worker import ModelLoader


def build_engine(config: EngineConfig, distributed: DistributedConfig | None = None,
                 loader: ModelLoader | None = None, disagg: DisaggConfig | None = None) -> EngineClient:
    """``loader`` reads the weights for an in-process engine (default: ``load_model`` in the config's
    weight format; instances on Ray load their own)."""
    if distributed is not None and disagg is not None:
        raise ValueError("choose the distributed KV cache (instances) or disaggregated prefill/decode, not both")
    if disagg is not None:
        from kvmosaic.disagg.ray_workers import build_disaggregated  # ray is imported only here

        return build_disaggregated(config, disagg)
    if distributed is not None:
        from kvmosaic.distributed.cluster import Cluster  # ray is imported only for a cluster

        return Cluster(config, distributed)
    from kvmosaic.engine.engine import Engine
    from kvmosaic.executor.local import LocalExecutor

    return Engine(config, LocalExecutor(config, loader))
