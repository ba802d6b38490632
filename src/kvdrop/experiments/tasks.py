"""Generated long-context tasks with known answers, for ``kvdrop eval``.

Four tasks, each a seeded generator of :class:`Sample`s at an exact token length:

* ``passkey``: one 5-digit pass key hidden in repeated filler, at controlled depths (sample ``i``
  of ``n`` at depth ``i / (n - 1)``).
* ``multikey``: RULER's multi-key needle: four "special magic numbers", each for a different word,
  hidden in filler; the question names one of them, the other three are distractors.
* ``kv``: key/value retrieval from a list: eight ``- The value of the key WORD is NUMBER.`` lines
  (one block, at the controlled depth, in filler); the question asks one key's value, the other
  seven values are distractors. (A denser list, the whole context of lines, is beyond
  SmolLM2-135M even with full KV: 1 in 6 at 1K tokens.)
* ``story``: facts spread through an everyday story: four people, one fact each (a city, a dog's
  name, a job, a favourite colour), the asked one at the controlled depth and the others spread
  evenly; the question asks the one fact.
* ``vt``: RULER's variable tracking, single-answer: two chains ``VAR A = 12345.`` ...
  ``VAR B = VAR A.`` in filler (the asked chain's first link at the controlled depth, its second
  later); the question asks the value of the asked chain's last variable, the other chain's value
  is the distractor. Two hops: the answer is never next to the name asked for. Not in the default
  grid (``--tasks ... vt``).

Every question opens the assistant's answer with a prefix ("The pass key is"), as RULER does: the
answers are short and checkable.

Every sample comes in the two forms ``kvdrop eval`` compares: ``inside`` is the whole prompt,
question included, exactly ``length`` tokens (so at a chunk size dividing ``length`` all of it is
compressed); ``context`` is the context alone, exactly ``length`` tokens, and ``question`` the
suffix appended after compression. Both share their first ``length - len(question)`` tokens. The
answer is always in the shared part. Prompts go through the model's chat template when the
tokenizer has one (the question closes the user turn and opens the assistant's).

Texts are built from pieces encoded separately and concatenated as token ids, so a length is hit
exactly (the context is cut mid-sentence if need be, never inside the answer).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdrop_engine.tokenizer import ChatTurns

__all__ = ["DEFAULT_TASKS", "SETTINGS", "TASKS", "Sample", "make_samples", "prompt_layout"]

#: Where the question is: compressed with the context, or appended after compression.
SETTINGS = ("inside", "after")

_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
_WORDS = (
    "amber apple arrow badge basil bison cedar cobalt comet coral crane delta ember falcon fern "
    "fjord garnet ginger harbor hazel heron indigo iris jade juniper kestrel lagoon lemon lilac "
    "maple marble meadow mint nectar nutmeg olive onyx orchid otter pebble pepper pine plum quartz "
    "raven river saffron sage slate sparrow spruce tulip umber velvet walnut willow yarrow zinc"
).split()
_NAMES = "Anna Boris Clara Daniel Elena Felix Grace Hugo Irene Jonas Laura Marco Nora Oscar".split()
_CITIES = "Lisbon Oslo Vienna Dublin Prague Madrid Athens Berlin Warsaw Zurich Milan Bergen".split()
_PETS = "Biscuit Pepper Shadow Mango Whiskers Rocky Luna Ziggy Noodle Pickles Maple Tiger".split()
_JOBS = "baker nurse pilot teacher plumber painter farmer lawyer chemist tailor".split()
_STORY = (
    "The morning was quiet and the streets were still wet from the rain.",
    "A bus rolled past the bakery on the corner, half empty.",
    "Someone in the park was feeding the pigeons with old bread.",
    "The market opened late because the delivery truck was stuck in traffic.",
    "Children ran along the river, shouting about a kite caught in a tree.",
    "At noon the bells of the old church rang twelve times.",
    "The library smelled of dust and coffee, as it always did.",
    "A cat slept on the warm roof of a parked car.",
    "The shop windows were full of autumn coats and umbrellas.",
    "In the evening the wind picked up and the lights came on one by one.",
    "A street musician played the same three songs over and over.",
    "The neighbours argued about whose turn it was to mow the lawn.",
    "Later that week the whole town talked about the new bridge.",
    "The train to the coast was late again, and nobody was surprised.",
)


@dataclass(frozen=True)
class Sample:
    """One generated prompt with its known answer (see the module docstring for the forms)."""

    task: str
    index: int
    inside: list[int]
    context: list[int]
    question: list[int]
    answer: str
    distractors: tuple[str, ...] = ()
    depth: float = 0.5  # where the asked fact sits in the context: 0 = start, 1 = end

    def prompt(self, setting: str) -> list[int]:
        """The prompt prefilled and compressed in ``setting``."""
        return self.inside if setting == "inside" else self.context

    def suffix(self, setting: str) -> list[int]:
        """Tokens appended after compression in ``setting`` (the question, or nothing)."""
        return [] if setting == "inside" else self.question

    def is_correct(self, text: str) -> bool:
        """The output names the answer and none of the distractors (a list of every candidate
        is not an answer)."""
        named = _mentions(text, self.answer)
        return named and not any(_mentions(text, d) for d in self.distractors)


def _mentions(text: str, value: str) -> bool:
    """``value`` occurs in ``text`` as a whole number / word (case-insensitive for words)."""
    if value.isdigit():
        return re.search(rf"(?<!\d){value}(?!\d)", text) is not None
    return re.search(rf"\b{re.escape(value)}\b", text, re.IGNORECASE) is not None


# ---------------------------------------------------------------------------------------------
# Building prompts from pieces
# ---------------------------------------------------------------------------------------------


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_bos=False))
    except TypeError:  # tokenizers without the flag (JSONTokenizer) never add BOS
        return list(tokenizer.encode(text))


def prompt_layout(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids before and after the user message: the chat template's parts, or nothing before
    and ``"\\nAnswer:"`` after for a tokenizer without a template."""
    turn = tokenizer.user_turn() if isinstance(tokenizer, ChatTurns) else None
    if turn is not None:
        return list(turn[0]), list(turn[1])
    return [], _encode(tokenizer, "\nAnswer:")


@dataclass
class _Spec:
    """A task instance before it is cut to length: intro, needles (at depths), filler, question."""

    intro: str
    needles: list[tuple[float, str]]  # (depth in [0, 1], sentence)
    filler: Callable[[random.Random], str]  # one filler sentence (or line)
    question: str
    answer: str
    distractors: tuple[str, ...]
    depth: float
    answer_prefix: str = ""  # opens the assistant's answer (as RULER does): short, checkable output


def _build(
    tokenizer: Any,
    layout: tuple[list[int], list[int]],
    spec: _Spec,
    length: int,
    rng: random.Random,
    task: str,
    index: int,
) -> Sample:
    head, tail = layout
    sep = " "
    intro = [*head, *_encode(tokenizer, spec.intro)]
    question = [*_encode(tokenizer, "\n\n" + spec.question), *tail]
    if spec.answer_prefix:
        question += _encode(tokenizer, spec.answer_prefix)
    needles = sorted((d, _encode(tokenizer, sep + s)) for d, s in spec.needles)
    # Every needle must fit in the part both forms share: length - len(question) tokens.
    room = length - len(intro) - len(question) - sum(len(ids) for _, ids in needles)
    if room < 16:
        raise ValueError(
            f"{task}: length {length} is too short for this task (intro, needles and question "
            f"take {length - room} tokens); use a length of at least {length - room + 64}"
        )
    body: list[int] = []
    filler = 0  # filler tokens so far
    for depth, ids in needles:
        target = round(depth * room)
        while True:  # whole filler pieces up to the needle's depth, never past it
            piece = _encode(tokenizer, sep + spec.filler(rng))
            if filler + len(piece) > target:
                break
            body.extend(piece)
            filler += len(piece)
        body.extend(ids)
    while len(intro) + len(body) < length:
        body.extend(_encode(tokenizer, sep + spec.filler(rng)))
    context = (intro + body)[:length]
    shared = length - len(question)
    return Sample(
        task=task,
        index=index,
        inside=context[:shared] + question,
        context=context,
        question=question,
        answer=spec.answer,
        distractors=spec.distractors,
        depth=spec.depth,
    )


# ---------------------------------------------------------------------------------------------
# The tasks
# ---------------------------------------------------------------------------------------------


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randint(10000, 99999))
        if value not in taken:
            taken.add(value)
            return value


def _filler(_rng: random.Random) -> str:
    return _FILLER


def _passkey(rng: random.Random, depth: float) -> _Spec:
    key = str(rng.randint(10000, 99999))
    return _Spec(
        intro="There is important information hidden in this text. Find it and remember it.",
        needles=[(depth, f"The pass key is {key}. Remember it. {key} is the pass key.")],
        filler=_filler,
        question="What is the pass key? Answer with the number only.",
        answer=key,
        distractors=(),
        depth=depth,
        answer_prefix="The pass key is",
    )


def _multikey(rng: random.Random, depth: float) -> _Spec:
    words = rng.sample(_WORDS, 4)
    taken: set[str] = set()
    values = [_number(rng, taken) for _ in words]
    others = sorted(rng.random() for _ in words[1:])
    depths = [depth, *others]
    needles = [
        (d, f"One of the special magic numbers for {w} is: {v}.")
        for d, w, v in zip(depths, words, values)
    ]
    return _Spec(
        intro="Some special magic numbers are hidden in this text. Find them and remember them.",
        needles=needles,
        filler=_filler,
        question=(
            f"What is the special magic number for {words[0]} mentioned in the text? "
            "Answer with the number only."
        ),
        answer=values[0],
        distractors=tuple(values[1:]),
        depth=depth,
        answer_prefix=f"The special magic number for {words[0]} mentioned in the text is",
    )


def _kv(rng: random.Random, depth: float) -> _Spec:
    keys = rng.sample(_WORDS, _KV_PAIRS)
    taken: set[str] = set()
    values = [_number(rng, taken) for _ in keys]
    asked = rng.randrange(_KV_PAIRS)
    listing = "\n".join(f"- The value of the key {k} is {v}." for k, v in zip(keys, values))
    return _Spec(
        intro="A list of keys and their values is hidden in this text. Find it and remember it.",
        needles=[(depth, f"\n\n{listing}\n\n")],
        filler=_filler,
        question=f"What is the value of the key {keys[asked]} in the list? "
        "Answer with the number only.",
        answer=values[asked],
        distractors=tuple(v for i, v in enumerate(values) if i != asked),
        depth=depth,
        answer_prefix=f"The value of the key {keys[asked]} is",
    )


_KV_PAIRS = 8


def _story(rng: random.Random, depth: float) -> _Spec:
    people = rng.sample(_NAMES, len(_KINDS))
    # One fact of each kind, each about another person; the asked one sits at ``depth``, the
    # others are spread evenly through the story.
    facts = [kind(rng, person) for kind, person in zip(_KINDS, people)]
    rng.shuffle(facts)
    others = [((k + 0.5) / (len(facts) - 1), f[0]) for k, f in enumerate(facts[1:])]
    sentence, question, prefix, answer = facts[0]
    return _Spec(
        intro="Read the story and remember the facts about the people in it.",
        needles=[(depth, sentence), *others],
        filler=lambda r: r.choice(_STORY),
        question=f"{question} Answer with one word.",
        answer=answer,
        distractors=(),
        depth=depth,
        answer_prefix=prefix,
    )


def _variable(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def _vt(rng: random.Random, depth: float) -> _Spec:
    names: set[str] = set()
    numbers: set[str] = set()
    chains = [(_variable(rng, names), _variable(rng, names), _number(rng, numbers)) for _ in "ab"]
    (first, last, value), (d_first, d_last, d_value) = chains
    # The asked chain's second link sits between its first and the end; the other chain anywhere.
    later = depth + (1 - depth) * rng.uniform(0.2, 0.8)
    others = sorted(rng.random() for _ in range(2))
    needles = [
        (depth, f"VAR {first} = {value}."),
        (later, f"VAR {last} = VAR {first}."),
        (others[0], f"VAR {d_first} = {d_value}."),
        (others[1], f"VAR {d_last} = VAR {d_first}."),
    ]
    return _Spec(
        intro="Memorize and track the chain(s) of variable assignments hidden in this text.",
        needles=needles,
        filler=_filler,
        question=f"What is the value of VAR {last}? Follow the chain of assignments. "
        "Answer with the number only.",
        answer=value,
        distractors=(d_value,),
        depth=depth,
        answer_prefix=f"The value of VAR {last} is",
    )


def _city(rng: random.Random, p: str) -> tuple[str, str, str, str]:
    c = rng.choice(_CITIES)
    return f"{p} lives in {c}.", f"In which city does {p} live?", f"{p} lives in", c


def _dog(rng: random.Random, p: str) -> tuple[str, str, str, str]:
    d = rng.choice(_PETS)
    return (
        f"{p} has a dog called {d}.",
        f"What is the name of {p}'s dog?",
        f"{p}'s dog is called",
        d,
    )


def _job(rng: random.Random, p: str) -> tuple[str, str, str, str]:
    j = rng.choice(_JOBS)
    return f"{p} works as a {j}.", f"What is {p}'s job?", f"{p} works as a", j


def _colour(rng: random.Random, p: str) -> tuple[str, str, str, str]:
    c = rng.choice(_COLOURS)
    return (
        f"{p}'s favourite colour is {c}.",
        f"What is {p}'s favourite colour?",
        f"{p}'s favourite colour is",
        c,
    )


_COLOURS = "red green blue yellow purple orange brown pink grey white".split()
_KINDS = (_city, _dog, _job, _colour)


#: Task name -> generator of one task instance from a seeded RNG and the asked fact's depth.
TASKS: dict[str, Callable[[random.Random, float], _Spec]] = {
    "passkey": _passkey,
    "multikey": _multikey,
    "kv": _kv,
    "story": _story,
    "vt": _vt,
}
#: The tasks of the default grid (``vt`` is measured on request).
DEFAULT_TASKS = ("passkey", "multikey", "kv", "story")


def make_samples(task: str, tokenizer: Any, length: int, n: int, seed: int = 0) -> list[Sample]:
    """``n`` samples of ``task`` at exactly ``length`` tokens, reproducible from ``seed``.

    Sample ``i`` hides the asked fact at depth ``i / (n - 1)`` (0.5 for one sample), so every run
    covers the start, the middle and the end of the context.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    layout = prompt_layout(tokenizer)
    samples = []
    for i in range(n):
        depth = i / (n - 1) if n > 1 else 0.5
        rng = random.Random(f"{seed}:{task}:{length}:{i}")
        spec = TASKS[task](rng, depth)
        samples.append(_build(tokenizer, layout, spec, length, rng, task, i))
    return samples
