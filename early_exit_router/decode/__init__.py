"""The decode core: one loop for one sequence or a batch, with layer-wise KV filling."""
