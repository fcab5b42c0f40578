"""The `code` task (hidden unit tests in the sandbox) and `humaneval` as an eval task."""

from __future__ import annotations

import re

import pytest

from tracerl import tasks
from tracerl.tasks import Prompt
from tracerl.tasks.code import TEMPLATES, CodeTask, same
from tracerl.tasks.humaneval import HumanEvalTask, to_ascii, truncate
from tracerl.tokenizer import CharTokenizer


@pytest.fixture(scope="module")
def task() -> CodeTask:
    return CodeTask()


def dist_prompt() -> Prompt:
    tests = [{"args": [5], "expected": 2}, {"args": [3], "expected": 0}, {"args": [-1], "expected": 4}]
    text = "# f(int): distance from x to 3\ndef f(x):\n"
    return Prompt(text, {"template": "dist", "params": {"a": 3}, "tests": tests}, "code")


@pytest.mark.parametrize(
    ("completion", "value", "reason"),
    [(" return abs(x-3)", 1.0, None),
     (" return x-3", 2 / 3, None),  # right for 5 and 3, wrong for -1
     (" return 0", 1 / 3, None),
     (" return -1", 0.0, "wrong_answer"),
     (" return x.foo", 0.0, "runtime_error"),
     (" return abs(x-", 0.0, "load_error"),
     ("", 0.0, "empty"),
     (" while True:\n  pass", 0.0, "runtime_error"),  # every call hits the per-call CPU limit
     (" import os\n os._exit(0)", 0.0, "exited"),
     (" return abs(x-3.0)", 0.0, "wrong_answer")],  # 2.0 is not 2: types must match
)
def test_code_reward(task: CodeTask, completion: str, value: float, reason: str | None) -> None:
    r = task.reward(dist_prompt(), completion)
    assert r.value == pytest.approx(value)
    assert r.info.get("reason") == reason
    assert r.info["total"] == 3


def test_reference_solutions_pass_their_hidden_tests(task: CodeTask) -> None:
    prompts = task.prompts("train", 60, seed=0) + task.prompts("test", 20, seed=0)
    assert {p.meta["template"] for p in prompts} == {t.name for t in TEMPLATES}
    rewards = tasks.rewards(task, prompts, [task.solve(p) for p in prompts])
    assert [r.value for r in rewards] == [1.0] * len(prompts), [r.info for r in rewards if r.value < 1]


def test_formats_fit_a_char_model(task: CodeTask) -> None:
    tok = CharTokenizer()
    for p in task.prompts("train", 200, seed=1):
        assert re.fullmatch(r"# f\((int|list|str)\): [^\n]+\ndef f\(x\):\n", p.text) and len(p.text) <= 64
        body = task.solve(p)
        tok.encode(p.text + body)
        assert len(body) + 1 <= task.max_new_tokens
        assert len(p.meta["tests"]) == task.n_tests


def test_the_child_receives_inputs_only(task: CodeTask, monkeypatch) -> None:
    tests = [{"args": ["abc"], "expected": "ABC"}, {"args": ["dd"], "expected": "DD"}]
    p = Prompt("# f(str): x in uppercase\ndef f(x):\n", {"template": "upper", "params": {}, "tests": tests}, "code")
    sent = []
    real = task.sandbox.run_many

    def spy(jobs, *a, **k):
        sent.extend(jobs)
        return real(jobs, *a, **k)

    monkeypatch.setattr(task.sandbox, "run_many", spy)
    assert task.reward(p, " return x.upper()").value == 1.0
    assert "ABC" not in repr(sent) and "DD" not in repr(sent) and "abc" in repr(sent)


def test_strict_equality() -> None:
    assert same([1, [2, "a"]], [1, [2, "a"]]) and not same(True, 1) and not same(1, 1.0) and not same([1], [1, 2])


def test_unknown_template_option() -> None:
    with pytest.raises(ValueError, match="unknown templates"):
        CodeTask(templates=["nope"])
    assert {p.meta["template"] for p in CodeTask(templates=["upper"]).prompts("train", 5)} == {"upper"}


# ---------------------------------------------------------------- humaneval


@pytest.fixture(scope="module")
def humaneval() -> HumanEvalTask:
    return tasks.get("humaneval")


def test_humaneval_prompts(humaneval: HumanEvalTask) -> None:
    ps = humaneval.prompts()
    assert len(ps) == 164 and ps[0].id == "HumanEval/0" and ps[-1].id == "HumanEval/163"
    sample = humaneval.prompts("test", 10, seed=1)
    assert len(sample) == 10 and sample == humaneval.prompts("test", 10, seed=1)
    with pytest.raises(ValueError, match="only a test split"):
        humaneval.prompts("train", 5)


def test_humaneval_stubs_fail(humaneval: HumanEvalTask) -> None:
    ps = humaneval.prompts("test", 8, seed=0)
    bad = tasks.rewards(humaneval, ps, ["    pass\n"] * 8)
    assert all(r.value == 0.0 and r.info["reason"] == "test_failed" for r in bad)
    broken = humaneval.reward(ps[0], "    return (\n")
    assert broken.value == 0.0 and broken.info["reason"] == "load_error"


def test_humaneval_all_canonical_solutions_pass(humaneval: HumanEvalTask) -> None:
    ps = humaneval.prompts()
    rewards = tasks.rewards(humaneval, ps, [humaneval.solve(p) for p in ps])
    assert [p.id for p, r in zip(ps, rewards) if r.value != 1.0] == []


def test_humaneval_hashlib_problem_imports_inside_the_sandbox(humaneval: HumanEvalTask) -> None:
    p = next(p for p in humaneval.prompts() if p.id == "HumanEval/162")  # imports hashlib in the solution
    assert humaneval.reward(p, humaneval.solve(p)).value == 1.0


def test_humaneval_prompts_fit_the_char_tokenizer(humaneval: HumanEvalTask) -> None:
    ps = humaneval.prompts()
    for p in ps:
        humaneval.tokenizer.encode(p.text)  # raises on a character outside the vocabulary
    affected = [p for p in ps if p.text != humaneval.problems[p.id]["prompt"]]
    assert 0 < len(affected) <= 12
    assert [r.value for r in tasks.rewards(humaneval, affected, [humaneval.solve(p) for p in affected])] == \
        [1.0] * len(affected)
    assert to_ascii("a \u279e b\t\u2264 \u00e9\u4e2d") == "a -> b    <= e?"


def test_truncate_at_stop_sequences() -> None:
    assert truncate("    return 1\n\ndef g():\n    pass") == "    return 1\n"
    assert truncate("    return 1\nif __name__ == '__main__':\n    f()") == "    return 1"
    assert truncate("    return 1\n") == "    return 1\n"
