"""Create an offline Hugging Face cache entry for facebook/opt-125m: its config and a tiny
tokenizer, no weights. vLLM's scheduler and connector helpers (create_vllm_config) only build a
ModelConfig and a tokenizer object; they never load weights, so the tests run offline.

Usage: python vllm_fake_opt.py HF_HOME
"""
import json
import os
import sys

from tokenizers import Tokenizer, models, pre_tokenizers

hf_home = sys.argv[1]
repo = "facebook/opt-125m"
sha = "0" * 39 + "1"
base = os.path.join(hf_home, "hub", "models--" + repo.replace("/", "--"))
snap = os.path.join(base, "snapshots", sha)
os.makedirs(snap, exist_ok=True)
os.makedirs(os.path.join(base, "refs"), exist_ok=True)
with open(os.path.join(base, "refs", "main"), "w") as f:
    f.write(sha)


def dump(name, obj):
    with open(os.path.join(snap, name), "w") as f:
        json.dump(obj, f, indent=2)


dump("config.json", {
    "_name_or_path": repo, "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
    "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12,
    "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "use_cache": True,
    "vocab_size": 50272, "word_embed_proj_dim": 768,
})
dump("generation_config.json", {"bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1})
vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
for i, w in enumerate("hello world the a of and to in".split()):
    vocab[w] = 4 + i
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.save(os.path.join(snap, "tokenizer.json"))
dump("tokenizer_config.json", {
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "</s>", "eos_token": "</s>",
    "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 2048,
})
dump("special_tokens_map.json", {
    "bos_token": "</s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
})
print("offline", repo, "at", snap)
