import pytest

from rft_core.rewards import answer_reward, parse_answer


@pytest.mark.parametrize("completion, answer, well_formed", [
    ("12 + 3 = 15\n<answer>15</answer>", "15", True),
    ("<answer> 15 </answer>\n", "15", True),
    ("<answer>15</answer> and more text", "15", False),  # trailing text
    ("<answer>1</answer><answer>15</answer>", "15", False),  # extra tags: last one counts
    ("<answer>15</answr>", None, False),  # malformed closing tag
    ("<answer>15", None, False),  # missing closing tag
    ("15", None, False),  # no tags at all
    ("", None, False),
    ("<answer><answer>15</answer>", "<answer>15", False),  # stray opening tag
    ("<answer>\n-7\n</answer>", "-7", True),
])
def test_parse_answer(completion, answer, well_formed):
    assert parse_answer(completion) == (answer, well_formed)


def test_answer_reward():
    completions = ["<answer>15</answer>", "<answer>14</answer>", "15", "<answer>15</answer> trailing"]
    rewards, parts = answer_reward(completions, ["15", "15", "15", 15])
    assert rewards == pytest.approx([1.1, 0.1, 0.0, 1.0])
    assert parts["correct"] == [1.0, 0.0, 0.0, 1.0]
    assert parts["format"] == [1.0, 1.0, 0.0, 0.0]


def test_exact_match_is_exact():
    rewards, _ = answer_reward(["<answer>015</answer>", "<answer>15.0</answer>"], ["15", "15"])
    assert rewards == pytest.approx([0.1, 0.1])


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 completions but 1 labels"):
        answer_reward(["a", "b"], ["1"])
