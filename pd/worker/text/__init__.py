"""Text: tokenizer (with the chat template), incremental detokenizer, stop strings.

Pure Python over `tokenizers` and jinja2; imports nothing else of pd.
"""

from pd.worker.text.detokenizer import IncrementalDetokenizer
from pd.worker.text.stop import StopChecker
from pd.worker.text.tokenizer import ChatTemplateError, Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "StopChecker", "Tokenizer"]
