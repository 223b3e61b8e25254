"""The decoder layer both the model's stack and the MTP head are built of: a mixer (Gated DeltaNet or gated
attention) and the sparse MoE, each behind a pre-norm residual."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from qwen35.attention import GatedAttention
from qwen35.config import LINEAR, Qwen35Config
from qwen35.execution import Execution
from qwen35.gdn import GatedDeltaNet
from qwen35.layers import RMSNorm
from qwen35.moe import SparseMoeBlock

__all__ = ["DecoderLayer"]


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: h += mixer(input_layernorm(h)); h += moe(post_attention_layernorm(h))."""

    def __init__(self, config: Qwen35Config, layer_idx: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 fp8_experts: bool = False, layer_type: str | None = None, execution: Execution = Execution()):
        c = config
        self.layer_type = layer_type or c.layer_types[layer_idx]  # `layer_type`: the MTP layer is full attention
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(c, rngs=rngs, param_dtype=param_dtype, execution=execution)
        else:
            self.self_attn = GatedAttention(c, rngs=rngs, param_dtype=param_dtype, execution=execution)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = SparseMoeBlock(c, rngs=rngs, param_dtype=param_dtype, fp8_experts=fp8_experts,
                                  execution=execution)

    def __call__(self, h, state, cache_index, *, mix=None, routed_fn=None):
        """(h [B, T, H] after the layer, the mixer's new state, router logits). `mix(mixer, x, state) -> (y, new
        state)` runs the mixer (`linear_attn` or `self_attn`) another way than its own `__call__` with the dense
        cache — the serving engine's paged step passes one; `routed_fn` goes to the MoE (`SparseMoeBlock`)."""
        x = self.input_layernorm(h)
        mixer = self.linear_attn if self.layer_type == LINEAR else self.self_attn
        if mix is not None:
            y, new_state = mix(mixer, x, state)
        elif self.layer_type == LINEAR:
            y, new_state = mixer(x, state)
        else:
            y, new_state = mixer(x, cache=state, cache_index=cache_index)
        h = h + y
        m, router_logits = self.mlp(self.post_attention_layernorm(h), routed_fn=routed_fn)
        return h + m, new_state, router_logits
