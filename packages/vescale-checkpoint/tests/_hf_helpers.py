"""The tiny transformers models the load_hf / export tests share."""

from __future__ import annotations

TOL = dict(atol=1e-5, rtol=1e-5)


def config(kind: str):
    """A tiny random-init config: ``"gpt2"`` (tied embeddings, fused c_attn) or LLaMA (GQA)."""
    import transformers

    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip
