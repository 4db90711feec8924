"""Session 12 call 5: is a FlashAttention-3 build importable here, and what does batched cuDNN SDPA cost
on the first call of each new prompt length (its per-shape build) against later calls."""
import importlib.util, time, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.attention as A
print("flash_attn_interface:", importlib.util.find_spec("flash_attn_interface") is not None,
      "flash_attn:", importlib.util.find_spec("flash_attn") is not None)
print("impls:", getattr(A, "list_flash_attention_impls", lambda: "n/a")())
try:
    A.activate_flash_attention_impl("FA3"); print("FA3 activated")
except Exception as e:  # noqa: BLE001
    print("FA3:", repr(e)[:200])
for L in (512, 496, 480, 512, 256, 1000):
    q = torch.randn(16, 32, L, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(16, 8, L, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    times = []
    for _ in range(4):
        torch.cuda.synchronize(); t = time.perf_counter()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize(); times.append((time.perf_counter() - t) * 1e3)
    print(f"cuDNN batched 16 x {L}: calls 1-4 {', '.join(f'{x:.2f}' for x in times)} ms", flush=True)
