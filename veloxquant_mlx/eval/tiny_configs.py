"""Tiny random configurations of every architecture the installed mlx_lm ships (data only; generated once from
hand-written, validated configurations, then kept here as plain dicts).

Key: the module name under ``mlx_lm.models``; value: what its ``ModelArgs.from_dict`` takes (as a config.json holds).
Each is small (hidden 64-128, 2-6 layers, vocabulary 128, head_dim 32 or 64 where the architecture lets it be
chosen) but keeps every layer kind its architecture has: sliding windows of 16 tokens (so an 80-token prompt
evicts), chunked attention, layers sharing another layer's keys and values, MLA latents, SSM / linear-attention
layers beside attention, MoE beside dense layers. `veloxquant_mlx.eval.architectures` builds and checks them.
"""

# Architectures that need something this configuration cannot give: module -> why.
NEEDS = {
    "olmo": "the ai2-olmo package (mlx_lm's olmo imports hf_olmo)",
    "bitnet": "Metal (its BitLinear layers run an mx.fast.metal_kernel)",
    "muse_spark": "Metal (its attention and routing run mlx_lm.kernels' Metal kernels)",
}
METAL_ONLY = ("bitnet", "muse_spark")

CONFIGS = {
    'afm7': {
        'model_type': 'afm7', 'vocab_size': 128, 'hidden_dim': 128, 'num_layers': 4, 'num_kv_reuse_layers': 2,
        'num_heads': 4, 'num_kv_heads': 2, 'hidden_dim_scale_factor': 2.0, 'rope_theta': 50000,
        'rms_norm_eps': 1e-05
    },
    'afmoe': {
        'model_type': 'afmoe', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads':
        2, 'head_dim': 32, 'max_position_embeddings': 2048, 'rms_norm_eps': 1e-05, 'rope_theta': 10000,
        'tie_word_embeddings': False, 'num_experts': 4, 'num_experts_per_tok': 2, 'num_shared_experts': 1,
        'num_dense_layers': 1, 'route_norm': True, 'route_scale': 2.826, 'score_func': 'sigmoid', 'n_group':
        1, 'topk_group': 1, 'sliding_window': 16, 'mup_enabled': True, 'layer_types': ['sliding_attention',
        'sliding_attention', 'sliding_attention', 'full_attention']
    },
    'apertus': {
        'model_type': 'apertus', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'mlp_bias': False, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'attention_bias': False, 'rms_norm_eps': 1e-05, 'max_position_embeddings': 2048, 'rope_theta':
        12000000, 'post_norm': False, 'qk_norm': True, 'tie_word_embeddings': False
    },
    'baichuan_m1': {
        'model_type': 'baichuan_m1', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'num_swa_attention_heads':
        4, 'num_swa_key_value_heads': 1, 'rope_theta': 10000.0, 'sliding_window': 16, 'sliding_window_layers':
        [0, 2], 'conv_window': 2, 'rms_norm_eps': 1e-05, 'tie_word_embeddings': False
    },
    'bailing_hybrid': {
        'model_type': 'bailing_hybrid', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads':
        4, 'num_experts': 4, 'num_experts_per_tok': 2, 'num_shared_experts': 1, 'n_group': 1, 'topk_group': 1,
        'first_k_dense_replace': 1, 'layer_group_size': 2, 'group_norm_size': 2, 'rms_norm_eps': 1e-06,
        'rope_theta': 600000, 'max_position_embeddings': 4096, 'routed_scaling_factor': 2.5, 'head_dim': 32,
        'q_lora_rank': 32, 'kv_lora_rank': 32, 'qk_rope_head_dim': 16, 'qk_nope_head_dim': 32, 'v_head_dim':
        32, 'partial_rotary_factor': 0.5, 'use_qk_norm': True, 'score_function': 'sigmoid', 'norm_topk_prob':
        True, 'moe_router_enable_expert_bias': True, 'tie_word_embeddings': False, 'num_nextn_predict_layers':
        0
    },
    'bailing_moe': {
        'model_type': 'bailing_moe', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'max_position_embeddings': 4096, 'moe_intermediate_size': 64, 'num_experts': 4, 'num_shared_experts':
        1, 'norm_topk_prob': True, 'num_attention_heads': 4, 'num_experts_per_tok': 2, 'num_hidden_layers': 3,
        'num_key_value_heads': 2, 'rms_norm_eps': 1e-06, 'rope_theta': 600000, 'first_k_dense_replace': 1,
        'use_qk_norm': True, 'partial_rotary_factor': 0.5, 'score_function': 'sigmoid',
        'moe_router_enable_expert_bias': True, 'routed_scaling_factor': 2.5, 'n_group': 1, 'topk_group': 1,
        'tie_word_embeddings': False
    },
    'bailing_moe_linear': {
        'model_type': 'bailing_moe_linear', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'max_position_embeddings': 4096, 'moe_intermediate_size': 64, 'num_experts': 4, 'num_shared_experts':
        1, 'norm_topk_prob': True, 'num_attention_heads': 4, 'num_experts_per_tok': 2, 'num_hidden_layers': 4,
        'num_key_value_heads': 2, 'rms_norm_eps': 1e-06, 'rope_theta': 600000, 'first_k_dense_replace': 1,
        'layer_group_size': 2, 'group_norm_size': 2, 'use_qk_norm': True, 'partial_rotary_factor': 0.5,
        'score_function': 'sigmoid', 'moe_router_enable_expert_bias': True, 'routed_scaling_factor': 2.5,
        'n_group': 1, 'topk_group': 1, 'head_dim': 32, 'tie_word_embeddings': False
    },
    'bailing_moe_v3': {
        'model_type': 'bailing_hybrid', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'moe_shared_expert_intermediate_size': 64, 'num_hidden_layers': 4,
        'num_attention_heads': 4, 'num_experts': 4, 'num_experts_per_tok': 2, 'num_shared_experts': 1,
        'first_k_dense_replace': 1, 'n_group': 1, 'topk_group': 1, 'routed_scaling_factor': 2.5,
        'layer_group_size': 2, 'head_dim': 32, 'q_lora_rank': 32, 'kv_lora_rank': 32, 'qk_nope_head_dim': 32,
        'qk_rope_head_dim': 16, 'v_head_dim': 32, 'short_conv_kernel_size': 4, 'rms_norm_eps': 1e-06,
        'rope_theta': 6000000.0, 'max_position_embeddings': 4096, 'tie_word_embeddings': False
    },
    'bitnet': {
        'model_type': 'bitnet', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-05,
        'max_position_embeddings': 2048, 'rope_theta': 500000.0, 'tie_word_embeddings': True
    },
    'cohere': {
        'model_type': 'cohere', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'rope_theta': 8000000.0,
        'layer_norm_eps': 1e-05, 'logit_scale': 0.0625, 'use_qk_norm': True
    },
    'cohere2': {
        'model_type': 'cohere2', 'vocab_size': 128, 'hidden_size': 128, 'head_dim': 32, 'num_hidden_layers':
        4, 'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'rope_theta':
        50000.0, 'layer_norm_eps': 1e-05, 'logit_scale': 0.25, 'sliding_window': 16, 'sliding_window_pattern':
        4
    },
    'dbrx': {
        'model_type': 'dbrx', 'vocab_size': 128, 'd_model': 128, 'n_layers': 2, 'n_heads': 4, 'attn_config':
        {'kv_n_heads': 2, 'clip_qkv': 8.0, 'rope_theta': 500000}, 'ffn_config': {'ffn_hidden_size': 64,
        'moe_num_experts': 4, 'moe_top_k': 2}
    },
    'deepseek': {
        'model_type': 'deepseek', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 3, 'num_attention_heads': 4, 'num_key_value_heads':
        2, 'n_shared_experts': 1, 'n_routed_experts': 4, 'num_experts_per_tok': 2, 'moe_layer_freq': 1,
        'first_k_dense_replace': 1, 'max_position_embeddings': 4096, 'rms_norm_eps': 1e-06, 'rope_theta':
        10000.0
    },
    'deepseek_v2': {  # (dense layers only: an MLA model MLX's CPU also runs in float16 / bfloat16)
        'model_type': 'deepseek_v2', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 3, 'num_attention_heads': 4, 'num_key_value_heads':
        4, 'n_shared_experts': 1, 'n_routed_experts': 4, 'routed_scaling_factor': 1.0, 'kv_lora_rank': 32,
        'q_lora_rank': None, 'qk_rope_head_dim': 16, 'v_head_dim': 32, 'qk_nope_head_dim': 32, 'topk_method':
        'greedy', 'n_group': 1, 'topk_group': 1, 'num_experts_per_tok': 2, 'moe_layer_freq': 1,
        'first_k_dense_replace': 3, 'max_position_embeddings': 4096, 'rms_norm_eps': 1e-06, 'rope_theta':
        10000.0, 'rope_scaling': {'type': 'yarn', 'factor': 8.0, 'original_max_position_embeddings': 512,
        'beta_fast': 32, 'beta_slow': 1, 'mscale': 0.707, 'mscale_all_dim': 0.707}
    },
    'deepseek_v3': {
        'model_type': 'deepseek_v3', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 3, 'num_attention_heads': 4, 'num_key_value_heads':
        4, 'n_shared_experts': 1, 'n_routed_experts': 4, 'routed_scaling_factor': 2.5, 'kv_lora_rank': 32,
        'q_lora_rank': 32, 'qk_rope_head_dim': 16, 'v_head_dim': 32, 'qk_nope_head_dim': 32, 'topk_method':
        'noaux_tc', 'scoring_func': 'sigmoid', 'norm_topk_prob': True, 'n_group': 2, 'topk_group': 1,
        'num_experts_per_tok': 2, 'moe_layer_freq': 1, 'first_k_dense_replace': 1, 'max_position_embeddings':
        4096, 'rms_norm_eps': 1e-06, 'rope_theta': 10000.0
    },
    'deepseek_v32': {
        'model_type': 'deepseek_v32', 'vocab_size': 128, 'hidden_size': 128, 'index_head_dim': 32,
        'index_n_heads': 2, 'index_topk': 16, 'intermediate_size': 256, 'moe_intermediate_size': 64,
        'num_hidden_layers': 3, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'n_shared_experts': 1,
        'n_routed_experts': 4, 'routed_scaling_factor': 2.5, 'kv_lora_rank': 32, 'q_lora_rank': 32,
        'qk_rope_head_dim': 16, 'v_head_dim': 32, 'qk_nope_head_dim': 32, 'topk_method': 'noaux_tc',
        'scoring_func': 'sigmoid', 'norm_topk_prob': True, 'n_group': 2, 'topk_group': 1,
        'num_experts_per_tok': 2, 'moe_layer_freq': 1, 'first_k_dense_replace': 1, 'max_position_embeddings':
        4096, 'rms_norm_eps': 1e-06, 'rope_theta': 10000.0
    },
    'deepseek_v41': {
        'model_type': 'deepseek_v41', 'vocab_size': 128, 'hidden_size': 64, 'num_hidden_layers': 4,
        'num_attention_heads': 2, 'head_dim': 64, 'q_lora_rank': 32, 'qk_rope_head_dim': 16, 'o_groups': 2,
        'o_lora_rank': 32, 'moe_intermediate_size': 64, 'n_routed_experts': 4, 'num_experts_per_tok': 2,
        'scoring_func': 'sqrtsoftplus', 'norm_topk_prob': True, 'routed_scaling_factor': 1.5, 'swiglu_limit':
        10.0, 'rms_norm_eps': 1e-06, 'sliding_window': 16, 'compress_ratios': [0, 4, 4, 4],
        'kv_source_layer_ids': [1], 'index_source_layer_ids': [1, 2], 'compress_rope_theta': 160000.0,
        'candidate_source_layer_id': 1, 'candidate_topk_blocks': 2, 'candidate_block_size': 4,
        'index_n_heads': 2, 'index_head_dim': 32, 'index_topk': 4, 'rope_theta': 10000.0,
        'max_position_embeddings': 4096, 'hc_mult': 4, 'hc_sinkhorn_iters': 20, 'hc_eps': 1e-06
    },
    'dots1': {
        'model_type': 'dots1', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 3,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-05, 'max_position_embeddings': 4096, 'first_k_dense_replace': 1,
        'moe_intermediate_size': 64, 'n_routed_experts': 4, 'n_shared_experts': 1, 'norm_topk_prob': True,
        'num_experts_per_tok': 2, 'rope_theta': 10000.0, 'routed_scaling_factor': 2.5, 'scoring_func':
        'noaux_tc', 'n_group': 1, 'topk_group': 1
    },
    'ernie4_5': {
        'model_type': 'ernie4_5', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'max_position_embeddings': 4096, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'num_hidden_layers': 2, 'rms_norm_eps': 1e-05, 'rope_theta': 500000, 'use_bias': False,
        'tie_word_embeddings': True
    },
    'ernie4_5_moe': {
        'model_type': 'ernie4_5_moe', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'max_position_embeddings': 4096, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'num_hidden_layers': 3, 'rms_norm_eps': 1e-05, 'rope_theta': 500000, 'use_bias': False,
        'tie_word_embeddings': False, 'moe_num_experts': 4, 'moe_layer_start_index': 1,
        'moe_intermediate_size': 64, 'moe_k': 2, 'moe_layer_interval': 1, 'moe_use_aux_free': True,
        'moe_num_shared_experts': 1
    },
    'exaone': {
        'model_type': 'exaone', 'vocab_size': 128, 'hidden_size': 128, 'num_layers': 2, 'intermediate_size':
        256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'rope_theta': 10000.0, 'layer_norm_epsilon':
        1e-05, 'max_position_embeddings': 2048, 'tie_word_embeddings': False
    },
    'exaone4': {
        'model_type': 'exaone4', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 4,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-05, 'max_position_embeddings': 4096, 'rope_theta': 1000000.0,
        'tie_word_embeddings': False, 'rope_scaling': None, 'sliding_window': 16, 'sliding_window_pattern':
        'LLLG'
    },
    'exaone_moe': {
        'model_type': 'exaone_moe', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads':
        2, 'head_dim': 32, 'num_experts': 4, 'num_experts_per_tok': 2, 'num_shared_experts': 1,
        'rms_norm_eps': 1e-05, 'max_position_embeddings': 4096, 'sliding_window': 16, 'layer_types':
        ['sliding_attention', 'sliding_attention', 'sliding_attention', 'full_attention'], 'is_moe_layer':
        [False, True, True, True], 'n_group': 1, 'topk_group': 1, 'routed_scaling_factor': 2.5,
        'norm_topk_prob': True, 'rope_theta': 1000000.0, 'tie_word_embeddings': False
    },
    'falcon_h1': {
        'model_type': 'falcon_h1', 'vocab_size': 128, 'hidden_size': 128, 'head_dim': 32,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'mamba_d_ssm': 128, 'mamba_n_heads': 4, 'mamba_d_head': 32, 'mamba_d_state': 16, 'mamba_d_conv': 4,
        'mamba_n_groups': 1, 'mamba_chunk_size': 32, 'mamba_expand': 1, 'max_position_embeddings': 4096,
        'rope_theta': 100000.0, 'tie_word_embeddings': False
    },
    'gear': {
        'model_type': 'gear', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-06, 'max_position_embeddings': 4096, 'layer_types': ['conv_mixer',
        'sliding_attention', 'conv_mixer', 'full_attention'], 'sliding_window': 16, 'conv_L_cache': 3,
        'final_logit_softcapping': 30.0
    },
    'gemma': {
        'model_type': 'gemma', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-06, 'rope_theta': 10000
    },
    'gemma2': {
        'model_type': 'gemma2', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-06, 'rope_theta': 10000, 'attn_logit_softcapping': 50.0, 'final_logit_softcapping':
        30.0, 'query_pre_attn_scalar': 32.0
    },
    'gemma3': {
        'model_type': 'gemma3', 'vocab_size': 128, 'text_config': {'model_type': 'gemma3_text', 'hidden_size':
        128, 'num_hidden_layers': 6, 'intermediate_size': 128, 'num_attention_heads': 4,
        'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-06, 'rope_theta': 1000000.0,
        'rope_local_base_freq': 10000.0, 'query_pre_attn_scalar': 32, 'sliding_window': 16,
        'sliding_window_pattern': 3, 'max_position_embeddings': 4096}
    },
    'gemma3_text': {
        'model_type': 'gemma3_text', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 6,
        'intermediate_size': 128, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-06, 'rope_theta': 1000000.0, 'rope_local_base_freq': 10000.0,
        'query_pre_attn_scalar': 32, 'sliding_window': 16, 'sliding_window_pattern': 6,
        'max_position_embeddings': 4096
    },
    'gemma3n': {
        'model_type': 'gemma3n', 'vocab_size': 128, 'text_config': {'model_type': 'gemma3n_text',
        'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 6, 'intermediate_size': 128,
        'num_attention_heads': 4, 'head_dim': 32, 'rms_norm_eps': 1e-06, 'num_key_value_heads': 2,
        'num_kv_shared_layers': 3, 'vocab_size_per_layer_input': 128, 'sliding_window': 16,
        'max_position_embeddings': 4096, 'rope_local_base_freq': 10000.0, 'rope_theta': 1000000.0,
        'final_logit_softcapping': 30.0, 'layer_types': ['sliding_attention', 'sliding_attention',
        'full_attention', 'sliding_attention', 'sliding_attention', 'full_attention'],
        'activation_sparsity_pattern': [0.95, 0.95, 0.0, 0.0, 0.0, 0.0], 'hidden_size_per_layer_input': 16,
        'altup_num_inputs': 4, 'altup_coef_clip': 120.0, 'altup_correct_scale': True, 'altup_active_idx': 0,
        'laurel_rank': 8}
    },
    'gemma4': {  # (every expert active: a top-2 router of random weights flips on float16 rounding alone)
        'model_type': 'gemma4', 'vocab_size': 128, 'text_config': {'model_type': 'gemma4_text', 'hidden_size':
        128, 'num_hidden_layers': 6, 'intermediate_size': 64, 'num_attention_heads': 4, 'head_dim': 32,
        'global_head_dim': 64, 'rms_norm_eps': 1e-06, 'num_key_value_heads': 2, 'num_global_key_value_heads':
        1, 'attention_k_eq_v': True, 'num_kv_shared_layers': 0, 'hidden_size_per_layer_input': 0,
        'vocab_size_per_layer_input': 128, 'use_double_wide_mlp': False, 'enable_moe_block': True,
        'num_experts': 4, 'top_k_experts': 4, 'moe_intermediate_size': 32, 'sliding_window': 16,
        'max_position_embeddings': 4096, 'final_logit_softcapping': 30.0, 'layer_types': ['sliding_attention',
        'sliding_attention', 'sliding_attention', 'sliding_attention', 'sliding_attention', 'full_attention'],
        'rope_parameters': {'full_attention': {'partial_rotary_factor': 0.25, 'rope_theta': 1000000.0,
        'rope_type': 'proportional'}, 'sliding_attention': {'rope_theta': 10000.0, 'rope_type': 'default'}}}
    },
    'gemma4_text': {
        'model_type': 'gemma4_text', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 6,
        'intermediate_size': 64, 'num_attention_heads': 4, 'head_dim': 32, 'global_head_dim': 64,
        'rms_norm_eps': 1e-06, 'vocab_size_per_layer_input': 128, 'num_key_value_heads': 2,
        'num_kv_shared_layers': 3, 'hidden_size_per_layer_input': 16, 'sliding_window': 16,
        'max_position_embeddings': 4096, 'final_logit_softcapping': 30.0, 'use_double_wide_mlp': True,
        'layer_types': ['sliding_attention', 'sliding_attention', 'full_attention', 'sliding_attention',
        'sliding_attention', 'full_attention'], 'rope_parameters': {'full_attention':
        {'partial_rotary_factor': 0.25, 'rope_theta': 1000000.0, 'rope_type': 'proportional'},
        'sliding_attention': {'rope_theta': 10000.0, 'rope_type': 'default'}}
    },
    'glm': {
        'model_type': 'glm', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-05, 'max_position_embeddings': 4096, 'attention_bias': True, 'rope_theta': 10000,
        'tie_word_embeddings': False
    },
    'glm4': {
        'model_type': 'glm4', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'attention_bias': True,
        'head_dim': 32, 'rms_norm_eps': 1e-05, 'partial_rotary_factor': 0.5, 'rope_theta': 10000,
        'max_position_embeddings': 4096
    },
    'glm4_moe': {
        'model_type': 'glm4_moe', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'max_position_embeddings': 4096, 'moe_intermediate_size': 64, 'norm_topk_prob': True,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'n_group': 1, 'topk_group': 1,
        'n_shared_experts': 1, 'n_routed_experts': 4, 'routed_scaling_factor': 2.5, 'num_experts_per_tok': 2,
        'first_k_dense_replace': 1, 'num_hidden_layers': 3, 'rms_norm_eps': 1e-05, 'rope_theta': 1000000,
        'rope_scaling': None, 'use_qk_norm': True, 'tie_word_embeddings': False, 'attention_bias': True,
        'partial_rotary_factor': 0.5
    },
    'glm4_moe_lite': {
        'model_type': 'glm4_moe_lite', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 3, 'num_attention_heads': 4, 'num_key_value_heads':
        4, 'n_shared_experts': 1, 'n_routed_experts': 4, 'routed_scaling_factor': 1.8, 'kv_lora_rank': 32,
        'q_lora_rank': 32, 'qk_rope_head_dim': 16, 'qk_nope_head_dim': 32, 'v_head_dim': 32, 'topk_method':
        'noaux_tc', 'scoring_func': 'sigmoid', 'norm_topk_prob': True, 'n_group': 1, 'topk_group': 1,
        'num_experts_per_tok': 2, 'moe_layer_freq': 1, 'first_k_dense_replace': 1, 'max_position_embeddings':
        4096, 'rms_norm_eps': 1e-05, 'rope_theta': 1000000.0, 'rope_scaling': None, 'attention_bias': False,
        'partial_rotary_factor': 1.0, 'tie_word_embeddings': False, 'num_nextn_predict_layers': 1
    },
    'glm_moe_dsa': {
        'model_type': 'glm_moe_dsa', 'vocab_size': 128, 'hidden_size': 128, 'index_head_dim': 32,
        'index_n_heads': 2, 'index_topk': 16, 'intermediate_size': 256, 'moe_intermediate_size': 64,
        'num_hidden_layers': 3, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'n_shared_experts': 1,
        'n_routed_experts': 4, 'routed_scaling_factor': 2.5, 'kv_lora_rank': 32, 'q_lora_rank': 32,
        'qk_rope_head_dim': 16, 'v_head_dim': 32, 'qk_nope_head_dim': 32, 'topk_method': 'noaux_tc',
        'scoring_func': 'sigmoid', 'norm_topk_prob': True, 'n_group': 1, 'topk_group': 1,
        'num_experts_per_tok': 2, 'moe_layer_freq': 1, 'first_k_dense_replace': 1, 'max_position_embeddings':
        4096, 'rms_norm_eps': 1e-05, 'rope_parameters': {'rope_theta': 1000000.0, 'rope_type': 'default'},
        'attention_bias': False
    },
    'gpt2': {
        'model_type': 'gpt2', 'vocab_size': 128, 'n_ctx': 1024, 'n_embd': 64, 'n_head': 2, 'n_layer': 2,
        'n_positions': 1024, 'layer_norm_epsilon': 1e-05
    },
    'gpt_bigcode': {
        'model_type': 'gpt_bigcode', 'vocab_size': 128, 'n_embd': 128, 'n_layer': 2, 'n_inner': 256, 'n_head':
        4, 'n_positions': 1024, 'layer_norm_epsilon': 1e-05, 'multi_query': True
    },
    'gpt_neox': {
        'model_type': 'gpt_neox', 'vocab_size': 128, 'max_position_embeddings': 2048, 'hidden_size': 64,
        'num_attention_heads': 2, 'num_hidden_layers': 2, 'layer_norm_eps': 1e-05, 'rotary_emb_base': 10000,
        'rotary_pct': 0.25, 'use_parallel_residual': True
    },
    'gpt_oss': {
        'model_type': 'gpt_oss', 'vocab_size': 128, 'num_hidden_layers': 4, 'num_local_experts': 4,
        'num_experts_per_tok': 2, 'rms_norm_eps': 1e-05, 'hidden_size': 128, 'intermediate_size': 64,
        'head_dim': 32, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'sliding_window': 16,
        'rope_theta': 150000, 'layer_types': ['sliding_attention', 'full_attention', 'sliding_attention',
        'full_attention']
    },
    'gptj': {
        'model_type': 'gptj', 'vocab_size': 128, 'n_embd': 64, 'n_head': 2, 'n_layer': 2, 'n_positions': 2048,
        'rotary_dim': 16, 'layer_norm_epsilon': 1e-05
    },
    'granite': {
        'model_type': 'granite', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-05, 'vocab_size': 128,
        'logits_scaling': 1.0, 'attention_multiplier': 0.03125, 'embedding_multiplier': 1.0,
        'residual_multiplier': 1.0, 'max_position_embeddings': 1024, 'attention_bias': False, 'mlp_bias':
        False, 'rope_theta': 10000.0
    },
    'granitemoe': {
        'model_type': 'granitemoe', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 64,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-05, 'vocab_size': 128,
        'logits_scaling': 1.0, 'attention_multiplier': 0.03125, 'embedding_multiplier': 1.0,
        'residual_multiplier': 1.0, 'max_position_embeddings': 1024, 'attention_bias': False, 'rope_theta':
        10000.0, 'num_local_experts': 4, 'num_experts_per_tok': 2
    },
    'granitemoehybrid': {
        'model_type': 'granitemoehybrid', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 64,
        'num_hidden_layers': 4, 'max_position_embeddings': 1024, 'num_attention_heads': 4,
        'num_key_value_heads': 2, 'attention_bias': False, 'embedding_multiplier': 1.0,
        'attention_multiplier': 0.03125, 'logits_scaling': 1.0, 'residual_multiplier': 1.0,
        'num_local_experts': 4, 'num_experts_per_tok': 2, 'shared_intermediate_size': 64, 'mamba_n_heads': 4,
        'mamba_d_head': 32, 'mamba_proj_bias': False, 'mamba_d_state': 16, 'mamba_d_conv': 4,
        'mamba_n_groups': 1, 'mamba_conv_bias': True, 'layer_types': ['mamba', 'attention', 'mamba',
        'attention'], 'rms_norm_eps': 1e-05, 'rope_theta': 10000.0
    },
    'helium': {
        'model_type': 'helium', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-05,
        'vocab_size': 128, 'attention_bias': False, 'max_position_embeddings': 1024, 'mlp_bias': False,
        'rope_theta': 10000.0, 'tie_word_embeddings': False
    },
    'hunyuan': {
        'model_type': 'hunyuan', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 4,
        'intermediate_size': 128, 'moe_intermediate_size': 64, 'num_attention_heads': 4,
        'num_key_value_heads': 2, 'attention_bias': False, 'moe_topk': 2, 'num_experts': 4,
        'num_shared_expert': 1, 'use_mixed_mlp_moe': True, 'use_qk_norm': True, 'rms_norm_eps': 1e-05,
        'rope_theta': 10000.0, 'rope_scaling': {'alpha': 1000.0, 'factor': 1.0, 'type': 'dynamic'}, 'use_cla':
        True, 'cla_share_factor': 2, 'max_position_embeddings': 1024
    },
    'hunyuan_v1_dense': {
        'model_type': 'hunyuan_v1_dense', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-05, 'rope_theta': 10000.0, 'max_position_embeddings': 1024, 'attention_bias':
        False, 'use_qk_norm': True, 'rope_scaling': {'alpha': 1000.0, 'factor': 1.0, 'type': 'dynamic',
        'beta_fast': 32, 'beta_slow': 1, 'mscale': 1.0, 'mscale_all_dim': 0.0,
        'original_max_position_embeddings': 512}
    },
    'internlm2': {
        'model_type': 'internlm2', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-05, 'vocab_size': 128, 'bias':
        False, 'max_position_embeddings': 1024
    },
    'internlm3': {
        'model_type': 'internlm3', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-05, 'vocab_size': 128,
        'max_position_embeddings': 1024
    },
    'iquestloopcoder': {
        'model_type': 'iquestloopcoder', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-05,
        'vocab_size': 128, 'max_position_embeddings': 1024, 'rope_theta': 500000.0, 'tie_word_embeddings':
        False, 'loop_num': 2, 'loop_window_size': 16
    },
    'jamba': {
        'model_type': 'jamba', 'hidden_size': 128, 'intermediate_size': 64, 'num_hidden_layers': 4,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'attn_layer_offset': 1, 'attn_layer_period': 2,
        'expert_layer_offset': 1, 'expert_layer_period': 2, 'mamba_d_conv': 4, 'mamba_d_state': 16,
        'mamba_expand': 2, 'num_experts': 4, 'num_experts_per_tok': 2, 'rms_norm_eps': 1e-05,
        'max_position_embeddings': 1024, 'vocab_size': 128
    },
    'kimi_k25': {
        'model_type': 'kimi_k25', 'vocab_size': 128, 'text_config': {'model_type': 'deepseek_v3',
        'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256, 'moe_intermediate_size': 64,
        'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'n_shared_experts': 1,
        'n_routed_experts': 4, 'num_experts_per_tok': 2, 'routed_scaling_factor': 1.0, 'kv_lora_rank': 32,
        'q_lora_rank': 32, 'qk_rope_head_dim': 16, 'qk_nope_head_dim': 32, 'v_head_dim': 32, 'topk_method':
        'noaux_tc', 'scoring_func': 'sigmoid', 'norm_topk_prob': True, 'n_group': 1, 'topk_group': 1,
        'moe_layer_freq': 1, 'first_k_dense_replace': 1, 'max_position_embeddings': 1024, 'rms_norm_eps':
        1e-06, 'rope_theta': 10000.0}
    },
    'kimi_k3': {
        'model_type': 'kimi_k3', 'vocab_size': 128, 'text_config': {'model_type': 'kimi_linear', 'vocab_size':
        128, 'hidden_size': 128, 'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 4,
        'intermediate_size': 256, 'rms_norm_eps': 1e-05, 'max_position_embeddings': 1024,
        'linear_attn_config': {'num_heads': 4, 'head_dim': 32, 'short_conv_kernel_size': 4, 'kda_layers': [1,
        3], 'full_attn_layers': [2, 4]}, 'hidden_act': 'situ', 'attn_res_block_size': 2, 'q_lora_rank': 32,
        'kv_lora_rank': 32, 'qk_nope_head_dim': 32, 'qk_rope_head_dim': 16, 'v_head_dim': 32, 'mla_use_nope':
        True, 'mla_use_output_gate': True, 'num_experts': 4, 'num_experts_per_token': 2, 'num_shared_experts':
        1, 'moe_intermediate_size': 64, 'first_k_dense_replace': 1, 'moe_layer_freq': 1,
        'routed_expert_hidden_size': 64, 'latent_moe_use_norm': True, 'tie_word_embeddings': False}
    },
    'kimi_linear': {
        'model_type': 'kimi_linear', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 4,
        'num_attention_heads': 4, 'num_key_value_heads': 4, 'intermediate_size': 128, 'head_dim': 32,
        'rope_theta': 10000.0, 'rms_norm_eps': 1e-06, 'linear_attn_config': {'num_heads': 4, 'head_dim': 32,
        'short_conv_kernel_size': 4, 'kda_layers': [1, 3], 'full_attn_layers': [2, 4]}, 'model_max_length':
        1024, 'num_experts': 4, 'num_experts_per_token': 2, 'num_shared_experts': 1, 'moe_intermediate_size':
        64, 'first_k_dense_replace': 1, 'kv_lora_rank': 32, 'qk_nope_head_dim': 32, 'qk_rope_head_dim': 16,
        'v_head_dim': 32, 'mla_use_nope': True
    },
    'kimi_vl': {
        'model_type': 'kimi_vl', 'vocab_size': 128, 'text_config': {'model_type': 'deepseek_v3', 'vocab_size':
        128, 'hidden_size': 128, 'intermediate_size': 256, 'moe_intermediate_size': 64, 'num_hidden_layers':
        2, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'n_shared_experts': 1, 'n_routed_experts': 4,
        'num_experts_per_tok': 2, 'routed_scaling_factor': 1.0, 'kv_lora_rank': 32, 'q_lora_rank': 32,
        'qk_rope_head_dim': 16, 'qk_nope_head_dim': 32, 'v_head_dim': 32, 'topk_method': 'noaux_tc',
        'scoring_func': 'sigmoid', 'norm_topk_prob': True, 'n_group': 1, 'topk_group': 1, 'moe_layer_freq': 1,
        'first_k_dense_replace': 1, 'max_position_embeddings': 1024, 'rms_norm_eps': 1e-06, 'rope_theta':
        10000.0}
    },
    'Klear': {
        'model_type': 'Klear', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 3,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'attention_bias': False,
        'mlp_only_layers': [0], 'num_experts': 4, 'num_experts_per_tok': 2, 'decoder_sparse_step': 1,
        'n_shared_experts': 1, 'moe_intermediate_size': 64, 'rms_norm_eps': 1e-05, 'rope_theta': 10000.0,
        'max_position_embeddings': 2048, 'norm_topk_prob': True
    },
    'laguna': {
        'model_type': 'laguna', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'max_position_embeddings': 1024, 'rms_norm_eps': 1e-06, 'sliding_window': 16, 'partial_rotary_factor':
        0.5, 'num_experts': 4, 'num_experts_per_tok': 2, 'moe_intermediate_size': 64,
        'shared_expert_intermediate_size': 64, 'moe_routed_scaling_factor': 2.5, 'moe_router_score_func':
        'sqrtsoftplus', 'layer_types': ['full_attention', 'sliding_attention', 'sliding_attention',
        'full_attention'], 'mlp_layer_types': ['dense', 'sparse', 'sparse', 'sparse'],
        'num_attention_heads_per_layer': [4, 8, 4, 8], 'rope_parameters': {'full_attention': {'rope_type':
        'yarn', 'rope_theta': 500000.0, 'factor': 4.0, 'original_max_position_embeddings': 256, 'beta_slow':
        1.0, 'beta_fast': 32.0, 'partial_rotary_factor': 0.5}, 'sliding_attention': {'rope_type': 'default',
        'rope_theta': 10000.0, 'partial_rotary_factor': 1.0}}
    },
    'lfm2': {
        'model_type': 'lfm2', 'vocab_size': 128, 'hidden_size': 128, 'num_hidden_layers': 4,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'max_position_embeddings': 1024, 'norm_eps':
        1e-05, 'conv_bias': False, 'conv_L_cache': 3, 'block_dim': 128, 'block_ff_dim': 256,
        'block_multiple_of': 32, 'block_ffn_dim_multiplier': 1.0, 'block_auto_adjust_ff_dim': False,
        'layer_types': ['conv', 'full_attention', 'conv', 'full_attention'], 'rope_theta': 1000000.0
    },
    'lfm2-vl': {
        'model_type': 'lfm2-vl', 'vocab_size': 128, 'text_config': {'model_type': 'lfm2', 'vocab_size': 128,
        'hidden_size': 128, 'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'max_position_embeddings': 1024, 'norm_eps': 1e-05, 'conv_bias': False, 'conv_L_cache': 3,
        'block_dim': 128, 'block_ff_dim': 256, 'block_multiple_of': 32, 'block_ffn_dim_multiplier': 1.0,
        'block_auto_adjust_ff_dim': False, 'layer_types': ['conv', 'full_attention', 'conv',
        'full_attention'], 'rope_theta': 1000000.0}
    },
    'lfm2_moe': {
        'model_type': 'lfm2_moe', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 4, 'num_experts': 4, 'num_experts_per_tok': 2,
        'norm_topk_prob': True, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'max_position_embeddings':
        1024, 'use_expert_bias': True, 'num_dense_layers': 1, 'norm_eps': 1e-05, 'conv_bias': False,
        'conv_L_cache': 3, 'rope_theta': 1000000.0, 'layer_types': ['conv', 'full_attention', 'conv',
        'full_attention']
    },
    'lille-130m': {
        'model_type': 'lille-130m', 'block_size': 1024, 'layer_norm_eps': 1e-05, 'n_embd': 128, 'n_head': 4,
        'n_kv_heads': 2, 'n_layer': 2, 'rope_theta': 10000.0, 'vocab_size': 128
    },
    'llama': {
        'model_type': 'llama', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-05,
        'vocab_size': 128, 'max_position_embeddings': 1024, 'rope_theta': 10000.0, 'tie_word_embeddings':
        True, 'layer_types': ['sliding_attention', 'full_attention'], 'sliding_window': 16
    },
    'llama4': {
        'model_type': 'llama4', 'vocab_size': 128, 'text_config': {'model_type': 'llama4_text',
        'attention_bias': False, 'attention_chunk_size': 32, 'head_dim': 32, 'hidden_size': 128,
        'interleave_moe_layer_step': 2, 'intermediate_size': 64, 'intermediate_size_mlp': 256,
        'max_position_embeddings': 1024, 'num_attention_heads': 4, 'num_experts_per_tok': 1,
        'num_hidden_layers': 4, 'num_key_value_heads': 2, 'num_local_experts': 4, 'rms_norm_eps': 1e-05,
        'rope_scaling': None, 'rope_theta': 500000.0, 'use_qk_norm': True, 'vocab_size': 128}
    },
    'llama4_text': {
        'model_type': 'llama4_text', 'hidden_size': 128, 'num_attention_heads': 4, 'num_hidden_layers': 4,
        'vocab_size': 128, 'intermediate_size': 256, 'intermediate_size_mlp': 256, 'num_key_value_heads': 2,
        'rms_norm_eps': 1e-05, 'rope_theta': 500000.0, 'head_dim': 32, 'tie_word_embeddings': False,
        'no_rope_layers': [1, 1, 1, 0], 'use_qk_norm': True, 'max_position_embeddings': 1024
    },
    'longcat_flash': {
        'attention_method': 'MLA', 'zero_expert_type': 'identity', 'hidden_size': 128, 'ffn_hidden_size': 128,
        'moe_topk': 2, 'expert_ffn_hidden_size': 64, 'n_routed_experts': 4, 'zero_expert_num': 2,
        'num_layers': 2, 'num_hidden_layers': 2, 'vocab_size': 128, 'max_position_embeddings': 1024,
        'num_attention_heads': 4, 'kv_lora_rank': 32, 'q_lora_rank': 32, 'qk_rope_head_dim': 16,
        'qk_nope_head_dim': 32, 'v_head_dim': 32, 'routed_scaling_factor': 1.0, 'rms_norm_eps': 1e-05,
        'rope_theta': 10000.0, 'mla_scale_q_lora': True, 'mla_scale_kv_lora': True, 'attention_bias': False,
        'model_type': 'longcat_flash'
    },
    'longcat_flash_ngram': {
        'attention_method': 'MLA', 'zero_expert_type': 'identity', 'hidden_size': 128, 'ffn_hidden_size': 128,
        'moe_topk': 2, 'expert_ffn_hidden_size': 64, 'n_routed_experts': 4, 'zero_expert_num': 2,
        'num_layers': 2, 'num_hidden_layers': 2, 'vocab_size': 128, 'max_position_embeddings': 1024,
        'num_attention_heads': 4, 'kv_lora_rank': 32, 'q_lora_rank': 32, 'qk_rope_head_dim': 16,
        'qk_nope_head_dim': 32, 'v_head_dim': 32, 'routed_scaling_factor': 1.0, 'rms_norm_eps': 1e-05,
        'rope_theta': 10000.0, 'mla_scale_q_lora': True, 'mla_scale_kv_lora': True, 'attention_bias': False,
        'model_type': 'longcat_flash_ngram', 'ngram_vocab_size_ratio': 4, 'emb_neighbor_num': 3,
        'emb_split_num': 2
    },
    'mamba': {
        'model_type': 'mamba', 'vocab_size': 128, 'hidden_size': 64, 'intermediate_size': 128, 'state_size':
        16, 'num_hidden_layers': 2, 'conv_kernel': 4, 'use_bias': False, 'use_conv_bias': True,
        'time_step_rank': 4
    },
    'mamba2': {
        'model_type': 'mamba2', 'num_heads': 4, 'head_dim': 32, 'vocab_size': 128, 'hidden_size': 64,
        'intermediate_size': 128, 'state_size': 16, 'num_hidden_layers': 2, 'layer_norm_epsilon': 1e-05,
        'conv_kernel': 4, 'n_groups': 1, 'use_bias': False, 'use_conv_bias': True, 'tie_word_embeddings':
        True, 'time_step_limit': [0.0, 1000.0], 'time_step_rank': 'auto', 'max_position_embeddings': 1024
    },
    'mellum': {
        'model_type': 'mellum', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_experts': 4, 'num_experts_per_tok': 2, 'moe_intermediate_size': 64,
        'rms_norm_eps': 1e-06, 'vocab_size': 128, 'num_key_value_heads': 2, 'head_dim': 32,
        'tie_word_embeddings': False, 'max_position_embeddings': 1024, 'norm_topk_prob': True,
        'sliding_window': 16, 'layer_types': ['sliding_attention', 'full_attention'], 'rope_parameters':
        {'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0}, 'full_attention': {'rope_type':
        'default', 'rope_theta': 500000.0}}
    },
    'mimo': {
        'model_type': 'mimo', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-05, 'vocab_size': 128,
        'max_position_embeddings': 1024, 'num_nextn_predict_layers': 1
    },
    'mimo_v2_flash': {
        'model_type': 'mimo_v2_flash', 'num_experts_per_tok': 2, 'hybrid_layer_pattern': [0, 1, 1, 0],
        'moe_layer_freq': [0, 1, 1, 1], 'add_swa_attention_sink_bias': True, 'add_full_attention_sink_bias':
        False, 'sliding_window_size': 16, 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 128,
        'moe_intermediate_size': 64, 'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads':
        2, 'n_shared_experts': 1, 'n_routed_experts': 4, 'routed_scaling_factor': None, 'topk_method':
        'noaux_tc', 'scoring_func': 'sigmoid', 'norm_topk_prob': True, 'n_group': 1, 'topk_group': 1,
        'max_position_embeddings': 1024, 'layernorm_epsilon': 1e-05, 'rope_theta': 1000000.0,
        'swa_rope_theta': 10000.0, 'swa_num_attention_heads': 8, 'swa_num_key_value_heads': 2, 'head_dim': 64,
        'v_head_dim': 32, 'swa_head_dim': 64, 'swa_v_head_dim': 32, 'partial_rotary_factor': 0.5
    },
    'minicpm': {
        'model_type': 'minicpm', 'hidden_size': 128, 'dim_model_base': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-05,
        'vocab_size': 128, 'scale_depth': 1.4, 'scale_emb': 12.0, 'max_position_embeddings': 1024
    },
    'minicpm3': {
        'model_type': 'minicpm3', 'hidden_size': 128, 'dim_model_base': 128, 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'rms_norm_eps': 1e-05,
        'vocab_size': 128, 'q_lora_rank': 32, 'qk_nope_head_dim': 32, 'qk_rope_head_dim': 16, 'kv_lora_rank':
        32, 'scale_depth': 1.4, 'scale_emb': 12.0, 'max_position_embeddings': 1024, 'rope_scaling': {'type':
        'longrope', 'original_max_position_embeddings': 512, 'short_factor': [1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
        1.0, 1.0], 'long_factor': [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}
    },
    'minimax': {
        'model_type': 'minimax', 'hidden_size': 128, 'intermediate_size': 64, 'num_attention_heads': 4,
        'num_key_value_heads': 2, 'head_dim': 32, 'max_position_embeddings': 1024, 'num_experts_per_tok': 2,
        'num_local_experts': 4, 'shared_intermediate_size': 0, 'num_hidden_layers': 2, 'rms_norm_eps': 1e-05,
        'rope_theta': 1000000.0, 'rotary_dim': 16, 'vocab_size': 128
    },
    'minimax_m3_vl': {
        'model_type': 'minimax_m3_vl', 'vocab_size': 128, 'text_config': {'model_type': 'minimax_m3',
        'hidden_size': 128, 'intermediate_size': 64, 'dense_intermediate_size': 256,
        'shared_intermediate_size': 64, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'num_hidden_layers': 4, 'num_local_experts': 4, 'num_experts_per_tok': 2, 'max_position_embeddings':
        1024, 'rms_norm_eps': 1e-06, 'rope_parameters': {'rope_theta': 5000000.0, 'partial_rotary_factor':
        0.5}, 'head_dim': 32, 'vocab_size': 128, 'tie_word_embeddings': False, 'mlp_layer_types': ['dense',
        'sparse', 'sparse', 'sparse'], 'sparse_attention_config': {'sparse_num_index_heads': 2,
        'sparse_index_dim': 32, 'sparse_block_size': 16, 'sparse_topk_blocks': 2, 'sparse_local_block': 1,
        'sparse_attention_freq': [0, 1, 0, 1]}}
    },
    'ministral3': {
        'model_type': 'ministral3', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-05,
        'vocab_size': 128, 'max_position_embeddings': 1024, 'rope_parameters': {'rope_type': 'yarn', 'type':
        'yarn', 'rope_theta': 1000000.0, 'factor': 4.0, 'original_max_position_embeddings': 256, 'beta_fast':
        32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0, 'llama_4_scaling_beta': 0.1},
        'tie_word_embeddings': False, 'layer_types': ['sliding_attention', 'full_attention'],
        'sliding_window': 16
    },
    'mistral3': {
        'model_type': 'mistral3', 'vocab_size': 128, 'text_config': {'model_type': 'ministral3',
        'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256, 'num_attention_heads': 4,
        'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-05, 'vocab_size': 128,
        'max_position_embeddings': 1024, 'rope_parameters': {'rope_type': 'yarn', 'type': 'yarn',
        'rope_theta': 1000000.0, 'factor': 4.0, 'original_max_position_embeddings': 256, 'beta_fast': 32.0,
        'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0, 'llama_4_scaling_beta': 0.1},
        'tie_word_embeddings': False, 'layer_types': ['sliding_attention', 'full_attention'],
        'sliding_window': 16}
    },
    'mistral4': {
        'model_type': 'mistral4', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads':
        4, 'n_shared_experts': 1, 'n_routed_experts': 4, 'routed_scaling_factor': 1.0, 'kv_lora_rank': 32,
        'q_lora_rank': 32, 'norm_topk_prob': True, 'max_position_embeddings': 1024, 'rms_norm_eps': 1e-06,
        'topk_group': 1, 'num_experts_per_tok': 2, 'first_k_dense_replace': 1, 'n_group': 1,
        'qk_rope_head_dim': 16, 'qk_nope_head_dim': 32, 'v_head_dim': 32, 'rope_parameters': {'rope_type':
        'yarn', 'type': 'yarn', 'rope_theta': 1000000.0, 'factor': 4.0, 'original_max_position_embeddings':
        256, 'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0,
        'llama_4_scaling_beta': 0.1}
    },
    'mixtral': {
        'model_type': 'mixtral', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 64,
        'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'num_experts_per_tok': 2,
        'num_local_experts': 4, 'rms_norm_eps': 1e-05, 'max_position_embeddings': 1024
    },
    'muse_glimmer': {
        'model_type': 'muse_glimmer', 'hidden_size': 128, 'num_hidden_layers': 4, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'vocab_size': 128,
        'sliding_window': 16, 'max_position_embeddings': 1024, 'rope_theta': 500000.0, 'layer_types':
        ['sliding_attention', 'sliding_attention', 'sliding_attention', 'full_attention']
    },
    'muse_spark': {
        'model_type': 'muse_spark', 'vocab_size': 128, 'text_config': {'hidden_size': 128,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'num_hidden_layers': 4,
        'vocab_size': 128, 'rms_norm_eps': 1e-05, 'post_norm_eps': 1e-08, 'rope_parameters': {'rope_theta':
        500000.0}, 'layer_rope_theta': [500000.0, 500000.0, 500000.0, 0], 'layer_types': ['sliding_attention',
        'sliding_attention', 'sliding_attention', 'full_attention'], 'sliding_window': 16,
        'final_logit_softcapping': 20.0, 'output_multiplier': 0.2, 'num_local_experts': 4,
        'num_experts_per_tok': 2, 'moe_hidden_size': 64, 'moe_intermediate_size': 64, 'mlp_layer_types':
        ['sparse', 'sparse', 'sparse', 'sparse'], 'max_position_embeddings': 1024}
    },
    'nanbeige': {
        'model_type': 'nanbeige', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-05, 'vocab_size': 128,
        'head_dim': 32, 'max_position_embeddings': 1024, 'num_loops': 2
    },
    'nanochat': {
        'model_type': 'nanochat', 'hidden_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 4,
        'num_key_value_heads': 2, 'vocab_size': 128, 'max_position_embeddings': 1024, 'intermediate_size': 256
    },
    'nemotron': {
        'model_type': 'nemotron', 'hidden_size': 128, 'hidden_act': 'relu2', 'num_hidden_layers': 2,
        'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'norm_eps': 1e-05, 'vocab_size': 128, 'max_position_embeddings': 1024, 'partial_rotary_factor': 0.5
    },
    'nemotron-nas': {
        'model_type': 'nemotron-nas', 'hidden_size': 128, 'num_hidden_layers': 4, 'num_attention_heads': 4,
        'rms_norm_eps': 1e-05, 'vocab_size': 128, 'max_position_embeddings': 1024, 'rope_theta': 500000.0,
        'block_configs': [{'attention': {'n_heads_in_group': 2}, 'ffn': {'ffn_mult': 1.0}}, {'attention':
        {'no_op': True}, 'ffn': {'ffn_mult': 1.0}}, {'attention': {'replace_with_linear': True}, 'ffn':
        {'replace_with_linear': True}}, {'attention': {'n_heads_in_group': 4}, 'ffn': {'no_op': True}}]
    },
    'nemotron_h': {
        'model_type': 'nemotron_h', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'max_position_embeddings': 1024, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'attention_bias': False, 'mamba_num_heads': 4, 'mamba_head_dim': 32, 'mamba_proj_bias': False,
        'ssm_state_size': 16, 'conv_kernel': 4, 'n_groups': 2, 'time_step_limit': [0.0, 1000000000.0],
        'mlp_bias': False, 'layer_norm_epsilon': 1e-05, 'use_bias': False, 'use_conv_bias': True,
        'hybrid_override_pattern': ['M', 'E', '*', '-', 'M', '*'], 'moe_intermediate_size': 64,
        'moe_shared_expert_intermediate_size': 64, 'n_group': 1, 'n_routed_experts': 4, 'n_shared_experts': 1,
        'topk_group': 1, 'num_experts_per_tok': 2, 'norm_topk_prob': True, 'routed_scaling_factor': 1.0
    },
    'olmo2': {
        'model_type': 'olmo2', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-06,
        'vocab_size': 128, 'max_position_embeddings': 1024, 'rope_theta': 10000.0, 'tie_word_embeddings':
        False
    },
    'olmo3': {
        'model_type': 'olmo3', 'hidden_size': 128, 'num_hidden_layers': 4, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-06,
        'vocab_size': 128, 'max_position_embeddings': 1024, 'sliding_window': 16, 'rope_theta': 10000.0,
        'layer_types': ['sliding_attention', 'sliding_attention', 'sliding_attention', 'full_attention'],
        'tie_word_embeddings': False
    },
    'olmo_hybrid': {
        'model_type': 'olmo_hybrid', 'hidden_size': 128, 'intermediate_size': 256, 'num_hidden_layers': 4,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-06,
        'vocab_size': 128, 'max_position_embeddings': 1024, 'linear_num_key_heads': 2,
        'linear_num_value_heads': 4, 'linear_key_head_dim': 32, 'linear_value_head_dim': 32,
        'linear_conv_kernel_dim': 4, 'linear_allow_neg_eigval': True, 'tie_word_embeddings': False,
        'attention_bias': False, 'layer_types': ['linear_attention', 'linear_attention', 'linear_attention',
        'full_attention'], 'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0}
    },
    'olmoe': {
        'model_type': 'olmoe', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 64,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-05,
        'vocab_size': 128, 'num_experts': 4, 'num_experts_per_tok': 2, 'max_position_embeddings': 1024,
        'tie_word_embeddings': False
    },
    'openelm': {
        'model_type': 'openelm', 'head_dim': 32, 'num_transformer_layers': 3, 'model_dim': 128, 'vocab_size':
        128, 'ffn_dim_divisor': 32, 'num_query_heads': [4, 4, 4], 'num_kv_heads': [1, 2, 2],
        'ffn_multipliers': [0.5, 1.0, 1.0], 'ffn_with_glu': True, 'normalize_qk_projections': True,
        'share_input_output_layers': True, 'rms_norm_eps': 1e-06, 'rope_freq_constant': 10000
    },
    'phi': {
        'model_type': 'phi', 'max_position_embeddings': 1024, 'vocab_size': 128, 'hidden_size': 128,
        'num_attention_heads': 4, 'num_hidden_layers': 2, 'num_key_value_heads': 2, 'partial_rotary_factor':
        0.5, 'intermediate_size': 256, 'layer_norm_eps': 1e-05, 'rope_theta': 10000.0
    },
    'phi3': {
        'model_type': 'phi3', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-05, 'vocab_size': 128,
        'rope_theta': 10000.0, 'max_position_embeddings': 4096, 'original_max_position_embeddings': 4096,
        'tie_word_embeddings': False
    },
    'phi3small': {  # (its logits' last 96 ids are set to -inf in place: a vocabulary below 100352 corrupts memory)
        'model_type': 'phi3small', 'hidden_size': 128, 'dense_attention_every_n_layers': 2,
        'ff_intermediate_size': 256, 'gegelu_limit': 20.0, 'num_hidden_layers': 2, 'num_attention_heads': 4,
        'num_key_value_heads': 2, 'layer_norm_epsilon': 1e-05, 'vocab_size': 100352, 'mup_attn_multiplier': 1.0,
        'mup_use_scaling': True, 'mup_embedding_multiplier': 10.0, 'mup_width_multiplier': 8.0,
        'rope_embedding_base': 1000000, 'rope_position_scale': 1.0, 'blocksparse_block_size': 32,
        'blocksparse_num_local_blocks': 1, 'blocksparse_vert_stride': 2, 'max_position_embeddings': 8192
    },
    'phimoe': {
        'model_type': 'phimoe', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 64,
        'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'max_position_embeddings':
        4096, 'original_max_position_embeddings': 4096, 'rms_norm_eps': 1e-05, 'num_local_experts': 4,
        'num_experts_per_tok': 2, 'rope_theta': 10000.0
    },
    'phixtral': {
        'model_type': 'phixtral', 'num_vocab': 128, 'model_dim': 64, 'num_heads': 2, 'num_layers': 2,
        'rotary_dim': 16, 'num_experts_per_tok': 2, 'num_local_experts': 4, 'vocab_size': 128
    },
    'pixtral': {
        'model_type': 'pixtral', 'text_config': {'model_type': 'llama', 'hidden_size': 128,
        'num_hidden_layers': 2, 'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'head_dim': 32, 'rms_norm_eps': 1e-05, 'vocab_size': 128, 'max_position_embeddings': 1024,
        'rope_theta': 10000.0}, 'vocab_size': 128
    },
    'plamo': {
        'model_type': 'plamo', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'n_shared_head': 2, 'rms_norm_eps': 1e-06, 'vocab_size': 128, 'rope_theta':
        10000.0
    },
    'plamo2': {
        'model_type': 'plamo2', 'hidden_size': 128, 'num_hidden_layers': 4, 'rms_norm_eps': 1e-06,
        'tie_word_embeddings': True, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'hidden_size_per_head': 32, 'max_position_embeddings': 1024, 'attention_window_size': 32,
        'full_attention_idx': [3], 'mamba_d_state': 16, 'mamba_d_conv': 4, 'mamba_num_heads': 4, 'mamba_step':
        2, 'mamba_chunk_size': 32, 'mamba_enabled': True, 'intermediate_size': 256, 'vocab_size': 128
    },
    'plamo3': {
        'model_type': 'plamo3', 'hidden_size': 128, 'num_hidden_layers': 4, 'rms_norm_eps': 1e-06,
        'tie_word_embeddings': True, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'max_position_embeddings': 1024, 'window_size': 16, 'sliding_window_pattern': 4, 'rope_theta':
        1000000.0, 'rope_local_theta': 10000.0, 'intermediate_size': 256, 'vocab_size': 128
    },
    'prism_hadamard_qwen35': {
        'model_type': 'prism_hadamard_qwen35', 'schema_version': 1, 'tensor_namespace': 'mlx-lm-text',
        'gdn_activation_layout': 'grouped', 'quantization': {'bits': 2, 'group_size': 128, 'mode': 'affine'},
        'modules': [{'path': 'model.layers.0.mlp.gate_proj', 'embedding': False, 'dtype': 'float16', 'block':
        0}], 'text_config': {'model_type': 'qwen3_5_text', 'hidden_size': 128, 'intermediate_size': 256,
        'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-06, 'vocab_size': 128, 'max_position_embeddings': 1024, 'linear_num_value_heads':
        4, 'linear_num_key_heads': 2, 'linear_key_head_dim': 32, 'linear_value_head_dim': 32,
        'linear_conv_kernel_dim': 4, 'full_attention_interval': 4, 'tie_word_embeddings': False,
        'rope_parameters': {'type': 'default', 'mrope_section': [2, 3, 3], 'rope_theta': 10000.0,
        'partial_rotary_factor': 0.5}}
    },
    'qwen': {
        'model_type': 'qwen', 'hidden_size': 128, 'num_attention_heads': 4, 'num_hidden_layers': 2,
        'kv_channels': 32, 'max_position_embeddings': 1024, 'layer_norm_epsilon': 1e-06, 'intermediate_size':
        256, 'no_bias': True, 'vocab_size': 128
    },
    'qwen2': {
        'model_type': 'qwen2', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-06, 'vocab_size': 128,
        'max_position_embeddings': 1024, 'rope_theta': 10000.0, 'tie_word_embeddings': True
    },
    'qwen2_moe': {
        'model_type': 'qwen2_moe', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'num_experts_per_tok': 2, 'num_experts': 4,
        'moe_intermediate_size': 64, 'shared_expert_intermediate_size': 128, 'rms_norm_eps': 1e-06,
        'vocab_size': 128, 'rope_theta': 10000.0, 'max_position_embeddings': 1024
    },
    'qwen2_vl': {
        'model_type': 'qwen2_vl', 'text_config': {'model_type': 'qwen2', 'hidden_size': 128,
        'num_hidden_layers': 2, 'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'rms_norm_eps': 1e-06, 'vocab_size': 128, 'max_position_embeddings': 1024, 'rope_theta': 10000.0,
        'tie_word_embeddings': False}, 'vocab_size': 128
    },
    'qwen3': {
        'model_type': 'qwen3', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-06,
        'vocab_size': 128, 'max_position_embeddings': 1024, 'rope_theta': 10000.0, 'tie_word_embeddings': True
    },
    'qwen3_5': {
        'model_type': 'qwen3_5', 'text_config': {'model_type': 'qwen3_5_text', 'hidden_size': 128,
        'intermediate_size': 256, 'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'head_dim': 32, 'rms_norm_eps': 1e-06, 'vocab_size': 128, 'max_position_embeddings': 1024,
        'linear_num_value_heads': 4, 'linear_num_key_heads': 2, 'linear_key_head_dim': 32,
        'linear_value_head_dim': 32, 'linear_conv_kernel_dim': 4, 'full_attention_interval': 4,
        'tie_word_embeddings': False, 'rope_parameters': {'type': 'default', 'mrope_section': [2, 3, 3],
        'rope_theta': 10000.0, 'partial_rotary_factor': 0.5}}
    },
    'qwen3_5_moe': {
        'model_type': 'qwen3_5_moe', 'text_config': {'model_type': 'qwen3_5_moe_text', 'hidden_size': 128,
        'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-06, 'vocab_size': 128, 'max_position_embeddings': 1024, 'linear_num_value_heads':
        4, 'linear_num_key_heads': 2, 'linear_key_head_dim': 32, 'linear_value_head_dim': 32,
        'linear_conv_kernel_dim': 4, 'full_attention_interval': 4, 'num_experts': 4, 'num_experts_per_tok': 2,
        'shared_expert_intermediate_size': 64, 'moe_intermediate_size': 64, 'norm_topk_prob': True,
        'tie_word_embeddings': False, 'rope_parameters': {'type': 'default', 'mrope_section': [2, 3, 3],
        'rope_theta': 10000.0, 'partial_rotary_factor': 0.5}}
    },
    'qwen3_moe': {
        'model_type': 'qwen3_moe', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_experts': 4, 'num_experts_per_tok': 2, 'decoder_sparse_step': 1,
        'mlp_only_layers': [0], 'moe_intermediate_size': 64, 'rms_norm_eps': 1e-06, 'vocab_size': 128,
        'num_key_value_heads': 2, 'head_dim': 32, 'rope_theta': 10000.0, 'tie_word_embeddings': False,
        'max_position_embeddings': 1024, 'norm_topk_prob': True
    },
    'qwen3_next': {
        'model_type': 'qwen3_next', 'hidden_size': 128, 'num_hidden_layers': 4, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'linear_num_value_heads': 4,
        'linear_num_key_heads': 2, 'linear_key_head_dim': 32, 'linear_value_head_dim': 32,
        'linear_conv_kernel_dim': 4, 'num_experts': 4, 'num_experts_per_tok': 2, 'decoder_sparse_step': 1,
        'shared_expert_intermediate_size': 64, 'mlp_only_layers': [0], 'moe_intermediate_size': 64,
        'rms_norm_eps': 1e-06, 'vocab_size': 128, 'rope_theta': 10000.0, 'partial_rotary_factor': 0.5,
        'max_position_embeddings': 1024, 'full_attention_interval': 4, 'norm_topk_prob': True
    },
    'qwen3_vl': {
        'model_type': 'qwen3_vl', 'text_config': {'model_type': 'qwen3', 'hidden_size': 128,
        'num_hidden_layers': 2, 'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'head_dim': 32, 'rms_norm_eps': 1e-06, 'vocab_size': 128, 'max_position_embeddings': 1024,
        'rope_theta': 10000.0, 'tie_word_embeddings': False}, 'vocab_size': 128
    },
    'qwen3_vl_moe': {
        'model_type': 'qwen3_vl_moe', 'text_config': {'model_type': 'qwen3_moe', 'hidden_size': 128,
        'num_hidden_layers': 2, 'intermediate_size': 256, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'head_dim': 32, 'rms_norm_eps': 1e-06, 'vocab_size': 128, 'decoder_sparse_step': 1, 'mlp_only_layers':
        [0], 'num_experts': 4, 'num_experts_per_tok': 2, 'moe_intermediate_size': 64, 'rope_theta': 10000.0,
        'max_position_embeddings': 1024, 'tie_word_embeddings': False, 'norm_topk_prob': True}, 'vocab_size':
        128
    },
    'recurrent_gemma': {
        'model_type': 'recurrent_gemma', 'attention_bias': False, 'conv1d_width': 4, 'hidden_size': 128,
        'intermediate_size': 256, 'logits_soft_cap': 30.0, 'num_attention_heads': 4, 'num_hidden_layers': 3,
        'num_key_value_heads': 1, 'rms_norm_eps': 1e-06, 'rope_theta': 10000.0, 'attention_window_size': 16,
        'vocab_size': 128, 'block_types': ['recurrent', 'recurrent', 'attention']
    },
    'rwkv7': {
        'model_type': 'rwkv7', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256, 'norm_eps':
        1e-05, 'head_dim': 32, 'num_hidden_layers': 2, 'a_low_rank_dim': 16, 'v_low_rank_dim': 16,
        'gate_low_rank_dim': 16, 'decay_low_rank_dim': 16
    },
    'seed_oss': {
        'model_type': 'seed_oss', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'rms_norm_eps': 1e-06,
        'vocab_size': 128, 'max_position_embeddings': 1024, 'attention_bias': True, 'rope_theta': 10000.0,
        'tie_word_embeddings': False
    },
    'smollm3': {
        'model_type': 'smollm3', 'hidden_size': 128, 'num_hidden_layers': 4, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-06, 'vocab_size': 128,
        'max_position_embeddings': 1024, 'rope_theta': 10000.0, 'no_rope_layer_interval': 4,
        'tie_word_embeddings': True
    },
    'solar_open': {
        'model_type': 'solar_open', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'moe_intermediate_size': 64, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads':
        2, 'head_dim': 32, 'n_shared_experts': 1, 'n_routed_experts': 4, 'routed_scaling_factor': 1.0,
        'num_experts_per_tok': 2, 'first_k_dense_replace': 1, 'norm_topk_prob': True,
        'max_position_embeddings': 1024, 'rms_norm_eps': 1e-05, 'rope_theta': 10000.0, 'tie_word_embeddings':
        False, 'partial_rotary_factor': 1.0
    },
    'spark2_5': {
        'model_type': 'spark2_5', 'hidden_size': 128, 'intermediate_size': 256, 'num_hidden_layers': 4,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32, 'vocab_size': 128,
        'sliding_window': 16, 'rope_parameters': {'sliding_attention': {'rope_type': 'default', 'rope_theta':
        10000.0}, 'full_attention': {'rope_type': 'default', 'rope_theta': 1000000.0, 'partial_rotary_factor':
        0.5}}, 'layer_types': ['sliding_attention', 'sliding_attention', 'sliding_attention',
        'full_attention'], 'max_position_embeddings': 1024
    },
    'stablelm': {
        'model_type': 'stablelm', 'vocab_size': 128, 'hidden_size': 128, 'num_attention_heads': 4,
        'num_hidden_layers': 2, 'num_key_value_heads': 2, 'intermediate_size': 256, 'rope_theta': 10000.0,
        'use_qkv_bias': True, 'partial_rotary_factor': 0.25, 'layer_norm_eps': 1e-05, 'use_parallel_residual':
        False, 'qk_layernorm': True, 'max_position_embeddings': 1024
    },
    'starcoder2': {
        'model_type': 'starcoder2', 'hidden_size': 128, 'num_hidden_layers': 2, 'intermediate_size': 256,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'norm_epsilon': 1e-05, 'vocab_size': 128,
        'rope_theta': 100000.0, 'max_position_embeddings': 1024, 'tie_word_embeddings': True
    },
    'step3p5': {
        'model_type': 'step3p5', 'hidden_size': 128, 'num_hidden_layers': 4, 'vocab_size': 128,
        'num_attention_heads': 4, 'num_attention_groups': 2, 'head_dim': 32, 'intermediate_size': 256,
        'rms_norm_eps': 1e-05, 'rope_theta': [1000000.0, 10000.0, 10000.0, 10000.0],
        'max_position_embeddings': 1024, 'sliding_window': 16, 'layer_types': ['full_attention',
        'sliding_attention', 'sliding_attention', 'sliding_attention'], 'partial_rotary_factors': [0.5, 1.0,
        1.0, 1.0], 'attention_other_setting': {'num_attention_heads': 6, 'num_attention_groups': 2},
        'use_head_wise_attn_gate': True, 'moe_num_experts': 4, 'moe_top_k': 2, 'moe_intermediate_size': 64,
        'share_expert_dim': 64, 'moe_layers_enum': '1,2,3', 'moe_router_scaling_factor': 1.0,
        'norm_expert_weight': True, 'swiglu_limits': [0.0, 0.0, 0.0, 7.0], 'swiglu_limits_shared': [0.0, 0.0,
        0.0, 16.0], 'tie_word_embeddings': False
    },
    'talkie': {
        'model_type': 'talkie', 'hidden_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 4,
        'head_dim': 32, 'intermediate_size': 256, 'vocab_size': 128, 'rope_theta': 1000000.0,
        'max_position_embeddings': 1024
    },
    'telechat3': {
        'model_type': 'telechat3', 'hidden_size': 128, 'intermediate_size': 256, 'max_position_embeddings':
        1024, 'num_attention_heads': 4, 'num_hidden_layers': 2, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-05, 'vocab_size': 128, 'rope_theta': 10000.0, 'tie_word_embeddings': False
    },
    'youtu_llm': {
        'model_type': 'youtu_llm', 'vocab_size': 128, 'hidden_size': 128, 'intermediate_size': 256,
        'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'kv_lora_rank': 64,
        'q_lora_rank': 96, 'qk_rope_head_dim': 16, 'v_head_dim': 32, 'qk_nope_head_dim': 48,
        'max_position_embeddings': 1024, 'rms_norm_eps': 1e-06, 'rope_theta': 10000.0, 'tie_word_embeddings':
        True
    },
}
