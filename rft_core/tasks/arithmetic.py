"""The arithmetic task, train_ppo.py's default: 2-digit +/- 1-digit and 1-digit x 1-digit problems with two
worked examples in the prompt, the answer inside <answer></answer> tags."""

import random

# SmolLM2-135M never emits <answer> tags unprompted (0 of 2,560 samples) but copies two worked examples; the
# worked form "a + b = c" lets it use the arithmetic it knows before committing to the tagged answer.
ARITHMETIC_SYSTEM = ("Solve the arithmetic problem. Write the equation, then the final answer in "
                     "<answer></answer> tags.")
ARITHMETIC_SHOTS = (("2 + 3", 5), ("4 * 2", 8))


def few_shot_row(question, answer, shots=ARITHMETIC_SHOTS):
    """A prompt row "What is {question}?" after the (question, answer) `shots` (the multiply task's too)."""
    messages = [{"role": "system", "content": ARITHMETIC_SYSTEM}]
    for q, a in shots:
        messages += [{"role": "user", "content": f"What is {q}?"},
                     {"role": "assistant", "content": f"{q} = {a}\n<answer>{a}</answer>"}]
    messages.append({"role": "user", "content": f"What is {question}?"})
    return {"prompt": messages, "label": str(answer)}


def arithmetic_task(num_train=4096, num_eval=96, seed=0):
    """Seeded train/eval rows; eval problems (fixed, family-balanced) never appear in train."""
    pools = {  # all problems, by family (784 in all)
        "+": [(a, b, a + b) for a in range(10, 50) for b in range(1, 10)],
        "-": [(a, b, a - b) for a in range(10, 50) for b in range(1, 10)],
        "*": [(a, b, a * b) for a in range(2, 10) for b in range(2, 10)],
    }
    eval_rng = random.Random(1234)  # the eval split is the same whatever --seed is
    eval_rows, train_pools = [], {}
    for op, problems in pools.items():
        problems = [(a, b, c) for a, b, c in problems if f"{a} {op} {b}" not in dict(ARITHMETIC_SHOTS)]
        held = set(eval_rng.sample(range(len(problems)), num_eval // len(pools)))
        eval_rows += [few_shot_row(f"{a} {op} {b}", c) for i, (a, b, c) in enumerate(problems) if i in held]
        train_pools[op] = [p for i, p in enumerate(problems) if i not in held]
    rng = random.Random(seed)
    train_rows = []
    for _ in range(num_train):  # families equally likely, so easy and hard problems mix in a batch
        op = rng.choice(sorted(train_pools))
        a, b, c = rng.choice(train_pools[op])
        train_rows.append(few_shot_row(f"{a} {op} {b}", c))
    return train_rows, eval_rows
