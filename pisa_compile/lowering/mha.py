"""``torch.nn`` attention modules that reach the graph as one opaque call.

- ``nn.MultiheadAttention``: Dynamo keeps ``F.multi_head_attention_forward`` as one call (it
  does not inline it), so the pass swaps it for :func:`pisa_multi_head_attention_forward`:
  the same projections and mask handling as PyTorch's function, with the attention itself
  done by ``pisa_attention``. Only the plain configuration is taken: batched input, no
  ``bias_k``/``bias_v``, no ``add_zero_attn``, no ``static_k``/``static_v``, dropout off,
  and the attention weights unused (``need_weights=False``, or the second output never read).
- ``nn.TransformerEncoderLayer`` (and ``nn.TransformerEncoder``) in inference: PyTorch's fast
  path calls the fused ``torch._transformer_encoder_layer_fwd``, which the pass swaps for
  :func:`pisa_transformer_encoder_layer_fwd`: the same projections, norms and feed-forward
  written out, with ``pisa_attention`` in the middle.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import PisaConfig
from ..ops import pisa_attention, self_attention_query_mask

__all__ = ["MHA_TARGET", "MHA_SIGNATURE", "pisa_multi_head_attention_forward",
           "ENCODER_LAYER_TARGET", "pisa_transformer_encoder_layer_fwd"]

MHA_TARGET = F.multi_head_attention_forward
MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
ENCODER_LAYER_TARGET = torch._transformer_encoder_layer_fwd


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
    # A bool key padding mask alone is structure: the kernels read it per key.
    key_mask = (~key_padding_mask if key_padding_mask is not None and attn_mask is None
                and key_padding_mask.dtype == torch.bool else None)
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
    if key_mask is not None:
        attn_mask = None
    elif key_padding_mask is not None:             # [B, S], additive float
        kpm = key_padding_mask.view(bsz, 1, 1, src_len)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    # `query is key`: self-attention, as PyTorch's own function reads it (packed projection).
    query_mask = (self_attention_query_mask(key_mask, tgt_len)
                  if key_mask is not None and query is key else None)
    out = pisa_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, config=config,
                         key_mask=key_mask, query_mask=query_mask)
    out = out.permute(2, 0, 1, 3).reshape(tgt_len * bsz, embed_dim)
    out = F.linear(out, out_proj_weight, out_proj_bias)
    return out.view(tgt_len, bsz, out.size(1)), None


def _encoder_mask(mask: Optional[Tensor], mask_type: Optional[int], batch: int,
                  length: int) -> Optional[Tensor]:
    """The fast path's merged mask as an SDPA mask: bool True means *masked* there (PyTorch's
    module convention), so it is inverted; float masks are additive either way. Type 1 is a
    key padding mask ``[B, L]``; the others are ``[L, L]`` or ``[B, H, L, L]``."""
    if mask is None:
        return None
    if mask_type == 1:
        mask = mask.view(batch, 1, 1, length)
    return ~mask if mask.dtype == torch.bool else mask


def pisa_transformer_encoder_layer_fwd(
    src: Tensor, embed_dim: int, num_heads: int, qkv_weight: Tensor, qkv_bias: Tensor,
    proj_weight: Tensor, proj_bias: Tensor, use_gelu: bool, norm_first: bool, eps: float,
    norm_weight_1: Tensor, norm_bias_1: Tensor, norm_weight_2: Tensor, norm_bias_2: Tensor,
    ffn_weight_1: Tensor, ffn_bias_1: Tensor, ffn_weight_2: Tensor, ffn_bias_2: Tensor,
    mask: Optional[Tensor] = None, mask_type: Optional[int] = None, *,
    config: Optional[PisaConfig] = None,
) -> Tensor:
    """``torch._transformer_encoder_layer_fwd`` (``nn.TransformerEncoderLayer``'s inference
    fast path) with the attention done by ``pisa_attention``.

    ``src`` is batch-first ``[B, L, E]``; returns ``[B, L, E]`` in ``src.dtype``. Post-norm
    (``norm_first=False``): ``x = norm1(x + sa(x)); x = norm2(x + ff(x))``; pre-norm:
    ``x = x + sa(norm1(x)); x = x + ff(norm2(x))`` (PyTorch's ``TransformerEncoderLayer``).
    """
    B, L, E = src.shape
    head_dim = embed_dim // num_heads
    # A bool key padding mask (type 1, True = padding) is structure: read per key.
    key_mask = ~mask if mask is not None and mask_type == 1 and mask.dtype == torch.bool else None
    attn_mask = None if key_mask is not None else _encoder_mask(mask, mask_type, B, L)
    query_mask = None if key_mask is None else self_attention_query_mask(key_mask, L)

    def sa(x: Tensor) -> Tensor:
        qkv = F.linear(x, qkv_weight, qkv_bias).view(B, L, 3, num_heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = pisa_attention(q, k, v, attn_mask=attn_mask, config=config, key_mask=key_mask,
                             query_mask=query_mask)
        return F.linear(out.transpose(1, 2).reshape(B, L, E), proj_weight, proj_bias)

    def ff(x: Tensor) -> Tensor:
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(h) if use_gelu else F.relu(h), ffn_weight_2, ffn_bias_2)

    def norm1(x: Tensor) -> Tensor:
        return F.layer_norm(x, (E,), norm_weight_1, norm_bias_1, eps)

    def norm2(x: Tensor) -> Tensor:
        return F.layer_norm(x, (E,), norm_weight_2, norm_bias_2, eps)

    x = src
    if norm_first:
        x = x + sa(norm1(x))
        return x + ff(norm2(x))
    x = norm1(x + sa(x))
    return norm2(x + ff(x))
