--[[ examples/small_model.lua — the small DeepSeek-V4-architecture model the examples train from scratch: every
layer type (sliding, CSA with its lightning indexer, HCA), hash-routed and learned MoE, mHC with 2 streams; about
0.6 M parameters over a byte-level vocabulary. Returns a function tok -> the config table for ds4.new_model (its
vocabulary and BOS / EOS are the tokenizer's).

  local config = dofile(ds4.script_dir() .. "/small_model.lua")(tok)
]]
return function(tok)
    return {
        vocab_size = tok:vocab_size(), hidden_size = 64, num_hidden_layers = 4,
        num_attention_heads = 4, head_dim = 32, qk_rope_head_dim = 16, q_lora_rank = 32,
        o_groups = 2, o_lora_rank = 32, sliding_window = 16,
        layer_types = { "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention" },
        compress_rates = { compressed_sparse_attention = 4, heavily_compressed_attention = 8 },
        mlp_layer_types = { "hash_moe", "moe", "moe", "moe" },
        index_n_heads = 4, index_head_dim = 32, index_topk = 4,
        n_routed_experts = 8, num_experts_per_tok = 2, moe_intermediate_size = 64,
        hc_mult = 2, num_nextn_predict_layers = 0, initializer_range = 0.05,
        bos_token_id = tok:special("bos"), eos_token_id = tok:special("eos"),
    }
end
