"""Build HF transformers' DeepseekV4ForCausalLM with the same weights as one of our models."""

from __future__ import annotations

import torch

from dsv4.config import ModelConfig
from dsv4.weights.names import to_hf_state_dict

_HF_KIND = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
            "hca": "heavily_compressed_attention"}


def hf_config(c: ModelConfig):
    from transformers import DeepseekV4Config

    rates = {_HF_KIND[k]: r for k, r in zip(c.layer_kinds, c.compress_ratios) if k != "sliding"}
    rope = {"rope_type": "default"}
    if c.yarn is not None:
        rope = {"rope_type": "yarn", "factor": c.yarn.factor, "beta_fast": c.yarn.beta_fast,
                "beta_slow": c.yarn.beta_slow,
                "original_max_position_embeddings": c.yarn.original_max_position_embeddings}
    return DeepseekV4Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, head_dim=c.head_dim, q_lora_rank=c.q_lora_rank,
        o_groups=c.o_groups, o_lora_rank=c.o_lora_rank, n_routed_experts=c.n_routed_experts,
        num_experts_per_tok=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size,
        layer_types=[_HF_KIND[k] for k in c.layer_kinds], compress_rates=rates,
        mlp_layer_types=["hash_moe" if h else "moe" for h in c.hash_layers],
        sliding_window=c.sliding_window, index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim,
        index_topk=c.index_topk, hc_mult=c.hc_mult, hc_sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps,
        partial_rotary_factor=c.rope_dim / c.head_dim, rope_theta=c.rope_theta,
        compress_rope_theta=c.compress_rope_theta, rope_parameters=rope,
        routed_scaling_factor=c.routed_scaling_factor, swiglu_limit=c.swiglu_limit, rms_norm_eps=c.rms_norm_eps,
        scoring_func=c.scoring_func, max_position_embeddings=c.max_position_embeddings,
        num_nextn_predict_layers=0)


def hf_model(c: ModelConfig, official_state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
    """HF model in eval mode holding ``official_state`` (our names), strict load."""
    import transformers
    from transformers import DeepseekV4ForCausalLM

    transformers.logging.set_verbosity_error()
    model = DeepseekV4ForCausalLM(hf_config(c)).to(dtype).eval()
    state = to_hf_state_dict(official_state, c.num_hidden_layers, c.n_routed_experts)
    ref = model.state_dict()
    for name, t in state.items():
        if name.endswith("tid2eid"):
            state[name] = t.to(ref[name].dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "inv_freq" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    # HF keeps these in fp32 whatever the model dtype (its _keep_in_fp32_modules_strict)
    return model


@torch.no_grad()
def hf_logits_incremental(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Prefill ``prompt`` then feed ``continuation`` one token at a time; fp32 logits for every
    position ``[len(prompt) + len(continuation), vocab]``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    pos = torch.arange(len(prompt)).unsqueeze(0)
    out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
    logits = [out.logits[0].float()]
    for i, tok in enumerate(continuation):
        p = len(prompt) + i
        out = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[p]]), past_key_values=cache,
                    use_cache=True)
        logits.append(out.logits[0].float())
    return torch.cat(logits)
