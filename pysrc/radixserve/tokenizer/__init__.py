"""Tokenization: Tokenizer (HF tokenizers / sentencepiece backends), sandboxed chat templates,
and the per-request IncrementalDetokenizer (streaming text with stop strings)."""
from radixserve.tokenizer.chat_template import ChatTemplate
from radixserve.tokenizer.detokenizer import DetokenizeResult, IncrementalDetokenizer
from radixserve.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "DetokenizeResult", "IncrementalDetokenizer", "Tokenizer"]
