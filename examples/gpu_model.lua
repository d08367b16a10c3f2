--[[ examples/gpu_model.lua — the DeepSeek-V4-architecture model of the GPU demonstration (examples/dapo.lua
--arch gpu --task mul): every layer type (sliding, CSA with its lightning indexer, HCA), two hash-routed layers then
learned MoE with a shared expert, mHC with 4 streams; ~220 M parameters, ~90 M of them active per token, over a
byte-level vocabulary. Sized for one GPU: a training step of the RL loop takes tens of milliseconds, so SFT warm-up
and DAPO together fit in minutes. Returns a function tok -> the config table for ds4.new_model.

The sliding window (32) covers a whole problem and its answer (about 20 tokens), so the task never depends on the
compressed entries alone; the compress rates (4 and 8) still give every CSA / HCA layer complete windows to attend.
]]
return function(tok)
    local layer_types, mlp_types = {}, {}
    local cycle = { "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention" }
    for i = 1, 12 do
        layer_types[i] = cycle[(i - 1) % 3 + 1]
        mlp_types[i] = i <= 2 and "hash_moe" or "moe"
    end
    return {
        vocab_size = tok:vocab_size(), hidden_size = 768, num_hidden_layers = 12,
        num_attention_heads = 12, head_dim = 64, qk_rope_head_dim = 32, q_lora_rank = 384,
        o_groups = 4, o_lora_rank = 384, sliding_window = 32,
        layer_types = layer_types,
        compress_rates = { compressed_sparse_attention = 4, heavily_compressed_attention = 8 },
        mlp_layer_types = mlp_types,
        index_n_heads = 8, index_head_dim = 64, index_topk = 4,
        n_routed_experts = 8, num_experts_per_tok = 2, moe_intermediate_size = 768, n_shared_experts = 1,
        hc_mult = 4, num_nextn_predict_layers = 0, initializer_range = 0.02,
        bos_token_id = tok:special("bos"), eos_token_id = tok:special("eos"),
    }
end
