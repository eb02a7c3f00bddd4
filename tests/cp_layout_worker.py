"""Run by tests/test_sequence_parallel.py under torchrun (2 CPU ranks, gloo): the layout of context
parallelism with torch's own `context_parallel` on a "cp" device mesh (what accelerator.maybe_context_parallel
calls under FSDP2), which shards buffers on CPU too (its ring attention does not: CUDA only). Writes
OUT_DIR/rank<r>.json: the columns the context gives this rank for the test batch, the response tokens they
own, and their targets.

    torchrun --nproc_per_node 2 tests/cp_layout_worker.py OUT_DIR
"""

import functools
import json
import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_sequence_parallel import batch  # noqa: E402

from rft_core.sequence_parallel import SequenceParallel  # noqa: E402

torch.distributed.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
sp = SequenceParallel(2, mesh.get_local_rank(), functools.partial(context_parallel, mesh), mesh.get_group())
exp = batch()
part = sp.layout(exp)
out = {"rank": sp.rank, "width": sp.width(exp), "columns": sp.columns(sp.width(exp), "cpu").tolist(),
       "owned": part.owned.long().tolist(), "targets": part.targets.tolist(),
       "positions": part.inputs["position_ids"].tolist(), "where": part.where.tolist()}
with open(os.path.join(sys.argv[1], f"rank{sp.rank}.json"), "w") as f:
    json.dump(out, f)
torch.distributed.destroy_process_group()
