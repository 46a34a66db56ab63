"""model/weight_floor.py: the bytes a batch-1 decode step streams (the floor's numerator)."""
import torch

from radixserve.model.weight_floor import streamed_weight_bytes


class _Cfg:
    def __init__(self, tied):
        self.tie_word_embeddings = tied


class _Model(torch.nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.config = _Cfg(tied)
        self.embed_tokens = torch.nn.Embedding(100, 8)               # 800 params
        self.proj = torch.nn.Linear(8, 8, bias=False)                # 64
        self.lm_head = torch.nn.Linear(8, 100, bias=False)           # 800
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def test_untied_embedding_table_is_not_streamed():
    assert streamed_weight_bytes(_Model(tied=False)) == (64 + 800) * 4


def test_tied_head_is_streamed_once():
    assert streamed_weight_bytes(_Model(tied=True)) == (800 + 64) * 4
