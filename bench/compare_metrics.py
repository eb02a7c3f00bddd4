"""Compare the step and eval metrics (all but perf/) of two bench/same_metrics.sh output roots, run by run:
python bench/compare_metrics.py BEFORE AFTER [names...]"""
import json, sys, math
before, after = sys.argv[1:3]
names = sys.argv[3:] or ["text_default","vl_default","gae","cpgd","rloo_kl","variants","lora","vl_gae",
                         "vl_kl"]
for n in names:
    try:
        a = [json.loads(l) for l in open(f"{before}/{n}/metrics.jsonl")]
        b = [json.loads(l) for l in open(f"{after}/{n}/metrics.jsonl")]
    except FileNotFoundError as e:
        print(n, "missing", e); continue
    diffs = []
    if len(a) != len(b): diffs.append(f"rows {len(a)} vs {len(b)}")
    for ra, rb in zip(a, b):
        for k in ra:
            if k.startswith("perf/"): continue
            if k not in rb: diffs.append(f"step {ra['step']} {k} missing after"); continue
            if ra[k] != rb[k] and not (isinstance(ra[k], float) and math.isnan(ra[k]) and math.isnan(rb[k])):
                diffs.append(f"step {ra['step']} {k}: {ra[k]} -> {rb[k]}")
        for k in rb:
            if k not in ra and not k.startswith("perf/"): diffs.append(f"step {rb['step']} new {k}")
    print(n, "IDENTICAL" if not diffs else f"{len(diffs)} diffs")
    for d in diffs[:12]: print("   ", d)
