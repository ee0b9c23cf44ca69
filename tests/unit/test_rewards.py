"""GRPO's reward functions (``shardyard.objectives.rewards``, issue 44): the shipped ``NumericAnswer`` and
``FormatRegex`` on hostile completions (huge numbers, other scripts' digits, no answer, empty and megabyte
strings, nested markers, signs, decimals, exponents, a catastrophic-backtracking pattern) give the documented
reward quickly and never raise; ``build_rewards`` builds what ``objective.rewards`` names and refuses what it
cannot use with exit 2 naming the entry; a user's reward that misbehaves stops the run naming it."""

import inspect
import random
import re
import time

import pytest

from shardyard.core.errors import UserError
from shardyard.objectives.rewards import (_NUMERAL, FormatRegex, NumericAnswer, Reward, _last_numeral,
                                          build_rewards)

HUGE = "1" + "0" * 5000  # 10**5000: past Python's 4300-digit int-string limit
MB = 1_000_000
STUCK = 10.0
"""Seconds past which a reward is taken for stuck: what these inputs guard against is catastrophic backtracking
or quadratic scans, which on them take minutes to hours ((a+)+$ on 30 a's and a b: 2**30 steps of re; a quadratic
scan of a megabyte: 10**12), while a linear scan takes milliseconds. The ceiling is that far from both so that a
loaded machine (the suite's second worker, other jobs) cannot fail it; how fast the rewards are is not a test's
business."""

NUMERIC_CASES = [
    # (completion, the row's answer, reward)
    ("Answer: 42", "42", 1.0),
    ("Let me think. 6 x 7 = 42.\nAnswer: 42.", 42, 1.0),
    ("Answer: 41", "42", 0.0),
    ("The answer is 42", "42", 0.0),  # no marker
    ("", "42", 0.0),
    ("Answer:", "42", 0.0),
    ("Answer: forty-two", "42", 0.0),
    (f"Answer: {HUGE}", HUGE, 0.0),  # a numeral past max_chars is unreadable, on either side
    (f"Answer: {HUGE}", "42", 0.0),
    ("Answer: 1", 10 ** 5000, 0.0),  # an int answer that large: unreadable, no int->str conversion
    ("Answer: ١٢٣", "123", 0.0),  # Arabic-Indic digits are not read (only ASCII digits)
    ("Answer: １２３", "123", 0.0),  # fullwidth digits neither
    ("Answer: ١٢٣ or 123", 123, 1.0),
    ("Answer: −5", -5, 0.0),  # the unicode minus is not a sign: this reads 5
    ("Answer: −5", 5, 1.0),
    ("Answer: -42", "-42", 1.0),
    ("Answer: -42", 42, 0.0),
    ("Answer: +42", 42, 1.0),
    ("Answer: 3.50", "3.5", 1.0),  # exact decimals: 3.50 == 3.5
    ("Answer: 3.5", 3.5, 1.0),
    ("Answer: 0.1", 0.1, 1.0),  # a float answer is its shortest repr, not 0.1000000000000000055...
    ("Answer: 0.30000000000000004", 0.3, 0.0),
    ("Answer: .5", "0.5", 1.0),
    ("Answer: 1,234", 1234, 1.0),  # thousands separators
    ("Answer: 1e309", "1e309", 1.0),  # exact: not a float overflowing to infinity
    ("Answer: 1e309", 1e308, 0.0),
    ("Answer: 1e3", 1000, 1.0),
    ("Answer: 1e999999999999", "1", 0.0),
    ("Answer: 1e309", "1e310", 0.0),  # equal as floats (both infinity), not as numbers
    ("Answer: 9007199254740993", 9007199254740992, 0.0),  # equal as floats (2**53 + 1 rounds to 2**53)
    ("Answer: 0.1000000000000000000001", "0.1", 0.0),
    ("Answer: 1e309", float("inf"), 0.0),  # a non-finite answer grades nothing as right
    ("Answer: nan", float("nan"), 0.0),
    ("Answer: Answer: Answer: 42", 42, 1.0),  # nested markers: after the last one
    ("Answer: 41\nWait, no.\nAnswer: 42", 42, 1.0),
    ("Answer: 42\nAnswer:", 42, 0.0),  # nothing after the last marker
    ("Answer: 42 (6 x 7)", 42, 0.0),  # the LAST number after the marker: 7
    ("Answer: 42", True, 0.0),  # a bool is not a number
    ("Answer: 42", None, 0.0),
    ("Answer: 42", [42], 0.0),
    ("x" * MB + "Answer: 42", 42, 1.0),  # megabyte strings
    ("Answer: 42" + "x" * MB, 42, 1.0),
    ("Answer: 42" + " " * MB, 42, 1.0),
    ("Answer: " + "1 " * (MB // 2) + "42", 42, 1.0),
    ("Answer: " + "7" * MB, 42, 0.0),
    ("Answer:" * (MB // 7), 42, 0.0),
    ("Answer: " + "1," * (MB // 2) + "42", 42, 1.0),
    ("Answer: " + "e" * MB + "42", 42, 1.0),
    ("Answer: 1,234" + "e" * 4092, 1234, 1.0),  # the backward scan's first window starts inside the answer
]


@pytest.mark.parametrize("case", range(len(NUMERIC_CASES)))
def test_numeric_answer_on_hostile_completions(case):
    completion, answer, expected = NUMERIC_CASES[case]
    reward = NumericAnswer()
    start = time.perf_counter()
    got = reward([completion], [{"answer": answer}])
    assert time.perf_counter() - start < STUCK
    assert got == [expected], (completion[:60], answer)


def test_numeric_answer_marker_field_and_rows():
    reward = NumericAnswer(field="solution", marker="####")
    assert reward.fields == ("solution",)
    rows = [{"solution": "18"}, {"solution": "18"}, {"other": "18"}, {"solution": "eighteen"}]
    completions = ["... so #### 18", "18", "#### 18", "#### 18"]
    assert reward(completions, rows) == [1.0, 0.0, 0.0, 0.0]
    assert NumericAnswer(marker="")(["it is 18"], [{"answer": 18}]) == [1.0]  # "": the whole completion
    assert reward([None], [{"solution": "18"}]) == [0.0]  # type: ignore[list-item]
    assert reward.check({"solution": " 18 "}) is None
    assert "no field 'solution'" in reward.check({"answer": 1})
    assert "is not one number" in reward.check({"solution": "18 apples"})


def test_last_numeral_scanning_back_equals_scanning_forward():
    """The backward window scan (linear time on megabyte completions) finds the match a forward scan finds, on
    random text made mostly of numeral characters (so windows must widen and resynchronise)."""
    rng = random.Random(0)
    for _ in range(150):
        n = rng.choice([5, 300, 5000, 20000])
        separators = rng.choice([0.1, 1e-3, 1e-4])  # how often a character no numeral contains comes
        text = "".join(rng.choice(" x") if rng.random() < separators else rng.choice("0123456789,.eE+-")
                       for _ in range(n))
        start = rng.randrange(n)
        forward = None
        for forward in _NUMERAL.finditer(text, start):
            pass
        backward = _last_numeral(text, start)
        assert (forward and (forward.span(), forward.group())) == (backward and (backward.span(), backward.group()))


@pytest.mark.parametrize("completion, expected", [
    ("<think>a\nb</think>\nAnswer: 12", 1.0),
    ("<think>a</think> Answer: 12 and more", 0.0),  # fullmatch: the whole completion
    ("preamble <think>a</think> Answer: 12", 0.0),
    ("", 0.0),
])
def test_format_regex_full_match_across_lines(completion, expected):
    reward = FormatRegex(r"<think>.*</think>\s*Answer: -?[0-9]+")
    assert reward([completion], [{}]) == [expected]
    assert reward.fields == ()


def test_format_regex_search_length_cap_and_backtracking_bomb():
    assert FormatRegex(r"Answer: [0-9]+", search=True)(["x Answer: 3 y", "x"], [{}, {}]) == [1.0, 0.0]
    assert FormatRegex(r".*")([""], [{}]) == [1.0]
    assert FormatRegex(r".*", max_chars=10)(["x" * 11, "x" * 10], [{}, {}]) == [0.0, 1.0]
    bomb = FormatRegex(r"(a+)+$")  # exponential backtracking on 'aaa...ab' for re
    for completion in ["a" * 30 + "b", "a" * 5000 + "b", "a" * 99_999 + "b", "a" * MB + "b"]:
        start = time.perf_counter()
        assert bomb([completion], [{}]) == [0.0]
        assert time.perf_counter() - start < STUCK
    assert bomb(["a" * 30], [{}]) == [1.0]
    nested = FormatRegex(r"(x+x+)+y", search=True)
    start = time.perf_counter()
    assert nested(["x" * 5000], [{}]) == [0.0]
    assert time.perf_counter() - start < STUCK


def test_format_regex_refuses_a_pattern_that_does_not_compile():
    with pytest.raises(UserError) as e:
        FormatRegex("(unclosed")
    assert e.value.key == "pattern"
    with pytest.raises(UserError) as e:
        build_rewards([{"_target_": "shardyard.objectives.rewards.NumericAnswer"},
                       {"_target_": "shardyard.objectives.rewards.FormatRegex", "pattern": "[a-"}])
    assert e.value.key == "objective.rewards[1].pattern" and e.value.value == "[a-"
    assert "objective.rewards[1].pattern" in " ".join(e.value.paragraph().split())


# --------------------------------------------------------------------------------------------------- build_rewards


def exact_length(completions, rows, target=3):
    """A user's reward: 1.0 for a completion of ``target`` characters."""
    return [float(len(c) == target) for c in completions]


exact_length.fields = ("answer",)


class Constant:
    """A user's reward class without ``weight`` or ``name`` parameters."""

    def __init__(self, value: float = 0.5):
        self.value = value

    def __call__(self, completions, rows):
        return [self.value] * len(completions)


def one_argument(completions):
    return [0.0] * len(completions)


def raises(completions, rows):
    raise KeyError("answer")


def not_finite(completions, rows):
    return [float("nan")] + [1.0] * (len(completions) - 1)


def too_few(completions, rows):
    return [1.0]


def strings(completions, rows):
    return ["1.0"] * len(completions)


def test_build_rewards_shipped_user_function_and_class():
    rewards = build_rewards([
        {"_target_": "shardyard.objectives.rewards.NumericAnswer", "weight": 2.0},
        {"_target_": "shardyard.objectives.rewards.FormatRegex", "pattern": ".*Answer: [0-9]+"},
        {"_target_": f"{__name__}.exact_length", "target": 2, "weight": 0.5},
        {"_target_": f"{__name__}.Constant", "value": 0.25, "weight": -1, "name": "penalty"},
    ])
    assert [(r.name, r.fields, r.weight) for r in rewards] == [
        ("numeric_answer", ("answer",), 2.0), ("format", (), 1.0), ("exact_length", ("answer",), 0.5),
        ("penalty", (), -1.0)]
    assert all(isinstance(r, Reward) for r in rewards)
    assert rewards[0].fn.weight == 2.0  # passed to the class that takes it
    completions, rows = ["Answer: 7", "ab"], [{"answer": "7"}, {"answer": "8"}]
    assert [r(completions, rows) for r in rewards] == [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.25, 0.25]]
    assert rewards[0].check({"answer": "x"}) and rewards[2].check({}) is None


@pytest.mark.parametrize("entries, key, says", [
    ([], "objective.rewards", "at least one"),
    (["shardyard.objectives.rewards.NumericAnswer"], "objective.rewards[0]", "mapping"),
    ([{"_target_": "shardyard.objectives.rewards.NoSuchReward"}], "objective.rewards[0]._target_", "imported"),
    ([{"_target_": "nosuchpackage.reward"}], "objective.rewards[0]._target_", "imported"),
    ([{"_target_": f"{__name__}.one_argument"}], "objective.rewards[0]", "signature"),
    ([{"_target_": f"{__name__}.exact_length", "targett": 2}], "objective.rewards[0]", "targett"),
    ([{"_target_": f"{__name__}.Constant", "values": 2}], "objective.rewards[0]", "values"),
    ([{"_target_": f"{__name__}.MB"}], "objective.rewards[0]._target_", "not a class or function"),
    ([{"_target_": "builtins.eval"}], "objective.rewards[0]", "blocklisted"),
    ([{"_target_": "shardyard.objectives.rewards.NumericAnswer", "weight": "high"}], "objective.rewards[0].weight",
     "finite number"),
    ([{"_target_": "shardyard.objectives.rewards.NumericAnswer", "weight": float("inf")}],
     "objective.rewards[0].weight", "finite number"),
    ([{"_target_": "shardyard.objectives.rewards.NumericAnswer", "field": ""}], "objective.rewards[0].field",
     "answer"),
    ([{"_target_": "shardyard.objectives.rewards.FormatRegex", "pattern": "a"},
      {"_target_": "shardyard.objectives.rewards.FormatRegex", "pattern": "b"}], "objective.rewards[1].name",
     "have this name"),
])
def test_build_rewards_refuses_naming_the_entry(entries, key, says):
    with pytest.raises(UserError) as e:
        build_rewards(entries)
    assert e.value.key == key
    assert says in " ".join(e.value.paragraph().split())


@pytest.mark.parametrize("target, says", [
    ("raises", "raised KeyError"), ("not_finite", "for completion 0: not a finite number"),
    ("too_few", "returned 1 values for 2 completions"), ("strings", "not a finite number")])
def test_a_misbehaving_user_reward_stops_the_run_naming_it(target, says):
    reward, = build_rewards([{"_target_": f"{__name__}.{target}"}])
    with pytest.raises(UserError) as e:
        reward(["a", "b"], [{}, {}])
    assert e.value.key == "objective.rewards[0]._target_" and e.value.value == f"{__name__}.{target}"
    assert says in " ".join(e.value.paragraph().split())


def test_rewards_never_execute_the_completion():
    """No eval/exec/sympy on generated text: a completion that would run code if evaluated is just text."""
    import shardyard.objectives.rewards as module

    source = inspect.getsource(module).replace("regex.compile(", "").replace("re.compile(", "")
    assert not re.search(r"\b(eval|exec|sympify|parse_expr|compile|__import__)\(", source)
    assert NumericAnswer(marker="")(["__import__('os').system('false') or 42"], [{"answer": 42}]) == [1.0]
