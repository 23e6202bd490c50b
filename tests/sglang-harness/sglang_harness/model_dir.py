"""The tiny model directory the workers (and smg's --model-path) load: a LlamaConfig small
enough to size a KV pool from, and a HuggingFace tokenizer with one token per
whitespace-separated word (WordLevel over a WhitespaceSplit pre-tokenizer; every word is
`[UNK]` except "word", which is what the played model generates)."""

import json
from pathlib import Path

# Kept small: the KV pool is CPU memory registered with Mooncake (2 layers x K,V).
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 16
HIDDEN = NUM_KV_HEADS * HEAD_DIM

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": HIDDEN,
    "num_attention_heads": NUM_KV_HEADS,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "num_hidden_layers": NUM_LAYERS,
    "intermediate_size": 2 * HIDDEN,
    "vocab_size": 2,
    "max_position_embeddings": 1 << 16,
    "torch_dtype": "bfloat16",
    "bos_token_id": None,
    "eos_token_id": None,
}

TOKENIZER = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [
        {
            "id": 0,
            "content": "[UNK]",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    ],
    "normalizer": None,
    "pre_tokenizer": {"type": "WhitespaceSplit"},
    "post_processor": None,
    "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "word": 1}, "unk_token": "[UNK]"},
}

# The chat template joins the message contents with spaces, so a chat prompt has as many
# tokens as its messages have words.
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "unk_token": "[UNK]",
    "model_max_length": 1 << 16,
    "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
}

# The token the played model generates (prefill's first token and every decode step).
GENERATED_TOKEN_ID = 1


def write(dir_: Path) -> Path:
    """Writes the three files (idempotent); returns the directory."""
    dir_.mkdir(parents=True, exist_ok=True)
    for name, body in (
        ("config.json", CONFIG),
        ("tokenizer.json", TOKENIZER),
        ("tokenizer_config.json", TOKENIZER_CONFIG),
    ):
        text = json.dumps(body, indent=1, sort_keys=True)
        path = dir_ / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return dir_
