"""Answers checked at depth, as pure logic: the known-answer prompts (a fact placed at a known position in generated
filler, asked back), when they are skipped, the fixed prompt set of the agreement check, the key its reference is
kept under, and the comparison of a run's greedy tokens with the reference's and its verdict.

In core, not in 05's package: 05 checks after its smoke test and 06 will check again at the end of a soak (issue
41), and stages never import each other. The requests that feed this are `core.cluster.qualityapi`'s."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ..values.params import QualityCheck, ServeSettings

PROMPT_SET = 1  # bumped when the agreement prompts or how they are asked change: a new reference, not a false alarm
AGREEMENT_PROMPTS = (  # completions (no chat template): what a base and an instruct model both continue
    ("capital", "The capital of France is"),
    ("counting", "1, 2, 3, 4, 5, 6, 7,"),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("story", "Once upon a time, in a small village by the sea, there lived"),
)
# Bland sentences that state nothing a question could be about; cycled in an order that changes with the index, so
# the filler does not repeat in a short period a model could lock onto.
FILLER = (
    "The morning light fell across the old stone wall.", "A cart rolled slowly down the dusty road.",
    "Someone in the market was selling baskets of apples.", "The river ran wide and brown after the rain.",
    "Birds gathered on the roof of the empty barn.", "A clock in the hall struck the hour twice.",
    "The baker opened the shutters and swept the step.", "Clouds drifted over the hills toward the east.",
    "Children were drawing chalk lines on the square.", "The ferry waited at the pier with its engine idling.",
    "A dog slept in the shade beneath the bench.", "Lanterns were hung along the narrow street at dusk.",
    "The wind turned the pages of a newspaper on a table.", "Fishermen mended their nets beside the harbour.",
)
ACCESS_CODE_QUESTION = "What is the access code for the blue door? Answer with the number only."


def filler(count: int) -> list[str]:
    """`count` filler sentences, the same for the same count on every run."""
    n = len(FILLER)
    return [FILLER[(i * 5 + i // n) % n] for i in range(count)]


def code_for(depth: float) -> str:
    """The fact's value at a depth: a four-digit number that differs per depth (no answer carries over)."""
    return str(1000 + int(hashlib.sha256(f"{depth:.4f}".encode()).hexdigest(), 16) % 9000)


def fact(code: str) -> str:
    return f"The access code for the blue door is {code}."


def sentences_for(tokens: int, tokens_per_sentence: float) -> int:
    """How many filler sentences fill about `tokens` tokens (at least one)."""
    return max(1, int(tokens / tokens_per_sentence))


def needle_text(sentences: int, position: float, code: str) -> str:
    """The filler with the fact placed after `position` of its sentences (0: first, 1: last), then the question."""
    body = filler(sentences)
    at = round(position * len(body))
    return " ".join([*body[:at], fact(code), *body[at:]]) + "\n\n" + ACCESS_CODE_QUESTION


@dataclass(frozen=True)
class Needle:
    """One known-answer prompt: the depth it aims at (a share of the served window and in tokens), where the fact
    sits, the text, and the answer it must hold."""

    depth: float  # share of the window serve.quality.depths names
    target_tokens: int
    position: float
    sentences: int
    text: str
    answer: str


def needle(depth: float, position: float, window: int, reserve: int, tokens_per_sentence: float,
           overhead: int) -> Needle:
    """The known-answer prompt at `depth` of a `window`-token context: the prompt and the answer's `reserve` tokens
    fit inside it; `overhead` is what the chat template and the question add beyond the filler."""
    target = max(1, int(depth * (window - reserve)))
    count = sentences_for(max(1, target - overhead), tokens_per_sentence)
    code = code_for(depth)
    return Needle(depth, target, position, count, needle_text(count, position, code), code)


def shrunk(n: Needle, measured: int, limit: int, tokens_per_sentence: float) -> Needle:
    """The same needle with fewer sentences where its measured prompt (`measured` tokens) passes `limit`; else
    itself."""
    if measured <= limit:
        return n
    count = max(1, n.sentences - int((measured - limit) / tokens_per_sentence) - 1)
    return Needle(n.depth, n.target_tokens, n.position, count, needle_text(count, n.position, n.answer), n.answer)


def dummy_weights(settings: ServeSettings) -> bool:
    """vLLM loads random weights (`--load-format dummy`): its answers are noise by design."""
    args = settings.extra_args
    pairs = zip(args, args[1:], strict=False)
    return "--load-format=dummy" in args or any(a == "--load-format" and b == "dummy" for a, b in pairs)


def known_answers_skipped(settings: ServeSettings) -> str | None:
    """Why the known-answer check does not run (None: it runs). A model that cannot answer a question (dummy
    weights; the params' smoke test expecting no answer, as the lab's random model) would fail it by design; the
    agreement check still runs for it."""
    if not settings.quality.known_answers:
        return "serve.quality.known_answers is false"
    if dummy_weights(settings):
        return "dummy weights (--load-format dummy): the answers are noise by design"
    if settings.smoke.expect is None:
        return "serve.smoke.expect is null: the params say this model cannot answer a question (the lab's random model)"
    return None


def reference_key(settings: ServeSettings, model: str, model_dir: str) -> str:
    """The reference a run compares with: the same model (`model`: model.path or model.hf_id, and 02's snapshot
    `model_dir`, so a new revision is a new model) served the same way where it decides a greedy token (dtype, the
    parallel sizes, the window, speculative decoding, the extra args such as a quantization), and the same prompt
    set. The image is left out on purpose: a new image serving the same model and plan is what the comparison is
    for (token soup behind a green /health). Memory, batching, ports and parsers are left out: they change no
    greedy token of one request at a time."""
    plan = {"model": model, "model_dir": model_dir, "dtype": settings.dtype,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "pipeline_parallel_size": settings.pipeline_parallel_size, "max_model_len": settings.max_model_len,
            "speculative": settings.speculative.config_json() if settings.speculative else None,
            "extra_args": list(settings.extra_args), "prompt_set": PROMPT_SET,
            "tokens": settings.quality.agreement_tokens}
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Trace:
    """One prompt's greedy continuation: the prompt's token ids, each generated token's id and its logprob."""

    prompt: str  # the prompt's name in the set
    prompt_ids: list[int]
    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class Reference:
    """The greedy traces of the first ok run of a model and plan (`reference_key`), which later runs compare with."""

    key: str
    run: str  # the run that recorded it
    at: str
    image: str  # what served it (not part of the key: said when a later run's image differs)
    traces: list[Trace]

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "run": self.run, "at": self.at, "image": self.image,
                           "traces": [t.__dict__ for t in self.traces]})

    @classmethod
    def from_json(cls, text: str) -> Reference:
        """The reference `to_json` wrote; ValueError saying what is not (an empty one compares nothing, so it is
        none)."""
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("key", "run", "at", "image")):
            raise ValueError("not a reference: key, run, at and image must be text")
        traces = data.get("traces")
        if not isinstance(traces, list) or not traces:
            raise ValueError("it holds no trace: it would pass every agreement check comparing nothing")
        return cls(data["key"], data["run"], data["at"], data["image"], [_trace(t) for t in traces])


def _trace(data: object) -> Trace:
    """One trace as written; ValueError where it could not be compared with (ids, tokens and logprobs of its own)."""
    if not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
        raise ValueError("a trace without its prompt's name")
    ids, tokens, logprobs = (data.get(k) or [] for k in ("prompt_ids", "tokens", "logprobs"))
    ints = all(isinstance(x, list) and x and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
               for x in (ids, tokens))
    floats = isinstance(logprobs, list) and all(isinstance(v, int | float) for v in logprobs)
    if not ints or not floats or len(logprobs) != len(tokens):
        raise ValueError(f"trace {data['prompt']!r}: token ids, tokens and as many logprobs are needed")
    return Trace(data["prompt"], list(ids), list(tokens), [float(v) for v in logprobs])


@dataclass(frozen=True)
class Agreement:
    """One prompt of the set against its reference: of the positions compared (each under the reference's own
    tokens before it), how many have the same top-1 token, the first that does not, and the largest gap between
    the reference's and this run's top-1 logprob (and where)."""

    prompt: str
    compared: int
    identical: int
    first_divergence: int | None  # position in the continuation (0: the first generated token); None: none
    largest_gap: float
    gap_at: int | None

    @property
    def share(self) -> float:
        return self.identical / self.compared if self.compared else 0.0


@dataclass
class Forced:
    """A run's top-1 tokens and logprobs at each position of a reference continuation, gathered by `step`."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def step(ref: Trace, got: Forced, tokens: list[int], logprobs: list[float]) -> bool:
    """Take a greedy continuation generated after the reference's first `len(got.tokens)` tokens: keep its tokens
    up to and including the first that differs from the reference. True when it diverged there (the next request
    starts after the reference's token at that position, so each position is compared under the reference's
    context, not one that drifted)."""
    start = len(got.tokens)
    for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=False)):
        if start + i >= len(ref.tokens):
            return False
        got.tokens.append(token)
        got.logprobs.append(logprob)
        if token != ref.tokens[start + i]:
            return True
    return False


def compare(ref: Trace, got: Forced) -> Agreement:
    """The reference's trace against a run's tokens at the same positions (`step`'s)."""
    pairs = list(zip(ref.tokens, got.tokens, strict=False))
    same = [a == b for a, b in pairs]
    gaps = [abs(a - b) for a, b in zip(ref.logprobs, got.logprobs, strict=False)]
    largest = max(gaps, default=0.0)
    return Agreement(ref.prompt, len(pairs), sum(same), same.index(False) if False in same else None,
                     round(largest, 6), gaps.index(largest) if gaps else None)


def verdict(agreements: list[Agreement], min_agreement: float) -> str | None:
    """What fails the agreement check (None: nothing): the first prompt whose share of identical top-1 tokens is
    below serve.quality.min_agreement, named with its first diverging position."""
    for a in agreements:
        if a.share < min_agreement:
            return (f"prompt {a.prompt!r}: {a.identical} of {a.compared} top-1 tokens agree with the reference "
                    f"({a.share:.0%} < serve.quality.min_agreement {min_agreement:.0%}); first diverging at position "
                    f"{a.first_divergence} of the continuation, largest logprob gap {a.largest_gap:.3g} at "
                    f"position {a.gap_at}")
    return None


@dataclass(frozen=True)
class Answer:
    """One known-answer prompt as the model answered it."""

    depth: float
    prompt_tokens: int
    position: float
    answer: str
    text: str
    finish_reason: str
    seconds: float

    @property
    def found(self) -> bool:
        return self.answer in self.text

    def row(self) -> dict[str, object]:
        return {"depth": f"{self.depth:.0%}", "prompt tokens": self.prompt_tokens,
                "fact at": f"{self.position:.0%}", "expected": self.answer, "answer": self.text[:120],
                "finish": self.finish_reason, "seconds": round(self.seconds, 1), "verdict": "ok" if self.found
                else "wrong answer"}


def answers_verdict(answers: list[Answer]) -> str | None:
    """The first known-answer prompt whose answer lacks the fact's value (None: every one holds it)."""
    for a in answers:
        if not a.found:
            return (f"known answer at depth {a.depth:.0%} ({a.prompt_tokens} prompt tokens, the fact at "
                    f"{a.position:.0%} of the filler): expected {a.answer!r}, got {a.text.strip()[:160]!r} "
                    f"(finish_reason {a.finish_reason or 'none'})")
    return None


def settings_shown(check: QualityCheck) -> dict[str, object]:
    return {"depths (share of the window)": ", ".join(f"{d:.0%}" for d in check.depths),
            "fact at": f"{check.fact_position:.0%} of the filler", "agreement tokens per prompt":
            check.agreement_tokens, "min agreement": check.min_agreement}
