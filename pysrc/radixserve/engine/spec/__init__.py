"""Speculative decoding without a draft model (--speculative-algorithm): host-side drafters.

ngram.py  NgramIndex: prompt-lookup drafts from a request's own token history.
Drafts are proposals only; the scheduler's SpecDecoder (engine/scheduler/spec.py) decides who
drafts, and a verify step (one extend of the k + 1 tokens) decides what is kept.
"""
