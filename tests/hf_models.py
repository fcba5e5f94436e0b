"""A tiny transformers Llama for the ``generate()`` tests (CPU interpreter and GPU)."""

from __future__ import annotations

import torch


def tiny_llama(impl: str = "sdpa", max_positions: int = 512):
    """A seeded random-init ``LlamaForCausalLM`` (train mode): vocabulary 128, hidden 64, 2
    layers, 4 query and 2 KV heads of 16, attention ``impl`` ("sdpa" or "eager")."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=max_positions)
    cfg._attn_implementation = impl
    return transformers.LlamaForCausalLM(cfg)


def tiny_generation_llama():
    """A seeded random-init ``LlamaForCausalLM``: vocabulary 128, hidden 64, 2 layers, 4 query
    and 2 KV heads of 16, SDPA attention, pad/bos/eos ids 0/1/2, eval mode."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


def padded_prompt(device: str, length: int = 3000, pad: int = 300, new: int = 8) -> dict:
    """``generate()`` keyword arguments for two rows of random bytes, the second left-padded
    by ``pad`` tokens, greedy, ``new`` tokens, with scores."""
    ids = torch.randint(3, 256, (2, length), device=device)
    am = torch.ones_like(ids)
    am[1, :pad] = 0
    return dict(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0)
