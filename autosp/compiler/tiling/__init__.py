"""Pass 2, tiling: the LM head + loss over tiles of the local tokens, token-wise blocks in token tiles, RMSNorms as one
kernel over chunks."""
