"""The tiny models and files bench/same_metrics.sh uses: python bench/same_metrics_models.py [/tmp/rft_tiny]"""
import os, sys, torch
out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rft_tiny"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from rft_core.models import embedded_model_path
gguf = embedded_model_path()
tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
torch.manual_seed(0)
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
LlamaForCausalLM(config).save_pretrained(f"{out}/model"); tokenizer.save_pretrained(f"{out}/model")
torch.manual_seed(1)
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
LlamaForSequenceClassification(config).save_pretrained(f"{out}/rm"); tokenizer.save_pretrained(f"{out}/rm")
open(f"{out}/chars.py","w").write("def chars(p, completions, l, **kw):\n    return [len(c) / 10 for c in completions]\n")
import json
open(f"{out}/ptx.jsonl","w").write("\n".join(json.dumps({"text": f"The number {i} is {'even' if i % 2 == 0 else 'odd'}."}) for i in range(6)))
