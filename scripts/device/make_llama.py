"""Write a random-init Llama of a real shape (bf16) for device tests: make_llama.py {8b,1b} OUT_DIR.

A byte-level ``tokenizer.json`` (ids 0..255) goes beside the weights so that ``hsx verify`` can tokenize
its prompts there (the device has no network); ``make_llama.py tokenizer DIR`` writes only that.
"""

import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
}


def write_byte_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(f"{out}/tokenizer.json")


def main(shape: str, out: str) -> None:
    if shape == "tokenizer":
        write_byte_tokenizer(out)
        return
    cfg = LlamaConfig(
        vocab_size=128256,
        num_key_value_heads=8,
        max_position_embeddings=16384,  # room for 8,192-token prompts plus the generated token
        rope_theta=500000.0,
        tie_word_embeddings=False,
        **SHAPES[shape],
    )
    t0 = time.time()
    torch.manual_seed(1234)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    write_byte_tokenizer(out)
    print(f"make_llama: {shape} -> {out} in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
