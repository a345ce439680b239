"""The model: runner (one step's tensors), the Llama model and its TP ranks, model config,
communicator, sampler, attention backends, device/dtype/KV sizing.

May import: pd.protocol, pd.kvcache. Never the engine (the runner reads a step through the
`StepBatch` Protocol) nor anything above it.
"""

from pd.worker.model.config import ModelConfig
from pd.worker.model.device import resolve_device, resolve_dtype, size_kv_pages
from pd.worker.model.runner import ModelRunner, StepBatch, StepRequest
from pd.worker.model.runner_config import Accelerator, RunnerConfig
from pd.worker.model.sampler import SampleOutput, Sampler

__all__ = [
    "ModelConfig",
    "Accelerator",
    "ModelRunner",
    "RunnerConfig",
    "SampleOutput",
    "Sampler",
    "StepBatch",
    "StepRequest",
    "resolve_device",
    "resolve_dtype",
    "size_kv_pages",
]
