"""The step channel between the engine and its ranks (no Ray): every rank gets its message, rank 0's answer comes
back; a rank that raises fails the step with StepError (the group is intact and keeps serving), and a rank that
dies, hangs or leaves the others stuck fails it with WorkerDiedError."""

import logging
import threading
import time

import pytest

from specray.cluster.step_channel import StepClient, StepServer, send_frame
from specray.cluster import step_channel
from specray.errors import StepError, WorkerDiedError


class Rank:
    def __init__(self, rank: int, behaviour=None):
        self.rank, self.behaviour, self.seen = rank, behaviour, []
        self.server = StepServer(self.handle, "127.0.0.1")

    def handle(self, plan, extra=None):
        self.seen.append((plan, extra))
        if self.behaviour is not None:
            self.behaviour(plan)
        return {"rank": self.rank, "plan": plan, "extra": extra}


def connect(ranks):
    return StepClient([r.server.address for r in ranks])


def test_every_rank_gets_its_message_and_rank0_answers():
    ranks = [Rank(0), Rank(1, lambda plan: time.sleep(0.05)), Rank(2)]
    client = connect(ranks)
    shared = ({"step": 1}, None)
    reply = client.step([({"step": 1}, "probs"), shared, shared], timeout=10, what="step 1")
    assert reply == {"rank": 0, "plan": {"step": 1}, "extra": "probs"}
    assert [r.seen for r in ranks] == [[({"step": 1}, "probs")], [({"step": 1}, None)], [({"step": 1}, None)]]
    assert len(client.last_busy_s) == 3 and client.last_busy_s[1] >= 0.05 > client.last_busy_s[0]
    big = list(range(1_000_000))  # several MB: frames are read whole
    assert client.step([(big, None)] * 3, timeout=30, what="big")["plan"] == big
    client.close()


def test_a_rank_that_raises_is_a_step_error_not_a_dead_group():
    """A plain Python error on a live rank (a bug, a bad input) comes back as StepError with the remote type,
    message and traceback, and the request ids the error names; the channel keeps serving the next step."""

    class BadRequest(KeyError):
        req_ids = ["r7"]

    def fail(plan):
        if plan == "bad":
            raise RuntimeError("shape mismatch in layer 3")
        if plan == "bad request":
            raise BadRequest("r7")

    ranks = [Rank(0), Rank(1, fail)]
    client = connect(ranks)
    with pytest.raises(StepError, match="rank 1 raised RuntimeError: shape mismatch in layer 3") as info:
        client.step([("bad", None)] * 2, timeout=10, what="step 7")
    err = info.value
    assert not isinstance(err, WorkerDiedError)
    assert (err.rank, err.exc_type, err.req_ids) == (1, "RuntimeError", [])
    assert err.exc_message == "shape mismatch in layer 3"
    assert "in fail" in err.remote_traceback and "Traceback" in err.remote_traceback
    with pytest.raises(StepError) as info:
        client.step([("bad request", None)] * 2, timeout=10, what="step 8")
    assert info.value.req_ids == ["r7"] and info.value.exc_type == "BadRequest"
    assert client.step([("ok", None)] * 2, timeout=10, what="step 9")["plan"] == "ok"  # still in step
    client.close()


def test_a_rank_that_raises_while_another_waits_for_it_leaves_the_group_out_of_step(monkeypatch):
    """Rank 1 raised before a collective; rank 0 waits in it for rank 1 and never answers: the group is stuck,
    which only a restart mends (WorkerDiedError naming both and carrying the traceback)."""
    monkeypatch.setattr(step_channel, "DESYNC_GRACE_S", 0.3)
    release = threading.Event()
    ranks = [Rank(0, lambda plan: release.wait(30)), Rank(1, lambda plan: 1 / 0)]
    client = connect(ranks)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 raised ZeroDivisionError.*ranks \[0\] did not finish") as info:
        client.step([("x", None)] * 2, timeout=60, what="step 4")
    assert time.monotonic() - start < 5
    assert "ZeroDivisionError" in info.value.remote_traceback
    release.set()
    client.close()


def test_errors_name_the_peer():
    ranks = [Rank(0)]
    ranks[0].behaviour = lambda plan: ranks[0].server.close()
    client = StepClient([r.server.address for r in ranks], peer="drafter actor rank")
    with pytest.raises(WorkerDiedError, match="drafting: drafter actor rank 0 died"):
        client.step([("x", None)], timeout=10, what="drafting")
    client.close()


def test_a_dead_rank_fails_the_step_at_once_even_while_another_waits_for_it():
    release = threading.Event()
    ranks = [Rank(0, lambda plan: release.wait(30)), Rank(1)]
    ranks[1].behaviour = lambda plan: ranks[1].server.close()  # its process died: the socket closes unanswered
    client = connect(ranks)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        client.step([("x", None)] * 2, timeout=60, what="step 2")
    assert time.monotonic() - start < 5
    release.set()
    client.close()


def test_a_hung_rank_times_out():
    release = threading.Event()
    ranks = [Rank(0, lambda plan: release.wait(30))]
    client = connect(ranks)
    with pytest.raises(WorkerDiedError, match=r"no answer from target ranks \[0\]"):
        client.step([("x", None)], timeout=0.3, what="step 3")
    release.set()
    client.close()


def test_only_the_token_holder_drives_a_rank():
    import socket

    rank = Rank(0)
    host, port, token = rank.server.address
    with socket.create_connection((host, port)) as stranger:
        send_frame(stranger, b"not the token")
        assert stranger.recv(1) == b""  # turned away
    client = StepClient([(host, port, token)])
    assert client.step([("ok", None)], timeout=10, what="step 1")["plan"] == "ok"
    assert rank.seen == [("ok", None)]
    client.close()


def test_an_unreachable_rank_is_a_clear_error():
    rank = Rank(0)
    host, port, token = rank.server.address
    with pytest.raises(WorkerDiedError, match="cannot reach"):
        StepClient([(host, port, token), ("127.0.0.1", 1, token)])


def test_a_failed_step_logs_its_plan_and_the_remote_traceback(caplog):
    from specray.contract import NewRequest, ScheduledChunk, StepPlan
    from specray.errors import log_error_detail
    from specray.sampling_params import SamplingParams

    plan = StepPlan(42, new_requests=[NewRequest("b", SamplingParams(), [3])],
                    chunks=[ScheduledChunk("a", [1, 2, 3], 7, num_draft_tokens=2), ScheduledChunk("b", [4] * 9, 0)],
                    finished_req_ids=["z"])
    err = StepError("step 42", 0, "KeyError", "'a'", "Traceback (most recent call last):\n  File \"runner.py\"\n")
    with caplog.at_level("ERROR"):
        log_error_detail(logging.getLogger("test"), plan, err)
    text = caplog.text
    assert "step 42: 2 chunks [a(+3@7, drafts=2), b(+9@0, drafts=0)]; new=['b'], finished=['z']" in text
    assert 'remote traceback:\nTraceback (most recent call last):\n  File "runner.py"' in text


def test_a_remote_user_error_is_raised_as_itself_with_the_remote_traceback_chained():
    from specray.cluster.remote_errors import raise_remote
    from specray.errors import RemoteTraceback

    class FakeTaskError(Exception):  # what ray.exceptions.RayTaskError carries
        def __init__(self, cause):
            super().__init__(f"remote: {cause}")
            self.cause, self.traceback_str = cause, "Traceback ...\n  File \"worker.py\", line 9, in setup"

    with pytest.raises(ValueError, match="heads") as info:
        raise_remote(FakeTaskError(ValueError("num_attention_heads=9 is not divisible by 2")))
    assert isinstance(info.value.__cause__, RemoteTraceback) and 'worker.py", line 9' in str(info.value.__cause__)
    with pytest.raises(WorkerDiedError, match="loading failed: boom") as info:
        raise_remote(FakeTaskError(RuntimeError("boom")), lambda m: WorkerDiedError(f"loading failed: {m}"))
    assert "worker.py" in str(info.value.__cause__)


def test_step_errors_cross_processes_whole():
    import pickle

    from specray.errors import RequestFailedError

    err = StepError("step 3", 1, "KeyError", "'x'", "tb", ["x"])
    back = pickle.loads(pickle.dumps(RequestFailedError("x", err)))
    assert (back.req_id, back.cause.req_ids, back.cause.remote_traceback, str(back.cause)) == \
        ("x", ["x"], "tb", str(err))
