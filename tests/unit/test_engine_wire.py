"""The wire of --engine-process (engine/process.py) without a model: EngineHost serving a stand-in
engine over a real Pipe, read from this test's side as EngineClient reads it. Outputs produced
in one loop turn cross in ONE message (not one per token); a refused submit, a failing call and
an unknown call come back as errors of the right kind; the host stops when the other end
closes. The end-to-end behaviour with the real engine is tests/e2e/test_engine_process.py."""
import asyncio
import multiprocessing

import pytest

from radixserve.config import ServerArgs
from radixserve.engine.io import GenerateOutput, GenerateReqInput
from radixserve.engine.process import (EngineHost, error_from_payload, error_payload,
                                       pack_output)
from radixserve.errors import EngineOverloaded, RequestError
from radixserve.sampling.params import SamplingParams


class StandIn:
    """What EngineHost uses of AsyncEngine: submit_nowait emits `tokens` outputs at once per
    request (as one step's results would), refuses the rid "bad"."""

    def __init__(self, tokens=3):
        self.tokens = tokens
        self.aborted, self.started, self.stopped = [], False, False
        self.loop_error = None
        self.on_fatal = None
        self.max_total_tokens, self.context_len = 100, 50
        self.served_model_name, self.model_path = "m", "/m"
        self.pooling_method = self.rerank_labels = self.rerank_unavailable = None
        self.lm_head_loaded = True

    def start(self):
        self.started = True

    async def shutdown(self):
        self.stopped = True

    def server_info(self):
        return {"x": 1}

    def metrics(self):
        return {"num_requests": 7}

    def waiting_count(self):
        return 2

    def abort(self, rid, message):
        self.aborted.append((rid, message))

    def submit_nowait(self, req, sink, grammar=None):
        if req.rid == "bad":
            raise RequestError("temperature must be >= 0", param="temperature")
        for i in range(self.tokens):
            sink(GenerateOutput(req.rid, "t", [i], i == self.tokens - 1,
                                completion_tokens=i + 1))

    async def flush_cache(self):
        raise RuntimeError("flush failed")


def _req(rid):
    return GenerateReqInput(rid=rid, input_ids=[1, 2], sampling_params=SamplingParams())


async def _recv(conn, timeout=5.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not conn.poll():
        assert loop.time() < deadline, "nothing arrived"
        await asyncio.sleep(0.005)
    return conn.recv()


def test_a_turns_outputs_cross_in_one_message_and_errors_keep_their_kind():
    async def main():
        ours, theirs = multiprocessing.Pipe(duplex=True)
        engine = StandIn()
        host = EngineHost(engine, theirs)
        task = asyncio.ensure_future(host.run())
        ready = await _recv(ours)
        assert ready[0] == "ready" and ready[1]["max_total_tokens"] == 100
        assert ready[1]["server_info"] == {"x": 1} and engine.started
        ours.send(("submit", _req("a")))
        ours.send(("submit", _req("b")))
        out = await _recv(ours)
        assert out[0] == "out" and out[2] == 2          # both requests, every token, one message
        got = [GenerateOutput(*f) for f in out[1]]
        assert [(o.rid, o.output_ids_delta, o.finished) for o in got] == \
            [("a", [0], False), ("a", [1], False), ("a", [2], True),
             ("b", [0], False), ("b", [1], False), ("b", [2], True)]
        assert pack_output(got[2]) == out[1][2]
        ours.send(("submit", _req("bad")))
        refused = await _recv(ours)
        assert refused[:2] == ("refused", "bad")
        e = error_from_payload(refused[2])
        assert isinstance(e, RequestError) and e.param == "temperature"
        ours.send(("abort", "a", "gone"))
        ours.send(("call", 1, "metrics", ()))
        assert await _recv(ours) == ("ret", 1, None, {"num_requests": 7})
        assert engine.aborted == [("a", "gone")]
        ours.send(("call", 2, "flush_cache", ()))
        ret = await _recv(ours)
        assert ret[:2] == ("ret", 2) and ret[3] is None
        assert "flush failed" in str(error_from_payload(ret[2]))
        ours.send(("call", 3, "rm -rf", ()))
        ret = await _recv(ours)
        assert isinstance(error_from_payload(ret[2]), ValueError)
        ours.close()                                    # the server went away
        assert await asyncio.wait_for(task, 5) == 0
        assert engine.stopped

    asyncio.run(main())


def test_error_payloads_round_trip():
    cases = [RequestError("x must be 1", param="x"), ValueError("bad"),
             EngineOverloaded("busy"), KeyError("k")]
    back = [error_from_payload(error_payload(e)) for e in cases]
    assert isinstance(back[0], RequestError) and back[0].param == "x"
    assert type(back[1]) is ValueError and str(back[1]) == "bad"
    assert isinstance(back[2], EngineOverloaded)
    assert type(back[3]) is RuntimeError and "KeyError" in str(back[3])


def test_engine_process_refuses_the_dashboard():
    with pytest.raises(ValueError, match="--engine-process"):
        ServerArgs(device="cpu", engine_process=True, enable_dashboard=True).check()
    ServerArgs(device="cpu", engine_process=True).check()
    ServerArgs(device="cpu", enable_dashboard=True).check()   # the default picks one process


@pytest.mark.parametrize("argv, device, dashboard, expected", [
    ([], "cuda", False, True),            # a GPU server: the engine in a process of its own
    ([], "cpu", False, False),            # the CPU: one process
    ([], "cuda", True, False),            # the dashboard reads the radix tree in-process
    (["--no-engine-process"], "cuda", False, False),
    (["--engine-process"], "cpu", False, True),
])
def test_engine_process_default_and_flags(argv, device, dashboard, expected):
    import argparse
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    args.device, args.enable_dashboard = device, dashboard
    assert args.resolved_engine_process() is expected


def test_deliver_merges_backlog_honours_the_interval_and_raises_refusals():
    from radixserve.engine.surface import deliver

    def out(n, done=False):
        return GenerateOutput("r", f"{n} ", [n], done, completion_tokens=n)

    async def main():
        q = asyncio.Queue()
        for n in (1, 2, 3):
            q.put_nowait(out(n))
        q.put_nowait(out(4, done=True))
        got = [o async for o in deliver(q, 1)]              # all queued: one merged output
        assert [(o.output_ids_delta, o.text_delta, o.finished) for o in got] == \
            [([1, 2, 3, 4], "1 2 3 4 ", True)]

        q = asyncio.Queue()
        agen = deliver(q, 3)                                # --stream-interval 3
        seen = []

        async def consume():
            async for o in agen:
                seen.append(o.output_ids_delta)

        task = asyncio.ensure_future(consume())
        for n in range(1, 9):
            q.put_nowait(out(n, done=n == 8))
            await asyncio.sleep(0)                          # one step at a time
        await asyncio.wait_for(task, 5)
        assert seen == [[1], [2, 3, 4], [5, 6, 7], [8]]    # first at once, then every 3, last

        q = asyncio.Queue()
        q.put_nowait(out(1))
        q.put_nowait(RequestError("rid in use", param="rid"))
        with pytest.raises(RequestError, match="rid in use"):
            async for _ in deliver(q, 1):
                pass

    asyncio.run(main())
