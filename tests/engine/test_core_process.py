"""AsyncLLM with its engine core in a process of its own (the default): the same outputs
as in-process, and everything that crosses the boundary (rejections, aborts, the
prefix-cache reset, a failed step) behaves as it does in-process."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections import deque
from pathlib import Path

import pytest

from engine import (
    AsyncLLM,
    EngineArgs,
    EngineDeadError,
    EngineHooks,
    RequestOutput,
    RequestValidationError,
    SamplingParams,
    core_client,
    start_core,
)
from engine.config import load_tokenizer
from engine.core_client import CoreProcess, discard_prestarted, prestart_core, wait_loaded
from engine.core_proc import ADD, CoreChannel, CoreReady, CoreRequest, _report
from engine.sampling_params import RequestOutputKind
from engine.scheduler.output import SchedulerStats
from tests.tiny_models import make_tiny_model

ARGS = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-core-proc"), byte_level=True)


def make_engine(path: Path, in_process: bool, hooks: EngineHooks | None = None) -> AsyncLLM:
    args = EngineArgs(model=str(path), engine_in_process=in_process, **ARGS)  # type: ignore[arg-type]
    return AsyncLLM.from_engine_args(args, hooks)


async def final(stream: object) -> RequestOutput:
    last = None
    async for output in stream:  # type: ignore[attr-defined]
        last = output
    assert last is not None
    return last


def mixed_requests(engine: AsyncLLM) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded sampling, n > 1, logprobs, a stop string, a shared prefix."""
    prefix = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    return [
        ([*prefix, 40 + i], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        for i in range(4)
    ] + [
        (prefix[:9], SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=20, logprobs=2)),
        (prefix[:12], SamplingParams(temperature=0.0, max_tokens=40, stop=("o",))),
        (prefix[:5], SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1)),
    ]


def run_all(engine: AsyncLLM) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        engine.start()
        try:
            jobs = [
                final(engine.generate(prompt, params, f"req{i}"))
                for i, (prompt, params) in enumerate(mixed_requests(engine))
            ]
            return list(await asyncio.gather(*jobs))
        finally:
            await engine.stop()

    return asyncio.run(run())


def test_outputs_equal_the_in_process_engine(model_dir: Path) -> None:
    remote = make_engine(model_dir, in_process=False)
    assert remote.core is None  # the core runs elsewhere
    local = make_engine(model_dir, in_process=True)
    assert local.core is not None
    got, want = run_all(remote), run_all(local)
    # Greedy choices are exact. A sampled choice can turn on the last bits of a logit,
    # which differ between batch shapes, and the two runs batch differently.
    for i in (0, 1, 2, 3, 5, 6):
        assert [(c.token_ids, c.text, c.finish_reason) for c in got[i].outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in want[i].outputs
        ]
    assert got[5].outputs[0].finish_reason == "stop" and "o" not in got[5].outputs[0].text
    sampled = got[4].outputs
    assert [c.index for c in sampled] == [0, 1, 2]
    assert all(len(c.token_ids) == 20 and len(c.logprobs or ()) == 20 for c in sampled)
    assert all(len(lp.top) == 2 for c in sampled for lp in c.logprobs or ())
    prompt_lps = [(lp.token_id, lp.rank) for lp in got[6].prompt_logprobs or ()]
    assert prompt_lps and prompt_lps == [
        (lp.token_id, lp.rank) for lp in want[6].prompt_logprobs or ()
    ]
    for a, b in zip(got[6].prompt_logprobs or (), want[6].prompt_logprobs or (), strict=True):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-4, abs=1e-5)


def test_a_request_the_core_refuses_ends_with_its_error(model_dir: Path) -> None:
    """The core's own checks cross back as the exception, `param` and all."""
    engine = make_engine(model_dir, in_process=False)

    async def run() -> None:
        engine.start()
        engine._validate = lambda *args: None  # type: ignore[method-assign]  # let it reach the core
        try:
            params = SamplingParams(n=2, max_tokens=4)
            with pytest.raises(RequestValidationError) as refused:
                await final(engine.generate([7] * 300, params, "too-long"))
            assert refused.value.param == "prompt" and "max_model_len" in str(refused.value)
            ok = await final(engine.generate([7, 8, 9], SamplingParams(max_tokens=3), "fine"))
            assert len(ok.outputs[0].token_ids) == 3
            assert not engine.has_pending_work
        finally:
            await engine.stop()

    asyncio.run(run())


def test_aborts_reach_the_core_before_a_prefix_cache_reset(model_dir: Path) -> None:
    engine = make_engine(model_dir, in_process=False)

    async def run() -> None:
        engine.start()
        try:
            params = SamplingParams(
                max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            stream = engine.generate(list(range(10, 60)), params, "long")
            await stream.__anext__()
            # Held blocks make a reset refuse; the abort goes first, so the reset runs.
            await stream.aclose()
            assert await engine.reset_prefix_cache() is True
            assert not engine.has_pending_work and engine.num_queued_requests == 0
        finally:
            await engine.stop()

    asyncio.run(run())


def test_a_failed_step_fails_the_streams_and_the_engine(model_dir: Path) -> None:
    engine = make_engine(model_dir, in_process=False, hooks=EngineHooks(fail_after_steps=2))
    pid = engine._remote.proc.pid  # type: ignore[union-attr]

    async def run() -> None:
        engine.start()
        try:
            params = SamplingParams(max_tokens=50, ignore_eos=True)
            with pytest.raises(EngineDeadError, match="injected engine step failure"):
                await final(engine.generate([5, 6, 7], params, "doomed"))
            for _ in range(100):  # the process exits once it has said why
                if engine.fatal_error is not None:
                    break
                await asyncio.sleep(0.05)
            assert not engine.is_alive
            assert engine.fatal_error == "the engine core process exited with code 1"
            with pytest.raises(EngineDeadError):
                engine.generate([5], params, "after")
        finally:
            await engine.stop()

    asyncio.run(run())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_two_frontends_share_a_core_and_one_that_quits_loses_its_requests(
    model_dir: Path,
) -> None:
    """Each frontend gets its own requests' outputs; the requests of one that quits are
    aborted (their blocks freed) while the other goes on; the core exits after both."""
    args = EngineArgs(model=str(model_dir), **ARGS)  # type: ignore[arg-type]
    start = start_core(args, None, None, num_frontends=2)
    try:
        first, second = (AsyncLLM.attach(channel, start.proc.pid) for channel in start.channels)

        async def run() -> None:
            first.start()
            second.start()
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            left = first.generate(list(range(10, 60)), long, "left-behind")
            await left.__anext__()  # running, holding blocks
            await first.stop()  # QUIT, without aborting its stream first
            short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            done = await final(second.generate([5, 6, 7], short, "served"))
            assert len(done.outputs[0].token_ids) == 8
            # Nothing holds a block: the quitter's request was aborted, not left running.
            assert await second.reset_prefix_cache() is True
            await second.stop()

        asyncio.run(run())
        assert start.proc.wait(timeout=30) == 0
    finally:
        if start.proc.poll() is None:
            start.proc.kill()
        shutil.rmtree(start.directory, ignore_errors=True)


def watch_the_load(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What happens, in order, as a frontend starts: the core's report ("core loaded"),
    and a tokenizer the frontend reads itself ("tokenizer read")."""
    import engine.async_llm as async_llm
    import engine.core_client as core_client

    events: list[str] = []
    read, wait = async_llm.load_tokenizer, core_client.wait_loaded

    def load_tokenizer(model: object) -> object:
        events.append("tokenizer read")
        return read(model)  # type: ignore[arg-type]

    def wait_loaded(channel: object) -> object:
        result = wait(channel)  # type: ignore[arg-type]
        events.append("core loaded")
        return result

    monkeypatch.setattr(async_llm, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(core_client, "wait_loaded", wait_loaded)
    return events


def serve_and_stop(*engines: AsyncLLM) -> None:
    """A request through each frontend, then each stops."""

    async def run() -> None:
        for engine in engines:
            engine.start()
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        for i, engine in enumerate(engines):
            done = await final(engine.generate([5, 6, 7], params, f"through-{i}"))
            assert len(done.outputs[0].token_ids) == 2
        for engine in engines:
            await engine.stop()

    asyncio.run(run())


def test_the_frontend_takes_the_tokenizer_the_core_read(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the core's report, for a frontend that starts its core and for each of the
    several frontends of one core: none reads the tokenizer itself (AutoTokenizer would
    import torch), and it is the model's."""
    events = watch_the_load(monkeypatch)
    engine = make_engine(model_dir, in_process=False)
    try:
        assert events == ["core loaded"]
        text = "the lazy dog"
        assert engine.tokenizer.encode(text) == load_tokenizer(engine.config.model).encode(text)
    finally:
        serve_and_stop(engine)
    events.clear()
    args = EngineArgs(model=str(model_dir), **ARGS)  # type: ignore[arg-type]
    start = start_core(args, None, None, num_frontends=2)
    try:
        frontends = [AsyncLLM.attach(c, start.proc.pid) for c in start.channels]
        assert events == ["core loaded", "core loaded"]
        serve_and_stop(*frontends)
        assert start.proc.wait(timeout=30) == 0
    finally:
        if start.proc.poll() is None:
            start.proc.kill()
        shutil.rmtree(start.directory, ignore_errors=True)


def test_a_tokenizer_that_does_not_pickle_is_read_by_the_frontend(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The core reports its config alone, and says why; the frontend then reads the
    model's tokenizer itself."""
    engine = make_engine(model_dir, in_process=True)
    try:
        tokenizer = load_tokenizer(engine.config.model)
        tokenizer.hook = lambda text: text  # as a tokenizer with Python code in it would hold
        read, write = os.pipe()
        ready = CoreReady(engine.config, tokenizer)
        with caplog.at_level(logging.WARNING, logger="engine.core_proc"):
            _report([CoreChannel("ipc://in", "ipc://out", write)], ready)
        assert "the tokenizer does not pickle" in caplog.text
        report = wait_loaded(CoreChannel("ipc://in", "ipc://out", read))
        assert isinstance(report, CoreReady) and report.tokenizer is None
        assert report.config == engine.config
        events = watch_the_load(monkeypatch)
        channel = CoreChannel("ipc://in", "ipc://out", -1)
        frontend = AsyncLLM._over(CoreProcess(report, channel, 0))
        assert events == ["tokenizer read"]
        assert frontend.tokenizer.encode("the lazy dog") == tokenizer.encode("the lazy dog")
    finally:
        serve_and_stop(engine)


def test_a_missing_model_fails_with_the_cores_error_not_the_tokenizers(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pagedserve never downloads weights"):
        make_engine(tmp_path / "nothing-here", in_process=False)


def test_a_frontend_that_cannot_send_fails_loudly(model_dir: Path) -> None:
    """A bug on the sending side must not leave callers waiting forever."""
    engine = make_engine(model_dir, in_process=False)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the output processor broke")

    async def run() -> None:
        engine.start()
        engine._processor.add_request = broken  # type: ignore[method-assign]
        try:
            with pytest.raises(EngineDeadError, match="the output processor broke"):
                await final(engine.generate([5, 6, 7], SamplingParams(max_tokens=3), "r"))
            assert not engine.is_alive
        finally:
            await engine.stop()

    asyncio.run(run())


def test_adds_a_step_has_not_seen_count_as_queued() -> None:
    """A step computed before an ADD frame reached the core does not hold its requests in
    its waiting queue: the frontend counts the frames after the step's ADDS_SEEN on top."""
    sent: list[bytes] = []

    class Remote:
        def send(self, kind: bytes, payload: bytes) -> None:
            sent.append(kind)

    engine = AsyncLLM.__new__(AsyncLLM)  # only the counting state: no core behind it
    engine._remote, engine._adds_sent, engine._unseen_adds = Remote(), 0, deque()
    engine._waiting_load = [0, 0]

    def add(name: str, tokens: int) -> CoreRequest:
        return CoreRequest(name, [5] * tokens, SamplingParams(), (0,), None, 0.0)

    engine._send_adds([add("a-0", 4), add("a-1", 4)])  # one request, n=2
    engine._send_adds([add("b", 10)])
    assert sent == [ADD, ADD]
    stats = SchedulerStats(num_running=1, num_waiting=3, kv_cache_usage=0.0, num_waiting_tokens=30)
    for seen, (queued, tokens) in enumerate([(6, 48), (4, 40), (3, 30), (3, 30)]):
        engine._count_waiting(stats, seen)
        assert engine._waiting_load == [queued, tokens], seen


def greedy_texts(engine: AsyncLLM) -> tuple[int, list[str]]:
    """(the core's pid, greedy completions of three prompts)."""

    async def run() -> tuple[int, list[str]]:
        engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            jobs = [final(engine.generate([5 + i, 9, 30], params, f"g{i}")) for i in range(3)]
            return engine.engine_pid, [o.outputs[0].text for o in await asyncio.gather(*jobs)]
        finally:
            await engine.stop()

    return asyncio.run(run())


def test_a_prestarted_core_serves_its_frontend_as_a_fresh_one(model_dir: Path) -> None:
    """prestart_core's interpreter, started before the frontend knows its settings, is
    the core the next lone frontend gets, with the same outputs as a core started then."""
    prestart_core()
    prestarted = core_client._prestarted
    assert prestarted is not None
    pid, texts = greedy_texts(make_engine(model_dir, in_process=False))
    assert pid == prestarted.proc.pid and core_client._prestarted is None
    assert prestarted.proc.wait(timeout=30) == 0  # stopped with its frontend
    fresh_pid, fresh_texts = greedy_texts(make_engine(model_dir, in_process=False))
    assert fresh_pid != pid and fresh_texts == texts


def test_a_prestarted_core_that_does_not_fit_is_ended(model_dir: Path) -> None:
    """Discarded, taken for several frontends, or for another environment: it exits and a
    core is started as before."""
    prestart_core()
    first = core_client._prestarted
    assert first is not None
    discard_prestarted()
    assert first.proc.poll() is not None and core_client._prestarted is None
    for frontends, env_change in ((2, None), (1, "PAGEDSERVE_TEST_ENV_CHANGE")):
        prestart_core()
        prestarted = core_client._prestarted
        assert prestarted is not None
        if env_change is not None:
            os.environ[env_change] = "1"
        try:
            start = start_core(EngineArgs(model=str(model_dir), **ARGS), None, None, frontends)  # type: ignore[arg-type]
        finally:
            os.environ.pop(env_change or "", None)
        try:
            assert prestarted.proc.poll() is not None  # ended, not used
            assert start.proc.pid != prestarted.proc.pid and len(start.channels) == frontends
        finally:
            start.proc.kill()
            start.proc.wait()
            shutil.rmtree(start.directory, ignore_errors=True)
            for channel in start.channels:
                os.close(channel.ready_fd)
