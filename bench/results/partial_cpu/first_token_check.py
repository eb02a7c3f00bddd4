"""Sampling check: the HF engine's first sampled token after a fixed prefix (prompt + 32 generated tokens),
left-padded in a batch with longer rows, against softmax(logits) of one plain forward. Many draws."""
import json, sys, collections, torch
sys.path.insert(0, "/work/main")
from rft_core.models import load_model_and_tokenizer
from rft_core.engine import HFEngine
from rft_core.data import encode_rows

torch.manual_seed(1)
model, tok = load_model_and_tokenizer("/tmp/pcpu/runs/warm-6/model")
model.eval()
rows = [json.loads(l) for l in open("/tmp/pcpu/count.jsonl")][:8]
samples, _ = encode_rows(tok, rows, 256)
eng = HFEngine(model, tok, micro_batch_size=512)
eos = tok.eos_token_id
# prefixes: prompt + 32 greedy-ish sampled tokens without EOS
prefixes = []
for s in samples:
    while True:
        g = eng.generate([s.prompt_ids], 32)[0]
        if len(g.token_ids) == 32 and eos not in g.token_ids:
            prefixes.append(s.prompt_ids + g.token_ids)
            break
long = samples[0].prompt_ids + list(range(100, 180))
for k, p in enumerate(prefixes[:4]):
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([p])).logits[0, -1].float(), -1)
    n = 1500
    for pad in (False, True):
        batch = [p] * n + ([long] * 64 if pad else [])
        outs = eng.generate(batch, 1)[:n]
        c = collections.Counter(o.token_ids[0] for o in outs)
        top = probs.topk(5)
        exp = {int(t): float(q) for q, t in zip(top.values, top.indices)}
        got = {t: c[t] / n for t in exp}
        pe = float(probs[eos])
        print(k, "padded" if pad else "alone ", "eos p %.3f got %.3f |" % (pe, c[eos] / n),
              " ".join("%d:%.3f/%.3f" % (t, exp[t], got[t]) for t in exp), flush=True)
