"""Registry, reasoning tasks (arith, countdown), the multi-turn maze, warm-start data and loss masks."""

from __future__ import annotations

import builtins
import re

import pytest

from tracerl import tasks
from tracerl.tasks import Prompt, Reward, Turn, build_multiturn_sequence, encode_transcript
from tracerl.tasks.base import MultiTurnTask, Task, split_of
from tracerl.tasks.countdown import evaluate_expression, find_expression
from tracerl.tasks.maze import STEP, MazeTask
from tracerl.tokenizer import CharTokenizer

TOK = CharTokenizer()


# ---------------------------------------------------------------- registry


def test_names_and_unknown_task() -> None:
    assert {"arith", "countdown", "code", "maze", "humaneval", "dataset"} <= set(tasks.names())
    with pytest.raises(ValueError, match=r"unknown task 'nope'; available: arith, countdown, code, maze"):
        tasks.get("nope")


@pytest.mark.parametrize("name", ["arith", "countdown", "code", "maze"])
def test_builtins_follow_the_protocol(name: str) -> None:
    task = tasks.get(name)
    assert isinstance(task, Task) and task.name == name
    assert isinstance(task.tokenizer, CharTokenizer) and task.max_new_tokens > 0
    assert task.multi_turn == (name == "maze") and isinstance(task, MultiTurnTask) == (name == "maze")


def test_options_are_forwarded_and_checked() -> None:
    task = tasks.get("arith", digits=3, ops="+-*", scratchpad=False)
    ps = task.prompts("train", 200, seed=1)
    assert {p.meta["op"] for p in ps} == {"+", "-", "*"} and max(p.meta["a"] for p in ps) > 99
    with pytest.raises(ValueError, match="ops"):
        tasks.get("arith", ops="/")
    with pytest.raises(TypeError):
        tasks.get("maze", colour="red")


def test_zero_reward_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="reason"):
        Reward(0.0)
    with pytest.raises(ValueError):
        Reward(1.5)


# ---------------------------------------------------------------- splits


@pytest.mark.parametrize("name", ["arith", "countdown", "code", "maze"])
def test_prompts_are_seeded_and_splits_disjoint(name: str) -> None:
    task = tasks.get(name)
    n = 60 if name == "countdown" else 200
    a, b = task.prompts("train", n, seed=5), task.prompts("train", n, seed=5)
    assert [p.text for p in a] == [p.text for p in b] and [p.id for p in a] == [p.id for p in b]
    assert [p.id for p in task.prompts("train", n, seed=6)] != [p.id for p in a]
    test = task.prompts("test", n // 2, seed=5)
    assert not {p.id for p in a} & {p.id for p in test}
    assert all(split_of(f"{name}/{p.id}", task_test_fraction(task)) == "test" for p in test)
    with pytest.raises(ValueError, match="split"):
        task.prompts("validation", 1)


def task_test_fraction(task: Task) -> float:
    return getattr(task, "options", task).test_fraction


def test_small_problem_spaces_still_fill_n() -> None:
    task = tasks.get("arith", digits=1)  # 100 problems, ~10 in test
    test = task.prompts("test", 50, seed=0)
    assert len(test) == 50 and len({p.id for p in test}) < 50


# ---------------------------------------------------------------- arith


def test_arith_default_format_is_short_and_learnable() -> None:
    task = tasks.get("arith")
    for p in task.prompts("train", 300, seed=0) + task.prompts("test", 100, seed=0):
        assert re.fullmatch(r"\d{1,2}\+\d{1,2}=", p.text) and len(p.text) <= 16
        target = task.solve(p)
        assert len(target) <= 16 and len(target) + 1 <= task.max_new_tokens  # + eos
        TOK.encode(p.text + target)
        assert task.reward(p, target).value == 1.0


def arith_prompt(a: int, op: str, b: int) -> Prompt:
    from tracerl.tasks.arith import evaluate

    return Prompt(f"{a}{op}{b}=", {"a": a, "op": op, "b": b, "answer": evaluate(a, op, b)}, "arith")


@pytest.mark.parametrize(
    ("a", "op", "b", "target"),
    [(23, "+", 45, "86#68"), (57, "+", 68, "521#125"), (23, "-", 45, "22-#-22"), (23, "*", 45, "115,92#1035"),
     (0, "+", 0, "0#0")],
)
def test_arith_scratchpad(a: int, op: str, b: int, target: str) -> None:
    task = tasks.get("arith", ops="+-*")
    p = arith_prompt(a, op, b)
    assert task.solve(p) == target
    assert task.reward(p, target).value == 1.0


@pytest.mark.parametrize(
    ("completion", "reason"),
    [("86#69", "wrong_answer"), ("86#", "unparseable_answer"), ("86#6 8", "unparseable_answer"), ("68", "no_marker"),
     ("", "empty"), ("  \n", "empty"), ("86#68x", "unparseable_answer"), ("86#" + "9" * 5000, "unparseable_answer")],
)
def test_arith_wrong_and_malformed(completion: str, reason: str) -> None:
    r = tasks.get("arith").reward(arith_prompt(23, "+", 45), completion)
    assert r.value == 0.0 and r.info["reason"] == reason


def test_arith_without_scratchpad() -> None:
    task = tasks.get("arith", scratchpad=False)
    p = arith_prompt(23, "+", 45)
    assert task.solve(p) == "68" and task.reward(p, "68").value == 1.0 and task.reward(p, " 68\n").value == 1.0
    assert task.reward(p, "67").info["reason"] == "wrong_answer"
    assert task.max_new_tokens <= 8


# ---------------------------------------------------------------- countdown


def cd(numbers: list[int], target: int) -> Prompt:
    return Prompt(f"{','.join(map(str, numbers))} to {target}:", {"numbers": numbers, "target": target}, "countdown")


@pytest.mark.parametrize(
    ("numbers", "target", "expr"),
    [([7, 3, 9], 13, "7+9-3"), ([7, 3, 9], 6, "(9-7)*3"), ([7, 3, 9], 10, "9/3+7"), ([7, 3, 9], 9, "9"),
     ([1, 3, 4, 6], 24, "6/(1-3/4)"), ([5, 5, 2], 0, " 5 - 5 ")],
)
def test_countdown_correct(numbers: list[int], target: int, expr: str) -> None:
    assert tasks.get("countdown").reward(cd(numbers, target), expr).value == 1.0


@pytest.mark.parametrize(
    ("expr", "reason"),
    [("7+9", "wrong_value"), ("7+7-1", "number_reused"), ("7+8-2", "number_not_given"), ("9**1+3", "disallowed"),
     ("-3+9+7", "disallowed"), ("__import__('os')", "disallowed"), ("7.0+9-3", "disallowed"), ("True+9+3", "disallowed"),
     ("7+", "syntax_error"), ("", "empty"), ("(" * 300 + "7" + ")" * 300, "too_long"),
     ("7+9-3=13", "syntax_error"), ("[7,9,3]", "disallowed"), ("9//3+7", "disallowed")],
)
def test_countdown_wrong_and_malformed(expr: str, reason: str) -> None:
    r = tasks.get("countdown").reward(cd([7, 3, 9], 13), expr)
    assert r.value == 0.0 and r.info["reason"] == reason


def test_countdown_division_by_zero() -> None:
    r = tasks.get("countdown").reward(cd([4, 2, 2], 1), "4/(2-2)")
    assert r.value == 0.0 and r.info["reason"] == "division_by_zero"


def test_countdown_never_calls_eval(monkeypatch) -> None:
    def forbidden(*a, **k):
        raise AssertionError("eval/exec used")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    task = tasks.get("countdown")
    assert task.reward(cd([7, 3, 9], 13), "7+9-3").value == 1.0
    assert task.reward(cd([7, 3, 9], 13), "__import__('os').system('true')").value == 0.0


def test_countdown_exact_arithmetic() -> None:
    # 1/3*3 is exactly 1 with fractions (floating point gives 1.0 too, but 0.1-style cases would not).
    assert evaluate_expression("1/3*3", [1, 3, 3]) == 1
    assert find_expression([1, 3, 4, 6], 24) is not None and find_expression([1, 1], 5) is None


def test_countdown_generated_problems_are_solvable_and_short() -> None:
    task = tasks.get("countdown")
    for p in task.prompts("train", 40, seed=0):
        assert len(p.meta["numbers"]) == 3 and len(p.text) <= 16
        sol = task.solve(p)
        assert task.reward(p, sol).value == 1.0 and len(sol) + 1 <= task.max_new_tokens
        TOK.encode(p.text + sol)


# ---------------------------------------------------------------- maze


def test_maze_is_deterministic_for_a_seed() -> None:
    a, b = MazeTask().prompts("train", 20, seed=3), MazeTask().prompts("train", 20, seed=3)
    assert [(p.text, p.meta["maze"], p.meta["start"], p.meta["goal"]) for p in a] == \
           [(p.text, p.meta["maze"], p.meta["start"], p.meta["goal"]) for p in b]
    task = MazeTask()
    for p in a[:5]:
        moves = "NESWWSEN" * 3
        t1, t2 = play(task, p, moves), play(task, p, moves)
        assert t1 == t2


def play(task: MazeTask, prompt: Prompt, moves: str) -> list:
    ep = task.reset(prompt)
    out = []
    for mv in moves:
        if ep.done:
            break
        out.append(ep.step(mv))
    return out


def test_maze_reference_policy_reaches_the_goal_in_at_least_8_turns() -> None:
    task = MazeTask()
    for p in task.prompts("train", 30, seed=0):
        assert re.fullmatch(r"G\d\d @\d\d [NESW]{1,4}>", p.text)
        turns = task.solve(p)
        moves = [t.text for t in turns if t.role == "policy"]
        assert 8 <= len(moves) <= task.max_turns
        assert all(t.role == ("policy" if i % 2 == 0 else "env") for i, t in enumerate(turns))
        ep = task.reset(p)
        for i, mv in enumerate(moves):
            obs, reward, done = ep.step(mv)
            assert done == (i == len(moves) - 1)
            if not done:
                assert re.fullmatch(r"@\d\d [NESW]{1,4}>", obs) and obs == turns[2 * i + 1].text and reward == 0.0
        assert ep.total_reward == 1.0 and ep.result.info["success"]
        assert task.reward(p, "".join(moves)).value == 1.0


def shortest_moves(task: MazeTask, p: Prompt) -> list[str]:
    maze, pos, goal = p.meta["maze"], p.meta["start"], p.meta["goal"]
    dist = maze.distances(goal)
    out = []
    while pos != goal:
        d = next(d for d in maze.moves(pos) if dist[(pos[0] + STEP[d][0], pos[1] + STEP[d][1])] < dist[pos])
        out.append(d)
        pos = (pos[0] + STEP[d][0], pos[1] + STEP[d][1])
    return out


def test_maze_partial_credit_walls_and_budget() -> None:
    task = MazeTask(max_turns=24)
    p = task.prompts("test", 1, seed=0)[0]
    best = shortest_moves(task, p)
    d0 = len(best)
    assert d0 >= 8
    # Three steps of progress, then wasted turns until the budget runs out.
    ep = task.reset(p)
    for mv in best[:3]:
        ep.step(mv)
    wasted = 0
    while not ep.done:
        ep.step("x")
        wasted += 1
    assert ep.turns == 24 and wasted == 21 and ep.invalid == 21
    assert ep.total_reward == pytest.approx(0.5 * 3 / d0) and not ep.result.info["success"]
    with pytest.raises(RuntimeError):
        ep.step("N")
    # Walking into a wall keeps the agent in place.
    ep = task.reset(p)
    start_obs = ep.observation
    wall = next(d for d in "NESW" if d not in p.meta["maze"].moves(p.meta["start"]))
    obs, _, _ = ep.step(wall)
    assert obs == start_obs and ep.blocked == 1
    # No progress at all is a zero with a reason.
    r = task.reward(p, "?" * 24)
    assert r.value == 0.0 and r.info["reason"] == "invalid_moves"
    r = task.reward(p, wall * 24)
    assert r.value == 0.0 and r.info["reason"] == "no_progress"
    assert task.reward(p, "").info["reason"] == "empty"


# ---------------------------------------------------------------- multi-turn sequences


def test_build_multiturn_sequence_masks_exactly_the_policy() -> None:
    ids, mask = build_multiturn_sequence([1, 10, 11], [("policy", [20, 2]), ("env", [30, 31, 32]), ("policy", [21, 2])])
    assert ids == [1, 10, 11, 20, 2, 30, 31, 32, 21, 2]
    assert mask == [False, False, False, True, True, False, False, False, True, True]
    with pytest.raises(ValueError, match="role"):
        build_multiturn_sequence([], [("user", [1])])


def test_maze_transcript_masks_exactly_the_moves() -> None:
    task = MazeTask()
    p = task.prompts("train", 1, seed=1)[0]
    turns = task.solve(p)
    ids, mask = encode_transcript(TOK, p.text, turns)
    assert len(ids) == len(mask) and ids[0] == TOK.bos_id
    policy = [i for i, m in zip(ids, mask) if m]
    env = [i for i, m in zip(ids, mask) if not m]
    moves = [t.text for t in turns if t.role == "policy"]
    assert policy == [x for mv in moves for x in (TOK.encode(mv)[0], TOK.eos_id)]
    assert TOK.decode(env) == p.text + "".join(t.text for t in turns if t.role == "env")
    assert TOK.eos_id not in env
    # Spans alternate env (prompt or observation), policy (move + eos), ..., ending on the policy's last move.
    spans = [m for k, m in enumerate(mask) if k == 0 or mask[k - 1] != m]
    assert spans == [False, True] * len(moves)


# ---------------------------------------------------------------- warm start


@pytest.mark.parametrize("name", ["arith", "countdown", "maze"])
def test_sft_dataset_targets_earn_full_reward(name: str) -> None:
    task = tasks.get(name)
    data = tasks.sft_dataset(name, 12, seed=0)
    assert len(data) == 12
    for (text, target), p in zip(data, task.prompts("train", 12, seed=0)):
        assert text == p.text
        if name == "maze":
            assert all(isinstance(t, Turn) for t in target)
            target = "".join(t.text for t in target if t.role == "policy")
        assert task.reward(p, target).value == 1.0


def test_rewards_batches_in_order() -> None:
    task = tasks.get("arith")
    ps = task.prompts("train", 6, seed=0)
    outs = [task.solve(p) if i % 2 else "0#0" for i, p in enumerate(ps)]
    values = [r.value for r in tasks.rewards(task, ps, outs)]
    assert values == [float(i % 2 or ps[i].meta["answer"] == 0) for i in range(6)]
    with pytest.raises(ValueError, match="completions"):
        tasks.rewards(task, ps, outs[:2])
