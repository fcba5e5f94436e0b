"""``nn.MultiheadAttention``: Dynamo keeps ``F.multi_head_attention_forward`` as one opaque
call in the graph (it does not inline it), so the pass recognises that call and swaps it for
:func:`pisa_multi_head_attention_forward`: the same projections and mask handling as
PyTorch's function, with the attention itself done by ``pisa_attention``.

Only the plain configuration is taken: batched input, no ``bias_k``/``bias_v``, no
``add_zero_attn``, no ``static_k``/``static_v``, dropout off, and the attention weights
unused (``need_weights=False``, or the second output never read).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from ..config import PisaConfig
from ..ops import pisa_attention

__all__ = ["MHA_TARGET", "MHA_SIGNATURE", "pisa_multi_head_attention_forward"]

MHA_TARGET = F.multi_head_attention_forward
MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def pisa_multi_head_attention_forward(
    query: Tensor, key: Tensor, value: Tensor, embed_dim_to_check: int, num_heads: int,
    in_proj_weight: Optional[Tensor], in_proj_bias: Optional[Tensor], bias_k, bias_v,
    add_zero_attn: bool, dropout_p: float, out_proj_weight: Tensor,
    out_proj_bias: Optional[Tensor], training: bool = True,
    key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
    attn_mask: Optional[Tensor] = None, use_separate_proj_weight: bool = False,
    q_proj_weight: Optional[Tensor] = None, k_proj_weight: Optional[Tensor] = None,
    v_proj_weight: Optional[Tensor] = None, static_k=None, static_v=None,
    average_attn_weights: bool = True, is_causal: bool = False, *,
    config: Optional[PisaConfig] = None,
) -> tuple[Tensor, None]:
    """``F.multi_head_attention_forward`` (the ``need_weights=False`` path) on PISA.

    Inputs are sequence-first ``[L, B, E]`` as PyTorch's function takes them (the module
    transposes ``batch_first`` inputs before the call). Returns ``(out, None)``.
    """
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    head_dim = embed_dim // num_heads
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
        target_type=query.dtype)
    if is_causal and key_padding_mask is None:
        attn_mask = None          # PyTorch's own rule: the mask is only a hint then
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                      other_name="", target_type=query.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False
    if not use_separate_proj_weight:
        q, k, v = F._in_projection_packed(query, key, value, in_proj_weight, in_proj_bias)
    else:
        b_q = b_k = b_v = None
        if in_proj_bias is not None:
            b_q, b_k, b_v = in_proj_bias.chunk(3)
        q, k, v = F._in_projection(query, key, value, q_proj_weight, k_proj_weight,
                                   v_proj_weight, b_q, b_k, b_v)
    q = q.view(tgt_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    k = k.view(src_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    v = v.view(src_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    if attn_mask is not None:                      # [L, S] or [B*H, L, S]
        attn_mask = (attn_mask if attn_mask.dim() == 2
                     else attn_mask.view(bsz, num_heads, tgt_len, src_len))
    if key_padding_mask is not None:               # [B, S], additive float
        kpm = key_padding_mask.view(bsz, 1, 1, src_len)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    out = pisa_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, config=config)
    out = out.permute(2, 0, 1, 3).reshape(tgt_len * bsz, embed_dim)
    out = F.linear(out, out_proj_weight, out_proj_bias)
    return out.view(tgt_len, bsz, out.size(1)), None
