"""How a script's process ends: `run_main` turns a user's error into one line and a status, `StopSignals`
stops the start-up at once and the loop at a step's end, `stop_error` says where that left the run."""

import faulthandler
import os
import signal
import sys

import torch

from rft_core.errors import CheckpointError, Stopped, UserError
from rft_core.runs.checkpoint import latest_checkpoint
from rft_core.runs.run_dir import redact_output


def run_main(main):
    """The scripts' entry point: a UserError or CUDA OOM ends with one line and status 2, a signal with 130 /
    143 (RFT_DEBUG=1: the traceback); anything else is a bug and keeps its traceback."""
    redact_output()
    try:
        main()
    except (UserError, KeyboardInterrupt, torch.OutOfMemoryError) as e:  # (StopNow: a KeyboardInterrupt)
        if os.environ.get("RFT_DEBUG", "0") not in ("", "0"):
            raise
        if isinstance(e, (UserError, StopNow)):
            said = f"{'stopped' if isinstance(e, (Stopped, StopNow)) else 'error'}: {e}"
        elif isinstance(e, KeyboardInterrupt):  # before main's handlers were installed
            said = ("interrupted: checkpoints are written atomically: rerun the same command to resume from "
                    "the last complete one, if there is one")
        else:  # out of memory, how much it tried, how much was free
            said = (f"error: {'. '.join(str(e).split('. ')[:3])}: make room with --optimizer_offload, a "
                    "smaller --max_tokens_per_micro_batch or --engine_mem_util, --gradient_checkpointing or "
                    "--lora_rank, or shard further (fsdp2.yaml, an *_offload.yaml config, more GPUs); "
                    "checkpoints are written atomically, so the last complete one is intact (RFT_DEBUG=1 "
                    "shows the traceback)")
        print(said, file=sys.stderr, flush=True)
        sys.exit(getattr(e, "exit_code", 130 if isinstance(e, KeyboardInterrupt) else 2))


class StopNow(KeyboardInterrupt):
    """A stop at once (start-up, Ctrl-C twice): a KeyboardInterrupt, so no `except Exception` reports it."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    """SIGINT and SIGTERM stop the start-up at once (at_once), then the loop after the step and its checkpoint
    (after SIGTERM, always); a second SIGINT stops at once. Every rank calls `requested` at the same point, to
    stop together. SIGUSR1 prints every thread's stack (where a stuck run waits)."""

    def __init__(self, args, at_once=False):
        self.args, self.at_once = args, at_once
        self.received = 0  # 1: SIGINT, 100: SIGTERM (summed over ranks, SIGTERM wins)
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.at_once or signum == signal.SIGINT and self.received:
            when = "during start-up, before any step ran" if self.at_once else "twice: stopped inside a step"
            where = _resumes_from(self.args, 0 if self.at_once else None)
            raise StopNow(f"{name} {when}; {where}", 130 if name == "SIGINT" else 143)
        self.received = 100 if signum == signal.SIGTERM else 1
        print(f"[stop] {name}: stopping after this step (Ctrl-C again: at once)", file=sys.stderr, flush=True)

    def requested(self, reduce_sum=None, device="cpu"):
        total = self.received
        if reduce_sum is not None:
            total = int(reduce_sum(torch.tensor(float(total), device=device)).item())
        return None if not total else "SIGTERM" if total >= 100 else "SIGINT"


def stop_error(signal_name, step, args):
    """The Stopped error of a run ended by signal_name after `step`, naming the newest intact checkpoint."""
    where = _resumes_from(args, step)
    return Stopped(f"{signal_name} after step {step}: {where}", 130 if signal_name == "SIGINT" else 143)


def _resumes_from(args, step):
    """Where a rerun starts: the newest intact checkpoint, or afresh and why (step: the last done or None)."""
    try:
        checkpoint = latest_checkpoint(args.output_dir)
    except (CheckpointError, OSError, ValueError):  # none intact, or unreadable: said at the next start
        checkpoint = None
    if checkpoint:
        how = "without --no_resume" if args.no_resume else "the same command"
        return f"{os.path.basename(checkpoint)} is intact; rerun {how} to resume from it"
    if not args.save_steps:
        why = "--save_steps 0"
    elif step is not None and step < args.save_steps:
        why = f"--save_steps {args.save_steps}: the first comes after step {args.save_steps}"
    else:
        why = f"none complete in {args.output_dir}"
    return f"no checkpoint ({why}): a rerun starts afresh"
