"""H200 check of moe.activation.swiglu against its torch reference at the layer's shapes, and CUDA-graph times of
both (ours one launch; the reference's silu, mul and conversion, plus the class-major copy when asked).
Run from the repository root; prints one row per case."""
import torch

from dsa_triton.harness import graph_time_us, rotation
from dsa_triton.moe.activation import swiglu
from dsa_triton.moe.activation_reference import swiglu_torch

dev = torch.device("cuda")
print("| rows | I | class_major | max abs err | ours graph us | torch graph us | of copy floor |")
for rows, inter, cm in ((8, 2048, True), (1024, 2048, True), (8192, 2048, True), (131072, 2048, False)):
    sets = rotation(lambda i: {"h": torch.randn(rows, 2 * inter, device=dev,
                                                generator=torch.Generator(dev).manual_seed(i))},
                    rows * inter * 10.0, dev)
    h = sets[0]["h"]
    err = (swiglu(h, torch.bfloat16, cm).float() - swiglu_torch(h, torch.bfloat16, cm).float()).abs().max().item()
    ours = graph_time_us(lambda s: swiglu(s["h"], torch.bfloat16, cm), sets, dev)
    ref = graph_time_us(lambda s: swiglu_torch(s["h"], torch.bfloat16, cm), sets, dev)
    floor = rows * inter * 10 / 4.27e6  # fp32 in, bf16 out, us at 4.27 TB/s
    print(f"| {rows} | {inter} | {cm} | {err:.3g} | {ours:.1f} | {ref:.1f} | {floor / ours:.2f} |", flush=True)
