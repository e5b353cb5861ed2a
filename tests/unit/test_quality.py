"""Answers checked at depth (issue 41, item 2), the pure logic of core.analysis.quality: the filler and where the fact sits,
when the known answers are skipped, the reference's key, the comparison under the reference's own tokens and the
verdict that names the prompt and the first diverging position."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkbook.core.analysis import quality
from sparkbook.core.analysis.quality import Agreement, Answer, Forced, Reference, Trace
from sparkbook.core.cluster import qualityapi
from sparkbook.core.values.params import ParamsError, ServeSettings, load_params

PARAMS = Path(__file__).resolve().parents[2] / "params"


def settings(**serve: object) -> ServeSettings:
    return ServeSettings.model_validate(serve)


def test_filler_is_the_same_every_time_and_does_not_repeat_in_a_short_period() -> None:
    assert quality.filler(40) == quality.filler(40) and quality.filler(10) == quality.filler(40)[:10]
    body = quality.filler(len(quality.FILLER))
    assert sorted(body) == sorted(quality.FILLER), "one full period holds every sentence once"
    assert all(a != b for a, b in zip(body, body[1:], strict=False))


@pytest.mark.parametrize("position, before", [(0.0, 0), (0.5, 10), (1.0, 20), (0.25, 5)])
def test_the_fact_sits_after_its_share_of_the_filler_and_the_question_comes_last(position, before) -> None:
    text = quality.needle_text(20, position, "4242")
    body, question = text.split("\n\n")
    sentences = [s + "." for s in body.rstrip(".").split(". ")]
    assert sentences[before] == quality.fact("4242") and len(sentences) == 21
    assert question == quality.ACCESS_CODE_QUESTION


def test_a_needle_aims_at_its_share_of_the_window_less_the_answer_and_shrinks_to_fit() -> None:
    n = quality.needle(0.5, 0.5, window=2048, reserve=48, tokens_per_sentence=10.0, overhead=40)
    assert n.target_tokens == 1000 and n.sentences == 96 and n.answer in n.text and n.answer == quality.code_for(0.5)
    assert quality.code_for(0.5) != quality.code_for(1.0), "each depth asks for another value"
    full = quality.needle(1.0, 0.9, window=2048, reserve=48, tokens_per_sentence=10.0, overhead=40)
    assert full.target_tokens == 2000
    assert quality.shrunk(full, 1990, 2000, 10.0) is full
    smaller = quality.shrunk(full, 2047, 2000, 10.0)
    assert smaller.sentences == full.sentences - 5 and smaller.answer == full.answer and smaller.depth == 1.0


@pytest.mark.parametrize("serve, why", [
    ({}, None),
    ({"extra_args": ["--load-format", "dummy"]}, "dummy weights"),
    ({"extra_args": ["--load-format=dummy"]}, "dummy weights"),
    ({"smoke": {"expect": None}}, "serve.smoke.expect is null"),
    ({"quality": {"known_answers": False}}, "serve.quality.known_answers is false"),
])
def test_the_known_answers_are_skipped_for_a_model_that_cannot_answer_and_say_why(serve, why) -> None:
    skipped = quality.known_answers_skipped(settings(**serve))
    assert (skipped is None) if why is None else (skipped is not None and skipped.startswith(why)), skipped


def test_the_lab_s_params_check_agreement_but_skip_the_known_answers() -> None:
    params = load_params(PARAMS / "lab.yaml")
    assert params.serve.quality.enabled and params.serve.quality.min_agreement == 0.9
    assert "random model" in str(quality.known_answers_skipped(params.serve))
    assert quality.known_answers_skipped(load_params(PARAMS / "spark-duo.yaml").serve) is None


def test_the_reference_key_follows_the_model_and_what_decides_a_token_not_the_image_or_the_memory() -> None:
    base = settings(dtype="bfloat16", tensor_parallel_size=2, max_model_len=8192)
    key = quality.reference_key(base, "/srv/models/m", "")
    same = [base.model_copy(update={"gpu_memory_utilization": 0.5, "max_num_seqs": 4, "port": 9000}),
            base.model_copy(update={"quality": base.quality.model_copy(update={"min_agreement": 0.5})})]
    assert all(quality.reference_key(s, "/srv/models/m", "") == key for s in same)
    other = [base.model_copy(update={"dtype": "float16"}), base.model_copy(update={"tensor_parallel_size": 1}),
             base.model_copy(update={"max_model_len": 4096}), base.model_copy(update={"extra_args": ["-q", "fp8"]})]
    assert len({quality.reference_key(s, "/srv/models/m", "") for s in other} | {key}) == 5
    assert quality.reference_key(base, "/srv/models/other", "") != key
    assert quality.reference_key(base, "org/m", "/hub/models--org--m/snapshots/b") != \
        quality.reference_key(base, "org/m", "/hub/models--org--m/snapshots/a"), "a new revision is a new model"


REF = Trace("story", [1, 2, 3], [10, 11, 12, 13, 14, 15], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])


class Replay:
    """A server as `forced` sees it: each greedy request answered from `answers`, the prompts it was sent kept."""

    def __init__(self, *answers: list[int]):
        self.answers, self.asked = list(answers), []

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        self.asked.append((prompt_ids, max_tokens))
        tokens = self.answers.pop(0)[:max_tokens]
        return tokens, [-0.1 * (len(prompt_ids) - 2 + i) for i in range(len(tokens))]


def test_the_same_server_agrees_in_one_request() -> None:
    api = Replay([10, 11, 12, 13, 14, 15])
    a = quality.compare(REF, qualityapi.forced(api, REF))  # type: ignore[arg-type]
    assert (a.compared, a.identical, a.first_divergence, a.share) == (6, 6, None, 1.0) and len(api.asked) == 1
    assert a.largest_gap == pytest.approx(0.0, abs=1e-9)
    assert quality.verdict([a], 0.9) is None


def test_after_a_divergence_the_next_request_continues_from_the_reference_s_own_tokens() -> None:
    """One near-tie flips a token: the positions after it are compared under the reference's context, not the
    drifted one, so the share counts the one flip only."""
    api = Replay([10, 11, 99, 98, 97, 96], [13, 14, 15])
    got = qualityapi.forced(api, REF)  # type: ignore[arg-type]
    a = quality.compare(REF, got)
    assert got.tokens == [10, 11, 99, 13, 14, 15] and api.asked[1] == ([1, 2, 3, 10, 11, 12], 3)
    assert (a.compared, a.identical, a.first_divergence) == (6, 5, 2)
    assert quality.verdict([a], 0.8) is None
    problem = quality.verdict([a], 0.9)
    assert problem is not None and problem.startswith("prompt 'story': 5 of 6 top-1 tokens agree")
    assert "first diverging at position 2 of the continuation" in problem


def test_soup_stops_after_the_requests_allowed_and_fails_at_its_first_position() -> None:
    long = Trace("capital", [7], list(range(100, 132)), [-0.01] * 32)
    api = Replay(*[[0] * 32 for _ in range(qualityapi.MAX_REQUESTS)])
    got = qualityapi.forced(api, long)  # type: ignore[arg-type]
    a = quality.compare(long, got)
    assert len(api.asked) == qualityapi.MAX_REQUESTS and a.compared == qualityapi.MAX_REQUESTS and a.identical == 0
    problem = quality.verdict([quality.compare(REF, Forced(list(REF.tokens), list(REF.logprobs))), a], 0.9)
    assert problem is not None and problem.startswith("prompt 'capital': 0 of 8") and "at position 0 " in problem


def test_the_largest_logprob_gap_and_where() -> None:
    a = quality.compare(REF, Forced([10, 11, 12, 13, 14, 15], [-0.1, -0.2, -2.3, -0.4, -0.5, -0.6]))
    assert a.largest_gap == pytest.approx(2.0) and a.gap_at == 2 and a.first_divergence is None


def test_a_lost_fact_fails_before_the_agreement_and_names_its_depth() -> None:
    found = Answer(0.1, 200, 0.5, "4242", "The code is 4242.", "stop", 1.0)
    lost = Answer(1.0, 2000, 0.5, "7777", "I do not know", "stop", 3.0)
    assert found.found and not lost.found and found.row()["verdict"] == "ok"
    report = qualityapi.QualityReport("k", 2048, None, [found, lost], None,
                                      [Agreement("story", 6, 0, 0, 1.0, 0)], [], 1.0)
    problem = report.problem(0.9)
    assert problem is not None and problem.startswith("known answer at depth 100% (2000 prompt tokens, the fact at 50%")
    assert "expected '7777'" in problem


def test_a_reference_reads_back_as_it_was_written(tmp_path: Path) -> None:
    run_dir = tmp_path / "lab" / "20261206T010000Z"
    ref = Reference("abc", run_dir.name, "2026-12-06T01:00:00+00:00", "img:1", [REF])
    path = qualityapi.save_reference(run_dir, ref)
    assert path == tmp_path / "lab" / "quality" / "abc.json", "beside the cluster's runs, not inside one"
    assert qualityapi.load_reference(tmp_path / "lab" / "20261207T000000Z", "abc") == ref
    assert qualityapi.load_reference(run_dir, "other") is None


def test_bad_quality_settings_name_the_field(tmp_path: Path) -> None:
    text = (PARAMS / "lab.yaml").read_text().replace("serve:\n", "serve:\n  quality:\n    depths: [0.5, 0.5]\n"
                                                      "    min_agreement: 1.5\n", 1)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError) as err:
        load_params(path)
    fields = {p.field for p in err.value.problems}
    assert {"serve.quality.depths", "serve.quality.min_agreement"} <= fields, err.value


class Reader:
    """A server as `known_answers` sees it: a token per word (the chat template adds 10), a window of 2048, and a
    model that answers with the number after "is" in the fact it was given (none where the fact is missing)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def tokenize(self, body: dict) -> dict:
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        count = len(text.split()) + (10 if "messages" in body else 0)
        return {"count": count, "tokens": list(range(count)), "max_model_len": 2048}

    def chat(self, text: str, max_tokens: int) -> tuple[str, str]:
        self.asked.append(text)
        words = text.split("blue door is ")
        return (words[1][:4] if len(words) > 1 else "I do not know"), "stop"


def test_each_depth_s_prompt_fits_the_window_less_the_answer_and_holds_the_fact_where_asked() -> None:
    api = Reader()
    answers = qualityapi.known_answers(api, settings(), 2048, 32)  # type: ignore[arg-type]
    assert [a.depth for a in answers] == [0.1, 0.5, 1.0] and all(a.found for a in answers)
    assert all(a.prompt_tokens <= 2048 - 32 for a in answers), [a.prompt_tokens for a in answers]
    assert answers[-1].prompt_tokens > 0.95 * (2048 - 32) and answers[0].prompt_tokens < 0.15 * 2048
    middle = api.asked[1].split("\n\n")[0]
    at = middle.index(quality.fact(answers[1].answer))
    assert 0.45 < at / len(middle) < 0.55, "the fact sits in the middle of the filler"


@pytest.mark.parametrize("planted, said", [
    ('{"key": "abc", "run": "r", "at": "t", "image": "i", "traces": []}', "holds no trace"),
    ("{not json", "not a quality reference"),
    ('{"key": "abc", "run": "r", "at": "t", "image": "i", "traces": [{"prompt": "p", "prompt_ids": [1], '
     '"tokens": [2, 3], "logprobs": [-0.1]}]}', "as many logprobs"),
    (None, "reference of key 'other', not 'abc'"),
])
def test_a_reference_that_is_empty_torn_or_another_keys_is_refused_not_passed(
        tmp_path: Path, planted: str | None, said: str) -> None:
    """Issue 56: a reference with no traces passed every agreement check comparing nothing; one copied under another
    key's name judged this run by another model's or plan's traces."""
    run_dir = tmp_path / "lab" / "20261206T010000Z"
    path = qualityapi.save_reference(run_dir, Reference("other", run_dir.name, "t", "img:1", [REF]))
    target = path.with_name("abc.json")
    if planted is None:
        path.rename(target)
    else:
        target.write_text(planted)
    with pytest.raises(qualityapi.BadReference) as err:
        qualityapi.load_reference(run_dir, "abc")
    assert said in str(err.value) and str(target) in str(err.value) and err.value.exit_kind == "invalid"
