import math, torch, tqdecode

device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the C++ reference (slow)
preset, head_dim, block_size, num_kv_heads, num_q_heads = "turboquant_4bit_nc", 128, 16, 8, 32
layout = tqdecode.cache_layout(preset, head_dim, block_size, num_kv_heads)
centroids, Pi, _ = tqdecode.make_model_constants(preset, head_dim, seed=0, device=device)
kv_cache = tqdecode.allocate_cache(64, block_size, num_kv_heads, head_dim, preset, device=device)
key, value = torch.randn(2, 100, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device)
tqdecode.store(key, value, kv_cache, torch.arange(100, device=device), Pi, centroids, preset)  # tokens -> slots 0..99
query = torch.randn(1, num_q_heads, head_dim, dtype=torch.bfloat16, device=device)
block_table, seq_lens = torch.arange(7, dtype=torch.int32, device=device)[None], torch.tensor([100], dtype=torch.int32, device=device)
args = (query, kv_cache, block_table, seq_lens, Pi, centroids, 1 / math.sqrt(head_dim))
out = tqdecode.turboquant_decode_attention(*args, **layout.decode_kwargs())
print(out.shape, out.dtype, tqdecode.decode_path(*args, **layout.decode_kwargs()))
