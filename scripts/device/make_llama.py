"""Write a random-init Llama of a real shape (bf16) for device tests: make_llama.py {8b,1b} OUT_DIR."""

import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
}


def main(shape: str, out: str) -> None:
    cfg = LlamaConfig(
        vocab_size=128256,
        num_key_value_heads=8,
        max_position_embeddings=16384,  # room for 8,192-token prompts plus the generated token
        rope_theta=500000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **SHAPES[shape],
    )
    t0 = time.time()
    torch.manual_seed(1234)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    print(f"make_llama: {shape} -> {out} in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
