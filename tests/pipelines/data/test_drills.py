"""Copy drills: the answer is the printed value, the value is random, nothing else changes."""

from __future__ import annotations

import json
import re

from pipelines.core.records import Conversation, Message
from pipelines.data.drills import copy_drills
from pipelines.data.export_llamafactory import export_llamafactory

PROMPT = "<image>\nQuestion: How many red objects are in the image?"


def conv(i: int, printed: str, answer: str, final: str | None = None,
         observation: str | None = None) -> Conversation:
    final = final or f"The code printed {answer}, so the answer is {answer}.\n<answer>\n\\boxed{{{answer}}}\n</answer>"
    observation = observation or f"<interpreter>\nText Result:\n{printed}\n</interpreter>"
    return Conversation(id=f"c{i}", data_source="synth/image-search", images=["a.png"],
                        messages=[Message(role="user", content=PROMPT),
                                  Message(role="assistant", content="<code>\n```python\nprint(3)\n```\n</code>"),
                                  Message(role="user", content=observation),
                                  Message(role="assistant", content=final)])


def boxed(c: Conversation) -> str:
    return re.findall(r"\\boxed\{(.*?)\}", c.messages[-1].content)[-1]


def test_drills_copy_the_printed_value_which_is_random_and_of_the_same_kind():
    convs = [conv(i, "3", "3") for i in range(30)]
    convs += [conv(100 + i, "{'A': 5, 'B': 9}\nB", "B",
                   final="From the output, the answer is B.\n<answer>\n\\boxed{B}\n</answer>")
              for i in range(10)]
    convs += [conv(200, "A", "A"), conv(201, "C", "C"), conv(202, "purple", "purple"),
              conv(203, "green", "green")]
    drills = copy_drills(convs, 2, seed=0)
    assert len(drills) == 2 * len(convs)
    for d in drills:
        value = boxed(d)
        printed = d.messages[-2].content.split("\n")[-2]
        assert printed == value  # the answer is exactly the last printed line
        assert d.problems() == []
        source = next(c for c in convs if c.id == d.metadata["drill_of"])
        # A drill is the source's last two turns, without media.
        assert [m.role for m in d.messages] == ["user", "assistant"]
        assert d.images == [] and d.videos == []
        original = boxed(source)
        assert value != original
        assert value.isdigit() == original.isdigit()
        assert (len(value) == 1 and value.isupper()) == (len(original) == 1 and original.isupper())
        # Only the value changed: the rest of the final turn is the source's, word for word.
        def masked(text: str, v: str) -> str:
            return re.sub(rf"(?<!\w){re.escape(v)}(?!\w)", "<V>", text)
        assert masked(d.messages[-1].content, value) == masked(source.messages[-1].content, original)
    counts = [boxed(d) for d in drills if boxed(d).isdigit()]
    assert len(set(counts)) >= 8  # spread over 0..12, not the data's single count
    letters = {boxed(d) for d in drills if len(boxed(d)) == 1 and boxed(d).isupper()}
    assert letters <= {"A", "B", "C"} and len(letters) == 3
    assert {boxed(d) for d in drills if d.metadata["drill_of"] == "c202"} == {"green"}
    # The video-style observation keeps its other lines.
    video = next(d for d in drills if d.metadata["drill_of"] == "c100")
    assert "{'A': 5, 'B': 9}" in video.messages[-2].content


def test_drills_skip_what_cannot_be_copied_and_are_deterministic():
    unprinted = conv(1, "7", "3")  # the answer is not a printed line
    unboxed = conv(2, "3", "3", final="It is 3.")
    shown = conv(4, "3", "3", observation="<interpreter>\nText Result:\n3\nImage Result:\n<image>\n</interpreter>")
    ok = conv(3, "4", "4")
    convs = [unprinted, unboxed, shown, ok]
    drills = copy_drills(convs, 3, seed=1)
    assert {d.metadata["drill_of"] for d in drills} == {"c3"} and len(drills) == 3
    assert copy_drills(convs, 0, seed=1) == []
    again = copy_drills(convs, 3, seed=1)
    assert [d.model_dump() for d in again] == [d.model_dump() for d in drills]
    other = [boxed(d) for d in copy_drills([ok] * 20, 1, seed=2)]
    assert other != [boxed(d) for d in copy_drills([ok] * 20, 1, seed=1)]


def test_drills_export_to_llamafactory_as_media_free_rows(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    convs = [conv(i, "2", "2") for i in range(3)]
    drills = copy_drills(convs, 2, seed=0)
    info = export_llamafactory([(tmp_path, convs), (tmp_path, drills)], tmp_path / "lf")
    assert info["rows"] == 9 and info["images"] == 3
    rows = [json.loads(line) for line in (tmp_path / "lf" / "pyvision_sft.jsonl").read_text().splitlines()]
    assert [len(r["images"]) for r in rows] == [1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert all(r["conversations"][0]["value"].startswith("<interpreter>") for r in rows[3:])
    assert [r["conversations"][-1]["value"].count("\\boxed{2}") for r in rows] == [1] * 3 + [0] * 6


def test_export_cli_adds_drills(tmp_path):
    from PIL import Image
    from typer.testing import CliRunner

    from pipelines.core.records import write_conversations
    from pyvision_cli.data import app

    (tmp_path / "src").mkdir()
    # A real image: the CLI's export brings images to the recipe's context size, so it reads them.
    Image.new("RGB", (64, 48)).save(tmp_path / "src" / "a.png")
    write_conversations(tmp_path / "src" / "conversations.jsonl", [conv(i, "2", "2") for i in range(4)])
    args = ["export", "--format", "llamafactory", "--source", str(tmp_path / "src"), "--json"]
    plain = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "plain")])
    drilled = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "drilled"), "--copy-drills", "2"])
    assert plain.exit_code == 0 and drilled.exit_code == 0, plain.output + drilled.output
    assert json.loads(plain.stdout)["rows"] == 4 and json.loads(drilled.stdout)["rows"] == 12
