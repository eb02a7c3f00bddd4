"""The bookkeeping of a step, kept out of the algorithm's lines: phase timing and peak memory, metric
means and the gather over ranks, the rollout's summary, the metrics log and the console line."""

import json
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from rft_core.errors import ConfigError
from rft_core.runs import run_dir
from rft_core.runs.integrity import append, read_rows, write_error, write_whole
from rft_core.runs.plots import write_plots


class StepTimer:
    """Phase times and GPU peaks: `phase(name)` starts one; `metrics()` returns perf/<name>_s, step_time_s,
    mem_<name>_gb (peak), mem_<name>_extra_gb (peak above the phase's start), once startup_s."""

    def __init__(self):
        import psutil

        self.process_start = psutil.Process().create_time()
        self.cuda = torch.cuda.is_available()
        # phase -> bytes its last peak rose above its start: what its next run needs free
        self.extra = {}
        self.name, self.step_start, self.values = None, None, {}

    def phase(self, name):
        now = time.time()
        if self.name is not None:
            self.values[f"perf/{self.name}_s"] = now - self.started
            if self.cuda:
                peak = torch.cuda.max_memory_allocated()
                self.extra[self.name] = peak - self.allocated
                self.values[f"perf/mem_{self.name}_gb"] = peak / 2**30
                self.values[f"perf/mem_{self.name}_extra_gb"] = self.extra[self.name] / 2**30
        self.step_start = self.step_start or now
        self.name, self.started = name, now
        if self.cuda and name is not None:
            self.allocated = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def metrics(self):
        self.phase(None)
        values = {**self.values, "perf/step_time_s": time.time() - self.step_start}
        if self.process_start is not None:
            values["perf/startup_s"] = self.step_start - self.process_start
            self.process_start = None
        self.step_start, self.values = None, {}  # (phase(None) ended the last phase)
        return values


class Means:
    """Running means of metric dicts; a (total, weight) pair is weighted, a _max name the largest value.
    Values may be 0-d device tensors, read once in `result()` (an .item() per micro-batch stalls the GPU)."""

    def __init__(self):
        self.sums, self.counts = {}, {}

    def add(self, metrics):
        for key, value in metrics.items():
            total, weight = value if isinstance(value, tuple) else (value, 1)
            if key.endswith("_max"):
                total = torch.as_tensor(total, dtype=torch.float32)
                total = torch.where(torch.as_tensor(weight, device=total.device) > 0, total, -torch.inf)
                self.sums[key] = torch.maximum(self.sums[key], total) if key in self.sums else total
            else:
                self.sums[key] = self.sums.get(key, 0.0) + total
            self.counts[key] = self.counts.get(key, 0) + weight

    def result(self):
        return {key: float(total if key.endswith("_max") else total / self.counts[key])
                for key, total in self.sums.items() if float(self.counts[key]) > 0}


def update_metrics(means):
    """The update's means: the engine-vs-trainer logprob gaps under rollout/, the rest under train/."""
    return {("rollout/" if key.startswith("logprob") else "train/") + key: v
            for key, v in means.result().items()}


def rollout_metrics(samples, generate_max_len, shaped_rewards=None, reward_clip=None):
    """rollout/ metrics of this rank's samples (shaped_rewards: (B,)). Lengths count the policy's tokens, not
    an environment's; an episode is truncated when a turn reached its token limit."""
    rewards = torch.tensor([s.reward for s in samples])  # as scored, before normalisation and clipping
    generations = [s.generation for s in samples]  # (a multi-turn one's mask: the policy's tokens)
    lengths = torch.tensor([float(len(g.token_ids) if g.mask is None else sum(g.mask)) for g in generations])
    if samples and samples[0].episode is not None:
        truncated = sum(s.episode.cut == "tokens" for s in samples)
    else:
        truncated = float((lengths >= generate_max_len).sum())
    metrics = {"rollout/reward_mean": rewards.mean().item(),
               "rollout/reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
               "rollout/response_length": lengths.mean().item(),
               "rollout/response_length_max": lengths.max().item(),
               "rollout/truncated": truncated / len(samples)}
    for name in dict.fromkeys(name for s in samples for name in s.components):
        values = [s.components.get(name, float("nan")) for s in samples]
        metrics[f"rollout/reward/{name}"] = float(np.nanmean(values))
    if shaped_rewards is not None:
        metrics["rollout/shaped_reward_mean"] = shaped_rewards.mean().item()
    if reward_clip is not None:
        metrics["rollout/reward_clip_frac"] = (shaped_rewards.abs() >= reward_clip).float().mean().item()
    return metrics


SUMMED = ("reward_errors", "filled_groups", "tokens", "buffered", "resumed", "finished_from_buffer",
          "dropped_stale", "tokens_generated", "env_calls", "env_errors", "env_tokens", "env_truncated",
          "cut_turns", "cut_tokens")


def gather_metrics(local):
    """Every rank's metrics merged: SUMMED summed, maxima maxed, others the nanmean of ranks holding them."""
    from accelerate.utils import gather_object

    per_rank = gather_object([local])  # dicts, so ranks may differ in keys (reward components)
    merged = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        values = [m[key] for m in per_rank if key in m]
        name = key.split("/", 1)[-1]
        merged[key] = (sum(values) if name in SUMMED else max(values) if name.endswith("_max")
                       else float(np.nanmean(values)))
    return merged


STEP_LINE = [("reward", "rollout/reward_mean"), ("±", "rollout/reward_std"),
             ("acc", "rollout/reward/correct"), ("errors", "rollout/reward_errors"),
             ("len", "rollout/response_length"), ("turns", "rollout/turns_mean"),
             ("env_err", "rollout/env_errors"),
             ("pg_loss", "train/policy_loss"), ("kl", "train/kl"), ("ppo_kl", "train/ppo_kl"),
             ("clip", "train/clip_frac"), ("ent", "train/entropy"), ("gnorm", "train/grad_norm"),
             ("vloss", "train/value_loss"), ("lp_diff", "rollout/logprob_diff_mean"),
             ("buffered", "rollout/buffered"), ("stale", "rollout/staleness_max"),
             ("is_w", "train/is_weight_mean"),
             ("t_gen", "perf/generate_s"), ("t_lp", "perf/logprob_s"), ("t_upd", "perf/update_s"),
             ("t_sync", "perf/weight_sync_s"), ("t_step", "perf/step_time_s")]


class MetricsLog:
    """The run's record: config.json, metrics.jsonl (and the trackers), samples.jsonl, the console line."""

    def __init__(self, output_dir, config=None, accelerator=None, trackers=False, keep_until=None,
                 samples_every=0, max_len=None):
        """Takes output_dir's lock (rft_core/runs/run_dir.py); a new run (keep_until None) over a previous one
        is refused unless config["no_resume"], a resumed one keeps the rows up to keep_until. Trackers start
        first (scalars only: TensorBoard's hparams refuse more); only the main process writes."""
        self.enabled = accelerator is None or accelerator.is_main_process
        self.said = set()  # the notices given (each once): "idle", "cut"
        self.accelerator = accelerator  # with trackers (wandb, TensorBoard): rows go to them too
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_every, self.max_len = samples_every, max_len
        config = run_dir.redact(config)  # (a token in --remote_rm_url)
        run_dir.on_main(accelerator, lambda: run_dir.take_lock(output_dir, tqdm.write))
        try:
            if trackers:  # first: a tracker that cannot start leaves output_dir as it was
                sys.argv = run_dir.redact(sys.argv)  # wandb records the command line with the run
                plain = (int, float, str, bool)
                scalars = {k: v if isinstance(v, plain) else str(v) for k, v in (config or {}).items()}
                try:
                    accelerator.init_trackers(os.environ.get("WANDB_PROJECT", "rft"), config=scalars)
                except Exception as e:  # wandb without a login, offline...: one line
                    raise ConfigError(f"the trackers could not start ({type(e).__name__}: {str(e)[:200]}): "
                                      "for wandb run `wandb login` or set WANDB_MODE=offline; or drop "
                                      "--report_to") from e
                run_dir.redact_output()
            run_dir.on_main(accelerator, lambda: self._start(output_dir, config, keep_until))
        except BaseException:
            if self.enabled:
                run_dir.release_lock(output_dir)
            raise

    def _start(self, output_dir, config, keep_until):
        config_path = os.path.join(output_dir, "config.json")
        samples_path = os.path.join(output_dir, "samples.jsonl")
        rows, lines = read_rows(self.path, tqdm.write if keep_until is not None else None)
        files = {self.path: []}  # what each record file starts with (lines)
        if keep_until is None:
            found = run_dir.previous_run(output_dir, rows)
            if found and not (config or {}).get("no_resume"):
                run_dir.refuse_overwrite(output_dir, found)
            if found:
                run_dir.move_previous(output_dir, found, tqdm.write)
        else:  # the rows logged after the checkpoint by the run that died are logged again: dropped
            files[self.path] = [line for row, line in zip(rows, lines) if row["step"] <= keep_until]
            if os.path.exists(samples_path):
                files[samples_path] = [line for row, line in zip(*read_rows(samples_path))
                                       if row["step"] <= keep_until]
            if config is not None:
                config = run_dir.with_segments(config_path, config, keep_until, tqdm.write)
        try:
            if config is not None:
                write_whole(config_path, json.dumps(config, indent=2), mode=0o600)
            for path, kept in files.items():
                write_whole(path, b"".join(kept))  # (a kill leaves the old rows or the kept ones)
        except OSError as e:
            said = write_error(e, output_dir)
            raise ConfigError(f"{said}: the run's record (config.json, metrics.jsonl) could not be written; "
                              "free space there or use another --output_dir") from e

    def write(self, step, metrics, print_line=False):
        """Append a row (print_line: and print its step line). The first step whose actor gradient is 0, and
        the first whose responses were all cut at the length limit, are said, with their likely causes."""
        if self.enabled:
            append(self.path, json.dumps({"step": step, **metrics}) + "\n", f"the row of step {step}")
            if print_line:
                tqdm.write(self.line(step, metrics))
            if metrics.get("train/grad_norm") == 0 and "idle" not in self.said:
                self.said.add("idle")
                tqdm.write(f"[signal] step {step} trained nothing: the actor's gradient is 0, so every "
                           "advantage was 0 (each group's rewards equal: all solved, all failed, or a reward "
                           "that does not vary with the answer); said once, train/grad_norm shows the others")
            if metrics.get("rollout/truncated") == 1 and "cut" not in self.said:
                self.said.add("cut")
                tqdm.write(f"[signal] step {step}: every response was cut at --generate_max_len "
                           f"{self.max_len} before it ended, so the rewards judged unfinished answers: raise "
                           "the limit if the task needs longer ones; said once, rollout/truncated shows the "
                           "others")
        if self.accelerator is not None and self.accelerator.trackers:
            self.accelerator.log(metrics, step=step)

    def finished(self, step):
        """The exports are whole: FINISHED names the last step (a rerun stops: checkpoint.finished_run)."""
        if self.enabled:
            path = os.path.join(os.path.dirname(self.path), run_dir.FINISHED)
            write_whole(path, json.dumps({"step": step}))

    def samples_and_plots(self, step, samples, tokenizer, lengths, last=False):
        """Every samples_every steps: 4 samples to samples.jsonl (2 printed; a wandb table with wandb) and
        the plots (also at the last step; lengths: this step's response lengths)."""
        if self.enabled and self.samples_every and step % self.samples_every == 0 and samples:
            rows = [{"prompt": tokenizer.decode(s.prompt_ids), "completion": s.completion, "label": s.label,
                     "reward": s.reward, **({} if s.episode is None else dict(
                         turns=s.episode.turns, cut=s.episode.cut, env_failure=s.episode.failure))}
                    for s in samples[:4]]
            path = os.path.join(os.path.dirname(self.path), "samples.jsonl")
            text = "".join(json.dumps({"step": step, **x}) + "\n" for x in rows)
            append(path, text, f"the samples of step {step}")
            for x in rows[:2]:
                tqdm.write(f"[sample] reward {x['reward']:.3g} | label {x['label']!r} | "
                           f"{x['completion'][:200]!r}")
            if self.accelerator is not None and any(t.name == "wandb" for t in self.accelerator.trackers):
                self.accelerator.get_tracker("wandb").log_table("samples", columns=["step", *rows[0]],
                                                                data=[[step, *x.values()] for x in rows],
                                                                step=step)
        if self.samples_every and (step % self.samples_every == 0 or last):
            self.plots(lengths)

    def plots(self, lengths):
        if self.enabled and self.samples_every:
            write_plots(os.path.dirname(self.path), lengths, self.max_len)

    @staticmethod
    def line(step, metrics, keys=STEP_LINE):
        """`step 3 | reward 0.512 | ...` for the (label, key) pairs (default STEP_LINE) present in metrics."""
        parts = [f"step {step}"] + [f"{label} {metrics[key]:.4g}" for label, key in keys if key in metrics]
        return " | ".join(parts)
