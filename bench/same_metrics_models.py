"""The tiny models and files bench/same_metrics.sh uses (the test suite's own tiny models):
python bench/same_metrics_models.py [/tmp/rft_tiny]"""

import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")]
from conftest import CHARS_REWARD, save_tiny_model, save_tiny_rm  # noqa: E402

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rft_tiny"
save_tiny_rm(f"{out}/rm", save_tiny_model(f"{out}/model"))
with open(f"{out}/chars.py", "w") as f:
    f.write(CHARS_REWARD)
with open(f"{out}/ptx.jsonl", "w") as f:
    f.write("\n".join(json.dumps({"text": f"The number {i} is {'even' if i % 2 == 0 else 'odd'}."})
                      for i in range(6)))
