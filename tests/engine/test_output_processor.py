"""OutputProcessor: the n fan-out, output kinds, stop-string aborts and the latency stats,
fed with hand-made engine outputs (no model)."""

from __future__ import annotations

from engine.output_processor import OutputProcessor
from engine.outputs import Logprobs
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler.output import EngineCoreOutput
from tests.tiny_models import save_word_tokenizer


def processor(tmp_path) -> OutputProcessor:
    from transformers import AutoTokenizer

    save_word_tokenizer(tmp_path)
    return OutputProcessor(AutoTokenizer.from_pretrained(tmp_path), eos_token_ids=(2,))


def out(request_id: str, token: int, finish: str | None = None, **kw: object) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [token], finish_reason=finish, **kw)  # type: ignore[arg-type]


def test_fan_out_gives_one_engine_request_per_choice(tmp_path) -> None:
    proc = processor(tmp_path)
    params = SamplingParams(n=3, seed=5, max_tokens=4)
    requests = proc.add_request("p", [7, 8], params, cache_salt="tenant")
    assert [r.request_id for r in requests] == ["p-0", "p-1", "p-2"]
    assert [r.sampling_params.seed for r in requests] == [5, 6, 7]
    assert all(r.sampling_params.n == 1 and r.cache_salt == "tenant" for r in requests)


def test_delta_outputs_carry_only_what_is_new(tmp_path) -> None:
    proc = processor(tmp_path)
    params = SamplingParams(n=2, output_kind=RequestOutputKind.DELTA, logprobs=0)
    proc.add_request("p", [7, 8], params)
    lp = Logprobs(10, -1.0, 1, [])
    first = proc.process_outputs([out("p-0", 10, new_logprobs=[lp]), out("p-1", 11)])
    (output,) = first.outputs
    assert [(c.index, c.text, c.token_ids) for c in output.outputs] == [
        (0, " t10", [10]),
        (1, " t11", [11]),
    ]
    assert output.outputs[0].logprobs == [lp] and not output.finished
    second = proc.process_outputs([out("p-1", 12, "length")])
    (output,) = second.outputs
    assert [(c.index, c.text, c.finish_reason) for c in output.outputs] == [(1, " t12", "length")]
    assert not output.finished  # choice 0 still runs
    third = proc.process_outputs([out("p-0", 13, "stop")])
    assert third.outputs[0].finished and "p" not in proc
    assert [f.request_id for f in second.stats.finished + third.stats.finished] == ["p-1", "p-0"]


def test_final_only_waits_for_every_choice(tmp_path) -> None:
    proc = processor(tmp_path)
    proc.add_request("p", [7], SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY))
    assert proc.process_outputs([out("p-0", 10), out("p-1", 11, "length")]).outputs == []
    (final,) = proc.process_outputs([out("p-0", 12, "length")]).outputs
    assert [c.text for c in final.outputs] == [" t10 t12", " t11"] and final.finished


def test_stop_string_ends_the_choice_and_asks_for_an_abort(tmp_path) -> None:
    proc = processor(tmp_path)
    params = SamplingParams(stop=["t12"], output_kind=RequestOutputKind.CUMULATIVE)
    proc.add_request("p", [7], params)
    first = proc.process_outputs([out("p-0", 10)])
    # The last len("t12") - 1 characters stay back: they could begin the stop string.
    assert first.outputs[0].outputs[0].text == " t"
    second = proc.process_outputs([out("p-0", 12)])
    assert second.aborts == ["p-0"]
    (choice,) = second.outputs[0].outputs
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (" t10 ", "stop", "t12")
    assert second.stats.num_generation_tokens == 1
    # A later output of the aborted engine request is ignored.
    assert proc.process_outputs([out("p-0", 13)]).outputs == []


def test_abort_reports_unfinished_choices(tmp_path) -> None:
    proc = processor(tmp_path)
    proc.add_request("p", [7], SamplingParams(n=2))
    proc.process_outputs([out("p-0", 10, "length")])
    engine_ids, stats = proc.abort_request("p")
    assert engine_ids == ["p-1"]
    assert [(f.request_id, f.finish_reason) for f in stats.finished] == [("p-1", "abort")]
    assert proc.abort_request("p") == ([], stats.__class__())


def test_latencies_first_token_then_inter_token(tmp_path) -> None:
    proc = processor(tmp_path)
    proc.add_request("p", [7], SamplingParams(), arrival_time=0.0)
    first = proc.process_outputs([out("p-0", 10, queue_time=0.25)])
    assert len(first.stats.time_to_first_tokens) == 1 and first.stats.queue_times == [0.25]
    second = proc.process_outputs([out("p-0", 11, "length")])
    assert len(second.stats.inter_token_latencies) == 1
    (finished,) = second.stats.finished
    assert finished.first_of_prompt and finished.num_generation_tokens == 2
    assert finished.ttft is not None and finished.ttft <= finished.e2e_latency
