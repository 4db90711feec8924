"""Session 12 call 2: which dense attention kernel does 16 x 512 causal GQA prompts (8B shape) fast on
the H200, against the paged prefill kernel: torch SDPA by backend, aten's varlen flash call, varlen_attn."""
import statistics, sys, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
sys.path.insert(0, "platforms/cuda/scripts")
from bench_kernels import PagedSets, causal_flops
from podium_cuda.tuning import CUDA_TUNING

def graph_us(fn, n=8, replays=15):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    for _ in range(3): g.replay()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts) / n * 1e3

B, L, H, HKV, D = 16, 512, 32, 8, 128
flops = causal_flops(B, 0, L)
q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
ke, ve = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
def report(name, fn):
    try:
        us = graph_us(fn)
        print(f"{name:55s} {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{name:55s} failed: {str(e).splitlines()[0][:150]}", flush=True)
report("sdpa default, enable_gqa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
report("sdpa default, heads expanded", lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
    for gqa in (True, False):
        def f(be=be, gqa=gqa):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k if gqa else ke, v if gqa else ve, is_causal=True, enable_gqa=gqa)
        report(f"sdpa {be.name} {'enable_gqa' if gqa else 'heads expanded'}", f)
# [T, H, D] layouts for varlen
qt = q.transpose(1, 2).reshape(B * L, H, D).contiguous()
kt = k.transpose(1, 2).reshape(B * L, HKV, D).contiguous(); vt = v.transpose(1, 2).reshape(B * L, HKV, D).contiguous()
ket = ke.transpose(1, 2).reshape(B * L, H, D).contiguous(); vet = ve.transpose(1, 2).reshape(B * L, H, D).contiguous()
cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * L
for name, kk, vv in (("gqa", kt, vt), ("heads expanded", ket, vet)):
    report(f"aten _flash_attention_forward varlen {name}",
           lambda kk=kk, vv=vv: torch.ops.aten._flash_attention_forward(qt, kk, vv, cu, cu, L, L, 0.0, True, False, scale=D**-0.5)[0])
qb, kb, vb = qt.view(B, L, H, D), kt.view(B, L, HKV, D), vt.view(B, L, HKV, D)
report("aten _flash_attention_forward batched [B, L, H, D] gqa",
       lambda: torch.ops.aten._flash_attention_forward(qb, kb, vb, None, None, L, L, 0.0, True, False, scale=D**-0.5)[0])
try:
    from torch.nn.attention.varlen import varlen_attn
    import inspect; print("varlen_attn", inspect.signature(varlen_attn), flush=True)
    report("varlen_attn heads expanded", lambda: varlen_attn(qt, ket, vet, cu, cu, L, L))
    report("varlen_attn enable_gqa", lambda: varlen_attn(qt, kt, vt, cu, cu, L, L, enable_gqa=True))
except Exception as e:  # noqa: BLE001
    print("varlen_attn:", repr(e)[:200])
for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
    sets = PagedSets(B, L, L, rotate=False, cache_dtype=cache_dtype)
    calls = sets.calls(CUDA_TUNING, 1)
    report(f"paged prefill kernel {CUDA_TUNING.prefill} over {cache_dtype}", calls[0])
