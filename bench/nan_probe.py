"""Run a training script (or a wrapper of one, e.g. bench/scripted_lengths.py) with autograd's anomaly mode:
the first backward op whose output is not finite raises, with the traceback of the forward op behind it.

    python bench/nan_probe.py bench/scripted_lengths.py train_ppo.py --torch_compile false ...
"""

import runpy
import sys

import torch

if __name__ == "__main__":
    torch.autograd.set_detect_anomaly(True, check_nan=True)
    path, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(path, run_name="__main__")
