"""The embedded default model: a random-weight Qwen3, built locally, nothing downloaded.

4 layers, hidden 256, 4 attention heads, 2 KV heads of 64, 32,768 positions, and a 4,096-token
byte-level BPE tokenizer trained on a corpus that ships with kvpush. The same bytes every
build: fixed seeds, a fixed corpus, and safetensors' deterministic writer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

NAME = "kvpush-tiny"
VOCAB_SIZE = 4096
SEED = 1234
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = Path(__file__).parent / "corpus" / "stdlib_docstrings.txt"
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def default_dir() -> Path:
    from kvpush.settings import SETTINGS

    return SETTINGS.cache_dir / NAME


def ensure(out: Path | None = None) -> Path:
    """Return the model folder, building it on first use."""
    out = Path(out) if out else default_dir()
    if all((out / f).exists() for f in FILES):
        return out
    return build(out)


def build(out: Path) -> Path:
    """Write the model into `out` atomically (a half-written folder is never seen)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_tokenizer(tmp)
        _write_model(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in FILES:
        h.update(name.encode())
        h.update((folder / name).read_bytes())
    return h.hexdigest()


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text()
    tok.train_from_iterator([text[i : i + 4096] for i in range(0, len(text), 4096)], trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True))


def _write_model(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"] | {t["content"]: t["id"] for t in tok["added_tokens"]}
    eos_id, pad_id = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    generation = {"bos_token_id": pad_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True))

    gen = torch.Generator().manual_seed(SEED)
    hidden, inter, head_dim = 256, 512, 64

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    # Larger-than-usual weights give peaked logits, so greedy decoding rarely meets a tie.
    tensors = {"model.embed_tokens.weight": rand(VOCAB_SIZE, hidden, std=1.0)}
    for i in range(4):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(4 * head_dim, hidden, std=0.08),
            p + "self_attn.k_proj.weight": rand(2 * head_dim, hidden, std=0.08),
            p + "self_attn.v_proj.weight": rand(2 * head_dim, hidden, std=0.08),
            p + "self_attn.o_proj.weight": rand(hidden, 4 * head_dim, std=0.08),
            p + "self_attn.q_norm.weight": torch.ones(head_dim),
            p + "self_attn.k_norm.weight": torch.ones(head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden, std=0.08),
            p + "mlp.up_proj.weight": rand(inter, hidden, std=0.08),
            p + "mlp.down_proj.weight": rand(hidden, inter, std=0.08),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    tensors["model.norm.weight"] = torch.ones(hidden)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
