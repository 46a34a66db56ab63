"""Tokenization: Tokenizer (HF tokenizers / sentencepiece backends), sandboxed chat templates,
the per-request IncrementalDetokenizer (streaming text with stop strings), and role formats
(roles.py: a chat template cut into per-role prefix/suffix text, for the frontend language and
/get_model_info's chat_template_name)."""
from radixserve.tokenizer.chat_template import ChatTemplate
from radixserve.tokenizer.detokenizer import DetokenizeResult, IncrementalDetokenizer
from radixserve.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "DetokenizeResult", "IncrementalDetokenizer", "Tokenizer"]
