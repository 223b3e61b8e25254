"""The multi-token-prediction (MTP) head of the released Qwen3.5 checkpoints (`mtp.*`, `mtp_num_hidden_layers` = 1):
a one-layer drafter that guesses the token after next from what the main model already computed.

At position t the main model has read tokens x_0..x_t; its last hidden state after the final norm, h_t, gave the
logits for x_{t+1}. The MTP layer takes h_t and the embedding of x_{t+1} (once it is known: sampled, or the next
prompt token) and predicts x_{t+2}:

    u_t = fc( [ pre_fc_norm_embedding(embed(x_{t+1}))  ;  pre_fc_norm_hidden(h_t) ] )     fc: [H, 2H], no bias
    v_t = DecoderLayer_full_attention(u_t)          one gated-attention + MoE layer, causal over t, RoPE position t
    logits_{t+2} = lm_head( norm(v_t) )             the model's own embedding and lm_head (shared, not in mtp.*)

The order of the concatenation (embedding first), the norms (zero-centred RMSNorms, like every norm of the model)
and the hidden state after the main model's final norm follow vLLM's Qwen3.5 MTP model
(`vllm/model_executor/models/qwen3_5_mtp.py`, https://github.com/vllm-project/vllm), which serves the released
checkpoints with this layer as a speculative drafter. Its attention layer keeps its own KV cache, one entry per
position t.

Checkpoint names: `mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.norm.weight`, `mtp.layers.0.*` (a decoder layer's names: `self_attn.*`, `mlp.experts.*` fused or per expert,
`mlp.shared_expert*`, the two layer norms). The released multimodal layout keeps them at the top level too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35.attention import KVCache
from qwen35.config import FULL, Qwen35Config
from qwen35.decoder import DecoderLayer
from qwen35.execution import Execution
from qwen35.layers import Linear, RMSNorm

__all__ = ["MultiTokenPredictor"]


class MultiTokenPredictor(nnx.Module):
    """`mtp.*`: `mtp_num_hidden_layers` full-attention decoder layers behind the fc projection (see the module
    docstring). Built by `Qwen35ForCausalLM(config, mtp=True)`; run through `Qwen35ForCausalLM.mtp_logits`."""

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32, fp8_experts: bool = False,
                 execution: Execution = Execution()):
        c = config
        if c.mtp_num_hidden_layers < 1:
            raise ValueError(f"config.mtp_num_hidden_layers is {c.mtp_num_hidden_layers}: this configuration has no "
                             f"MTP layer (the released checkpoints have 1)")
        H = c.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(H, c.rms_norm_eps, param_dtype=param_dtype)
        self.pre_fc_norm_hidden = RMSNorm(H, c.rms_norm_eps, param_dtype=param_dtype)
        self.fc = Linear(2 * H, H, rngs=rngs, param_dtype=param_dtype)
        self.layers = nnx.List([
            DecoderLayer(c, 0, rngs=rngs, param_dtype=param_dtype, fp8_experts=fp8_experts, layer_type=FULL,
                         execution=execution)
            for _ in range(c.mtp_num_hidden_layers)
        ])
        self.norm = RMSNorm(H, c.rms_norm_eps, param_dtype=param_dtype)

    def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> tuple[KVCache, ...]:
        """One empty K/V cache per MTP layer."""
        return tuple(layer.self_attn.init_cache(batch_size, max_len, dtype) for layer in self.layers)

    def __call__(self, hidden: jax.Array, next_embeds: jax.Array, *, cache: tuple[KVCache, ...] | None = None,
                 cache_index: jax.Array | int = 0, step: int = 0, routed_fn=None, mix=None):
        """hidden [B, T, H] (the main model's hidden states after its final norm) and next_embeds [B, T, H] (the
        embeddings of the tokens one position later) -> (MTP states [B, T, H] before `norm`, new cache, router
        logits).
        `step` picks the layer when there are several (draft step k uses layer k mod n, as vLLM does). `mix`: the
        attention run another way than with its own dense cache (`DecoderLayer`'s `mix`; the serving engine's
        paged step passes one), `cache` then being what `mix` reads and returns (the engine's pool)."""
        u = self.fc(jnp.concatenate([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
        i = step % len(self.layers)
        if mix is not None:
            return self.layers[i](u, cache, cache_index, mix=mix, routed_fn=routed_fn)
        state = None if cache is None else cache[i]
        v, new_state, router_logits = self.layers[i](u, state, cache_index, routed_fn=routed_fn)
        new_cache = None if cache is None else tuple(new_state if j == i else s for j, s in enumerate(cache))
        return v, new_cache, router_logits
