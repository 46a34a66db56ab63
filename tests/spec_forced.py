"""Forced speculative drafts for the unit and GPU tests of issue 39 point 4 (verify steps in the
overlapped loop): every draft is the request's true greedy continuation, so each is accepted,
or with corrupt_every = n every n-th draft has its second token wrong (accepted up to there)."""
from typing import Dict, List


def force_drafts(monkeypatch, refs: Dict[str, List[int]], corrupt_every: int = 0,
                 vocab: int = 1000) -> None:
    """Hold speculation's gates open, overlap verify steps (the knob on: the CPU's auto runs
    them serially) and make SpecDecoder.draft return refs[rid] (the request's unspeculated
    output) from the position after the token the draft's first row reads: the step in
    flight's draft counts as accepted and its next token as unknown (DecodeManager._in_flight).
    A corrupted token is (true + 1) % vocab."""
    from radixserve.engine.scheduler import spec as spec_mod

    calls = {"n": 0}

    def draft(self, req, extra=(), unknown=False, miss_cooldown=0):
        if not self.eligible(req):
            return []
        pos = len(req.output_ids) + len(extra) + (1 if unknown else 0)
        room = min(self.num_draft, req.max_new_tokens - req.num_output_scheduled - 1)
        d = list(refs[req.rid][pos:pos + max(room, 0)])
        calls["n"] += 1
        if corrupt_every and calls["n"] % corrupt_every == 0 and len(d) >= 2:
            d[1] = (d[1] + 1) % vocab
        return d

    monkeypatch.setattr(spec_mod.RateGate, "allow", lambda self, *a: True)
    monkeypatch.setattr(spec_mod.SpecDecoder, "draft", draft)
    monkeypatch.setenv("RADIXSERVE_SPEC_OVERLAP", "on")
