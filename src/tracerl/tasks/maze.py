"""`maze`: a multi-turn text maze. Each turn the env says where the agent is and which ways are open; the
policy answers one move (N, E, S or W, then eos). Deterministic for a seed.

Transcript (env text unmasked in the prompt and observations, policy moves in between):
    prompt  "G43 @01 ES>"      goal (4,3); agent at (0,1); open: East, South
    policy  "E" <eos>
    env     "@11 NS>"
    policy  "S" <eos> ...
Coordinates are x (column, grows East) then y (row, grows South), one digit each. A blocked or
malformed move uses up the turn and leaves the agent in place. The episode ends at the goal or after
`max_turns` moves. Reward (given at the last step): 1.0 on reaching the goal; otherwise partial credit
0.5 * (d0 - d_best) / d0, where d is the maze (shortest-path) distance to the goal, d0 at the start
and d_best the least reached, so getting closer pays but never as much as arriving.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from tracerl.tasks.base import Prompt, Reward, Turn, draw, zero
from tracerl.tokenizer import CharTokenizer

DIRS = "NESW"  # clockwise, so the right of heading h is (h + 1) % 4
STEP = {"N": (0, -1), "E": (1, 0), "S": (0, 1), "W": (-1, 0)}
Cell = tuple[int, int]


@dataclass(frozen=True)
class Maze:
    """A perfect maze: `open[y][x]` holds the directions one can move from cell (x, y)."""

    width: int
    height: int
    open: tuple[tuple[str, ...], ...]

    def moves(self, c: Cell) -> str:
        """Open directions from c, in NESW order."""
        return self.open[c[1]][c[0]]

    def distances(self, goal: Cell) -> dict[Cell, int]:
        """Shortest-path distance from every cell to goal (BFS)."""
        dist = {goal: 0}
        queue = deque([goal])
        while queue:
            c = queue.popleft()
            for d in self.moves(c):
                n = (c[0] + STEP[d][0], c[1] + STEP[d][1])
                if n not in dist:
                    dist[n] = dist[c] + 1
                    queue.append(n)
        return dist


def generate_maze(width: int, height: int, rng: random.Random) -> Maze:
    """A perfect maze (exactly one path between any two cells) by randomized depth-first search."""
    opened: dict[Cell, set[str]] = {(x, y): set() for x in range(width) for y in range(height)}
    back = {"N": "S", "S": "N", "E": "W", "W": "E"}
    start = (rng.randrange(width), rng.randrange(height))
    stack, seen = [start], {start}
    while stack:
        c = stack[-1]
        options = []
        for d in DIRS:
            n = (c[0] + STEP[d][0], c[1] + STEP[d][1])
            if 0 <= n[0] < width and 0 <= n[1] < height and n not in seen:
                options.append((d, n))
        if not options:
            stack.pop()
            continue
        d, n = rng.choice(options)
        opened[c].add(d)
        opened[n].add(back[d])
        seen.add(n)
        stack.append(n)
    rows = tuple(tuple("".join(d for d in DIRS if d in opened[(x, y)]) for x in range(width)) for y in range(height))
    return Maze(width, height, rows)


def wall_follower(maze: Maze, start: Cell, goal: Cell, max_steps: int) -> str | None:
    """The right-hand-rule moves from start to goal (None if longer than max_steps).

    The rule needs only the last move and the open directions, both in the transcript, which is what
    makes it a policy a small model can imitate. The initial heading is N.
    """
    pos, heading, moves = start, 0, []
    while pos != goal:
        if len(moves) >= max_steps:
            return None
        open_ = maze.moves(pos)
        for turn in (1, 0, 3, 2):  # right, straight, left, back
            d = DIRS[(heading + turn) % 4]
            if d in open_:
                break
        heading = DIRS.index(d)
        moves.append(d)
        pos = (pos[0] + STEP[d][0], pos[1] + STEP[d][1])
    return "".join(moves)


def observation(maze: Maze, pos: Cell) -> str:
    """What the agent sees each turn: its position and the open directions."""
    return f"@{pos[0]}{pos[1]} {maze.moves(pos)}>"


@dataclass
class MazeEpisode:
    """One running episode; `step` takes the policy's move text."""

    maze: Maze
    start: Cell
    goal: Cell
    max_turns: int
    pos: Cell = (0, 0)
    turns: int = 0
    done: bool = False
    total_reward: float = 0.0
    invalid: int = 0
    blocked: int = 0
    result: Reward | None = None
    _dist: dict[Cell, int] = field(default_factory=dict, repr=False)
    _best: int = 0

    def __post_init__(self) -> None:
        self.pos = self.start
        self._dist = self.maze.distances(self.goal)
        self._best = self._dist[self.start]

    @property
    def observation(self) -> str:
        """The current observation text (empty once done)."""
        return "" if self.done else observation(self.maze, self.pos)

    def step(self, action_text: str) -> tuple[str, float, bool]:
        """Apply one move; return (next observation, reward for this step, done). The reward comes at the end."""
        if self.done:
            raise RuntimeError("maze: step() after the episode ended")
        self.turns += 1
        move = action_text.strip()
        if move not in STEP:
            self.invalid += 1
        elif move not in self.maze.moves(self.pos):
            self.blocked += 1
        else:
            self.pos = (self.pos[0] + STEP[move][0], self.pos[1] + STEP[move][1])
            self._best = min(self._best, self._dist[self.pos])
        if self.pos == self.goal or self.turns >= self.max_turns:
            return "", self.finish(), True
        return self.observation, 0.0, False

    def finish(self) -> float:
        """End the episode now and score it (used when a transcript runs out of moves)."""
        d0 = self._dist[self.start]
        info = {"turns": self.turns, "invalid": self.invalid, "blocked": self.blocked,
                "start_distance": d0, "best_distance": self._best}
        if self.pos == self.goal:
            self.result = Reward(1.0, {**info, "success": True})
        elif self._best < d0:
            self.result = Reward(0.5 * (d0 - self._best) / d0, {**info, "success": False})
        else:
            self.result = zero("no_progress" if self.invalid < self.turns else "invalid_moves", **info, success=False)
        self.done = True
        self.total_reward = self.result.value
        return self.result.value


class MazeTask:
    """Multi-turn maze navigation; one move per turn; episode reward as described in the module docstring."""

    name = "maze"
    multi_turn = True

    def __init__(self, width: int = 5, height: int = 5, max_turns: int = 24, min_path: int = 8,
                 test_fraction: float = 0.2) -> None:
        if not (2 <= width <= 10 and 2 <= height <= 10):
            raise ValueError("maze: width and height must be in 2..10 (one digit per coordinate)")
        if not 1 <= min_path <= max_turns:
            raise ValueError("maze: need 1 <= min_path <= max_turns")
        self.width, self.height, self.max_turns, self.min_path = width, height, max_turns, min_path
        self.test_fraction = test_fraction
        self.tokenizer = CharTokenizer()
        self.max_new_tokens = 2  # per turn: the move and eos

    def _make(self, rng: random.Random) -> tuple[str, Prompt]:
        cells = [(x, y) for y in range(self.height) for x in range(self.width)]
        for _ in range(1000):
            maze = generate_maze(self.width, self.height, rng)
            for _ in range(20):
                start, goal = rng.sample(cells, 2)
                # Keep only problems a transcript-only policy (the wall follower) solves within the budget,
                # and that need at least min_path turns even for an oracle.
                if maze.distances(goal)[start] >= self.min_path and wall_follower(maze, start, goal, self.max_turns):
                    key = f"{'|'.join(','.join(r) for r in maze.open)}/{start}/{goal}"
                    meta = {"maze": maze, "start": start, "goal": goal}
                    text = f"G{goal[0]}{goal[1]} {observation(maze, start)}"
                    return key, Prompt(text, meta, self.name, key)
        raise RuntimeError("maze: could not generate a solvable maze with these options")

    def prompts(self, split: str = "train", n: int = 64, seed: int = 0) -> list[Prompt]:
        """n seeded episodes (maze, start, goal) of one split."""
        return draw(self.name, split, n, seed, self._make, self.test_fraction)

    def reset(self, prompt: Prompt) -> MazeEpisode:
        """Start an episode; the first observation is prompt.text."""
        m = prompt.meta
        return MazeEpisode(m["maze"], tuple(m["start"]), tuple(m["goal"]), self.max_turns)

    def solve(self, prompt: Prompt) -> list[Turn]:
        """A correct policy's transcript after the prompt: policy move, env observation, ..., final move."""
        m = prompt.meta
        moves = wall_follower(m["maze"], tuple(m["start"]), tuple(m["goal"]), self.max_turns)
        assert moves is not None  # _make only keeps problems the wall follower solves
        ep, turns = self.reset(prompt), []
        for mv in moves:
            obs, _, done = ep.step(mv)
            turns.append(Turn("policy", mv))
            if not done:
                turns.append(Turn("env", obs))
        return turns

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """Play the moves in `completion` (one character per turn, whitespace ignored) and score the episode."""
        ep = self.reset(prompt)
        moves = "".join(completion.split())
        for mv in moves:
            if ep.done:
                break
            ep.step(mv)
        if not ep.done:
            if ep.turns == 0:
                return zero("empty")
            ep.finish()
        assert ep.result is not None
        return ep.result
