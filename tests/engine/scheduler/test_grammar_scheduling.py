"""The scheduler with constrained requests, through the GrammarMatcher protocol alone (no
grammar engine): waiting for a compile, advancing the matcher, ending on a complete grammar."""

from __future__ import annotations

from concurrent.futures import Future

from engine.request import Request, RequestStatus
from engine.structured_output import StructuredOutputRequest
from tests.engine.scheduler.test_scheduler import fake_step, make_request, make_scheduler


class CountingMatcher:
    """A grammar that is complete after `length` tokens and allows only token 7."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id == 7

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length or 7 not in self.accepted[-1:]

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        raise AssertionError("the scheduler never fills bitmasks")


class Compiled:
    def __init__(self, length: int) -> None:
        self.length = length

    def new_matcher(self) -> CountingMatcher:
        return CountingMatcher(self.length)


def constrained(rid: str, future: Future, **params: object) -> Request:
    request = make_request(rid, 6, **params)
    request.structured = StructuredOutputRequest(future)
    return request


def test_a_compiling_request_is_passed_over_without_stalling_the_queue() -> None:
    sched = make_scheduler()
    compiling: Future = Future()
    first = constrained("grammar", compiling, max_tokens=10)
    sched.add_request(first)
    sched.add_request(make_request("plain", 6))
    assert first.status is RequestStatus.WAITING_FOR_GRAMMAR

    output = sched.schedule()
    assert [e.request_id for e in output.scheduled] == ["plain"]
    assert list(sched.waiting) == [first]  # it keeps its place at the head
    assert sched.stats().num_waiting == 1
    fake_step(sched, output)

    compiling.set_result(Compiled(length=3))
    output = sched.schedule()
    assert [e.request_id for e in output.scheduled] == ["plain", "grammar"]
    assert first.status is RequestStatus.RUNNING


def test_a_complete_grammar_ends_the_request_with_stop_before_max_tokens() -> None:
    sched = make_scheduler()
    done: Future = Future()
    done.set_result(Compiled(length=3))
    request = constrained("r", done, max_tokens=10)
    sched.add_request(request)
    assert request.status is RequestStatus.WAITING  # compiled already: no wait
    finish = None
    while finish is None:
        result = fake_step(sched, sched.schedule())
        finish = next((o.finish_reason for o in result.outputs if o.finished), None)
    assert finish == "stop" and request.output_token_ids == [7, 7, 7]
    assert request.structured is not None and request.structured.matcher is not None
    assert request.structured.matcher.accepted == [7, 7, 7]  # type: ignore[attr-defined]


def test_a_rejected_token_ends_the_request_instead_of_sampling_from_a_broken_grammar() -> None:
    sched = make_scheduler()
    done: Future = Future()
    done.set_result(Compiled(length=5))
    sched.add_request(constrained("r", done, max_tokens=10))
    result = fake_step(sched, sched.schedule(), sample=lambda r: 8)
    assert [(o.new_token_ids, o.finish_reason) for o in result.outputs] == [([8], "stop")]


def test_a_failed_compile_aborts_only_that_request_and_reports_it() -> None:
    sched = make_scheduler()
    failing: Future = Future()
    sched.add_request(constrained("bad", failing))
    sched.add_request(make_request("plain", 6))
    failing.set_exception(ValueError("cannot compile"))
    output = sched.schedule()
    assert [e.request_id for e in output.scheduled] == ["plain"]
    result = fake_step(sched, output)
    aborted = [o for o in result.outputs if o.request_id == "bad"]
    assert [(o.new_token_ids, o.finish_reason) for o in aborted] == [([], "abort")]
    assert "bad" not in sched.requests and not sched.waiting


def test_max_tokens_still_cuts_an_unfinished_grammar_with_length() -> None:
    sched = make_scheduler()
    done: Future = Future()
    done.set_result(Compiled(length=50))
    sched.add_request(constrained("r", done, max_tokens=2))
    reasons = []
    while sched.has_unfinished_requests():
        reasons += [o.finish_reason for o in fake_step(sched, sched.schedule()).outputs]
    assert reasons == [None, "length"]
