"""The built-in multi-turn task: multiplications too large to do in one's head (3 digits x 2 digits), and a
calculator environment that answers `<calc>expression</calc>`.

    python train_ppo.py --prompt_data multiply                    # the model alone
    python train_ppo.py --prompt_data multiply --env calculator   # the model with the calculator
    python train_ppo.py --prompt_data multiply --env calculator_react --stop "</calc>"   # ReAct, inline

The data's prompts ask for the answer directly; `reset` swaps in the tool's instructions and worked examples.
`step` answers a call with its result (a "tool" message); a turn without one ends the episode, scored by
`answer`. ReactCalculator: the ReAct style, call, result and answer inline in one message."""

import ast
import operator
import random
import re

from rft_core.tasks.arithmetic import few_shot_row

CALCULATOR_SYSTEM = ("You have a calculator. To use it, write <calc>expression</calc> and stop; the result "
                     "comes back. Then give the final answer in <answer></answer> tags.")
REACT_SYSTEM = ("You have a calculator. To use it, write <calc>expression</calc>; its result follows it. "
                "Then give the final answer in <answer></answer> tags.")
SHOTS = ((123, 45), (208, 37))
DIRECT_SHOTS = tuple((f"{x} * {y}", x * y) for x, y in SHOTS)  # the data's worked examples
QUESTION = re.compile(r"What is (\d+) \* (\d+)\?")
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)


def multiply_task(num_train=4096, num_eval=96, seed=0):
    """Seeded rows of a x b, a in [100, 999], b in [10, 99]; eval's are fixed (any seed), never in train."""
    eval_rng = random.Random(4321)
    held = set()
    while len(held) < num_eval:
        problem = (eval_rng.randint(100, 999), eval_rng.randint(10, 99))
        held.update([problem] if problem not in SHOTS else [])
    rng, train = random.Random(seed), []
    while len(train) < num_train:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        if (a, b) not in held and (a, b) not in SHOTS:
            train.append(few_shot_row(f"{a} * {b}", a * b, DIRECT_SHOTS))
    return train, [few_shot_row(f"{a} * {b}", a * b, DIRECT_SHOTS) for a, b in sorted(held)]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


def calculate(expression):
    """The value of an arithmetic expression (numbers, + - * / // %, parentheses); ValueError otherwise."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / // % and parentheses")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None
    return int(result) if float(result).is_integer() else round(result, 6)


def opening(sample, system, shot):
    """A multiply_task prompt's tool-use opening: system, SHOTS' questions and shot(x, y), the question."""
    prompt = sample["prompt"]
    question = QUESTION.search(prompt[-1]["content"] if isinstance(prompt, list) else prompt)
    if question is None:
        raise ValueError("this environment takes the multiply task's prompts ('What is A * B?'): "
                         "--prompt_data multiply")
    messages = [{"role": "system", "content": system}]
    for x, y in SHOTS:
        messages += [{"role": "user", "content": f"What is {x} * {y}?"}, *shot(x, y)]
    return messages + [{"role": "user", "content": "What is {} * {}?".format(*question.groups())}]


class Calculator:
    """The environment: reset gives the tool-use opening; step answers a <calc> call or ends the episode."""
    inline = False  # ReAct: the result appended to the turn, which goes on

    def reset(self, sample):
        return opening(sample, CALCULATOR_SYSTEM, lambda x, y: [
            {"role": "assistant", "content": f"<calc>{x} * {y}</calc>"},
            {"role": "tool", "content": str(x * y)},
            {"role": "assistant", "content": f"{x} * {y} = {x * y}\n<answer>{x * y}</answer>"}])

    def step(self, state, text):
        calls = CALL.findall(text) if not self.inline or text.rstrip().endswith("</calc>") else []
        if not calls:  # the answer: the reward scores this turn
            return None, True, 0.0, {"calls": state.data.get("calls", 0)}
        state.data["calls"] = state.data.get("calls", 0) + 1
        try:
            result = str(calculate(calls[-1]))
        except ValueError as e:
            result = f"error: {e}"
        return (f" = {result}\n" if self.inline else {"role": "tool", "content": result}), False


class ReactCalculator(Calculator):
    """--env calculator_react: a turn stops at `</calc>`; step appends " = result" and the turn goes on."""
    stop, inline = ["</calc>"], True

    def reset(self, sample):
        return opening(sample, REACT_SYSTEM, lambda x, y: [
            {"role": "assistant", "content": f"<calc>{x} * {y}</calc> = {x * y}\n<answer>{x * y}</answer>"}])
