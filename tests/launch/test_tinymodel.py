from __future__ import annotations

import json

from kvpush.launch import tinymodel


def test_build_is_deterministic_byte_for_byte(tmp_path, tiny_model):
    again = tinymodel.build(tmp_path / "again")
    for name in tinymodel.FILES:
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name


def test_model_has_the_documented_shape(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (4, 256)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["head_dim"] == 64
    assert config["max_position_embeddings"] == 32768
    assert config["vocab_size"] == 4096


def test_tokenizer_round_trips_and_has_a_chat_template(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok) == 4096
    text = "Return the number of items in the list."
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_ensure_reuses_a_complete_folder(tiny_model):
    before = (tiny_model / "model.safetensors").stat().st_mtime_ns
    assert tinymodel.ensure(tiny_model) == tiny_model
    assert (tiny_model / "model.safetensors").stat().st_mtime_ns == before
