"""Roofline capacity planner: memory, step time, tokens/s and critical batch size of decode steps.

``probe_hardware`` lives in :mod:`kvmosaic.planner.probe` (it imports torch); everything here is pure Python.
"""

from kvmosaic.planner.presets import HARDWARE_PRESETS, MODEL_PRESETS, resolve_hardware, resolve_model
from kvmosaic.planner.roofline import (
    HardwareSpec,
    ModelSpec,
    PlanRow,
    StepTime,
    Workload,
    critical_batch_size,
    kv_bytes_per_token,
    max_batch_size,
    param_count,
    plan,
    roofline_step_time,
    step_time,
    tokens_per_second,
    weight_bytes,
    workload,
)

__all__ = [
    "HARDWARE_PRESETS", "MODEL_PRESETS", "HardwareSpec", "ModelSpec", "PlanRow", "StepTime", "Workload",
    "critical_batch_size", "kv_bytes_per_token", "max_batch_size", "param_count", "plan", "resolve_hardware",
    "resolve_model", "roofline_step_time", "step_time", "tokens_per_second", "weight_bytes", "workload",
]
