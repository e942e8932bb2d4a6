"""What a CUDA process holds outside PyTorch's allocator: context, cuBLAS/cuDNN workspaces, SDPA kernels."""
import json
import sys

import torch

free0, total = torch.cuda.mem_get_info()  # creates the context
out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "total": total,
       "after_init_used": total - free0}
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
(a @ a).sum().backward()
q = torch.randn(1, 16, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
torch.cuda.synchronize()
free1, _ = torch.cuda.mem_get_info()
out.update(after_kernels_used=total - free1, reserved=torch.cuda.memory_reserved(),
           allocated=torch.cuda.memory_allocated())
out["outside_allocator_mib"] = (out["after_kernels_used"] - out["reserved"]) / 2**20
print(json.dumps(out))
open(sys.argv[1], "w").write(json.dumps(out))
