"""Copy drills: short SFT rows that teach a small model to answer with what its code printed.

A PyVision trajectory ends with the interpreter's result and the model's answer, which restates
that result. A model of a few million parameters, trained for minutes, lowers its loss on that
answer fastest by guessing from the answers' prior (most counts are 2-4, most letters A or B), and
then never learns to read the result: the tiny demo's SFT model answered with the printed value on
0 of 28 answered held-out image samples, so tool use bought it nothing and RL had nothing to
reinforce.

A drill is a trajectory's last interpreter turn and its final answer, with the result replaced, in
both, by another value of the same kind drawn at random. The prior is then uninformative and only
copying lowers the loss. Drills carry no media and are a few dozen tokens long.

Measured on the demo's data (seed 0, two drills per trajectory, 3 SFT epochs instead of 5): the SFT
model answered with the printed value on 22 of 43 answered held-out image samples, against 0 of 28
without drills. Drills that kept the whole trajectory as context (media included) taught nothing
at 1.7x the cost (1 of 21), and batches sampled by length (all-drill batches) made the model loop
on its own recent tokens. Drills do not teach the other copy the tasks need, the question's colour
into the code (0 of 24 count questions restated it right), so RL found copying no better than
guessing and unlearnt it (22 -> 6 of 48); on seed 1 no SFT code ran at all. RL beat SFT on neither
seed, and the run took 1011 s instead of about 760, so the tiny recipe leaves drills off
(``data.copy_drills: 0``, the default); ``docs/tiny-recipe.md`` has the numbers.
A model that already copies (any released VLM) does not need them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

from pipelines.core.records import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Conversation, Message

_BOXED = re.compile(r"\\boxed\{([^{}\n]*)\}")


def _kind(value: str) -> str:
    if value.isdigit():
        return "int"
    if len(value) == 1 and value.isalpha() and value.isupper():
        return "letter"
    return "word"


def _pools(answers: Iterable[str]) -> dict[str, list[str]]:
    """Values a drill may use for each kind of answer: every one seen, and for integers the whole
    range from 0 to the largest seen (at least 12), so that no count is privileged."""
    seen: dict[str, set[str]] = {"int": set(), "letter": set(), "word": set()}
    for a in answers:
        seen[_kind(a)].add(a)
    top = max([12, *(int(a) for a in seen["int"])])
    seen["int"] |= {str(i) for i in range(top + 1)}
    return {k: sorted(v) for k, v in seen.items()}


def _answer(conv: Conversation) -> str | None:
    found = _BOXED.findall(conv.messages[-1].content)
    return found[-1].strip() if found else None


def _drill(conv: Conversation, value: str, new: str, k: int) -> Conversation | None:
    observation, final = conv.messages[-2].content, conv.messages[-1].content
    lines = observation.split("\n")
    hits = [i for i, line in enumerate(lines) if line.strip() == value]
    if not hits:
        return None  # the answer is not a printed line: nothing to copy
    lines[hits[-1]] = new
    same = re.compile(rf"(?<![\w]){re.escape(value)}(?![\w])")
    return Conversation(
        id=f"{conv.id}-drill{k}", data_source=f"drill/{conv.data_source}",
        messages=[Message(role="user", content="\n".join(lines)),
                  Message(role="assistant", content=same.sub(lambda _: new, final))],
        metadata={"drill_of": conv.id})


def copy_drills(conversations: list[Conversation], per_conversation: int,
                seed: int) -> list[Conversation]:
    """``per_conversation`` drills for each conversation whose answer is a line its last
    interpreter turn printed as text (others are skipped). Deterministic given ``seed``."""
    if per_conversation <= 0:
        return []
    answers = {c.id: _answer(c) for c in conversations}
    pools = _pools(a for a in answers.values() if a)
    rng = random.Random(seed)
    out: list[Conversation] = []
    for conv in conversations:
        value = answers[conv.id]
        if (not value or len(conv.messages) < 3 or conv.messages[-2].role != "user"
                or IMAGE_PLACEHOLDER in conv.messages[-2].content
                or VIDEO_PLACEHOLDER in conv.messages[-2].content):
            continue  # no answer to copy, or a result that is an image (a drill has no media)
        choices = [v for v in pools[_kind(value)] if v != value]
        if not choices:
            continue
        for k in range(per_conversation):
            drill = _drill(conv, value, rng.choice(choices), k)
            if drill is None:
                break
            out.append(drill)
    return out
