"""What `radixserve bench serving` needs to know about the server, asked the way any
OpenAI-compatible server answers:

  model name   --model, else the first id of GET /v1/models
  vocabulary   (prompts are token ids below it) the first of: --vocab-size; --tokenizer (a model
               directory, or a name transformers can load); for --backend generate (SGLang's
               native API, asked for) GET /get_model_info's vocab_size; the /v1/models card's
               vocab_size when the server reports one, else its `root` when that is a model
               directory on this machine (radixserve, SGLang and vLLM report the model path
               there). Else BenchError: pass --vocab-size or --tokenizer.
  tokenizer    (--backend chat only: decodes the prompts to text) --tokenizer, else the card's
               root as above.

Nothing here calls a radixserve-only route; /get_model_info only with --backend generate.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import httpx

from radixserve.bench import BenchError
from radixserve.bench.backends import auth_headers


class Vocab(NamedTuple):
    size: int                                   # token ids [0, size) are valid prompts
    decode: Callable[[List[int]], str]


class ServerFacts(NamedTuple):
    model: str                                  # the name requests carry
    vocab_size: int
    vocab_source: str                           # which source above gave it
    tokenizer: Optional[Vocab]                  # None unless needed (chat) and found
    info: Dict                                  # the /v1/models card (+ /get_model_info)

    def record(self) -> Dict:
        """What a result file keeps of these facts."""
        return {"model": self.model, "vocab_size": self.vocab_size,
                "vocab_source": self.vocab_source, **self.info}


def load_vocab(path_or_name: str) -> Vocab:
    """The tokenizer of a model directory (radixserve's Tokenizer; the size is the smaller of
    its vocabulary and config.json's vocab_size) or of a name transformers resolves."""
    if os.path.isdir(path_or_name):
        from radixserve.tokenizer.tokenizer import Tokenizer
        tok = Tokenizer.from_path(path_or_name)
        size = tok.vocab_size
        config = os.path.join(path_or_name, "config.json")
        if os.path.isfile(config):
            import json
            with open(config) as f:
                size = min(size, json.load(f).get("vocab_size") or size)
        return Vocab(size, lambda ids: tok.decode(ids))
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(path_or_name)
    return Vocab(len(hf), lambda ids: hf.decode(ids, skip_special_tokens=True))


async def _get_json(client: httpx.AsyncClient, url: str) -> Optional[Dict]:
    """GET url as JSON; None when the server answers an error. BenchError when it is
    unreachable."""
    try:
        r = await client.get(url, headers=auth_headers())
    except httpx.TransportError as e:
        raise BenchError(f"cannot reach {url}: {type(e).__name__}: {e}; is the server up "
                         f"(--host/--port/--base-url)?") from e
    if r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


async def served_model(client: httpx.AsyncClient, base_url: str, args) -> Tuple[str, Dict]:
    """(model name, its /v1/models card or {})."""
    listing = await _get_json(client, base_url + "/v1/models") or {}
    cards = [c for c in listing.get("data") or [] if isinstance(c, dict) and c.get("id")]
    if args.model:
        return args.model, next((c for c in cards if c["id"] == args.model), {})
    if cards:
        return cards[0]["id"], cards[0]
    if args.backend == "generate":       # /generate names no model
        return "", {}
    raise BenchError(f"{base_url}/v1/models lists no model; pass --model NAME")


def _local_root(card: Dict) -> Optional[str]:
    root = card.get("root")
    return root if isinstance(root, str) and os.path.isdir(root) else None


class VocabFound(NamedTuple):
    size: int
    source: str
    vocab: Optional[Vocab]                      # the tokenizer, when one was loaded


async def _vocab_size(client, base_url: str, args, card: Dict, info: Dict) -> VocabFound:
    """The vocabulary size from the first source of the module doc that has it; a
    /get_model_info answer is kept in info["model_info"]."""
    if args.vocab_size:
        return VocabFound(args.vocab_size, "--vocab-size", None)
    if args.tokenizer:
        vocab = load_vocab(args.tokenizer)
        return VocabFound(vocab.size, "--tokenizer", vocab)
    if args.backend == "generate":
        model_info = await _get_json(client, base_url + "/get_model_info") or {}
        info["model_info"] = model_info
        if model_info.get("vocab_size"):
            return VocabFound(int(model_info["vocab_size"]), "/get_model_info", None)
    if card.get("vocab_size"):
        return VocabFound(int(card["vocab_size"]), "/v1/models", None)
    root = _local_root(card)
    if root:
        vocab = load_vocab(root)
        return VocabFound(vocab.size, "/v1/models root", vocab)
    raise BenchError("cannot tell the served model's vocabulary size (prompts are token ids "
                     "below it): pass --vocab-size N or --tokenizer PATH")


async def discover(base_url: str, args) -> ServerFacts:
    """The facts of the module doc. BenchError when the server is unreachable or a fact cannot
    be found."""
    async with httpx.AsyncClient(timeout=30) as client:
        model, card = await served_model(client, base_url, args)
        info: Dict = {"model_card": card}
        size, source, vocab = await _vocab_size(client, base_url, args, card, info)
    if args.backend == "chat" and vocab is None:
        path = args.tokenizer or _local_root(card)
        vocab = load_vocab(path) if path else None
    return ServerFacts(model, size, source, vocab, info)
