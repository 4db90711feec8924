"""Session 12 call 3 (eager timings): aten's varlen cuDNN attention (_cudnn_attention_forward with cumulative lengths) on
the 8B shape's fresh prompts, GQA and heads expanded, int32 / int64 offsets; errors against SDPA's math."""
import statistics, sys, torch
import torch.nn.functional as F
sys.path.insert(0, "platforms/cuda/scripts")
from bench_kernels import causal_flops

def graph_us(fn, n=8, replays=15):
    """eager (cuDNN's varlen call does not capture): n back-to-back calls between events, median"""
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n): fn()
        b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts) / n * 1e3

H, HKV, D = 32, 8, 128
def cudnn(q, k, v, cu, max_len):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, False, 0.0, True, False,
                                                   scale=D**-0.5)[0]
def reference(q, k, v, lens):
    outs, at = [], 0
    for n in lens:
        qs, ks, vs = (t[at:at + n].transpose(0, 1).float() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(H // ks.shape[0], 0), vs.repeat_interleave(H // vs.shape[0], 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        at += n
    return torch.cat(outs)
for name, lens in (("16 x 512", [512] * 16), ("240 x 1 + 15 x 512 + 256", [1] * 240 + [512] * 15 + [256]),
                   ("ragged 37..700", [37, 700, 1, 129, 512, 64, 300, 17, 448, 256])):
    T = sum(lens)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ke, ve = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    starts = [0]
    for n in lens: starts.append(starts[-1] + n)
    flops = sum(4.0 * D * H * n * (n + 1) / 2 for n in lens)
    ref = reference(q, k, v, lens)
    for idx in (torch.int32, torch.int64):
        cu = torch.tensor(starts, device="cuda", dtype=idx)
        for label, kk, vv in (("gqa", k, v), ("expanded", ke, ve)):
            tag = f"{name:26s} {str(idx)[6:]} {label:8s}"
            try:
                out = cudnn(q, kk, vv, cu, max(lens))
                err = ((out.float() - ref).norm() / ref.norm()).item()
                worst = max(((out[a:b].float() - ref[a:b]).norm() / ref[a:b].norm()).item() for a, b in zip(starts, starts[1:]))
                us = graph_us(lambda: cudnn(q, kk, vv, cu, max(lens)))
                print(f"{tag} {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s  rel err {err:.2e} worst seq {worst:.2e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{tag} failed: {str(e).splitlines()[0][:200]}", flush=True)
    cu = cu.to(torch.int32)
    fa = lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max(lens), max(lens), 0.0, True, False, scale=D**-0.5)[0]
    print(f"{name:26s} flash varlen gqa {graph_us(fa):8.1f} us", flush=True)
print(torch.backends.cudnn.version())
