"""User datasets: JSONL and Parquet, math-verify answers, user reward functions, and clear errors."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from tracerl import tasks
from tracerl.tasks.dataset import DatasetTask

ROWS = [
    {"prompt": "What is 1/2 as a decimal?", "answer": "0.5"},
    {"prompt": "Simplify 2/4.", "answer": "\\frac{1}{2}"},
    {"prompt": "Solve x+1=3.", "answer": "2"},
    {"prompt": "sqrt(16)?", "answer": "4"},
    {"prompt": "Capital of France?", "answer": "Paris"},
] + [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(40)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def jsonl(tmp_path) -> str:
    return write_jsonl(tmp_path / "data.jsonl", ROWS)


def by_prompt(task: DatasetTask, text: str):
    return next(task._prompt(i) for i, r in enumerate(task.rows) if r["prompt"] == text)


@pytest.mark.parametrize(
    ("prompt", "completion", "value"),
    [("What is 1/2 as a decimal?", "The answer is $\\frac{1}{2}$.", 1.0),
     ("What is 1/2 as a decimal?", "0.5", 1.0),
     ("Simplify 2/4.", "It simplifies to \\boxed{0.5}", 1.0),
     ("Solve x+1=3.", "x = 2", 1.0),
     ("Solve x+1=3.", "x = 3", 0.0),
     ("sqrt(16)?", "\\boxed{\\sqrt{16}}", 1.0),
     ("Capital of France?", "I think\nParis", 1.0),
     ("Capital of France?", "Lyon", 0.0)],
)
def test_math_verify_rewards(jsonl: str, prompt: str, completion: str, value: float) -> None:
    task = tasks.get("dataset", path=jsonl)
    r = task.reward(by_prompt(task, prompt), completion)
    assert r.value == value, r.info
    if value == 0:
        assert r.info["reason"] == "wrong_answer"


def test_malformed_completions(jsonl: str) -> None:
    task = tasks.get("dataset", path=jsonl)
    p = by_prompt(task, "Solve x+1=3.")
    assert task.reward(p, "").info["reason"] == "empty"
    assert task.reward(p, "no idea, sorry").info["reason"] == "no_answer_found"


def test_splits_are_seeded_and_disjoint(jsonl: str) -> None:
    task = tasks.get("dataset", path=jsonl, test_fraction=0.3)
    train, test = task.prompts("train", 100, seed=1), task.prompts("test", 100, seed=1)
    assert not {p.text for p in train} & {p.text for p in test}
    assert {p.text for p in train} | {p.text for p in test} == {r["prompt"] for r in ROWS}
    assert [p.text for p in train] == [p.text for p in task.prompts("train", 100, seed=1)]
    assert [p.text for p in train] != [p.text for p in task.prompts("train", 100, seed=2)]
    assert len(train) == 100  # more than the split holds: cycles through reshuffled passes


def test_explicit_split_column(tmp_path) -> None:
    rows = [{"prompt": f"q{i}", "answer": str(i), "split": "test" if i < 2 else "train"} for i in range(6)]
    task = tasks.get("dataset", path=write_jsonl(tmp_path / "s.jsonl", rows))
    assert {p.text for p in task.prompts("test", 2)} == {"q0", "q1"}


def test_parquet(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    task = tasks.get("dataset", path=str(path))
    assert len(task.rows) == len(ROWS)
    assert task.reward(by_prompt(task, "Solve x+1=3."), "2").value == 1.0


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch) -> None:
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'tracerl\[data\]'"):
        tasks.get("dataset", path=str(path))


def test_user_reward_function(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length_match(prompt, completion, row):
            return 1.0 if len(completion) == row["n"] else 0.0

        def out_of_range(prompt, completion, row):
            return 2.0

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "say 3 chars", "n": 3}])
    task = tasks.get("dataset", path=data, reward_fn="my_rewards:length_match")
    p = task.prompts("train", 1)[0] if task._splits["train"] else task.prompts("test", 1)[0]
    assert task.reward(p, "abc").value == 1.0
    r = task.reward(p, "ab")
    assert r.value == 0.0 and r.info["reason"] == "reward_fn_returned_zero"
    bad = tasks.get("dataset", path=data, reward_fn="my_rewards:out_of_range")
    with pytest.raises(ValueError, match="outside"):
        bad.reward(p, "abc")
    with pytest.raises(TypeError, match="not callable"):
        tasks.get("dataset", path=data, reward_fn="my_rewards:NOT_CALLABLE")
    assert tasks.get("dataset", path=data, reward_fn=lambda p, c, r: c == "x").reward(p, "x").value == 1.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"path": "/nonexistent/data.jsonl"}, FileNotFoundError, "no file at"),
     ({"reward_fn": "no_such_module_xyz:f"}, ImportError, "cannot import module 'no_such_module_xyz'"),
     ({"reward_fn": "json:no_such_function"}, ImportError, "has no attribute 'no_such_function'"),
     ({"reward_fn": "justaname"}, ValueError, "module:function"),
     ({"answer_column": "solution"}, ValueError, "no 'solution' column"),
     ({"prompt_column": "question"}, ValueError, "no 'question' column")],
)
def test_clear_errors(jsonl: str, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        tasks.get("dataset", **{"path": jsonl, **kwargs})


def test_bad_files(tmp_path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        tasks.get("dataset", path=str(tmp_path / "bad.jsonl"))
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        tasks.get("dataset", path=str(tmp_path / "data.csv"))
    with pytest.raises(TypeError, match="needs path"):
        tasks.get("dataset")
