"""Rule-based rewards: answers inside <answer>...</answer>, exact match plus a small format term."""

import re

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_answer(completion):
    """Return (answer, well_formed) for a completion.

    answer: the stripped text of the last complete <answer>...</answer> pair, or None.
    well_formed: exactly one pair, no stray tag, and nothing but whitespace after it.
    """
    matches = list(ANSWER_RE.finditer(completion))
    if not matches:
        return None, False
    last = matches[-1]
    stray = completion.count("<answer>") + completion.count("</answer>") != 2
    well_formed = len(matches) == 1 and not stray and not completion[last.end():].strip()
    return last.group(1).strip(), well_formed


def answer_reward(completions, labels, format_weight=0.1):
    """Exact-match correctness (1.0) plus `format_weight` for a well-formed answer tag.

    Returns (rewards, metrics): rewards a list of floats, metrics per-sample lists of
    `correct` and `format` (0/1) for logging.
    """
    if len(completions) != len(labels):
        raise ValueError(f"{len(completions)} completions but {len(labels)} labels")
    rewards, correct, formatted = [], [], []
    for completion, label in zip(completions, labels):
        answer, well_formed = parse_answer(completion)
        is_correct = answer is not None and answer == str(label).strip()
        rewards.append(float(is_correct) + format_weight * float(well_formed))
        correct.append(float(is_correct))
        formatted.append(float(well_formed))
    return rewards, {"correct": correct, "format": formatted}
