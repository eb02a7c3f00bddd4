"""Does generating in pieces (HF engine, continued from prompt + tokens so far) sample the same distribution
as one uninterrupted generation? Same weights, sampling at T=1."""
import json, sys, statistics, torch
sys.path.insert(0, "/work/main")
from rft_core.models import load_model_and_tokenizer
from rft_core.engine import HFEngine
from rft_core.data import encode_rows

torch.manual_seed(0)
model, tok = load_model_and_tokenizer("/tmp/pcpu/runs/warm-6/model")
model.eval()
rows = [json.loads(l) for l in open("/tmp/pcpu/count.jsonl")][:48]
samples, _ = encode_rows(tok, rows, 256)
prompts = [s.prompt_ids for s in samples for _ in range(4)]
eng = HFEngine(model, tok, micro_batch_size=64)
L, B, eos = 128, int(sys.argv[1]) if len(sys.argv) > 1 else 32, tok.eos_token_id

def whole():
    return [(g.token_ids, g.logprobs) for g in eng.generate(prompts, L)]

def pieces():
    toks = [[] for _ in prompts]; lps = [[] for _ in prompts]; done = [False] * len(prompts)
    while not all(done):
        idx = [i for i in range(len(prompts)) if not done[i]]
        limits = [min(B, L - len(toks[i])) for i in idx]
        outs = eng.generate([prompts[i] + toks[i] for i in idx], limits)
        for i, lim, g in zip(idx, limits, outs):
            toks[i] += g.token_ids; lps[i] += g.logprobs
            done[i] = (g.token_ids and g.token_ids[-1] == eos) or len(g.token_ids) < lim or len(toks[i]) >= L
    return list(zip(toks, lps))

@torch.no_grad()
def trainer_lp(p, t):
    ids = torch.tensor([p + t])
    logits = model(ids).logits[0, len(p) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(t)[:, None])[:, 0].tolist()

for name, fn in (("whole", whole), ("pieces", pieces)):
    out = fn()
    lens = [len(t) for t, _ in out]
    eos_end = [bool(t) and t[-1] == eos for t, _ in out]
    diffs = []
    for p, (t, lp) in list(zip(prompts, out))[::8]:
        if t:
            tl = trainer_lp(p, t)
            diffs += [abs(a - b) for a, b in zip(lp, tl)]
    texts = tok.batch_decode([t for t, _ in out[:3]], skip_special_tokens=True)
    print(name, "mean len %.1f  eos %.3f  at L %.3f  |engine-trainer| mean %.4f max %.3f" % (
        statistics.mean(lens), statistics.mean(eos_end), statistics.mean(l >= L for l in lens),
        statistics.mean(diffs), max(diffs)), flush=True)
    print("  ", [x[:60] for x in texts])
